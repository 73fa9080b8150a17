"""Local steps in the tools: run names (``lioncub.names``), ``TrainConfig``'s local-steps and zero-vote
fields, the report's per-window medians, ``lioncub train --local-steps`` (bitwise resume from the middle
of a window, bytes only at the outer steps) (the ``1bit/h2`` row of a compare is in test_train)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import background
import compare_runs
import local_runs
from lioncub import cli
from lioncub.cli.options import config_from_args
from lioncub.names import name_of_run_dir, parse_run_name, run_dir_name, run_label
from lioncub.optim import LocalSteps
from lioncub.report.runs import RunLog, per_step_median
from lioncub.train import checkpoint
from lioncub.train.config import TrainConfig
from train_runs import expected_bytes, records, train

# -- names ---------------------------------------------------------------------------------------------

NAMES = {
    "1bit": {"variant": "1bit"},
    "1bit@hierarchical": {"variant": "1bit", "topology": "hierarchical"},
    "8bit+overlap": {"variant": "8bit", "overlap": True},
    "1bit/h16": {"variant": "1bit", "local_steps": 16},
    "8bit-sign/h4/lr2": {"variant": "8bit-sign", "local_steps": 4, "outer_lr": 2.0},
    "1bit@node-majority/h8": {"variant": "1bit", "topology": "node-majority", "local_steps": 8},
    "dsm/h16": {"variant": "32bit", "local_steps": 16, "outer": "dsm"},
    "diloco/h64/lr0.7": {"variant": "32bit", "local_steps": 64, "outer": "diloco", "outer_lr": 0.7},
    "diloco-16bit/h16": {"variant": "16bit", "local_steps": 16, "outer": "diloco"},
    "diloco/h16/keep": {"variant": "32bit", "local_steps": 16, "outer": "diloco", "inner_momentum": "keep"},
    "1bit/h4/lr2/average": {
        "variant": "1bit",
        "local_steps": 4,
        "outer_lr": 2.0,
        "inner_momentum": "average",
    },
    "1bit/h4/b0.9:0.96": {"variant": "1bit", "local_steps": 4, "outer_betas": [0.9, 0.96]},
    "dsm/h16/lr0.5/b0.8:0.99/keep": {
        "variant": "32bit",
        "local_steps": 16,
        "outer": "dsm",
        "outer_lr": 0.5,
        "outer_betas": [0.8, 0.99],
        "inner_momentum": "keep",
    },
    "1bit/plus": {"variant": "1bit", "zero_vote": "plus"},
    "4bit@hierarchical/h8/keep/plus+overlap": {
        "variant": "4bit",
        "topology": "hierarchical",
        "local_steps": 8,
        "inner_momentum": "keep",
        "zero_vote": "plus",
        "overlap": True,
    },
}


@pytest.mark.parametrize(("name", "fields"), NAMES.items())
def test_run_names_parse_and_print_back(name: str, fields: dict) -> None:
    assert parse_run_name(name) == fields
    assert run_label({"topology": "flat", "overlap": False, **fields}) == name
    assert name_of_run_dir(run_dir_name(name)) == name and "/" not in run_dir_name(name)


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("1bit/16", "hH"),
        ("1bit/h0", "hH"),
        ("1bit/h4/x", "/lrX"),
        ("1bit/h4/lrx", "a number"),
        ("a/h2/lr1/b", "/bB1:B2 needs two numbers"),
        ("a/h2/lr1/x", "/lrX"),
        ("1bit/keep", "/hH"),  # an inner-momentum rule needs local steps
        ("1bit/h4/keep/lr2", "in this order"),
        ("1bit/h4/b0.9", "two numbers"),
        ("1bit/h4/b0.9:x", "two numbers"),
        ("1bit/h4/b0.9:0.99/lr2", "in this order"),
        ("1bit/plus/h4", "in this order"),
    ],
)
def test_run_names_that_are_not_understood(name: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_run_name(name)


def test_run_names_name_every_outer_rule_but_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The outer rules' names are one torch-free table (``optim.config.OUTER_RULE_FACTS``), the optimizer's
    rules those; a run name spells every rule but the default, so that a rule of its own that votes (a
    Nesterov sign step, say) is not named as the default vote of its variant."""
    from lioncub import names
    from lioncub.optim.config import DEFAULT_OUTER, OUTER_RULE_FACTS
    from lioncub.optim.outer import OUTER_RULES

    assert list(OUTER_RULE_FACTS) == list(OUTER_RULES) and LocalSteps.outer == DEFAULT_OUTER
    for rule in (r for r in OUTER_RULE_FACTS if r != DEFAULT_OUTER):
        label = run_label({"variant": "16bit", "local_steps": 4, "outer": rule})
        assert label == f"{rule}-16bit/h4" and parse_run_name(label)["outer"] == rule
    monkeypatch.setattr(names, "_NAMED_RULES", ["nesterov-sign", *names._NAMED_RULES])
    new = run_label({"variant": "1bit", "local_steps": 16, "outer": "nesterov-sign"})
    assert (
        new == "nesterov-sign-1bit/h16" != run_label({"variant": "1bit", "local_steps": 16, "outer": "vote"})
    )
    assert parse_run_name(new) == {"variant": "1bit", "local_steps": 16, "outer": "nesterov-sign"}


