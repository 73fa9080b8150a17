"""``lioncub train`` / ``lioncub compare`` end to end on the tiny workloads (2 gloo ranks on loopback).

Oracles: the bytes each variant hands to its collectives per step (closed form in the parameter count),
the lr schedule (closed form), an uninterrupted run against a stopped-and-resumed one (bitwise), and the
mean of the saved momenta for a world-size conversion (numpy).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import background
import compare_runs
from lioncub import cli
from lioncub.names import config_entries, run_label
from lioncub.optim import PRESETS
from lioncub.train import budget, checkpoint
from lioncub.train.config import BASELINES, TrainConfig, lr_factor
from lioncub.train.memory import MEMORY_KEYS
from train_runs import TINY, expected_bytes, records, train

ALL_VARIANTS = sorted({*PRESETS, *BASELINES})


# -- pure parts ----------------------------------------------------------------------------------------


def test_lr_schedule_warmup_then_cosine() -> None:
    steps, warmup, floor = 100, 10, 0.1
    assert lr_factor(1, steps, warmup, floor) == pytest.approx(0.1)
    assert lr_factor(10, steps, warmup, floor) == pytest.approx(1.0)
    assert lr_factor(55, steps, warmup, floor) == pytest.approx(floor + (1 - floor) * 0.5)  # half-way
    assert lr_factor(100, steps, warmup, floor) == pytest.approx(floor)
    values = [lr_factor(s, steps, warmup, floor) for s in range(warmup, steps + 1)]
    assert all(a >= b for a, b in itertools.pairwise(values))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"variant": "2bit"}, "--variant '2bit': allowed values are"),
        ({"workload": "bert"}, "--workload 'bert': allowed values are"),
        ({"size": "huge"}, "--size 'huge': allowed values for gpt are"),
        ({"steps": 0}, "--steps 0 must be an integer >= 1"),
        ({"data_mode": "stripes"}, "--data-mode 'stripes'"),
        ({"overrides": {"n_layers": 3}}, "--set n_layers: not a field of the gpt workload"),
        ({"stop_at": 300}, "--stop-at 300 must be an integer within"),
        ({"convert_momenta": "sum"}, "--convert-momenta 'sum': allowed values are \\['average'\\]"),
        ({"variant": "1bit", "topology": "ring"}, "--topology ring: allowed values are"),
        ({"nonfinite": "ignore"}, "--nonfinite ignore: allowed values are \\['skip', 'raise'\\]"),
        ({"seed": 2**63}, "--seed 9223372036854775808 must be at most 2\\*\\*63 - 1"),
        ({"version": 2, "optimizer": {"sync_every": 0}}, "--sync-every 0 must be an int >= 1"),
    ],
)
def test_config_errors_name_the_option(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_json(fields)


#: a run directory's config.json as lioncub wrote it before TrainConfig had parts (one flat object)
FLAT_CONFIG_JSON = """{
 "workload": "gpt",
 "size": "tiny",
 "variant": "8bit",
 "steps": 60,
 "warmup_steps": null,
 "min_lr_ratio": 0.1,
 "eval_every": 20,
 "checkpoint_every": 0,
 "seed": 3,
 "data_mode": "random",
 "bucket_mb": 25.0,
 "device": "auto",
 "overrides": {
  "batch_size": 8
 },
 "convert_momenta": null,
 "stop_at": null,
 "momentum_sync": [
  "wte",
  "lm_head"
 ],
 "sync_every": 5,
 "diagnostics_every": 0,
 "quantizer": "l0",
 "topology": "hierarchical",
 "nonfinite": "skip",
 "overlap": false,
 "nproc": 4,
 "link": "1gbit",
 "nnodes": 2,
 "intra_link": "10gbit"
}
"""


def saved_settings(path: Path) -> dict:
    """The settings of the ``config.json`` at ``path`` by name (nested on disk)."""
    return config_entries(json.loads(path.read_text()))


@pytest.mark.parametrize(
    ("doc", "betas"),
    [
        ({"version": 2, "optimizer": {"variant": "1bit", "local_steps": 4}}, [0.9, 0.99]),
        ({"version": 2, "optimizer": {"variant": "32bit", "local_steps": 4}}, [0.9, 0.99]),  # dsm
        ({"version": 2, "optimizer": {"variant": "32bit", "local_steps": 4, "outer": "diloco"}}, None),
        ({"version": 2, "optimizer": {"variant": "1bit"}}, None),
        ({"version": 3, "optimizer": {"variant": "1bit", "local_steps": 4}}, None),  # today's default
        ({"variant": "1bit", "local_steps": 4}, [0.9, 0.99]),  # flat: version 1
    ],
)
def test_a_run_written_before_outer_betas_resumes_with_the_betas_it_ran(
    doc: dict, betas: list | None
) -> None:
    """The sign rules' outer betas were (0.9, 0.99) before ``config.json`` version 3 (today's default is
    (0.9, 0.96)): a run written then keeps them on resume, and says so in its name."""
    run = {"steps": 8, "eval_every": 4}
    doc = {**doc, **({"run": run} if "version" in doc else run)}
    config = TrainConfig.from_json(doc)
    assert config.optimizer.outer_betas == betas
    assert ("/b0.9:0.99" in run_label(config.to_json())) is (betas is not None)
    assert config.optimizer.outer_lr is None  # at H = 4 the outer lr's default is 1, then and now


@pytest.mark.parametrize(
    ("version", "outer", "lr"), [(2, "vote", 1.0), (2, "diloco", None), (3, "vote", None)]
)
def test_a_run_written_before_the_outer_lr_default_fell_with_h_keeps_1(
    version: int, outer: str, lr: float | None
) -> None:
    """Before ``config.json`` version 3 the sign rules' outer lr was 1 at every H; today it is min(1, √(8/H))
    (0.71 at H = 16): a run written then keeps 1, DiLoCo's 0.7 never changed."""
    variant = "1bit" if outer == "vote" else "32bit"
    opt = {"variant": variant, "local_steps": 16, "outer": outer}
    config = TrainConfig.from_json(
        {"version": version, "run": {"steps": 32, "eval_every": 16}, "optimizer": opt}
    )
    assert config.optimizer.outer_lr == lr


