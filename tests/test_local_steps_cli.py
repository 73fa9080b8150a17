"""Local steps in the tools: run names (``lioncub.names``), ``TrainConfig``'s local-steps and zero-vote
fields, the report's per-window medians, ``lioncub train --local-steps`` (bitwise resume from the middle
of a window, bytes only at the outer steps) (the ``1bit/h2`` row of a compare is in test_train)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lioncub import cli
from lioncub.cli.options import config_from_args
from lioncub.names import name_of_run_dir, parse_run_name, run_dir_name, run_label
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
        ("a/h2/lr1/b", "/lrX"),
    ],
)
def test_run_names_that_are_not_understood(name: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_run_name(name)


# -- the configuration ---------------------------------------------------------------------------------


def test_local_steps_in_the_configuration() -> None:
    dense = TrainConfig.from_json({"variant": "32bit", "local_steps": 4, "steps": 8, "eval_every": 4})
    assert dense.optimizer.outer == "dsm"  # a vote on the fp32 mean is the sign of the mean: dsm
    doc = dense.to_json()
    assert [doc[k] for k in ("local_steps", "outer", "outer_lr", "inner_momentum")] == [
        4,
        "dsm",
        None,
        "reset",
    ]
    assert TrainConfig.from_json(doc).to_json() == doc
    plain = TrainConfig.from_json({"variant": "8bit"}).to_json()
    assert not {"local_steps", "outer", "outer_lr", "inner_momentum", "zero_vote"} & plain.keys()


def test_a_one_bit_run_written_before_zero_vote_resumes_with_the_papers_rule() -> None:
    assert TrainConfig.from_json({"variant": "1bit"}).optimizer.zero_vote == "plus"
    assert TrainConfig.from_json({"variant": "4bit", "zero_vote": "split"}).optimizer.zero_vote == "split"
    assert TrainConfig.from_json({"variant": "8bit"}).optimizer.zero_vote == "split"  # not a one-bit vote
    parser = cli.build_parser()
    new = config_from_args(parser.parse_args(["train", "--out", "x", "--variant", "1bit"]))
    assert new.optimizer.zero_vote == "split" and new.to_json()["zero_vote"] == "split"
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

H, STEPS, STOP = 2, 6, 3  # the stop after step 3 is in the middle of the second window
RUN = ["--variant", "1bit", "--nproc", "2", "--local-steps", str(H), "--steps", str(STEPS)]
RUN += ["--eval-every", str(H), "--set", "dropout=0.1"]


@pytest.mark.slow
def test_train_with_local_steps_resumes_from_the_middle_of_a_window_bitwise(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A stop after step 3 and a resume give the uninterrupted run bit for bit: every rank's replica comes
    back from its optimizer state (the checkpoint's model file is rank 0's); the ranks send only at the
    outer steps, the 1-bit vote of the model and the step check."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert train(whole, *RUN, "--checkpoint-every", str(STOP)) == 0
    assert train(parts, *RUN, "--stop-at", str(STOP)) == 0
    assert train(parts, "--resume", "--no-progress") == 0
    a, b = checkpoint.latest(whole), checkpoint.latest(parts)
    assert a.step == b.step == STEPS
    for name, tensor in checkpoint.model_state(a).items():
        assert torch.equal(tensor, checkpoint.model_state(b)[name]), name
    for rank in range(2):
        sa, sb = (torch.load(m.path / f"rank{rank}.pt", weights_only=False)["optimizer"] for m in (a, b))
        for index, state in sa["state"].items():
            assert state.keys() == sb["state"][index].keys()
            for key, value in state.items():
                assert torch.equal(value, sb["state"][index][key]), (rank, index, key)
    mid = torch.load(whole / "checkpoints" / f"step_{STOP:08d}" / "rank1.pt", weights_only=False)
    assert all("replica" in s for s in mid["optimizer"]["state"].values())  # rank 1's own replica
    key = ("step", "loss", "lr", "bytes_sent")
    assert [tuple(r[k] for k in key) for r in records(whole, "step")] == [
        tuple(r[k] for k in key) for r in records(parts, "step")
    ]
    assert [e["step"] for e in records(whole, "eval")] == [2, 4, 6]
    d = json.loads((whole / "summary.json").read_text())["params"]
    sent = [r["bytes_sent"] for r in records(whole, "step")]
    assert sent == [0, expected_bytes("1bit", d, 2)] * (STEPS // 2)  # the vote and the step check
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