def test_run_names_tell_the_inner_momentum_and_zero_rules_apart() -> None:
    """A run's name says which inner-momentum rule (reset, the default, is left out) and which zero rule
    (split, the default, is left out) it ran; the defaults may be spelt out; the rules are the optimizer's."""
    from lioncub.names import INNER_MOMENTA, ZERO_VOTES
    from lioncub.optim.config import ZERO_VOTES as OPTIM_ZERO_VOTES
    from lioncub.optim.local_steps import INNER_MOMENTA as OPTIM_INNER_MOMENTA

    assert (
        set(INNER_MOMENTA) == set(OPTIM_INNER_MOMENTA) and INNER_MOMENTA[0] == LocalSteps(h=2).inner_momentum
    )
    assert ZERO_VOTES == OPTIM_ZERO_VOTES
    names = set()
    for rule in ("reset", "keep", "average"):
        doc = {"variant": "32bit", "local_steps": 16, "outer": "diloco", "inner_momentum": rule}
        names.add(run_label(TrainConfig.from_json({**doc, "steps": 32, "eval_every": 16}).to_json()))
    assert names == {"diloco/h16", "diloco/h16/keep", "diloco/h16/average"}
    assert parse_run_name("diloco/h16/reset")["inner_momentum"] == "reset"
    assert parse_run_name("1bit/h4/split")["zero_vote"] == "split"
    for zero, name in (("split", "1bit"), ("plus", "1bit/plus")):
        assert run_label(TrainConfig.from_json({"variant": "1bit", "zero_vote": zero}).to_json()) == name


def test_compare_rows_of_each_inner_momentum_rule() -> None:
    """``--variants diloco/h16,diloco/h16/keep`` trains both rules, each row under its own name; a row's
    own rule wins over ``--inner-momentum``; ``/plus`` on a vote that is not one-bit is refused."""
    from lioncub.cli.compare import _config, _variants

    parser = cli.build_parser("compare")
    args = parser.parse_args(["compare", "--out", "x", "--variants", "diloco/h16,diloco/h16/keep,1bit/plus"])
    args.steps = 32
    assert _variants(args, Path("x")) == ["diloco/h16", "diloco/h16/keep", "1bit/plus"]
    rows = {v: _config(args, v) for v in _variants(args, Path("x"))}
    assert [c.optimizer.inner_momentum for c in rows.values()] == ["reset", "keep", "reset"]
    assert rows["1bit/plus"].optimizer.zero_vote == "plus"
    assert [run_label(c.to_json()) for c in rows.values()] == list(rows)
    args.inner_momentum = "average"
    assert _config(args, "diloco/h16/reset").optimizer.inner_momentum == "reset"
    assert _config(args, "diloco/h16").optimizer.inner_momentum == "average"
    with pytest.raises(
        ValueError, match=r"--variants 8bit/plus: --zero-vote plus applies .*\(variant 8bit\)"
    ):
        _config(args, "8bit/plus")
    args.variants = "1bit/plus"  # --inner-momentum with no local-steps row, though a name has a '/'
    with pytest.raises(ValueError, match="--inner-momentum average: applies only with --local-steps"):
        _variants(args, Path("x"))


# -- the configuration ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "fix", "not_this"),
    [
        ({"momentum_sync": "all"}, "--inner-momentum average averages them", None),
        ({"diagnostics_every": 2}, "drop --diagnostics-every", "--inner-momentum"),
        ({"overlap": True}, "drop --overlap", "--inner-momentum"),
    ],
    ids=["momentum-sync", "diagnostics-every", "overlap"],
)
def test_each_refusal_with_local_steps_names_its_own_fix(
    option: dict, fix: str, not_this: str | None
) -> None:
    with pytest.raises(ValueError) as err:
        TrainConfig.from_json({"variant": "1bit", "local_steps": 2, "steps": 4, "eval_every": 2, **option})
    assert fix in str(err.value), str(err.value)
    assert not_this is None or not_this not in str(err.value), str(err.value)