def test_a_flat_config_json_loads_into_the_parts_and_is_written_back_nested() -> None:
    """A run directory of an earlier lioncub: its flat ``config.json`` loads into the parts, with the same
    settings, and is written back nested (version 3), which loads into the same configuration."""
    flat = json.loads(FLAT_CONFIG_JSON)
    config = TrainConfig.from_json(flat)
    run, opt, cluster = config.run, config.optimizer, config.cluster
    assert (run.workload, run.size, run.steps, run.eval_every, run.seed) == ("gpt", "tiny", 60, 20, 3)
    assert (run.overrides, run.warmup, run.min_lr_ratio) == ({"batch_size": 8}, 6, 0.1)
    assert (opt.variant, opt.quantizer, opt.topology, opt.sync_every) == ("8bit", "l0", "hierarchical", 5)
    assert opt.momentum_sync == ["wte", "lm_head"]
    assert (cluster.nproc, cluster.link, cluster.nnodes, cluster.intra_link) == (4, "1gbit", 2, "10gbit")
    assert cluster.nproc_per_node == 2
    doc = json.loads(json.dumps(config.to_json()))
    assert (doc["version"], list(doc)) == (3, ["version", "run", "optimizer", "cluster"])
    assert {k: v for k, v in config_entries(doc).items() if k in flat} == flat
    assert (
        doc["run"]["steps"] == 60 and doc["optimizer"]["quantizer"] == "l0" and doc["cluster"]["nnodes"] == 2
    )
    assert TrainConfig.from_json(doc) == config
    without_nodes = TrainConfig.from_json({"nproc": 2})
    assert (without_nodes.cluster.nnodes, without_nodes.cluster.intra_link) == (None, None)


@pytest.mark.parametrize("command", ["train", "compare"])
def test_the_flags_follow_the_settings(command: str) -> None:
    """Every setting a command takes is its flag, left None unless given (a resume keeps what is not),
    with its choices and its default in ``--help``; a flag converts its text as its setting's type."""
    import argparse

    from lioncub.cli.options import add_run_arguments
    from lioncub.train.config import SETTINGS

    parser = argparse.ArgumentParser(prog=f"lioncub {command}")
    add_run_arguments(parser, command)
    taken = {n: d for n, d in SETTINGS.items() if command in d.setting.commands}
    assert {"steps", "inner_momentum", "zero_vote"} <= taken.keys() and "pilot_steps" not in taken
    assert ("time_budget_s" in taken, "variant" in taken) == (command == "compare", command == "train")
    given = vars(parser.parse_args([]))
    assert {n: given[n] for n in taken} == dict.fromkeys(taken)
    text = " ".join(parser.format_help().split())
    for d in taken.values():
        assert d.flag in text, d.flag
        if d.setting.choices is not None:
            assert "{" + ",".join(d.setting.choices) + "}" in text, d.flag
    assert "optimizer steps; the lr schedule ends at the last one (default 200)" in text
    assert "(default vote, dsm min(1, √(8/H)); diloco 0.7)" in text or command == "compare"
    args = parser.parse_args(["--steps", "8", "--min-lr-ratio", "0.5", "--momentum-sync", "wte,lm_head"])
    assert (args.steps, args.min_lr_ratio, args.momentum_sync) == (8, 0.5, ["wte", "lm_head"])


def test_a_nested_config_json_holds_settings_only() -> None:
    """A nested ``config.json`` names what it holds that is not a setting of its part, or a version newer
    than this lioncub reads; a one-bit flat one without ``zero_vote`` ran the papers' rule, a nested one
    always records it."""
    doc = TrainConfig.from_json({"variant": "1bit"}).to_json()
    assert doc["optimizer"]["zero_vote"] == "plus"
    for bad, fragment in (
        ({**doc, "nnodes": 2}, "['nnodes']"),
        ({**doc, "run": {**doc["run"], "variant": "1bit"}}, "['run.variant']"),
        ({**doc, "version": 4}, "version 4: written by a newer lioncub"),
    ):
        with pytest.raises(ValueError, match=re.escape(fragment)):
            TrainConfig.from_json(bad)
    del doc["optimizer"]["zero_vote"]
    assert TrainConfig.from_json(doc).optimizer.zero_vote == "split"  # version 3 has it: its default


