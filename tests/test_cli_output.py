"""Output that must not mislead: what the commands print for degenerate or unusual inputs (the comparison
table's parts add up, ``lioncub cost`` for one worker and equal rows, the ``bps`` spellings, an
underdetermined calibration fit, a rank's failure and interruption, the final validation line, the lr
schedule's ends), and output for people: tables and notes that fit a terminal of 80 or 120 columns (no
cell, number or name cut or split), ``lioncub report``'s summary of a run, the progress lines' end,
compare's torchft-diloco row."""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.cells import cell_len
from rich.console import Console

import background
import compare_runs
from lioncub import cli
from lioncub.launch.preload import Zygote, lease, shared_env
from lioncub.report import runs as rp
from lioncub.train.config import TrainConfig
from lioncub.units import parse_rate

from processes import PY

#: tests/compare_runs.py's comparisons (shared with tests/test_train.py): ``compare`` printed for 80 columns
BACKGROUND = {"compares": compare_runs.job}

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


@pytest.fixture
def rank_zygote() -> Iterator[Zygote]:
    """The zygote that ``lioncub train``'s launches in this process fork their ranks from (torch and the
    training loop imported): :func:`lioncub.launch.preload.lease` of a plain launch's modules, directory and
    shared environment, held for the test. The interrupted ranks below are forked as ``lioncub train``'s
    are, and share one import of torch (~3 s of CPU) with each other and with the suite's launches before
    and after them (test_train.py's, which run before this module's tests)."""
    from lioncub.launch.environment import rank_env
    from lioncub.train.driver import RANK_MODULE, make_launch_config

    config = TrainConfig.from_values({"device": "cpu"})  # forked on a machine with a GPU too
    launch = make_launch_config(config, [PY, "-m", RANK_MODULE, "."], None)
    env = rank_env(0, 1, master_addr="127.0.0.1", master_port=0, ifname="lo", launch_id="", extra=launch.env)
    with lease(shared_env([env]), os.getcwd(), launch.preload) as zygote:
        yield zygote


def _interrupted(zygote: Zygote, code: str, sig: signal.Signals, cwd: Path) -> tuple[int, str]:
    """``python -c code`` forked from ``zygote`` in ``cwd``: once it printed ``ready``, ``sig``; its exit
    status and what it wrote to stderr."""
    rank = zygote.fork([PY, "-c", code], {**os.environ, "PYTHONUNBUFFERED": "1"}, str(cwd))
    assert rank.stdout is not None and rank.stderr is not None
    try:
        assert rank.stdout.readline() == b"ready\n"
        time.sleep(0.1)
        os.kill(rank.pid, sig)
        status = rank.wait(20)
        return status, rank.stderr.read().decode()
    finally:
        if rank.poll() is None:
            os.kill(rank.pid, signal.SIGKILL)
        rank.stdout.close()
        rank.stderr.close()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_rank_ends_with_one_line(
    rank_zygote: Zygote, tmp_path: Path, sig: signal.Signals
) -> None:
    code, err = _interrupted(rank_zygote, RANK_SCRIPT, sig, tmp_path)
    assert err == f"interrupted ({sig.name}) at step 7\n"
    assert code == 128 + sig


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
def test_a_training_rank_ends_with_one_line_when_interrupted(rank_zygote: Zygote, tmp_path: Path) -> None:
    code, err = _interrupted(rank_zygote, RUN_RANK_SCRIPT, signal.SIGINT, tmp_path)
    assert err == "interrupted (SIGINT) at step 7\n"
    assert code == 130


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


# ------------------------------------------------------------------------- 8. a terminal of any width

#: a number split from its unit over two lines: a line ending in a digit, the next starting with a unit
UNIT_SPLIT = re.compile(r"\d\n\s*(ms|s|us|ns|MB|kB|GB|B|Mbit/s|Gbit/s|kbit/s|steps?|x)\b")