@pytest.mark.parametrize(("outer", "default"), [("vote", 1.0), ("diloco", 0.7)])
def test_a_resume_accepts_the_default_outer_lr_given(outer: str, default: float) -> None:
    """``--resume --outer-lr D`` on a run that has none, D being its rule's default, trains what the run
    trained: accepted, and the run keeps its None (and its name); another outer lr is refused."""
    from lioncub.train.prepare import check_resume

    variant = "1bit" if outer == "vote" else "32bit"
    doc = {"variant": variant, "local_steps": 2, "outer": outer, "steps": 4, "eval_every": 2}
    saved = TrainConfig.from_json(doc)
    given = TrainConfig.from_json({**doc, "outer_lr": default, "steps": 8})
    check_resume(saved, given, Path("run"))
    assert given.optimizer.outer_lr is None and run_label(given.to_json()) == run_label(saved.to_json())
    with pytest.raises(ValueError, match=r"--resume: --outer-lr 2\.0: the run in run has --outer-lr None"):
        check_resume(saved, TrainConfig.from_json({**doc, "outer_lr": 2.0}), Path("run"))


def test_local_steps_in_the_configuration() -> None:
    dense = TrainConfig.from_json({"variant": "32bit", "local_steps": 4, "steps": 8, "eval_every": 4})
    assert dense.optimizer.outer == "dsm"  # a vote on the fp32 mean is the sign of the mean: dsm
    doc = dense.to_json()
    local = ("local_steps", "outer", "outer_lr", "inner_momentum")
    assert [doc["optimizer"][k] for k in local] == [4, "dsm", None, "reset"]
    assert TrainConfig.from_json(doc).to_json() == doc
    plain = TrainConfig.from_json({"variant": "8bit"}).to_json()["optimizer"]
    assert [plain[k] for k in (*local, "zero_vote")] == [None, "vote", None, "reset", "split"]


def test_a_one_bit_run_written_before_zero_vote_resumes_with_the_papers_rule() -> None:
    assert TrainConfig.from_json({"variant": "1bit"}).optimizer.zero_vote == "plus"
    assert TrainConfig.from_json({"variant": "4bit", "zero_vote": "split"}).optimizer.zero_vote == "split"
    assert TrainConfig.from_json({"variant": "8bit"}).optimizer.zero_vote == "split"  # not a one-bit vote
    parser = cli.build_parser()
    new = config_from_args(parser.parse_args(["train", "--out", "x", "--variant", "1bit"]))
    assert new.optimizer.zero_vote == "split" and new.to_json()["optimizer"]["zero_vote"] == "split"
    assert TrainConfig.from_json(new.to_json()).optimizer.zero_vote == "split"  # nested: written with it
    h8 = config_from_args(parser.parse_args(["train", "--out", "x", "--local-steps", "8", "--steps", "96"]))
    assert h8.run.eval_every == 48  # the multiple of H nearest the default 50


# -- the report: per-window medians ----------------------------------------------------------------------


def test_the_report_takes_medians_over_windows() -> None:
    """H = 4: three windows of mean bytes (0+0+0+40)/4 = 10, (0+0+0+80)/4 = 20, 30 and an incomplete fourth;
    the median over the complete windows is 20 (a median over steps would say 0)."""
    steps = [
        {
            "kind": "step",
            "step": s,
            "bytes_sent": 10 * s if s % 4 == 0 else 0,
            "step_s": 1.0 if s % 4 else 5.0,
        }
        for s in range(1, 15)
    ]
    run = RunLog(Path("r"), {"variant": "1bit", "local_steps": 4}, steps, [])
    assert run.variant == "1bit/h4"
    assert per_step_median(run, "bytes_sent") == 20 and per_step_median(run, "step_s") == 2.0
    per_step = RunLog(Path("r"), {"variant": "1bit"}, steps, [])
    assert per_step_median(per_step, "bytes_sent") == 0


# -- lioncub train --local-steps ---------------------------------------------------------------------------

#: tests/compare_runs.py's job (shared with tests/test_train.py and tests/test_cli_output.py), started in the
#: background when collection ends (tests/background.py): the three runs of the mid-window resume
#: (tests/local_runs.py) in its interpreter, their ranks forked from its zygote, in ``WORKDIR/local``
BACKGROUND = {"compares": compare_runs.job}


