"""``lioncub train --fsdp`` and ``lioncub compare ... --fsdp`` (issue 46, item 4; docs/shards.md "From the
command line"): each emulated node shards the model over its ranks with FSDP2, the nodes vote on the
shards. The refusals are tests/test_bad_input.py's; the runs need root (network namespaces) and are
skipped with a stated reason otherwise.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

import background
import fsdp_runs
import node_runs
from lioncub.cli import compare as compare_cli
from lioncub.cli import train as train_cli
from lioncub.cli.options import config_for_name, config_from_args
from lioncub.names import parse_run_name, run_label
from lioncub.train.config import TrainConfig, check_start

NODES = fsdp_runs.NODES
STEPS = fsdp_runs.STEPS


def _args(command: str, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"lioncub {command}")
    (train_cli if command == "train" else compare_cli).add_arguments(parser)
    return parser.parse_args(["--out", "unused", *argv])


def test_fsdp_is_a_setting_recorded_and_named() -> None:
    config = config_from_args(_args("train", ["--variant", "1bit", *NODES, "--fsdp"]))
    saved = config.to_json()
    assert saved["cluster"]["fsdp"] is True
    assert run_label(saved) == "1bit+fsdp"
    assert TrainConfig.from_json(saved) == config
    older = {**saved, "cluster": {k: v for k, v in saved["cluster"].items() if k != "fsdp"}}
    assert TrainConfig.from_json(older).cluster.fsdp is False  # a config.json before the setting
    assert parse_run_name("1bit/h4+fsdp") == {"fsdp": True, "variant": "1bit", "local_steps": 4}
    # compare: a name's +fsdp, or --fsdp for every run, is the same run as lioncub train --fsdp
    compare = _args("compare", ["--steps", "200", *NODES])
    assert config_for_name(compare, "1bit+fsdp", "--variants") == config
    flagged = _args("compare", ["--steps", "200", *NODES, "--fsdp"])
    assert config_for_name(flagged, "1bit", "--variants") == config
    local = config_for_name(flagged, "1bit/h4", "--variants")
    assert run_label(local.to_json()) == "1bit/h4+fsdp"


def test_a_sharded_run_resumes_on_its_own_nodes_only() -> None:
    config = config_from_args(_args("train", ["--variant", "1bit", *NODES, "--fsdp"]))
    check_start(config, resume=True, inside_job=False)
    with pytest.raises(ValueError, match="--fsdp with --convert-momenta average: each node's momenta"):
        config.replace(convert_momenta="average")


#: the runs (tests/fsdp_runs.py), one after another in the job of every launch on emulated nodes
#: (tests/node_runs.py, shared with tests/test_nodes.py), in ``WORKDIR/fsdp``; nothing to run without root
BACKGROUND = {"node_runs": node_runs.job}


def _run_dir(which: str = "run") -> Path:
    return background.workdir("node_runs") / "fsdp" / which


def _summary(which: str = "run") -> dict:
    return json.loads((_run_dir(which) / "summary.json").read_text())


def _steps(which: str = "run") -> list[dict]:
    log = _run_dir(which) / "log.jsonl"
    return [r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "step"]


def _fsdp_intra_bytes(model: torch.nn.Module, shards: int) -> int:
    """FSDP2's bytes a rank sends in its node per step: (S − 1) · padded shard for each all-gather (a
    block: forward and backward; the root: forward) and for the reduce-scatter."""

    def padded(params: list[torch.Tensor]) -> int:
        return sum(-(-p.shape[0] // shards) * (p.numel() // p.shape[0]) * 4 for p in params)

    blocks = [p for block in model.transformer.h for p in block.parameters()]
    rest = [p for p in model.parameters() if all(p is not q for q in blocks)]
    return (shards - 1) * (3 * padded(blocks) + 2 * padded(rest))


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.background("node_runs")
def test_fsdp_runs_vote_between_nodes_on_shards() -> None:
    """The issue's Done-when on a local-steps run: parameters and gradients at most 0.6× an unsharded
    rank's per rank, a NIC that carries one vote per node, FSDP2's bytes inside it, a ``model.pt`` that is
    the whole trained model, and a resume from a checkpoint mid-window (torch.distributed.checkpoint, each
    rank its shards) that ends with the same bits as the uninterrupted run. (The unsharded run's loss,
    within 1 %, and HSDP + Lion: BENCHMARKS.md, by hand; the sharded vote is bit for bit the unsharded vote
    of the nodes' mean gradients: tests/test_shards.py.)"""
    from lioncub.train.workloads import make_workload

    proc = background.result("node_runs", BACKGROUND["node_runs"])
    path = _run_dir("runs.json")
    assert path.exists(), proc.stdout[-2000:] + proc.stderr[-3000:]
    runs = json.loads(path.read_text())
    assert [r["returncode"] for r in runs] == [0, 0], [(r["argv"], r["out"], r["err"]) for r in runs]
    wl = make_workload("gpt", "tiny", rank=0, world_size=1, seed=0)
    model = wl.build_model()
    d = sum(p.numel() for p in model.parameters())
    summary = _summary()
    assert summary["config"]["cluster"]["fsdp"] is True and run_label(summary["config"]) == fsdp_runs.RUN
    for key in ("parameters", "gradients"):  # an unsharded rank holds 4·d bytes of each (tests/test_train.py)
        assert summary["memory"][key] <= 0.6 * 4 * d, (key, summary["memory"])
    steps = _steps()  # a 1-bit vote of each rank's shard every H steps, FSDP2's traffic every step
    assert [r["nic_bytes"] > 0 for r in steps] == [s % fsdp_runs.H == 0 for s in range(1, STEPS + 1)]
    for record in steps:
        assert record["intra_bytes"] == _fsdp_intra_bytes(model, 2)
        if record["nic_bytes"]:  # each rank's shard crosses its NIC: one vote per node (flat: about 2×)
            assert record["nic_bytes"] == 2 * record["bytes_sent"]
            assert d / 8 <= record["nic_bytes"] <= 1.01 * d / 8 + 256
    saved = _run_dir() / "checkpoints" / f"step_{STEPS:08d}"  # model.pt is the whole trained model
    model.load_state_dict(torch.load(saved / "model.pt", weights_only=True))
    final = summary["final"]["val_loss"]
    assert wl.evaluate(model)["val_loss"] == pytest.approx(final, rel=1e-5)
    # resumed mid-window from a checkpoint of each rank's shards: the same bits at the end
    resumed, at = _run_dir("resumed"), fsdp_runs.CHECKPOINT_AT
    assert f"resumed from {resumed}/checkpoints/step_{at:08d}" in runs[-1]["out"] + runs[-1]["err"]
    assert sorted(p.name for p in (resumed / "checkpoints" / f"step_{STEPS:08d}" / "shards").iterdir()) == [
        ".metadata", *(f"__{r}_0.distcp" for r in range(4))]  # fmt: skip
    assert _summary("resumed")["final"]["val_loss"] == final  # to the last bit
    assert [r["loss"] for r in _steps("resumed")] == [r["loss"] for r in steps]
    again = torch.load(resumed / "checkpoints" / f"step_{STEPS:08d}" / "model.pt", weights_only=True)
    whole = torch.load(saved / "model.pt", weights_only=True)
    assert all(torch.equal(again[k], v) for k, v in whole.items())