def _rows(text: str) -> dict[str, list[str]]:
    """The rows of the box-drawn tables in ``text`` by their first cell: every cell of the row in all the
    tables its columns were printed in (a row continued on a second line has the first cell "")."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("│"):
            cells = [cell.strip() for cell in line.strip().strip("│").split("│")]
            rows.setdefault(cells[0], []).extend(cells[1:])
    return rows


def _fits(text: str, columns: int) -> None:
    """Every line of ``text`` within ``columns``; no number split from its unit; nothing cut to '…'."""
    assert max(cell_len(line) for line in text.splitlines()) <= columns, text
    assert UNIT_SPLIT.search(text) is None, text
    assert "…" not in text, text


def test_wrap_breaks_between_phrases_never_inside_a_number_or_a_name() -> None:
    from lioncub.report.text import wrap

    paragraph = (
        "gpt/tiny 1bit/h16 on 4 rank(s), 20mbit: 512 steps, mean step 85.3 ms (compute 60.1 ms, "
        "communication 20.2 ms, apply 1.2 ms), 0.042 MB sent per rank per step; at step 512: val_loss "
        "2.8349; fault-tolerant: 40 steps with 3 groups, 20 steps with 2 groups; 1 heal (group 1 at step 35 "
        "from g0: 0.9 MB in 0.06 s); the replicas of groups 0, 1, 2 were bitwise equal at the end"
    )
    glued = re.findall(r"\d+(?:\.\d+)? (?:ms|s|MB|steps|groups)\b", paragraph)
    for width in (120, 80, 40, 20):
        lines = wrap(paragraph, width)
        assert " ".join(line.strip() for line in lines).split() == paragraph.split()  # nothing lost
        assert all(line.startswith("  ") for line in lines[1:]) and not lines[0].startswith(" ")
        assert all(cell_len(line) <= width for line in lines), lines
        for pair in glued:  # "85.3 ms", "512 steps": on one line, whatever the width
            assert any(pair in line for line in lines), (width, pair, lines)
    for width in (120, 80):  # wide enough for every phrase: the lines end between phrases
        assert all(line.endswith((";", ",")) for line in wrap(paragraph, width)[:-1]), wrap(paragraph, width)
    assert wrap(paragraph, len(paragraph)) == [paragraph]
    assert wrap("  a note: " + "x" * 30, 20) == ["  a note:", "    " + "x" * 30]  # a word stands alone


def test_a_table_too_wide_for_one_column_beside_its_names_is_printed_row_by_row() -> None:
    from lioncub.report.text import print_table

    buf = io.StringIO()
    rows = [["dlion-mavo", "[bold]381 ms[/bold]"], ["dlion-avg", "336 ms"]]  # markup printed as styles
    print_table(
        Console(file=buf, width=16, color_system=None), "two presets", ["variant", "time / step"], rows
    )
    assert buf.getvalue().splitlines() == [
        "two presets",
        "dlion-mavo",
        "  time / step:",
        "      381 ms",
        "dlion-avg",
        "  time / step:",
        "      336 ms",
    ]


@pytest.mark.parametrize("columns", [80, 120])
def test_cost_tables_fit_the_terminal(
    columns: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lioncub cost`` at COLUMNS=80 and 120 (rich's width): every cell whole (each prediction's numbers,
    formatted, are cells of its row), every name whole and distinct (dlion-mavo, dlion-avg), no line wider."""
    from lioncub.optim.config import PRESETS
    from lioncub.planning import costmodel as cm
    from lioncub.report.cost import format_bytes, format_seconds

    monkeypatch.setenv("COLUMNS", str(columns))
    rc, out = _cost(capsys, "--params", "25M", "--workers", "4")
    assert rc == 0
    _fits(out, columns)
    rows = _rows(out)
    assert set(rows) == set(PRESETS)  # no continued row (""), no name cut into another
    network, bucket = cm.Network(50e-6, 1e9 / 8, cm.TCP_EFFICIENCY), int(25 * 2**20 / 4)
    for p in cm.table(25_000_000, 4, network, cm.DEFAULT_CPU_COMPUTE, bucket_numel=bucket):
        cells = [format_seconds(s) for s in (p.latency_s, p.bandwidth_s, p.compute_s, p.total_s)]
        assert set(cells) | {format_bytes(p.bytes_sent)} <= set(rows[p.variant]), (p.variant, rows[p.variant])
    assert "1.00x" in rows["32bit"]
    rc, out = _cost(capsys, "--params", "25M", "--nnodes", "2", "--nproc-per-node", "2")
    assert rc == 0
    _fits(out, columns)
    rows = _rows(out)
    cluster = cm.Cluster(2, 2, network, cm.Network(5e-6, 400e9 / 8, cm.TCP_EFFICIENCY))
    ranked = sorted(
        (p for p in cm.cluster_table(25_000_000, cluster, cm.DEFAULT_CPU_COMPUTE, bucket_numel=bucket)
         if p.allowed), key=lambda p: p.total_s,
    )  # fmt: skip
    assert list(rows) == [str(i) for i in range(1, len(ranked) + 1)]
    for i, p in enumerate(ranked, 1):
        cells = rows[str(i)]
        assert {p.variant, format_seconds(p.total_s), format_bytes(p.nic_sent)} <= set(cells), cells
        assert p.topology in {c.removesuffix(" *") for c in cells}


