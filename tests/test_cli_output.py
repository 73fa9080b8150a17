"""Output that must not mislead: what the commands print for degenerate or unusual inputs (the comparison
table's parts add up, ``lioncub cost`` for one worker and equal rows, the ``bps`` spellings, an
underdetermined calibration fit, a rank's failure and interruption, the final validation line, the lr
schedule's ends)."""

from __future__ import annotations

import io
import itertools
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console

from lioncub import cli
from lioncub.report import runs as rp
from lioncub.units import parse_rate

from processes import python_cmd

# ----------------------------------------------------------------------- 1. lioncub compare's table


def _write_run(root: Path, variant: str, parts: list[tuple[float, float, float, float]]) -> Path:
    """A run dir whose step records have (step_s, compute_s, comm_s, apply_s) = ``parts``."""
    run_dir = root / variant
    run_dir.mkdir()
    config = {"variant": variant, "workload": "gpt", "size": "tiny", "world_size": 2, "link": "1gbit"}
    (run_dir / "config.json").write_text(json.dumps({**config, "steps": len(parts), "seed": 0}))
    lines = []
    for i, (step, compute, comm, apply) in enumerate(parts):
        rec = {"kind": "step", "step": i + 1, "loss": 3.0, "time_s": 0.1 * (i + 1), "step_s": step}
        lines.append(json.dumps(rec | {"compute_s": compute, "comm_s": comm, "apply_s": apply}))
    lines.append(json.dumps({"kind": "eval", "step": len(parts), "val_loss": 2.0, "time_s": 1.0}))
    (run_dir / "log.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def test_compare_table_parts_add_up_to_the_step(tmp_path: Path) -> None:
    # 8bit: median step 65.9 ms, compute 33.2, comm 13.4, apply 1.8 -> other 17.5 ms. 32bit: step 100, 120,
    # 140 (median 120), compute 50, 80, 60 (60), comm 30, apply 2 -> other 28, though the median of the
    # per-step remainders (18, 8, 48) is 18: only the remainder of the medians makes the row add up
    eight = [
        (0.0659, 0.0332, 0.0134, 0.0018),
        (0.0629, 0.0332, 0.0170, 0.0018),
        (0.0700, 0.0300, 0.0127, 0.0018),
    ]
    base = [(0.100, 0.050, 0.030, 0.002), (0.120, 0.080, 0.030, 0.002), (0.140, 0.060, 0.030, 0.002)]
    runs = [_write_run(tmp_path, "32bit", base), _write_run(tmp_path, "8bit", eight)]
    report = rp.make_report(runs, tmp_path / "out", plots=False)
    assert "other ms" in rp.COLUMNS
    assert rp.COLUMNS.index("other ms") == rp.COLUMNS.index("apply ms") + 1
    for row in report.rows:
        assert row.other_s == pytest.approx(row.step_s - row.compute_s - row.comm_s - row.apply_s)
    assert report.rows[0].other_s == pytest.approx(0.028)
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| 8bit | 65.9 | 33.2 | 13.4 | 1.8 | 17.5 |" in md
    assert "| 32bit | 120.0 | 60.0 | 30.0 | 2.0 | 28.0 |" in md
    assert rp.TABLE_NOTE in md and "other ms = step − compute − comm − apply" in rp.TABLE_NOTE
    rows = json.loads((tmp_path / "out" / "summary.json").read_text())["rows"]
    assert [r["other_s"] for r in rows] == pytest.approx([0.028, 0.0175])
    buf = io.StringIO()
    rp.print_table(report, Console(file=buf, width=250, color_system=None))
    text = buf.getvalue()
    assert "other ms" in text and "17.5" in text and "28.0" in text
    assert "other ms = step − compute − comm − apply" in text and "zero_grad" in text
    # the step-time bars stack up to the step time
    ax = rp.figure_step_time_split(report).axes[0]
    ends = [max(p.get_x() + p.get_width() for p in (c.patches[k] for c in ax.containers)) for k in range(2)]
    assert ends == pytest.approx([120.0, 65.9])


# ------------------------------------------------------------------------------------- 2. lioncub cost


def _cost(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli.main(["cost", *argv])
    return rc, capsys.readouterr().out


def test_cost_for_one_worker_says_nothing_is_communicated(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _cost(capsys, "--params", "25M", "--workers", "1")
    assert rc == 0
    assert "N = 1: nothing is communicated" in out
    assert "codec" in out and "no speedups" in out
    for misleading in (
        "0.00x",
        "per step)",
        "never faster",
        "always faster",
        "crossovers with",
        "fastest by link",
    ):
        assert misleading not in out, misleading
    assert "winner:" not in out


def test_cost_equal_rows_are_equal_not_never_faster(capsys: pytest.CaptureFixture[str]) -> None:
    # 8bit-sign and dlion-avg send the same int8 exchange: the same cost at every link rate
    rc, out = _cost(
        capsys,
        "--params",
        "25M",
        "--workers",
        "4",
        "--bandwidth",
        "100gbit",
        "--variants",
        "8bit-sign,dlion-avg",
    )
    assert rc == 0
    assert "never faster" not in out
    assert "8bit-sign vs dlion-avg: equal at every link rate" in out
    assert "winner: 8bit-sign, dlion-avg (equal," in out
    assert ": 8bit-sign = dlion-avg" in out  # the link-rate ranges name both


def test_cost_refuses_duplicate_variants(run_cli: Callable[[list[str]], tuple[int, str]]) -> None:
    rc, err = run_cli(["cost", "--params", "25M", "--workers", "4", "--variants", "1bit,1bit"])
    assert rc == 2
    assert "--variants" in err and "1bit" in err and "distinct" in err


# ------------------------------------------------------------------------------------------- 3. units


@pytest.mark.parametrize("family", ["bps", "kbps", "mbps", "gbps", "tbps"])
def test_bps_spellings_are_bits_only_with_an_upper_case_prefix(family: str) -> None:
    accepted = {"Kbps": 1e3, "Mbps": 1e6, "Gbps": 1e9, "Tbps": 1e12}
    for letters in itertools.product(*((c.lower(), c.upper()) for c in family)):
        unit = "".join(letters)
        if unit in accepted:
            assert parse_rate(f"2{unit}") == 2 * accepted[unit]
            continue
        with pytest.raises(ValueError, match=rf"'2{unit}' is ambiguous.*bits.*Kbps, Mbps, Gbps, Tbps") as exc:
            parse_rate(f"2{unit}")
        assert "bit" in str(exc.value).split("write ")[1]


# ------------------------------------------------------------------------------ 4. calibration fits


def test_two_size_calibration_says_the_fit_is_underdetermined(monkeypatch: pytest.MonkeyPatch) -> None:
    from lioncub.planning import measure as cal

    class FakeComm:  # two ranks; the timings below replace the collectives
        world_size, rank, backend, exchange = 2, 0, "gloo", "p2p"

        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

    points = {
        "allreduce_f32": [(1e6, 1e-3), (4e6, 3e-3)],  # fits both points exactly: no residual
        "all_to_all": [(1e6, 2e-3), (4e6, 1e-3)],  # time falls with the payload: no positive slope
    }
    monkeypatch.setattr(cal, "Comm", FakeComm)
    monkeypatch.setattr(cal, "_time_op", lambda op, comm, sizes, repeats, warmup, **_: points[op])
    lines: list[str] = []
    calib = cal.calibrate(
        [1 << 20, 4 << 20], ops=list(points), compute_numel=0, log=lines.append, link_bps=None
    )
    text = "\n".join(lines)
    assert "nan" not in text
    f32 = next(line for line in lines if "allreduce_f32:" in line)
    a2a = next(line for line in lines if "all_to_all:" in line)
    assert "residual n/a" in f32 and "residual 0" not in f32
    assert "payload n/a" in a2a
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 2, text
    assert sum("underdetermined" in w for w in warnings) == 1
    assert any("3" in w and "--sizes" in w for w in warnings)
    assert sum("no positive slope" in w and "all_to_all" in w for w in warnings) == 1
    # the JSON keeps its fields (and says how many degrees of freedom each fit had)
    doc = calib.raw["per_op"]
    assert doc["allreduce_f32"]["rel_rms_residual"] == pytest.approx(0, abs=1e-9)
    assert doc["allreduce_f32"]["dof"] == 0
    assert doc["all_to_all"]["ok"] is False


def test_fit_alpha_beta_counts_degrees_of_freedom() -> None:
    from lioncub.planning.measure import fit_alpha_beta

    assert fit_alpha_beta([(1e6, 2e-3), (2e6, 3e-3)]).dof == 0  # two points, two parameters
    assert fit_alpha_beta([(1e6, 0.9e-3), (2e6, 2.1e-3)]).dof == 1  # refitted through 0: one parameter
    assert fit_alpha_beta([(1e6, 2e-3), (2e6, 3e-3), (4e6, 5.2e-3)]).dof == 1


# --------------------------------------------------------------------------------------- 5. launcher


def test_a_failed_rank_is_reported_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(30)\n"
    )
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(["launch", "--nproc", "2", "--grace", "2", "--timeout", "60", "--", str(script)]) == 3
    err = capsys.readouterr().err
    assert err.count("rank 1 exited with code 3") == 1, err
    lines = err.splitlines()
    assert len(lines) == len(set(lines)), err
    assert "[lioncub] exit code 3 after" in err


RANK_SCRIPT = """
import sys, time
from lioncub.train.rank import interrupt_as_one_line
with interrupt_as_one_line(lambda: "at step 7"):
    print("ready", flush=True)
    time.sleep(30)
sys.exit(0)
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_rank_ends_with_one_line(tmp_path: Path, sig: signal.Signals) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    proc = subprocess.Popen(
        python_cmd(str(script)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert err == f"interrupted ({sig.name}) at step 7\n"
    assert proc.returncode == 128 + sig


def test_the_rank_entry_point_has_no_keyboard_interrupt_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lioncub.train import rank
    from lioncub.train.config import TrainConfig

    (tmp_path / "config.json").write_text(json.dumps(TrainConfig().to_json()))

    def interrupted(config: object, run_dir: object) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(rank, "train_in_job", interrupted)
    try:
        rc = rank.main([str(tmp_path)])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped the rank entry point (a traceback per rank)")
    assert rc == 130
    assert capsys.readouterr().err == "interrupted (SIGINT) before the first step\n"


RUN_RANK_SCRIPT = """
import os, sys, time
from pathlib import Path
from lioncub.train import loop, rank
from lioncub.train.config import TrainConfig

def train(config, run_dir, **kwargs):
    for step in range(1, 100):
        loop.PROGRESS["step"] = step
        if step == 7:
            print("ready", flush=True)
            time.sleep(30)

rank.init_distributed = lambda config: None
loop.train = train
rank.dist.barrier = rank.dist.destroy_process_group = lambda *a, **k: None
rank.run_rank(TrainConfig(), Path("."), driven=True)
"""


@pytest.mark.slow
def test_a_training_rank_ends_with_one_line_when_interrupted(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RUN_RANK_SCRIPT)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        python_cmd(str(script)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert err == "interrupted (SIGINT) at step 7\n"
    assert proc.returncode == 130


# -------------------------------------------------------------------------------- 6. final validation


def test_final_validation_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lioncub.train import rank
    from lioncub.train.config import TrainConfig

    (tmp_path / "config.json").write_text(json.dumps(TrainConfig().to_json()))
    final = {"kind": "eval", "step": 8, "time_s": 1.5, "val_loss": 2.123449, "val_acc": 0.456}
    monkeypatch.setattr(rank, "train_in_job", lambda config, run_dir: {"final": final})
    monkeypatch.setenv("RANK", "0")
    assert rank.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out == "final validation at step 8: val_loss 2.1234, val_acc 0.4560\n"


# ---------------------------------------------------------------------------------- 7. lr schedule


@pytest.mark.parametrize("steps", [1, 2, 3, 10, 200])
def test_lr_without_warmup_starts_at_the_peak_and_ends_at_the_minimum(steps: int) -> None:
    from lioncub.train.config import lr_factor

    factors = [lr_factor(s, steps, 0, 0.1) for s in range(1, steps + 1)]
    assert factors[0] == 1.0
    if steps > 1:
        assert factors[-1] == pytest.approx(0.1)
        assert min(factors[:-1]) > 0.1
        assert all(a > b for a, b in itertools.pairwise(factors))
    if steps == 3:
        assert factors[1] == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the cosine


def test_lr_with_warmup_peaks_at_its_last_step_and_ends_at_the_minimum() -> None:
    from lioncub.train.config import lr_factor

    factors = [lr_factor(s, 20, 4, 0.0) for s in range(1, 21)]
    assert factors[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert factors[-1] == pytest.approx(0.0) and factors[-2] > 0
    assert factors[11] == pytest.approx(0.5)  # step 12: progress (12 - 4) / (20 - 4) = 1/2