def test_momentum_conversion_is_the_mean(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    momenta = [rng.standard_normal((3, 5)).astype(np.float32) for _ in range(3)]
    path = tmp_path / "checkpoints" / "step_00000007"
    path.mkdir(parents=True)
    hashes = {}
    for r, m in enumerate(momenta):
        state = {"state": {0: {"exp_avg": torch.from_numpy(m)}}, "param_groups": []}
        torch.save({"optimizer": state, "rng": {}, "data": {}, "rank": r}, path / f"rank{r}.pt")
        hashes[f"rank{r}.pt"] = hashlib.sha256((path / f"rank{r}.pt").read_bytes()).hexdigest()
    meta = checkpoint.CheckpointMeta(path, 7, "1bit", 3, "gpt", "tiny", 0, hashes)
    with pytest.raises(ValueError, match=r"written by 3 ranks; this run has 2\..*--convert-momenta average"):
        checkpoint.check_compatible(
            meta, variant="1bit", world_size=2, workload="gpt", size="tiny", seed=0, convert_momenta=None
        )
    with pytest.raises(ValueError, match="written by --variant 1bit; this run is --variant 8bit"):
        checkpoint.check_compatible(
            meta, variant="8bit", world_size=3, workload="gpt", size="tiny", seed=0, convert_momenta=None
        )
    state = checkpoint.load_rank_state(meta, 1, 2)
    mean = np.mean(np.stack(momenta).astype(np.float64), axis=0).astype(np.float32)
    np.testing.assert_array_equal(state["optimizer"]["state"][0]["exp_avg"].numpy(), mean)
    assert state["converted_from"] == 3


# -- end to end --------------------------------------------------------------------------------------


#: the runs of test_every_variant_trains_through_the_cli: 5 steps (evaluated at 4 and, as the last, at 5),
#: checkpoints at steps 3 and 5. test_resume_equals_uninterrupted stops the same runs of its variants at
#: step 3 and resumes them (dropout on for 32bit and 1bit), so one launch of each serves both tests;
#: test_report_command_plots_the_diagnostics reads a copy of the 8bit one (the quantizer l0, diagnostics at
#: step 4). A batch of 4 windows a rank (the tiny GPT's is 16): no check depends on it (the losses are
#: compared between runs, the bytes and the memory are the parameters').
STEPS, EVAL_EVERY, CHECKPOINT_AT, DIAGNOSTICS_AT = 5, 4, 3, 4
EXTRA = {
    "32bit": ["--set", "dropout=0.1"],
    "1bit": ["--set", "dropout=0.1"],
    "8bit": ["--quantizer", "l0", "--diagnostics-every", str(DIAGNOSTICS_AT)],
}


def run_args(variant: str) -> list[str]:
    """Everything but ``--checkpoint-every`` of the uninterrupted run of ``variant`` (2 ranks)."""
    return ["--variant", variant, "--nproc", "2", "--steps", str(STEPS), "--eval-every", str(EVAL_EVERY),
            "--set", "batch_size=4", *EXTRA.get(variant, [])]  # fmt: skip


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``variant -> run directory`` of its uninterrupted run (launched on first use; tests only read it)."""
    runs: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in runs:
            out = tmp_path_factory.mktemp("whole") / variant
            assert train(out, *run_args(variant), "--checkpoint-every", str(CHECKPOINT_AT)) == 0
            runs[variant] = out
        return runs[variant]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_every_variant_trains_through_the_cli(whole_run: Callable[[str], Path], variant: str) -> None:
    out = whole_run(variant)
    steps = records(out, "step")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    summary = json.loads((out / "summary.json").read_text())
    d = summary["params"]
    for r in steps:
        assert math.isfinite(r["loss"]) and r["step_s"] > 0
        assert r["bytes_sent"] == pytest.approx(expected_bytes(variant, d, 2))
        parts = r["compute_s"] + r["comm_s"] + r["apply_s"]
        assert parts <= r["step_s"] * 1.0001 + 1e-6
    assert [e["step"] for e in records(out, "eval")] == [EVAL_EVERY, STEPS]  # and the last step's
    assert summary["final"]["val_loss"] > 0 and summary["steps_run"] == STEPS
    # bytes a rank holds (fp32): the parameters, a gradient for each, one momentum each (DDP + Lion and
    # every LionCub preset); the peak RSS is the OS's
    memory = summary["memory"]
    assert all(isinstance(memory[k], int) and memory[k] > 0 for k in MEMORY_KEYS)
    assert memory["parameters"] == memory["gradients"] == memory["optimizer_state"] == 4 * d
    assert memory["peak_rss"] > 4 * 4 * d
    meta = checkpoint.latest(out)
    assert meta is not None and (meta.step, meta.variant, meta.world_size) == (STEPS, variant, 2)


@pytest.mark.slow
def test_loss_falls_on_the_tiny_gpt(tmp_path: Path) -> None:
    """40 steps of the 1bit vote on 2 ranks, batches of 4 windows a rank (the tiny GPT's is 16: a quarter
    of the compute): the training loss falls by about 1.2 nats (from 4.32 to 3.13 over the last 5 steps)."""
    out = tmp_path / "run"
    argv = ["--variant", "1bit", "--nproc", "2", "--steps", "40", "--eval-every", "0"]
    assert train(out, *argv, "--set", "batch_size=4") == 0
    losses = [r["loss"] for r in records(out, "step")]
    assert losses[0] > math.log(40)  # about uniform over the ~60 characters at the start
    assert np.mean(losses[-5:]) < losses[0] - 0.8, losses


def assert_same_checkpoint(a: Path, b: Path, ranks: int = 2) -> None:
    """Two checkpoint directories hold bitwise the same model, momenta and RNG states of every rank."""
    ma, mb = (torch.load(d / "model.pt", weights_only=True) for d in (a, b))
    assert ma.keys() == mb.keys()
    for name, tensor in ma.items():
        assert torch.equal(tensor, mb[name]), name
    for r in range(ranks):
        sa, sb = (torch.load(d / f"rank{r}.pt", weights_only=False) for d in (a, b))
        for index, state in sa["optimizer"]["state"].items():
            assert torch.equal(state["exp_avg"], sb["optimizer"]["state"][index]["exp_avg"]), (r, index)
        assert torch.equal(sa["rng"]["torch"], sb["rng"]["torch"]), r  # the generator dropout draws from
        assert sa["rng"]["python"] == sb["rng"]["python"], r


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["32bit", "1bit", "8bit"], ids=["32bit-dropout", "1bit-dropout", "8bit"])
def test_resume_equals_uninterrupted(whole_run: Callable[[str], Path], tmp_path: Path, variant: str) -> None:
    """Stopped at step 3 and resumed = uninterrupted, bitwise; with dropout drawing from each rank's global
    generator (seeded from ``(seed, rank)``, saved and restored by the checkpoints) this also shows that two
    runs of one seed agree: ``whole`` and the first part of ``parts`` are two such runs up to step 3. The
    32bit baseline measures its forward + backward before training (dropout draws there too)."""
    whole, parts = whole_run(variant), tmp_path / "parts"
    assert train(parts, *run_args(variant), "--stop-at", str(CHECKPOINT_AT)) == 0
    assert checkpoint.latest(parts).step == CHECKPOINT_AT
    assert_same_checkpoint(whole / "checkpoints" / f"step_{CHECKPOINT_AT:08d}", checkpoint.latest(parts).path)
    assert train(parts, "--resume", "--no-progress") == 0
    a, b = checkpoint.latest(whole), checkpoint.latest(parts)
    assert a.step == b.step == STEPS
    assert_same_checkpoint(a.path, b.path)
    key = ("step", "loss", "lr", "bytes_sent")
    assert [tuple(r[k] for k in key) for r in records(whole, "step")] == [
        tuple(r[k] for k in key) for r in records(parts, "step")
    ]
    assert [e["val_loss"] for e in records(whole, "eval")] == [e["val_loss"] for e in records(parts, "eval")]
    ranks = [torch.load(a.path / f"rank{r}.pt", weights_only=False)["rng"]["torch"] for r in range(2)]
    assert not torch.equal(*ranks)  # every rank draws its own dropout masks


@pytest.mark.slow
def test_resume_refuses_another_world_size_or_variant(
    whole_run: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    shutil.copytree(whole_run("1bit"), out)  # 2 ranks, ended at step 5: a resume goes on to --steps 7
    capsys.readouterr()
    assert train(out, "--resume", "--nproc", "1") == 2
    assert "written by 2 ranks; this run has 1" in capsys.readouterr().err
    assert train(out, "--resume", "--variant", "8bit") == 2
    assert "written by --variant 1bit; this run is --variant 8bit" in capsys.readouterr().err
    assert train(out, "--variant", "1bit") == 2  # without --resume an existing run is not overwritten
    assert "already holds a run; pass --resume" in capsys.readouterr().err
    resume = ["--resume", "--nproc", "1", "--convert-momenta", "average", "--steps", str(STEPS + 2)]
    assert train(out, *resume) == 0
    assert [r["step"] for r in records(out, "step")] == list(range(1, STEPS + 3))
    assert json.loads((out / "summary.json").read_text())["world_size"] == 1


#: the two comparisons of tests/compare_runs.py, one after the other in one interpreter, in the background
#: (the job shared with tests/test_cli_output.py and tests/test_local_steps_cli.py)
BACKGROUND = {"compares": compare_runs.job}


def compare_run(name: str) -> tuple[Path, str]:
    """The output directory of ``compare_runs.RUNS[name]`` and what it printed (stdout)."""
    done = background.result("compares", BACKGROUND["compares"])
    workdir = background.workdir("compares")
    out = workdir / name / "cmp"
    log = workdir / f"{name}.log"
    assert (out / "summary.json").exists(), (
        f"exit {done.returncode}: {log.read_text()[-3000:] if log.exists() else ''}{done.stderr[-2000:]}"
    )
    return out, (workdir / f"{name}.out").read_text()


def without_plots(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compare called again in a test only rebuilds its tables (``make_report(plots=False)``): the PNGs,
    about 0.3 s of CPU each, are test_compare_writes_table_and_plots' (it checks the first call's)."""
    from lioncub.report import runs

    monkeypatch.setattr(runs, "make_report", functools.partial(runs.make_report, plots=False))


@pytest.fixture(scope="module")
def compared() -> tuple[Path, str]:
    """``compare_runs.COMPARE``'s output directory and what it printed (stdout): test_compare_writes_table_
    and_plots, test_compare_with_an_overlapped_variant, test_diagnostics_and_momentum_sync_through_the_cli
    (its 1bit run) and test_compare_has_a_local_steps_row."""
    return compare_run("compare")


@pytest.mark.background("compares")
@pytest.mark.slow
def test_compare_writes_table_and_plots(
    compared: tuple[Path, str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, printed = compared
    assert saved_settings(out / "32bit" / "config.json")["diagnostics_every"] == 0
    assert [r["step"] for r in records(out / "1bit", "diag")] == [2, 4]
    assert (out / "diagnostics_vs_step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "32bit" in printed and "1bit" in printed and str(out / "summary.md") in printed
    table = (out / "summary.md").read_text()
    assert "| 32bit" in table and "| 1bit" in table
    for name in (
        "val_loss_vs_step",
        "val_loss_vs_time",
        "val_loss_vs_bytes",
        "step_time_split",
        "bytes_per_step",
    ):
        png = (out / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n", name
    # a second call reuses the finished runs instead of training again (its report without the PNGs
    # checked above: the same runs drawn again)
    capsys.readouterr()
    without_plots(monkeypatch)
    assert cli.main([*compare_runs.COMPARE, "--out", str(out)]) == 0
    assert "reusing the finished run" in capsys.readouterr().err


@pytest.mark.slow
def test_cnn_trains_with_batchnorm_and_reports_accuracy(tmp_path: Path) -> None:
    """12 steps of the 4bit vote on 2 ranks: the digits' validation accuracy is ~0.8 at step 6 and ~0.84 at
    step 12 (~0.92 at step 30), far above chance."""
    out = tmp_path / "cnn"
    argv = ["train", "--workload", "cnn", "--size", "tiny", "--no-progress", "--variant", "4bit"]
    assert cli.main([*argv, "--nproc", "2", "--steps", "12", "--eval-every", "6", "--out", str(out)]) == 0
    evals = records(out, "eval")
    assert [e["step"] for e in evals] == [6, 12]
    assert 0.0 <= evals[0]["val_acc"] <= 1.0
    assert evals[-1]["val_acc"] > 0.5  # ten digit classes: chance is 0.1


@pytest.mark.background("compares")
@pytest.mark.slow
def test_diagnostics_and_momentum_sync_through_the_cli(compared: tuple[Path, str]) -> None:
    """The compare's 1bit run (2 ranks, 4 steps): diagnostics every 2 steps, the io momenta synced every 2."""
    out = compared[0] / "1bit"
    assert saved_settings(out / "config.json")["momentum_sync"] == "io"
    diags = records(out, "diag")
    assert [d["step"] for d in diags] == [2, 4]
    layers = diags[0]["layers"]
    assert "transformer.wte.weight" in layers and "lm_head.weight" in layers
    for d in diags:
        assert 0.0 <= d["overall"]["flip"] <= d["overall"]["flip"] + d["overall"]["match"] <= 1.0
        assert 0.0 <= d["overall"]["tie"] <= 1.0  # N = 2: a tie wherever the two signs differ
    # synced every 2 steps: at steps 2 and 4 the io momenta agree across ranks
    synced = diags[0]["layers"]["transformer.wte.weight"]["momentum_max_std"]  # E[m²] − E[m]² in fp32: ~0
    local = diags[0]["layers"]["transformer.h.0.attn.c_attn.weight"]["momentum_max_std"]
    assert synced < 1e-3 * local
    assert [r["step"] for r in records(out, "step")] == [1, 2, 3, 4]  # the report reads only steps/evals


@pytest.mark.slow
def test_report_command_plots_the_diagnostics(
    whole_run: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``lioncub report`` of the 8bit run of test_every_variant_trains_through_the_cli (a copy: the report
    writes its plots into the run directory): ``--quantizer l0``, diagnostics at step 4 of 5."""
    out = tmp_path / "run"
    shutil.copytree(whole_run("8bit"), out)
    assert [d["step"] for d in records(out, "diag")] == [DIAGNOSTICS_AT]
    capsys.readouterr()
    assert cli.main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "diagnostics at step 4" in printed and "transformer.wte.weight" in printed and "overall" in printed
    for name in ("diag_rates", "diag_momentum_std", "diag_update_shape"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert saved_settings(out / "config.json")["quantizer"] == "l0"
    assert cli.main(["report", str(tmp_path)]) == 2  # not a run directory
    assert "no log.jsonl" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--quantizer l7 is not one of \['l0', 'l1'"):
        TrainConfig.from_json({"quantizer": "l7"})
    with pytest.raises(
        ValueError, match=r"--quantizer l0: applies only to the quantized vote .* --variant 1bit"
    ):
        TrainConfig.from_json({"variant": "1bit", "quantizer": "l0"})


@pytest.mark.background("compares")
@pytest.mark.slow
def test_compare_with_an_overlapped_variant(
    compared: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``1bit+overlap`` trains bitwise like ``1bit`` (model, losses, bytes) and is its own row."""
    out, _ = compared
    assert saved_settings(out / "1bit+overlap" / "config.json")["overlap"] is True
    assert saved_settings(out / "1bit" / "config.json")["overlap"] is False
    key = ("step", "loss", "bytes_sent")
    plain, over = records(out / "1bit", "step"), records(out / "1bit+overlap", "step")
    assert [r["step"] for r in plain] == [1, 2, 3, 4]
    assert [tuple(r[k] for k in key) for r in plain] == [tuple(r[k] for k in key) for r in over]
    assert all(r["overlapped_s"] > 0 for r in over) and all(r["overlapped_s"] == 0 for r in plain)
    a, b = checkpoint.latest(out / "1bit"), checkpoint.latest(out / "1bit+overlap")
    for name, tensor in checkpoint.model_state(a).items():
        assert torch.equal(tensor, checkpoint.model_state(b)[name]), name
    assert "| 1bit+overlap" in (out / "summary.md").read_text()
    capsys.readouterr()
    bad = ["compare", *TINY, "--variants", "32bit+overlap", "--out", str(tmp_path / "bad")]
    assert cli.main(bad) == 2
    assert "'+overlap'" in capsys.readouterr().err
    assert train(tmp_path / "bad2", "--variant", "16bit", "--overlap") == 2
    assert "--overlap: --variant 16bit is DDP + Lion, which always overlaps" in capsys.readouterr().err


@pytest.mark.background("compares")
@pytest.mark.slow
def test_compare_has_a_local_steps_row(
    compared: tuple[Path, str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """test_train's compare has ``1bit/h2`` (its run in ``1bit_h2``): no diagnostics or momentum sync there
    (they apply to a vote every step), bytes at the outer steps, and the per-window median in the table."""
    out = compared[0]
    config = saved_settings(out / "1bit_h2" / "config.json")
    assert (config["local_steps"], config["diagnostics_every"], config["momentum_sync"]) == (2, 0, "none")
    steps = records(out / "1bit_h2", "step")
    assert [r["bytes_sent"] > 0 for r in steps] == [False, True, False, True]
    rows = {r["variant"]: r for r in json.loads((out / "summary.json").read_text())["rows"]}
    assert rows["1bit/h2"]["bytes_sent_per_step"] == pytest.approx(steps[1]["bytes_sent"] / 2)
    summary = json.loads((out / "1bit_h2" / "summary.json").read_text())
    # at the run's end (a window's): the inner momentum, the anchor θ_t and the outer momentum, fp32 each
    assert summary["memory"]["optimizer_state"] == 3 * 4 * summary["params"]
    assert "| 1bit/h2" in (out / "summary.md").read_text()
    capsys.readouterr()
    without_plots(monkeypatch)
    assert cli.main(["compare", "--out", str(out), "--report-only"]) == 0
    assert "1bit/h2" in capsys.readouterr().out


# -- comparisons at equal time: lioncub compare --time-budget (lioncub.train.budget) ------------------------


def test_the_pilot_and_the_plan() -> None:
    """A pilot trains at least 8 steps and 3 periods, in whole periods, and its step time leaves its first
    period out; the steps that fit are rounded down to a multiple of H; about 10 evaluations a run."""
    assert [budget.pilot_steps(p) for p in (1, 2, 4, 16, 10)] == [8, 8, 12, 48, 30]
    assert budget.pilot_step_time([9.0, 1.0, 2.0, 3.0], 1) == 2.0
    assert budget.pilot_step_time([9.0, 9.0, 1.0, 3.0], 2) == 2.0
    with pytest.raises(ValueError, match="more than 2 steps"):
        budget.pilot_step_time([9.0, 9.0], 2)
    assert budget.planned_steps(300, 0.25, 1) == 1200 and budget.planned_steps(300, 0.245, 16) == 1216
    with pytest.raises(ValueError, match=r"--time-budget 1: .* not even a window of 16 steps fits"):
        budget.planned_steps(1, 0.1, 16)
    assert [budget.eval_interval(n, h) for n, h in ((1200, 1), (1216, 16), (20, 16))] == [120, 128, 16]
    synced = TrainConfig.from_json({"variant": "1bit", "momentum_sync": "io", "sync_every": 4})
    local = TrainConfig.from_json({"variant": "1bit", "local_steps": 4, "steps": 8, "eval_every": 4})
    assert budget.period(synced) == 4 and budget.period(local) == 4 and budget.period(TrainConfig()) == 1


def test_a_planned_run_spans_its_own_steps() -> None:
    """The pilot is the row's run, shorter (its own warm-up, evaluated only at its end); the planned run
    takes the steps its pilot's step time fits, its lr schedule (warm-up 10 %, cosine) over them."""
    doc = {"variant": "1bit", "local_steps": 4, "steps": 4, "eval_every": 4, "time_budget_s": 10.0}
    config = TrainConfig.from_json({**doc, "nproc": 2, "min_lr_ratio": 0.2})
    pilot = budget.pilot_config(config)
    assert (pilot.run.steps, pilot.run.eval_every, pilot.run.time_budget_s) == (12, 0, None)
    assert pilot.optimizer == config.optimizer and pilot.cluster == config.cluster
    times = [1.0] * 4 + [0.125] * 8  # the first window is left out: 0.125 s a step, 80 steps in 10 s
    plan = budget.planned_config(config, 10.0, times, eval_given=False)
    assert (plan.run.steps, plan.run.eval_every, plan.run.warmup) == (80, 8, 8)
    assert (plan.run.time_budget_s, plan.run.pilot_steps, plan.run.pilot_step_s) == (10.0, 12, 0.125)
    assert lr_factor(80, plan.run.steps, plan.run.warmup, 0.2) == pytest.approx(0.2)  # the end of its cosine
    assert budget.planned_config(config, 10.0, times, eval_given=True).run.eval_every == 4
    assert TrainConfig.from_json(plan.to_json()) == plan
    plain = TrainConfig().to_json()["run"]
    assert [plain[k] for k in ("time_budget_s", "pilot_steps", "pilot_step_s")] == [None, None, None]


def test_each_row_plans_the_steps_its_own_step_time_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lioncub compare --time-budget 1``: two rows whose pilots (stubbed) took 1/64 and 1/256 s a step
    after their first period plan 64 and 256 steps, each evaluated about 10 times."""
    from lioncub.cli import compare, options
    from lioncub.train.driver import RunOutcome

    step_s = {1: 1 / 64, 4: 1 / 256}  # by H

    def pilot(args: object, config: TrainConfig, run_dir: Path, lock: object, label: str = "") -> RunOutcome:
        lock.release()  # type: ignore[attr-defined]
        h, n = config.optimizer.local_steps or 1, config.run.steps
        lines = [{"kind": "step", "step": s, "step_s": 1.0 if s <= h else step_s[h]} for s in range(1, n + 1)]
        (run_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        return RunOutcome(0, "", {"steps_run": n})

    monkeypatch.setattr(options, "train_run", pilot)
    argv = [
        "compare",
        *TINY,
        "--out",
        str(tmp_path / "cmp"),
        "--variants",
        "32bit,1bit/h4",
        "--time-budget",
        "1",
    ]
    args = cli.build_parser("compare").parse_args(argv)
    plans = {v: compare._plan(args, compare._config(args, v), v) for v in ("32bit", "1bit/h4")}
    assert {v: (p.run.steps, p.run.eval_every, p.run.pilot_steps) for v, p in plans.items()} == {
        "32bit": (64, 6, 8),
        "1bit/h4": (256, 24, 12),
    }
    assert [p.run.pilot_step_s for p in plans.values()] == [1 / 64, 1 / 256]


@pytest.fixture(scope="module")
def budget_compared() -> tuple[Path, str]:
    """``compare_runs.BUDGET``, a comparison at equal time: 32bit planned from its pilot; 1bit/h2 from a
    pilot step time taken 20× too short, so that it runs far over its budget and the guard stops it. The
    output directory and what compare printed (stdout)."""
    return compare_run("budget")


@pytest.mark.background("compares")
@pytest.mark.slow
def test_compare_at_equal_time_plans_each_run_from_its_pilot(budget_compared: tuple[Path, str]) -> None:
    """Each run trains the steps its own pilot's step time fits in the budget (a multiple of H), evaluated
    about 10 times and at its end, with its lr schedule over its own steps; the summary records the budget,
    the plan and the measured time; the run far over its budget is stopped at a window's end, evaluated and
    checkpointed there."""
    out = budget_compared[0]
    planned = {}
    for name, h in (("32bit", 1), ("1bit_h2", 2)):
        config = saved_settings(out / name / "config.json")
        steps = config["steps"]
        planned[name] = steps
        assert config["pilot_steps"] == budget.pilot_steps(h) and config["time_budget_s"] == 1.0
        assert steps == budget.planned_steps(1.0, config["pilot_step_s"], h)
        assert config["eval_every"] == budget.eval_interval(steps, h)
        recs = records(out / name, "step")
        warmup = min(100, steps // 10)
        peak = recs[0]["lr"] / lr_factor(1, steps, warmup, 0.1)
        assert [r["lr"] for r in recs] == pytest.approx(
            [peak * lr_factor(r["step"], steps, warmup, 0.1) for r in recs]
        )
        summary = json.loads((out / name / "summary.json").read_text())["time_budget"]
        assert (summary["budget_s"], summary["planned_steps"]) == (1.0, steps)
        assert (summary["steps_run"], summary["wall_s"]) == (recs[-1]["step"], recs[-1]["time_s"])
        evals = [e["step"] for e in records(out / name, "eval")]
        assert evals[-1] == recs[-1]["step"] and all(s % config["eval_every"] == 0 for s in evals[:-1])
    assert planned["1bit_h2"] > 4 * planned["32bit"]  # the 20× shorter step time
    stop = records(out / "1bit_h2", "stop")
    assert len(stop) == 1 and stop[0]["step"] % 2 == 0 and stop[0]["time_s"] > budget.GUARD_FACTOR
    steps = records(out / "1bit_h2", "step")
    assert steps[-1]["step"] == stop[0]["step"] < planned["1bit_h2"]
    earlier = next(r for r in steps if r["step"] == stop[0]["step"] - 2)  # the window's end before
    assert earlier["time_s"] <= budget.GUARD_FACTOR
    summary = json.loads((out / "1bit_h2" / "summary.json").read_text())["time_budget"]
    assert summary["stopped_at"] == stop[0]["step"]
    assert checkpoint.latest(out / "1bit_h2").step == stop[0]["step"]


@pytest.mark.background("compares")
@pytest.mark.slow
def test_compare_at_equal_time_reports_the_loss_at_the_budget(
    budget_compared: tuple[Path, str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table: each run's steps, its validation loss at the budget (the last evaluation by 1.05 × the
    budget, with its time; none for the run stopped far over it) and its time to the target; the loss-vs-time
    plot; a second call reuses the finished runs (no pilot)."""
    out, printed = budget_compared
    assert "time budget: 1 s of training per run" in printed and "1bit/h2" in printed
    rows = {r["variant"]: r for r in json.loads((out / "summary.json").read_text())["rows"]}
    for name, row in rows.items():
        evals = records(Path(row["run_dir"]), "eval")
        within = [e for e in evals if e["time_s"] <= 1.05]
        at = within[-1] if within else None
        assert row["budget"]["loss"] == (at["val_loss"] if at else None), name
        assert row["budget"]["loss_time_s"] == (at["time_s"] if at else None), name
        assert row["time_to_target_s"] == evals[0]["time_s"]  # target 10: reached at the first evaluation
        assert row["steps"] == records(Path(row["run_dir"]), "step")[-1]["step"]
    assert rows["1bit/h2"]["budget"]["stopped_at"] is not None and rows["32bit"]["budget"]["loss"] is not None
    table = (out / "summary.md").read_text()
    assert "| steps | val loss at budget (s) | final val loss | time to target s |" in table
    assert (
        "| 1bit/h2 (stopped over budget: step " in table and "time budget: 1 s of training per run" in table
    )
    assert (out / "val_loss_vs_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    without_plots(monkeypatch)
    assert cli.main([*compare_runs.BUDGET, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("reusing the finished run") == 3 and "pilot" not in err


@pytest.mark.background("compares")
@pytest.mark.slow
def test_compare_row_auto_trains_what_its_pilot_chose(budget_compared: tuple[Path, str]) -> None:
    """The row ``auto``: a pilot of the per-step 1bit vote measured compute c and communication m (the
    medians of its steps after the first); the run trains the schedule rule's choice for them, planned from
    its own pilot, records c, m and ``chosen_by``, and the report names it ``auto (CHOICE)``."""
    from lioncub.cli.auto import choose_run

    out = budget_compared[0]
    config = saved_settings(out / "auto" / "config.json")
    assert config["chosen_by"] == "auto" and config["auto_compute_s"] > 0 and config["auto_vote_s"] > 0
    chosen, _ = choose_run(config["auto_compute_s"], config["auto_vote_s"])
    assert chosen.startswith("1bit/h")  # loopback: m > 0, and f(4) = 1
    assert run_label({k: v for k, v in config.items() if k != "chosen_by"}) == chosen
    assert config["variant"] == "1bit" and config["time_budget_s"] == 1.0
    h = config["local_steps"]
    assert config["pilot_steps"] == budget.pilot_steps(h)  # the chosen run's own pilot planned the steps
    assert [r["step"] for r in records(out / "auto", "step")][-1] % h == 0
    rows = {r["variant"]: r for r in json.loads((out / "summary.json").read_text())["rows"]}
    assert f"auto ({chosen})" in rows
    assert f"auto ({chosen})" in (out / "summary.md").read_text()


@pytest.mark.slow
def test_train_variant_auto_records_what_its_pilot_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``lioncub train --variant auto`` on one rank: its pilot measures no communication (a rank alone
    sends nothing), so nothing beats the vote every step; the run trains ``1bit``, records c, m and
    ``chosen_by``, and is named ``auto (1bit)``."""
    argv = ["--variant", "auto", "--steps", "16", "--eval-every", "16", "--set", "batch_size=4"]
    assert train(tmp_path / "auto", *argv) == 0  # 16 steps: a multiple of every H it may choose
    config = saved_settings(tmp_path / "auto" / "config.json")
    assert (config["chosen_by"], config["variant"], config["local_steps"]) == ("auto", "1bit", None)
    assert config["auto_vote_s"] == 0.0 and config["auto_compute_s"] > 0
    assert run_label(config) == "auto (1bit)"
    assert "--variant auto: chose 1bit: a vote every step" in capsys.readouterr().err
    assert len(records(tmp_path / "auto", "step")) == 16