@pytest.mark.background("compares")
@pytest.mark.slow
@pytest.mark.parametrize("columns", [compare_runs.COLUMNS, 120])
def test_a_compare_prints_for_the_terminal(columns: int, tmp_path: Path) -> None:
    """tests/compare_runs.py's ``compare`` (32bit, 1bit, 1bit+overlap, 1bit/h2) printed its table and notes
    for COLUMNS=80; the same runs' table at 120. Every row's name and numbers (summary.json's, formatted
    here) are whole cells; no line is wider (but the file paths, printed whole)."""
    done = background.result("compares", BACKGROUND["compares"])
    workdir = background.workdir("compares")
    out = workdir / "compare" / "cmp"
    assert (out / "summary.json").exists(), done.stderr[-2000:]
    rows = json.loads((out / "summary.json").read_text())["rows"]
    if columns == compare_runs.COLUMNS:
        text = (workdir / "compare.out").read_text()
        text = "\n".join(line for line in text.splitlines() if not line.startswith(("report: ", "plot ")))
        log = (workdir / "compare.log").read_text()  # the runs' summaries: short lines (but paths)
        summaries = [line for line in log.splitlines() if str(workdir) not in line]
        assert sum(line.startswith("[") for line in summaries) == 4, log
        assert all(cell_len(line) <= columns for line in summaries), log
    else:
        report = rp.make_report([Path(row["run_dir"]) for row in rows], tmp_path, plots=False)
        buf = io.StringIO()
        rp.print_table(report, Console(file=buf, width=columns, color_system=None))
        text = buf.getvalue()
    _fits(text, columns)
    printed = _rows(text)
    assert list(printed) == ["32bit", "1bit", "1bit+overlap", "1bit/h2"]
    for row in rows:
        cells = {
            f"{row['step_s'] * 1e3:.1f}",
            f"{row['compute_s'] * 1e3:.1f}",
            f"{row['final_val_loss']:.4f}",
        }
        assert cells | {f"{row['bytes_sent_per_step'] / 1e6:.3g}"} <= set(printed[row["variant"]]), row


def _named_run(root: Path, dirname: str, config: dict, steps: list[float]) -> Path:
    """A run dir of ``config`` (its name's settings) with 2 ranks' step records of ``steps`` seconds (a
    tenth each of compute and apply, the rest communication) and an evaluation at the last step."""
    run_dir = root / dirname
    run_dir.mkdir()
    base = {"workload": "gpt", "size": "tiny", "world_size": 2, "link": "1gbit", "seed": 0}
    (run_dir / "config.json").write_text(json.dumps({**base, "steps": 4, **config}))
    lines = [
        {"kind": "step", "step": i + 1, "loss": 3.0, "time_s": 0.5 * (i + 1), "step_s": s,
         "compute_s": s / 10, "comm_s": s * 0.8, "apply_s": s / 10, "bytes_sent": 1.5e6 / (i + 1)}
        for i, s in enumerate(steps)
    ]  # fmt: skip
    lines.append({"kind": "eval", "step": len(steps), "val_loss": 2.123456, "time_s": 2.0})
    (run_dir / "log.jsonl").write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    return run_dir