@pytest.mark.slow
@pytest.mark.background("compares")
def test_train_with_local_steps_resumes_from_the_middle_of_a_window_bitwise(
    capsys: pytest.CaptureFixture,
) -> None:
    """A stop after step 3 and a resume (given the default ``--outer-lr 1``) give the uninterrupted run bit
    for bit: every rank's replica comes back from its optimizer state (the checkpoint's model file is rank
    0's); the ranks send only at the outer steps, the 1-bit vote of the model and the step check. The runs
    (tests/local_runs.py) ran in the background, in tests/compare_runs.py's job."""
    done = background.result("compares", BACKGROUND["compares"])
    workdir = background.workdir("compares") / "local"
    printed = [path.read_text()[-2000:] for path in sorted(workdir.glob("*.out"))]
    failed = (workdir / "failed").read_text() if (workdir / "failed").exists() else None
    assert failed == "0" and len(printed) == len(local_runs.RUNS), f"{done.stderr[-2000:]}{printed}"
    whole, parts = workdir / "whole", workdir / "parts"
    steps, stop = local_runs.STEPS, local_runs.STOP
    assert (
        json.loads((parts / "config.json").read_text())["optimizer"]["outer_lr"] is None
    )  # and the run keeps its own
    a, b = checkpoint.latest(whole), checkpoint.latest(parts)
    assert a.step == b.step == steps
    for name, tensor in checkpoint.model_state(a).items():
        assert torch.equal(tensor, checkpoint.model_state(b)[name]), name
    for rank in range(2):
        sa, sb = (torch.load(m.path / f"rank{rank}.pt", weights_only=False)["optimizer"] for m in (a, b))
        for index, state in sa["state"].items():
            assert state.keys() == sb["state"][index].keys()
            for key, value in state.items():
                assert torch.equal(value, sb["state"][index][key]), (rank, index, key)
    mid = torch.load(whole / "checkpoints" / f"step_{stop:08d}" / "rank1.pt", weights_only=False)
    assert all("replica" in s for s in mid["optimizer"]["state"].values())  # rank 1's own replica
    key = ("step", "loss", "lr", "bytes_sent")
    assert [tuple(r[k] for k in key) for r in records(whole, "step")] == [
        tuple(r[k] for k in key) for r in records(parts, "step")
    ]
    assert [e["step"] for e in records(whole, "eval")] == [2, 4, 6]
    d = json.loads((whole / "summary.json").read_text())["params"]
    sent = [r["bytes_sent"] for r in records(whole, "step")]
    assert sent == [0, expected_bytes("1bit", d, 2)] * (steps // 2)  # the vote and the step check
    capsys.readouterr()
    assert (
        train(parts, "--resume", "--no-progress", "--local-steps", "4", "--steps", "8", "--eval-every", "4")
        == 2
    )
    assert "--resume: --local-steps 4: the run in" in capsys.readouterr().err


def test_compare_gives_zero_vote_and_local_options_only_to_the_runs_they_apply_to() -> None:
    from lioncub.cli.compare import _config

    parser = cli.build_parser("compare")
    args = parser.parse_args(["compare", "--out", "x", "--zero-vote", "plus", "--inner-momentum", "keep"])
    rows = {name: _config(args, name).optimizer for name in ("32bit", "1bit", "8bit/h4", "1bit/h4", "dsm/h4")}
    assert [rows[n].zero_vote for n in rows] == ["split", "plus", "split", "plus", "split"]
    assert [rows[n].inner_momentum for n in rows] == ["reset", "reset", "keep", "keep", "keep"]
    assert rows["dsm/h4"].outer == "dsm" and rows["dsm/h4"].variant == "32bit"


def test_a_conversion_to_another_world_size_needs_a_window_end() -> None:
    meta = checkpoint.CheckpointMeta(Path("ckpt"), 6, "1bit", 2, "gpt", "tiny", 0)
    same = dict(variant="1bit", workload="gpt", size="tiny", seed=0, convert_momenta="average")
    checkpoint.check_compatible(meta, world_size=4, local_steps=3, **same)  # step 6: a window's end
    with pytest.raises(ValueError, match="step 6, in the middle of a window of --local-steps 4"):
        checkpoint.check_compatible(meta, world_size=4, local_steps=4, **same)
    checkpoint.check_compatible(meta, world_size=2, local_steps=4, **same)  # the same ranks: each its own