@pytest.mark.parametrize("columns", [80, 120])
def test_compare_table_fits_the_terminal(tmp_path: Path, columns: int) -> None:
    """Names that share their start (dlion-mavo, dlion-avg, 1bit@...) and a partial run's long label stay
    whole and distinct at 80 and 120 columns; the numbers are whole cells of their rows."""
    configs = {
        "32bit": {"variant": "32bit"},
        "dlion-mavo": {"variant": "dlion-mavo"},
        "dlion-avg": {"variant": "dlion-avg"},
        "1bit@hierarchical": {"variant": "1bit", "topology": "hierarchical"},
        "1bit@node-majority": {"variant": "1bit", "topology": "node-majority"},
    }
    runs = [_named_run(tmp_path, f"r{i}", c, [0.2, 0.1, 0.3, 0.25]) for i, c in enumerate(configs.values())]
    runs.append(_named_run(tmp_path, "partial", {"variant": "8bit-sign"}, [0.2, 0.4]))  # 2 steps of 4
    report = rp.make_report(runs, tmp_path / "out", plots=False)
    buf = io.StringIO()
    rp.print_table(report, Console(file=buf, width=columns, color_system=None))
    text = buf.getvalue()
    _fits(text, columns)
    rows = _rows(text)
    assert list(rows) == [*configs, "8bit-sign (partial: step 2 of 4)"]
    # medians: step (0.2 + 0.25) / 2 = 225.0 ms, bytes (0.75 + 0.5) / 2 = 0.625 MB; the partial run 300.0 ms
    # and 1.125 MB; no step evaluated by every run (4; the partial run's 2): no loss at equal steps
    for name in configs:
        assert {"225.0", "0.625", "2.1235", "—"} <= set(rows[name]), rows[name]
    assert {"300.0", "1.12", "1.00x"} & set(rows["8bit-sign (partial: step 2 of 4)"]) == {"300.0", "1.12"}


def test_other_ms_the_medians_leave_below_zero_is_shown_as_0_with_its_reason(tmp_path: Path) -> None:
    # every step's parts add up to it (remainder 0), but the medians do not: step (20 + 30) / 2 = 25 ms,
    # compute 5, apply sorted 1 1 4 4 -> 2.5, comm = step - 5 - apply = 1 14 24 31 -> 19: 26.5 ms of parts
    steps, apply = [0.010, 0.020, 0.030, 0.040], [0.004, 0.001, 0.001, 0.004]
    parts = [(s, 0.005, s - 0.005 - a, a) for s, a in zip(steps, apply, strict=True)]
    run = _write_run(tmp_path, "32bit", parts)
    report = rp.make_report([run], tmp_path / "out", plots=False)
    assert report.rows[0].other_s == pytest.approx(-0.0015)  # kept as it is in summary.json
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["rows"][0]["other_s"] == pytest.approx(
        -0.0015
    )
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| 32bit | 25.0 | 5.0 | 19.0 | 2.5 | 0.0 |" in md
    assert "other ms of 32bit: shown as 0.0; the medians leave -1.5 ms" in md
    assert "the median of a sum is not the sum of the medians" in md
    buf = io.StringIO()
    rp.print_table(report, Console(file=buf, width=200, color_system=None))
    assert "0.0" in _rows(buf.getvalue())["32bit"] and "-1.5" not in _rows(buf.getvalue())["32bit"]
    assert "the medians leave -1.5 ms" in buf.getvalue()


def _diag_run(root: Path) -> Path:
    """A run dir with one diagnostics record of two long-named tensors (values with exponents)."""
    root.mkdir()
    layer = {"match": 0.91234, "flip": 3.8481e-05, "tie": 0.08, "momentum_max_std": 1.25e-07,
             "max_over_mean": 12.5, "kurtosis": None}  # fmt: skip
    names = ["transformer.h.0.attn.c_attn.weight", "transformer.h.11.mlp.c_proj.weight"]
    diag = {"kind": "diag", "step": 4, "overall": layer, "layers": dict.fromkeys(names, layer)}
    (root / "log.jsonl").write_text(json.dumps(diag) + "\n")
    return root


@pytest.mark.parametrize("columns", [80, 120])
def test_diagnostics_table_fits_the_terminal(tmp_path: Path, columns: int) -> None:
    from lioncub.report import diagnostics

    buf = io.StringIO()
    diagnostics.print_table(_diag_run(tmp_path / "run"), Console(file=buf, width=columns, color_system=None))
    text = buf.getvalue()
    _fits(text, columns)
    rows = _rows(text)
    assert list(rows) == [
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.11.mlp.c_proj.weight",
        "overall",
    ]
    for cells in rows.values():
        assert {"0.9123", "3.848e-05", "0.08", "1.25e-07", "12.5", "—"} <= set(cells), cells


# --------------------------------------------------------------------------------- 9. lioncub report


def _finished_run(run_dir: Path) -> None:
    """A finished fault-tolerant run of 4 steps without diagnostics: config, log and summary.json."""
    run_dir.mkdir()
    config = {"variant": "1bit", "workload": "gpt", "size": "tiny", "nproc": 3, "link": "loopback"}
    (run_dir / "config.json").write_text(json.dumps({**config, "steps": 4, "seed": 0}))
    step_s, sent, loss = [0.1, 0.3, 0.2, 0.4], [1000, 3000, 2000, 4000], [4.0, 3.6, 3.3, 3.0]
    records, t = [], 0.0
    for i in range(4):
        t += step_s[i]
        records.append({"kind": "step", "step": i + 1, "time_s": t, "step_s": step_s[i], "compute_s": 0.05,
                        "comm_s": 0.02, "apply_s": 0.01, "bytes_sent": sent[i], "loss": loss[i],
                        "participants": 3 if i != 2 else 2})  # fmt: skip
    records.append({"kind": "eval", "step": 4, "time_s": t, "val_loss": 2.75})
    (run_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    heal = {"group": 1, "life": 1, "step": 4, "source": "g0", "nbytes": 900_000, "seconds": 0.05}
    fault = {"participants": {"3": 3, "2": 1}, "skipped_steps": 0, "heals": [heal], "kill": ["1@3"],
             "rejoin": ["1@4"], "groups_finished": [0, 1, 2], "replicas_equal": True}  # fmt: skip
    memory = {"parameters": 448_768, "gradients": 448_768, "optimizer_state": 1_346_304, "peak_rss": 416e6}
    summary = {"steps_run": 4, "final": records[-1], "fault_tolerance": fault, "memory": memory}
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_report_summarises_a_run_without_diagnostics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    _finished_run(run)
    monkeypatch.setenv("COLUMNS", "80")
    capsys.readouterr()
    assert cli.main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    _fits(out, 80)
    flat = " ".join(out.split())
    # medians: step (0.2 + 0.3) / 2 = 250 ms, bytes (2000 + 3000) / 2 = 2500 B; 10000 B in all; 1 s trained
    assert flat.startswith("gpt/tiny 1bit on 3 rank(s), link loopback: 4 steps ")
    assert "speed: 250.0 ms per step (median; compute 50.0 ms, communication 20.0 ms, apply 10.0 ms" in flat
    assert "other 170.0 ms); 1.0 s of training, 4.00 steps/s" in flat
    assert "bytes: a rank sent 0.0025 MB per step, 0.01 MB in all (4 steps)" in flat
    assert "loss: training 4.0000 at step 1 → 3.0000 at step 4; validation: val_loss 2.7500 at step 4" in flat
    assert "fault tolerance: 3 steps with 3 groups, 1 step with 2 groups; 0 steps skipped" in flat
    assert "heal: group 1 at step 4 from g0, 0.9 MB in 0.05 s" in flat
    assert "the replicas of groups 0, 1, 2 were bitwise equal at the end" in flat
    assert "memory per rank: parameters 0.449 MB, gradients 0.449 MB, optimizer state 1.35 MB" in flat
    assert "no vote diagnostics in its log" in flat
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "log.jsonl", "summary.json"]  # no plots
    (run / "summary.json").unlink()  # not finished (yet): said so, the groups per step from the log
    assert cli.main(["report", str(run)]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    assert "4 steps of 4 (not finished" in flat
    assert "fault tolerance: 3 steps with 3 groups, 1 steps with 2 groups (so far)" in flat


# ------------------------------------------------------------------------------------ 10. progress


def test_no_progress_line_after_the_final_evaluation(tmp_path: Path) -> None:
    """Rank 0 prints its final validation line once it has logged its last evaluation: a progress line
    for what is read with (or after) that evaluation would come after it."""
    from lioncub.train.progress import Progress

    log, stream = tmp_path / "log.jsonl", io.StringIO()

    def steps(first: int, last: int) -> str:
        recs = [{"kind": "step", "step": s, "loss": 1.0, "time_s": 0.1 * s} for s in range(first, last + 1)]
        return "".join(json.dumps(r) + "\n" for r in recs)

    log.write_text(steps(1, 5))
    bar = Progress(log, "1bit/h2", 0, 10, stream)
    bar.start()
    try:
        deadline = time.monotonic() + 20
        while "step 5/10" not in stream.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "step 5/10" in stream.getvalue()
        with log.open("a") as f:  # the rest in one write, as rank 0's last steps and its final evaluation
            f.write(steps(6, 10) + json.dumps({"kind": "eval", "step": 10, "val_loss": 1.0}) + "\n")
        time.sleep(0.7)  # a read of the log (every 0.5 s); a later one would print nothing either way
    finally:
        bar.done.set()
        bar.join(timeout=5)
    printed = [line for line in stream.getvalue().splitlines() if line.startswith("[train]")]
    assert [line.split()[3] for line in printed] == [f"{s}/10" for s in range(1, 6)], printed
    assert all(line.startswith("[train] 1bit/h2 step") for line in printed)


# ------------------------------------------------------------------------ 11. compare's peer row


def test_compare_takes_the_torchft_diloco_row_it_advertises(
    run_cli: Callable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compare --variants ...,torchft-diloco/h4 --fault-tolerant`` (README, docs/fault-tolerance.md) gets
    through every check to training, each row fault-tolerant (as ``train --variant torchft-diloco
    --local-steps 4 --fault-tolerant``); without --fault-tolerant, or without /hH, the refusal names what to
    add."""
    from lioncub.cli import compare
    from lioncub.train.driver import RunOutcome

    trained = []

    def train_run(args: object, config: TrainConfig, *rest: object) -> RunOutcome:
        trained.append(config)
        return RunOutcome(3, "not trained here", None)

    monkeypatch.setattr(compare, "train_run", train_run)
    argv = ["compare", "--workload", "gpt", "--size", "tiny", "--nproc", "2", "--steps", "8"]
    argv += ["--variants", "1bit/h4,torchft-diloco/h4", "--out", str(tmp_path / "cmp")]
    rc, err = run_cli([*argv, "--fault-tolerant"])
    assert rc == 3 and "1bit/h4 failed (exit code 3" in err, err  # the first row reached training
    rc, err = run_cli(
        [*argv[:-3], "torchft-diloco/h4,1bit/h4", *argv[-2:], "--fault-tolerant", "--overwrite"]
    )
    assert rc == 3 and "torchft-diloco/h4 failed (exit code 3" in err, err
    assert [(c.optimizer.variant, c.optimizer.local_steps, c.cluster.fault_tolerant) for c in trained] == [
        ("1bit", 4, True),
        ("torchft-diloco", 4, True),
    ]
    rc, err = run_cli(argv)
    assert rc == 2 and "'torchft-diloco/h4' runs torchft's DiLoCo" in err and "add --fault-tolerant" in err
    rc, err = run_cli([*argv[:-3], "1bit,torchft-diloco", *argv[-2:], "--fault-tolerant"])
    assert rc == 2 and "name it torchft-diloco/hH (e.g. torchft-diloco/h4)" in err, err


def test_train_prints_its_summary_in_lines_that_fit_the_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lioncub train``'s closing summary (a paragraph of ~250 characters for a fault-tolerant run) in
    lines of at most ``COLUMNS`` cells, broken between phrases; the training itself is replaced by an
    outcome whose summary is built from the configuration the command checked."""
    from lioncub.cli import train as train_cli
    from lioncub.train.driver import RunOutcome

    def finished(args: object, config: Any, run_dir: Path, lock: object) -> RunOutcome:
        fault = {"participants": {"3": 40, "2": 20}, "skipped_steps": 0, "groups_finished": [0, 1, 2],
                 "heals": [{"group": 1, "step": 35, "source": "g0", "nbytes": 900_000, "seconds": 0.06}],
                 "replicas_equal": True}  # fmt: skip
        summary = {"config": config.to_json(), "world_size": 3, "steps_run": 60, "median_step_s": 0.0853,
                   "median_compute_s": 0.0601, "median_comm_s": 0.0202, "median_apply_s": 0.0012,
                   "median_bytes_sent": 42_000, "final": {"step": 60, "val_loss": 2.83491},
                   "fault_tolerance": fault}  # fmt: skip
        return RunOutcome(0, "", summary)

    monkeypatch.setattr(train_cli, "train_run", finished)
    for columns in (80, 60):
        monkeypatch.setenv("COLUMNS", str(columns))
        out_dir = tmp_path / f"run{columns}"
        argv = ["train", "--workload", "gpt", "--size", "tiny", "--variant", "1bit", "--steps", "60",
                "--out", str(out_dir)]  # fmt: skip
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        summary = out[: out.index("log: ")]
        _fits(summary, columns)
        assert len(summary.splitlines()) >= 3, summary
        flat = " ".join(summary.split())
        assert flat.startswith("gpt/tiny 1bit on 3 rank(s), ")
        assert "60 steps, median step 85.3 ms (compute 60.1 ms, communication 20.2 ms, apply 1.2 ms)" in flat
        assert "0.042 MB sent per rank per step; at step 60: val_loss 2.8349" in flat
        assert "1 heal (group 1 at step 35 from g0: 0.9 MB in 0.06 s)" in flat


def test_the_progress_bar_names_the_run_not_the_bare_variant() -> None:
    """The bar of a plain and of a fault-tolerant run (both take :func:`progress_title`): ``1bit/h16`` for
    a run with local steps, compare's row name when given."""
    from lioncub.train.driver import progress_title

    config = TrainConfig.from_values({"variant": "1bit", "local_steps": 16, "steps": 32, "eval_every": 16})
    assert progress_title(config) == "1bit/h16"
    assert progress_title(config, "1bit/h16, again") == "1bit/h16, again"
    assert progress_title(TrainConfig.from_values({"variant": "8bit"})) == "8bit"


def test_a_run_stopped_by_stop_at_says_the_replicas_were_equal_at_that_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault-tolerant run stopped with ``--stop-at 4`` (of 8 steps): its summary line and ``lioncub
    report`` say the replicas were equal at step 4, not "at the end"."""
    from lioncub.train.driver import format_fault_tolerance

    entry = {"participants": {"3": 4}, "skipped_steps": 0, "heals": [], "groups_finished": [0, 1, 2],
             "replicas_equal": True}  # fmt: skip
    assert format_fault_tolerance(entry).endswith("groups 0, 1, 2 were bitwise equal at the end")
    stopped = format_fault_tolerance(entry, 4)
    assert stopped.endswith("groups 0, 1, 2 were bitwise equal at step 4 (--stop-at)")
    alone = format_fault_tolerance({**entry, "groups_finished": [0]}, 4)
    assert alone.endswith("group 0 alone finished at step 4 (--stop-at) (no replica to compare with)")
    unequal = {**entry, "replicas_equal": False}
    assert "NOT equal at step 4 (--stop-at)" in format_fault_tolerance(unequal, 4)
    run = tmp_path / "run"
    _finished_run(run)
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "steps": 8, "stop_at": 4}))
    monkeypatch.setenv("COLUMNS", "100")
    capsys.readouterr()
    assert cli.main(["report", str(run)]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    assert "the replicas of groups 0, 1, 2 were bitwise equal at step 4 (--stop-at)" in flat
