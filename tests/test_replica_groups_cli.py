"""``lioncub train --fault-tolerant``: every rank a torchft replica group, the failure schedule carried out
by the launcher (:mod:`lioncub.launch.groups`), the groups' logs merged (:mod:`lioncub.train.fault_tolerant`).

The end-to-end runs (3 groups of the tiny GPT with a batch of 4 sequences, 24 steps; group 1 SIGKILLed after
step 4 and started again at step 9: tests/ft_runs.py) run one after the other in one interpreter in the
background; the schedule's launcher is also tested alone, on small scripts that stand in for groups."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shutil
import statistics
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import background
import ft_runs
from emulated_network import netns_usable
from lioncub import cli
from lioncub.launch import LaunchConfig
from lioncub.launch.groups import Fault, launch_groups, parse_faults
from lioncub.train.config import TrainConfig
from train_runs import TINY

from processes import python_cmd

HAS_TORCHFT = importlib.util.find_spec("torchft") is not None
needs_torchft = pytest.mark.skipif(
    not HAS_TORCHFT, reason="torchft is not installed (the ft extra, docs/install.md)"
)


def _job() -> background.Spawned | None:
    if not HAS_TORCHFT:
        return None
    return background.Spawned(ft_runs.run_job, 1, (netns_usable(),), timeout=600)


#: every run of tests/ft_runs.py, one after the other in one process, in the background
BACKGROUND = {"ft_runs": _job}


def finished(name: str) -> tuple[Path, str]:
    """The run directory of ``ft_runs.RUNS[name]`` and its output, once it exited 0."""
    (code,) = background.result("ft_runs", BACKGROUND["ft_runs"])
    workdir = background.workdir("ft_runs")
    log_file, run_dir = workdir / f"{ft_runs.slug(name)}.out", workdir / ft_runs.slug(name)
    output = log_file.read_text() if log_file.exists() else ""
    job = (workdir / "job.out").read_text() if (workdir / "job.out").exists() else ""
    assert (run_dir / "summary.json").exists(), f"exit {code}: {output[-3000:]}{job[-2000:]}"
    return run_dir, output


def log(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines()) if r["kind"] == kind]


# ------------------------------------------------------------------------------------- end to end


@needs_torchft
@pytest.mark.slow
@pytest.mark.background("ft_runs")
@pytest.mark.parametrize(
    ("name", "rejoined_at"),
    [
        ("1bit", 9),
        ("1bit/h4", 12),  # with local steps the group joins at the window after step 9: steps 13.. have 3
    ],
)
def test_a_group_killed_and_rejoined_heals_and_every_step_says_who_voted(name: str, rejoined_at: int) -> None:
    run_dir, stdout = finished(name)
    steps = log(run_dir, "step")
    assert [r["step"] for r in steps] == list(range(1, 25))
    expected = [3] * 4 + [2] * (rejoined_at - 4) + [3] * (24 - rejoined_at)
    assert [r["participants"] for r in steps] == expected
    assert all(r["committed"] for r in steps)  # killed at a commit boundary: nothing was put back
    assert [r["groups"] for r in steps[4:rejoined_at]] == [[0, 2]] * (rejoined_at - 4)
    # the step after the kill waited for the lost group's heartbeats to stop (2 s), inside its step time
    # (never longer than the quorum's bound: the heartbeat timeout of the launcher's lighthouse, 2 s)
    assert 1.0 < steps[4]["quorum_s"] < 4.0 and steps[4]["step_s"] > steps[4]["quorum_s"]
    assert max(r["quorum_s"] for r in steps[5:]) < 4.0
    summary = json.loads((run_dir / "summary.json").read_text())
    ft = summary["fault_tolerance"]
    assert ft["participants"] == {"3": 24 - (rejoined_at - 4), "2": rejoined_at - 4}
    assert ft["skipped_steps"] == 0 and ft["kill"] == ["1@4"] and ft["rejoin"] == ["1@9"]
    assert ft["replicas_equal"] and ft["groups_finished"] == [0, 1, 2]
    (heal,) = ft["heals"]
    assert [
        r
        for r in map(json.loads, (run_dir / "groups/g1.jsonl").read_text().splitlines())
        if r["kind"] == "heal"
    ]
    assert (heal["group"], heal["life"], heal["step"], heal["source"]) == (1, 1, rejoined_at, "g0")
    assert heal["nbytes"] >= 2 * 4 * summary["params"]  # the parameters and the momenta, fp32
    # a group's rank holds the fp32 parameters, their gradients and its momenta (local steps: with the
    # anchors and the outer momenta), the largest over the groups
    d, memory = summary["params"], summary["memory"]
    assert (memory["parameters"], memory["gradients"]) == (4 * d, 4 * d) and memory["peak_rss"] > 0
    assert memory["optimizer_state"] == (3 if "/h4" in name else 1) * 4 * d
    digests = {json.loads((run_dir / f"groups/g{g}.end.json").read_text())["digest"] for g in range(3)}
    assert digests == {ft["digest"]}
    evals = log(run_dir, "eval")
    assert [e["step"] for e in evals] == [8, 16, 24] and all(e["replicas_agree"] for e in evals)
    assert [e["groups"] for e in evals] == [[0, 2], [0, 1, 2], [0, 1, 2]]  # group 1 away from 5 to 9/12
    assert "1 heal (group 1 at step" in stdout and "bitwise equal at the end" in stdout


@needs_torchft
@pytest.mark.slow
@pytest.mark.background("ft_runs")
@pytest.mark.parametrize("name", ["1bit", "1bit/h4"])
def test_the_final_loss_is_within_2_percent_of_the_run_without_the_kill(name: str) -> None:
    killed, _ = finished(name)
    whole, _ = finished(f"{name}, no kill")
    assert {r["participants"] for r in log(whole, "step")} == {3}
    ft = json.loads((whole / "summary.json").read_text())["fault_tolerance"]
    assert ft["heals"] == [] and ft["replicas_equal"]
    a, b = (json.loads((d / "summary.json").read_text())["final"]["val_loss"] for d in (killed, whole))
    assert abs(a - b) / b < 0.02, (a, b)
    assert a != b  # 5 or 8 steps voted by 2 groups: another run, not the same one


@needs_torchft
@pytest.mark.slow
@pytest.mark.background("ft_runs")
def test_the_torchft_diloco_row_equals_lioncub_diloco_with_inner_momenta_kept() -> None:
    """torchft's own DiLoCo (lioncub's Lion inside, Nesterov SGD outside) through ``lioncub train``: the
    same parameters, bit for bit, as ``--outer diloco --inner-momentum keep`` without failures and without
    weight decay, with 2 groups (with 3 the two allreduces add in another order: measured after one window,
    |Δθ| <= 7.5e-9 on 9643 of 112192 coordinates; docs/fault-tolerance.md)."""
    theirs, stdout = finished("torchft-diloco")
    ours, _ = finished("diloco/keep")
    digests = [
        json.loads((d / "summary.json").read_text())["fault_tolerance"]["digest"] for d in (theirs, ours)
    ]
    assert digests[0] is not None and digests[0] == digests[1]
    # the same state, kept in other places: the inner momenta, torchft's backup of the parameters and its
    # SGD's momenta; lioncub's exp_avg, anchor and outer_buf
    for d in (theirs, ours):
        summary = json.loads((d / "summary.json").read_text())
        assert summary["memory"]["optimizer_state"] == 3 * 4 * summary["params"], d
    assert "torchft-diloco/h4 on 2 rank(s)" in stdout
    steps = log(theirs, "step")
    assert [r["participants"] for r in steps] == [2] * 16
    assert [r["bytes_sent"] > 0 for r in steps] == [s % 4 == 0 for s in range(1, 17)]  # a sync per window


@needs_torchft
@pytest.mark.slow
@pytest.mark.background("ft_runs")
def test_a_rerun_of_the_same_schedule_gives_the_same_bits() -> None:
    first, _ = finished("1bit")
    again, _ = finished("1bit, again")
    assert [r["participants"] for r in log(first, "step")] == [r["participants"] for r in log(again, "step")]
    digests = [
        json.loads((d / "summary.json").read_text())["fault_tolerance"]["digest"] for d in (first, again)
    ]
    assert digests[0] == digests[1]
    assert [r["loss"] for r in log(first, "step")] == [r["loss"] for r in log(again, "step")]


@needs_torchft
@pytest.mark.slow
@pytest.mark.background("ft_runs")
def test_a_straggler_never_trains_alone_and_a_failed_run_keeps_everything(tmp_path: Path) -> None:
    """Group 1 SIGSTOPped after its step 10 until group 0 finished (tests/ft_runs.py, ``--collective-timeout
    3``): group 0 trains on alone and finishes; group 1, woken, fails rather than train alone. The job
    exits 3 (a group failed, the survivor finished), keeps every file (group 0's model.pt, the logs) with
    failure.json saying what failed, and a new run into the directory is refused, deleting nothing."""
    run_dir, stdout = finished("straggler")
    summary = json.loads((run_dir / "summary.json").read_text())
    ft = summary["fault_tolerance"]
    assert ft["groups_finished"] == [0] and ft["status"]["exit_code"] == 3
    steps = log(run_dir, "step")
    assert [r["step"] for r in steps] == list(range(1, 31))  # every step once: no step of group 1 alone
    assert sum(ft["participants"].values()) + ft["skipped_steps"] == 30 and ft["participants"]["2"] >= 10
    # group 0's wait for the stalled group 1 is in its log: group 1 stopped inside a step, in the exchange of
    # that step, not committed (comm_s: --collective-timeout, 3 s); stopped between two steps (before it
    # asked for the next quorum), in the quorum that left it out once its heartbeats stopped (quorum_s: the
    # launcher's lighthouse drops a group after 2 s without them; seen in 2 of 11 runs)
    skipped = [r for r in steps if not r["committed"]]
    assert all(r["comm_s"] >= 0.8 * ft_runs.STRAGGLER_TIMEOUT_S for r in skipped), skipped  # 4 s of 5 before
    alone = next(r for r in steps if r["participants"] == 1)
    assert skipped or alone["quorum_s"] >= 1.0, steps[9:]
    assert all(r["groups"] == [0] for r in steps if r["participants"] == 1)
    assert not [
        r for r in map(json.loads, (run_dir / "groups" / "g1.jsonl").read_text().splitlines())
        if r.get("kind") == "step" and r["committed"] and r["participants"] == 1
    ]  # fmt: skip
    end = json.loads((run_dir / "groups" / "g0.end.json").read_text())
    assert not (run_dir / "groups" / "g1.end.json").exists() and ft["digest"] == end["digest"]
    state = torch.load(run_dir / "model.pt")
    assert params_digest_of(state) == end["digest"]  # group 0's model, not the straggler's
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["exit_code"] == 3 and failure["group_exit_codes"] == [0, 1]
    assert failure["message"] == "group 1 exited with code 1; group 0 finished"
    assert {"model.pt", "log.jsonl", "groups/g0.jsonl", "groups/g1.jsonl"} <= set(failure["kept"])
    assert "nothing was deleted" in stdout and "failed (exit code 3" in stdout
    before = sorted(p.name for p in run_dir.rglob("*"))
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(["train", *ft_runs.TINY, "--fault-tolerant", "--out", str(copy), *ft_runs.STRAGGLER])
    assert rc == 2, err.getvalue()
    assert "holds a fault-tolerant run that failed (failure.json says what failed" in err.getvalue()
    assert sorted(p.name for p in copy.rglob("*")) == before


def params_digest_of(state: dict) -> str:
    """The digest of a saved model's parameters (``torch.save`` of its ``state_dict``), as the groups
    compute theirs: its tensors that are parameters, in the model's order."""
    from lioncub.train.replica_group import params_digest
    from lioncub.train.workloads import make_workload

    model = make_workload("gpt", "tiny", rank=0, world_size=1, seed=0).build_model()
    model.load_state_dict(state)
    return params_digest(model)


def records(path: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == kind]


@needs_torchft
@pytest.mark.slow
@pytest.mark.background("ft_runs")
def test_a_job_stopped_resumed_and_restarted_ends_with_the_bits_of_the_whole_run() -> None:
    """tests/ft_runs.py's checkpointed runs (local steps H = 2, group 1 killed after step 2 and started
    again at step 3, a checkpoint every 4 steps): stopped after step 6, then resumed from the checkpoint of
    step 4 (that of step 6 made incomplete), where group 1, which joined after step 4, has no part and heals
    from the others as it did in the whole run; the resumed job's groups all SIGKILLed after step 9 and
    restarted (``--restarts 1``) from the checkpoint of step 8. It ends with the whole run's bits: the same
    final parameters (its ``model.pt`` bitwise, the digest), the same quorums and losses at every step."""
    whole, _ = finished("checkpoints")
    run_dir, _ = finished("checkpoints, stopped")  # the resume went on in it
    stdout = (background.workdir("ft_runs") / f"{ft_runs.slug('checkpoints, resumed')}.out").read_text()
    assert "resuming from step_00000004, the newest complete checkpoint" in stdout
    assert "every group was lost" in stdout and "restart 1 of 1 (--restarts)" in stdout
    assert "goes on from its newest complete checkpoint" in stdout and "step_00000008" in stdout
    a, b = (json.loads((d / "summary.json").read_text())["fault_tolerance"] for d in (whole, run_dir))
    assert b["replicas_equal"] and b["groups_finished"] == [0, 1, 2] and b["digest"] == a["digest"]
    assert [(h["group"], h["life"], h["step"], h["source"]) for h in b["heals"]] == [(1, 1, 4, "g0")]
    assert [(h["group"], h["life"], h["step"], h["source"]) for h in a["heals"]] == [(1, 1, 4, "g0")]
    for kind, keys in (("step", ("step", "participants", "groups", "loss")), ("eval", ("step", "val_loss"))):
        assert [[r[k] for k in keys] for r in log(run_dir, kind)] == [
            [r[k] for k in keys] for r in log(whole, kind)
        ]
    assert [r["step"] for r in log(run_dir, "step")] == list(range(1, 13))
    saved = [torch.load(d / "model.pt", weights_only=True) for d in (whole, run_dir)]
    assert saved[0].keys() == saved[1].keys() and all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])
    # the last checkpoint holds the final parameters; what each launch cut from the logs is kept
    last = torch.load(run_dir / "checkpoints" / "step_00000012" / "model.pt", weights_only=True)
    assert all(torch.equal(last[k], saved[0][k]) for k in last)
    cut = records(run_dir / "groups" / "g0.cut.jsonl", "step")
    assert {5, 6} <= {r["step"] for r in cut} and max(r["step"] for r in cut) >= 9  # the stop's, the killed


@needs_torchft
@pytest.mark.slow
@pytest.mark.background("ft_runs")
def test_every_group_of_the_quorum_keeps_its_own_part_atomically_and_one_model() -> None:
    """What the stopped run left (copied before its resume): the checkpoints of steps 4 and 6, complete,
    each file's SHA-256 the one ``meta.json`` records; a part (``rankK.pt``) for every group of the quorum
    that committed the step -- groups 0 and 2 at step 4 (group 1 joined after it), all three at step 6 --
    each with its own momenta (Distributed Lion: they differ between groups; with local steps the outer
    momenta, the inner ones reset at the window's end) and one ``model.pt``; no
    temporary directory left, no ``model.pt`` of the run (it stopped), every group ended at step 6. Each
    group logged the step's stall (the serialisation) and its background write."""
    import hashlib

    stopped = background.workdir("ft_runs") / f"{ft_runs.slug('checkpoints, stopped')}.at_stop"
    root = stopped / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004", "step_00000006"]
    assert (root / "latest").read_text() == "step_00000006\n" and not (stopped / "model.pt").exists()
    for step, ranks in ((4, [0, 2]), (6, [0, 1, 2])):
        path = root / f"step_{step:08d}"
        meta = json.loads((path / "meta.json").read_text())
        files = ["model.pt", *(f"rank{r}.pt" for r in ranks)]
        assert sorted(p.name for p in path.iterdir()) == sorted([*files, "meta.json"])
        assert meta["sha256"] == {n: hashlib.sha256((path / n).read_bytes()).hexdigest() for n in files}
        assert (meta["step"], meta["world_size"], meta["variant"]) == (step, 3, "1bit")
        assert meta["fault_tolerant"]["ranks"] == ranks
        parts = {r: torch.load(path / f"rank{r}.pt", weights_only=True) for r in ranks}
        assert [p["group"]["step"] for p in parts.values()] == [step] * len(ranks)
        momenta = [p["optimizer"]["state"][0]["outer_exp_avg"] for p in parts.values()]  # the vote's (H = 2)
        assert not torch.equal(momenta[0], momenta[-1])  # groups 0 and 2: each its own
    for g in range(3):
        end = json.loads((stopped / "groups" / f"g{g}.end.json").read_text())
        assert end["step"] == 6
        logged = records(stopped / "groups" / f"g{g}.jsonl", "checkpoint")
        assert [r["step"] for r in logged] == ([6] if g == 1 else [4, 6]), logged
        assert all(r["stall_s"] > 0 and r["bytes"] > 0 for r in logged)
        written = records(stopped / "groups" / f"g{g}.jsonl", "checkpoint_written")
        assert [r["step"] for r in written] == [r["step"] for r in logged]
    completed = [
        r for g in range(3) for r in records(stopped / "groups" / f"g{g}.jsonl", "checkpoint_written")
    ]
    assert sorted(r["completed"] for r in completed if "completed" in r) == [
        "checkpoints/step_00000004", "checkpoints/step_00000006"
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.background("ft_runs")
@pytest.mark.root
def test_nodes_of_two_ranks_are_groups_that_heal_and_agree() -> None:
    """``--nnodes 2 --nproc-per-node 2 --fault-tolerant``: each node one group (DDP inside, one voter), node
    1 killed after step 8 and started again at step 16: 2, 1, then 2 participants; its two ranks heal at
    step 16, each from its peer rank of node 0; at the end the two ranks of each node and the two nodes hold
    the same parameters; each step's bytes: a rank's (its share of the vote, and DDP's ring and the share
    broadcasts inside the node), and the node's NIC (both ranks' shares)."""
    run_dir, stdout = finished("nodes")
    steps = log(run_dir, "step")
    assert [r["participants"] for r in steps] == [2] * 8 + [1] * 8 + [2] * 8
    assert all(r["committed"] for r in steps) and [r["step"] for r in steps] == list(range(1, 25))
    ft = json.loads((run_dir / "summary.json").read_text())["fault_tolerance"]
    assert ft["replicas_equal"] and ft["groups_finished"] == [0, 1]
    ends = [json.loads((run_dir / f"groups/g{g}.end.json").read_text()) for g in (0, 1)]
    assert [e["ranks_equal"] for e in ends] == [True, True]
    (heal,) = ft["heals"]
    params = json.loads((run_dir / "summary.json").read_text())["params"]
    assert (heal["group"], heal["step"], heal["source"]) == (1, 16, "g0")
    assert heal["nbytes"] >= 2 * 4 * params  # both ranks' shares: the parameters and their momenta, fp32
    # through a node's NIC a 1-bit vote of the whole model per step: N = 2 groups, ~2·(N−1)/N·d/8 bytes (one
    # rank's share alone would be about half of it); inside it, per rank, DDP's fp32 ring of 2 ranks (4·d)
    # and the broadcast of its share of the parameters (2·d, the mean)
    inside = 6 * params
    for r in steps[:8]:
        assert r["nic_bytes"] >= params / 8 and r["intra_bytes"] == inside, r
        assert r["bytes_sent"] == pytest.approx(r["nic_bytes"] / 2 + inside), r  # a rank's: its share
    summary = json.loads((run_dir / "summary.json").read_text())  # a rank's, as its line says
    assert summary["median_bytes_sent"] == pytest.approx(statistics.median(r["bytes_sent"] for r in steps))
    assert "2 replica groups of 2 ranks" in stdout


def sharded() -> tuple[Path, str]:
    """The sharded nodes run (tests/ft_runs.py's ``nodes, fsdp, stopped``, resumed in its directory by
    ``nodes, fsdp, resumed``: the one run of ``--fsdp`` on nodes) and the resumed launch's output."""
    run_dir, _ = finished("nodes, fsdp, stopped")
    out = background.workdir("ft_runs") / f"{ft_runs.slug('nodes, fsdp, resumed')}.out"
    return run_dir, out.read_text()


def shards_digest_of(state: dict, ranks: int) -> str:
    """The digest a group of ``ranks`` FSDP2 ranks reports for a saved model's parameters ``state``: each
    rank's local shards (dim 0 cut as ``torch.chunk`` cuts it, FSDP2's ``Shard(0)``) hashed in the model's
    parameter order, then those ``ranks`` digests hashed in rank order."""
    import hashlib

    from lioncub.train.workloads import make_workload

    model = make_workload("gpt", "tiny", rank=0, world_size=1, seed=0).build_model()
    model.load_state_dict(state)
    digests = []
    for r in range(ranks):
        h = hashlib.sha256()
        for p in model.parameters():
            if len(chunks := torch.chunk(p.detach(), ranks, dim=0)) > r:
                h.update(chunks[r].contiguous().view(torch.uint8).numpy().tobytes())
        digests.append(h.hexdigest())
    return hashlib.sha256(",".join(digests).encode()).hexdigest()


@pytest.mark.slow
@pytest.mark.background("ft_runs")
@pytest.mark.root
def test_nodes_sharded_over_their_ranks_heal_shard_by_shard_as_ddp_inside() -> None:
    """The same run with ``--fsdp`` (and a checkpoint every 8 steps, stopped after step 20 and resumed:
    :func:`sharded`): each node's group shards the model over its two ranks (FSDP2) and votes on each
    rank's shard with the same shard rank of the other node; node 1's ranks heal at step 16, each from the
    same shard rank of node 0. Held to the run without ``--fsdp`` (DDP inside: the same two voters, each
    node's gradient its ranks' mean, a/2 + b/2 = (a + b)/2 in floats): the same loss at every step, the
    same final validation loss and model, to the last bit (the groups' digest: that model's parameters cut
    into FSDP2's shards); half the parameter and gradient bytes per rank, the same vote through the node's
    NIC."""
    run_dir, stdout = sharded()
    whole, _ = finished("nodes")
    steps, plain = log(run_dir, "step"), log(whole, "step")
    assert [r["participants"] for r in steps] == [2] * 8 + [1] * 8 + [2] * 8
    assert all(r["committed"] for r in steps) and [r["step"] for r in steps] == list(range(1, 25))
    assert [r["loss"] for r in steps] == [r["loss"] for r in plain]
    assert [r["val_loss"] for r in log(run_dir, "eval")] == [r["val_loss"] for r in log(whole, "eval")]
    assert [r["step"] for r in log(run_dir, "eval")] == [r["step"] for r in log(whole, "eval")] == [12, 24]
    ours, theirs = (torch.load(d / "model.pt") for d in (run_dir, whole))
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    summary = json.loads((run_dir / "summary.json").read_text())
    ft, params = summary["fault_tolerance"], summary["params"]
    assert ft["replicas_equal"] and ft["groups_finished"] == [0, 1]
    assert ft["digest"] == shards_digest_of(theirs, 2)
    (heal,) = ft["heals"]
    assert (heal["group"], heal["step"], heal["source"]) == (1, 16, "g0")  # both ranks, each from g0's rank
    assert heal["nbytes"] >= 2 * 4 * params  # the two ranks' shards: the parameters and their momenta, fp32
    memory, dense = summary["memory"], json.loads((whole / "summary.json").read_text())["memory"]
    for key in ("parameters", "gradients"):  # the largest rank's shards: about half of each tensor
        assert 2 * params <= memory[key] <= 0.6 * dense[key] and dense[key] == 4 * params, (memory, dense)
    for r, p in zip(steps, plain, strict=True):
        assert r["nic_bytes"] == p["nic_bytes"] and r["bytes_sent"] == r["nic_bytes"] / 2, (r, p)
        assert r["intra_bytes"] == steps[0]["intra_bytes"] > 0, r  # FSDP2's gathers and reduce-scatter
    assert "1bit+fsdp on 2 nodes" in stdout


@pytest.mark.slow
@pytest.mark.background("ft_runs")
@pytest.mark.root
def test_nodes_sharded_stopped_and_resumed_end_with_the_bits_of_the_whole_run() -> None:
    """The sharded run with a checkpoint every 8 steps, stopped after step 20 (node 1 killed after step 8,
    back and healed at step 16) and resumed in its directory: each rank loads its own shards of the
    parameters and of the optimizer state from its part, and the job ends with the bits of the whole run
    (that without ``--fsdp``, which an uninterrupted sharded run equals: the model, and the digest of its
    shards), its quorums and losses. Each rank's part holds its shards, not the whole model; a checkpoint's
    ``model.pt`` is the gathered whole model (that of step 24: the final one)."""
    whole, _ = finished("nodes")
    run_dir, out = sharded()  # the resume went on in it
    assert "24 steps" in out, out[-3000:]
    assert f"lioncub: resumed from {run_dir / 'checkpoints' / 'step_00000020'} at step 20" in out, out[-3000:]
    # the stop's checkpoint of step 20, then the resumed launch's (it went on from there, not from step 1)
    g0 = run_dir / "groups" / "g0.jsonl"
    assert [r["step"] for r in records(g0, "checkpoint")] == [8, 16, 20, 24]
    # each completed: that of step 8 too, both parts of node 1 (SIGKILLed after step 8) on disk before it died
    completed = [r.get("completed") for r in records(g0, "checkpoint_written")]
    assert completed == [f"checkpoints/step_{s:08d}" for s in (8, 16, 20, 24)], completed
    assert [r["step"] for r in records(g0, "step")] == list(range(1, 25))
    b = json.loads((run_dir / "summary.json").read_text())["fault_tolerance"]
    final = torch.load(whole / "model.pt", weights_only=True)
    assert b["replicas_equal"] and b["groups_finished"] == [0, 1]
    assert b["digest"] == shards_digest_of(final, 2)
    assert [(h["group"], h["step"], h["source"]) for h in b["heals"]] == [(1, 16, "g0")]
    for kind, keys in (("step", ("step", "participants", "loss")), ("eval", ("step", "val_loss"))):
        assert [[r[k] for k in keys] for r in log(run_dir, kind)] == [
            [r[k] for k in keys] for r in log(whole, kind)
        ]
    path = run_dir / "checkpoints" / "step_00000024"
    for d in (run_dir, path):
        saved = torch.load(d / "model.pt", weights_only=True)
        assert saved.keys() == final.keys() and all(torch.equal(saved[k], final[k]) for k in final), d
    meta = json.loads((path / "meta.json").read_text())
    assert sorted(n for n in meta["sha256"] if n.startswith("rank")) == [f"rank{k}.pt" for k in range(4)]
    params = json.loads((whole / "summary.json").read_text())["params"]
    for k in range(4):  # ranks 2ℓ, 2ℓ+1: node ℓ's shards, together every element once
        part = torch.load(path / f"rank{k}.pt", weights_only=True)
        assert 0 < sum(t.numel() for t in part["shards"]) < params and part["rank"] == k
    pairs = [torch.load(path / f"rank{k}.pt", weights_only=True)["shards"] for k in (0, 1)]
    assert sum(t.numel() for s in pairs for t in s) == params


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fault-tolerant", "--kill", "5@20"], "--kill 5@20: there is no group 5 (groups 0..2"),
        (["--fault-tolerant", "--kill", "1@80"], "--kill 1@80: the step must be within 1..59 (--steps 60"),
        (["--fault-tolerant", "--kill", "1@20,"], "--kill '': give GROUP@STEP"),  # a trailing comma
        (["--fault-tolerant", "--kill", "1@20", "--rejoin", "1@15"], "--rejoin 1@15: group 1 is running"),
        (["--fault-tolerant", "--rejoin", "1@15"], "--rejoin 1@15: group 1 is running then"),
        (["--fault-tolerant", "--kill", "1@20,1@30"], "--kill 1@30: group 1 is not running then"),
        (["--fault-tolerant", "--kill", "0@5,1@6,2@7"], "no group would be left to train after step 7"),
        (["--fault-tolerant", "--kill", "1@20", "--rejoin", "1@20"], "the same step as its --kill"),
        (["--fault-tolerant", "--kill", "one@20"], "--kill 'one@20': give GROUP@STEP"),
        (  # with local steps a group rejoins at a window start, healed there: none is left after step 56
            ["--fault-tolerant", "--local-steps", "4", "--kill", "1@20", "--rejoin", "1@57"],
            "--rejoin 1@57: the step must be within 21..56 (--steps 60 --local-steps 4: a group rejoins",
        ),
        (
            ["--fault-tolerant", "--local-steps", "4", "--kill", "1@58", "--rejoin", "1@59"],
            "--rejoin 1@59: no window start is left after its --kill 1@58 (--steps 60 --local-steps 4",
        ),
        (
            ["--fault-tolerant", "--local-steps", "4", "--kill", "1@5,1@8", "--rejoin", "1@7"],
            "--kill 1@8: group 1 rejoins in the window after step 8 (--local-steps 4: the next window start "
            "after its --rejoin); the step must be within 9..59",
        ),
        (
            ["--fault-tolerant", "--local-steps", "4", "--kill", "1@5,2@6,0@8", "--rejoin", "1@7"],
            "--rejoin 1@7: no other group is alive at the window start after step 8 to heal group 1",
        ),
        (["--kill", "1@20"], "--kill: applies only with --fault-tolerant"),
        (["--lighthouse", "http://x:1"], "--lighthouse: applies only with --fault-tolerant"),
        (["--fault-tolerant", "--lighthouse", "x:1"], "--lighthouse 'x:1': give the lighthouse's URL"),
        (  # probed before anything starts: nothing listens there
            ["--fault-tolerant", "--lighthouse", "http://127.0.0.1:1"],
            "--lighthouse http://127.0.0.1:1: no torchft lighthouse answers there (ConnectionRefusedError",
        ),
        (["--fault-tolerant", "--variant", "32bit"], "DDP + Lion has no vote between groups"),
        (["--fault-tolerant", "--overlap"], "--overlap with --fault-tolerant"),
        (  # checkpoints at a window's end only (a plain run's may fall inside one)
            ["--fault-tolerant", "--local-steps", "4", "--checkpoint-every", "10"],
            "--checkpoint-every 10 with --fault-tolerant --local-steps 4: must be a multiple of 4 (e.g. 8)",
        ),
        (
            ["--fault-tolerant", "--local-steps", "4", "--stop-at", "30"],
            "--stop-at 30 with --fault-tolerant --local-steps 4: must be a multiple of 4 (e.g. 28)",
        ),
        (  # stopped between its start and its first quorum, group 1 would stop unhealed
            ["--fault-tolerant", "--kill", "1@10", "--rejoin", "1@20", "--stop-at", "20"],
            "--stop-at 20 with --rejoin 1@20: group 1 is started again after step 20 and joins the quorum "
            "only after step 20, so it would stop unhealed; stop before step 20 or after step 20",
        ),
        (
            ["--fault-tolerant", "--variant", "torchft-diloco", "--local-steps", "4", "--checkpoint-every=8"],
            "--checkpoint-every 8 with --fault-tolerant --variant torchft-diloco: torchft's DiLoCo keeps",
        ),
        (["--fault-tolerant", "--resume"], "holds no lioncub run"),  # resumes as any run: from a checkpoint
        (["--variant", "torchft-diloco", "--local-steps", "4"], "runs on torchft's Manager"),
        (["--fault-tolerant", "--variant", "torchft-diloco"], "add --fault-tolerant and --local-steps H"),
        (
            ["--fault-tolerant", "--variant", "torchft-diloco", "--local-steps", "4", "--outer", "dsm"],
            "torchft's DiLoCo averages the pseudo-gradients (--outer diloco)",
        ),
    ],
)
def test_bad_fault_tolerant_input_is_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    base = ["--variant", "1bit", "--nproc", "3", "--steps", "60"]
    out = tmp_path / "run"
    assert cli.main(["train", *TINY, "--out", str(out), *base, *args]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not out.exists()


def test_compare_gives_every_row_the_same_failure_schedule() -> None:
    import argparse

    from lioncub.cli import compare

    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    argv = ["--variants", "1bit,1bit/h4,torchft-diloco/h4", "--nproc", "3", "--fault-tolerant", "--out", "x"]
    args = parser.parse_args([*argv, "--kill", "1@20", "--rejoin", "1@36", "--steps", "60"])
    rows = {v: compare._config(args, v) for v in ("1bit", "1bit/h4", "torchft-diloco/h4")}
    assert {
        v: (c.cluster.fault_tolerant, c.cluster.kill, c.cluster.rejoin) for v, c in rows.items()
    } == dict.fromkeys(rows, (True, ["1@20"], ["1@36"]))
    peer = rows["torchft-diloco/h4"].optimizer
    assert (peer.variant, peer.local_steps, peer.outer, peer.inner_momentum) == (
        "torchft-diloco",
        4,
        "diloco",
        "keep",
    )


def test_without_torchft_the_option_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from lioncub.train.driver import check_before_launch

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a)
    )
    config = TrainConfig.from_values({"variant": "1bit", "nproc": 3, "fault_tolerant": True, "steps": 60})
    with pytest.raises(
        ValueError, match=r"--fault-tolerant: needs the torchft package.*pip install '\.\[ft\]' in a clone"
    ):
        check_before_launch(config, None)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"momentum_sync": "io"}, "--momentum-sync with --fault-tolerant --nnodes: each node is one replica"),
        ({"topology": "hierarchical"}, "--topology hierarchical with --fault-tolerant --nnodes"),
        ({"kill": ["2@5"]}, "--kill 2@5: there is no group 2 (groups 0..1"),
        (
            {"variant": "torchft-diloco", "local_steps": 4, "outer": "diloco", "inner_momentum": "keep"},
            "--variant torchft-diloco with --fault-tolerant --nnodes",
        ),
    ],
)
def test_nodes_are_groups_and_what_they_do_not_take_is_refused(values: dict, message: str) -> None:
    """With --nnodes every node is one replica group (2 here, of 2 ranks): a --kill names a node; momentum
    sync, a topology over nodes and torchft's DiLoCo are refused, naming the option."""
    nodes = {"variant": "1bit", "nproc": 4, "nnodes": 2, "link": "1gbit", "fault_tolerant": True}
    config = TrainConfig.from_values({**nodes, "steps": 20})
    assert (config.cluster.replica_groups, config.cluster.nproc_per_node) == (2, 2)
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig.from_values({**nodes, "steps": 20, **values})


def test_the_schedule_is_sorted_and_alternates() -> None:
    faults = parse_faults(["1@20", "2@5", "1@50"], ["1@35", "2@40"], 3, 60)
    assert faults == [
        Fault(5, "kill", 2), Fault(20, "kill", 1), Fault(35, "rejoin", 1), Fault(40, "rejoin", 2),
        Fault(50, "kill", 1),
    ]  # fmt: skip
    assert faults[0].spec == "--kill 2@5"
    assert parse_faults(["1@20"], ["1@57"], 3, 60) == parse_faults(["1@20"], ["1@57"], 3, 60, 1)  # H = 1
    assert parse_faults(["1@20"], ["1@56"], 3, 60, 4) == [Fault(20, "kill", 1), Fault(56, "rejoin", 1)]


def test_a_group_started_again_holds_only_at_its_own_lives_kill_and_never_trains_alone() -> None:
    """A group's later life does not hold at an earlier life's --kill step (it would wait there forever);
    a group started again whose first quorum neither healed it nor had another group stops, naming why."""
    from lioncub.integrations.torchft import ReplicaGroupError
    from lioncub.train import replica_group

    config = TrainConfig.from_values({"variant": "1bit", "nproc": 3, "fault_tolerant": True, "steps": 60,
                                      "kill": ["1@20", "1@50"], "rejoin": ["1@35"]})  # fmt: skip
    assert [replica_group._schedule(config, 1, life)[0] for life in (0, 1)] == [{20}, {50}]
    assert replica_group._schedule(config, 0, 0)[0] == set()
    loop = object.__new__(replica_group._GroupLoop)
    loop.life, loop.joined, loop.position = 1, False, replica_group._Position()
    with pytest.raises(ReplicaGroupError, match=r"started again \(life 1\), its first quorum has no other"):
        loop.check_joined(1)
    loop.check_joined(2)  # a peer in the quorum (it heals the group)
    assert loop.joined
    loop.check_joined(1)  # later quorums: the group's own business


# ---------------------------------------------------------------------------------- the launcher alone

#: a stand-in for a replica group: writes a step record per 20 ms to its log and holds at its kill step
#: (as lioncub.train.replica_group does); group 2 of its first life fails at step 3 when FAIL is set
STAND_IN = textwrap.dedent(
    """
    import json, os, sys, time
    g, life = int(os.environ["LIONCUB_GROUP"]), int(os.environ["LIONCUB_GROUP_LIFE"])
    out, kill, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if life else 0
    print(f"group {g} life {life} lighthouse {os.environ['LIONCUB_LIGHTHOUSE']}", flush=True)
    for step in range(start + 1, 21):
        with open(f"{out}/g{g}.jsonl", "a") as f:
            f.write(json.dumps({"kind": "step", "step": step, "life": life}) + "\\n")
        if os.environ.get("FAIL") and g == 2 and step == 3:
            sys.exit(3)
        if step == kill and g == 1 and life == 0:
            while True:
                time.sleep(1)
        time.sleep(0.02)
    """
)


@pytest.fixture
def lighthouse_page() -> Iterator[str]:
    """The URL of a page that answers as a lighthouse's ``/status`` does (HTTP 200), in this process: what
    the launcher watches of a lighthouse given by URL, for the stand-in groups (which need no quorum)."""
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"Next quorum status: [0/0 participants healthy][0 heartbeating]")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _progress(out: Path) -> object:
    def progress(group: int) -> int:
        path = out / f"g{group}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return max((json.loads(x)["step"] for x in lines), default=0)

    return progress


@pytest.mark.slow
def test_the_launcher_kills_a_group_after_its_step_and_starts_it_again(
    tmp_path: Path, lighthouse_page: str
) -> None:
    script = tmp_path / "group.py"
    script.write_text(STAND_IN)
    config = LaunchConfig(python_cmd(str(script), str(tmp_path), "6", "12"), nproc=3, timeout_s=60)
    out, err = io.StringIO(), io.StringIO()
    faults = [Fault(6, "kill", 1), Fault(12, "rejoin", 1)]
    ends: list[tuple[int, int, int]] = []  # what the driver is told: each life's end, its code
    result = launch_groups(
        config, faults, _progress(tmp_path), lighthouse=lighthouse_page, out=out, err=err,
        ended=lambda g, life, code: ends.append((g, life, code)),
    )  # fmt: skip
    assert result.ok, err.getvalue()
    assert result.rank_returncodes == [0, 0, 0]
    assert sorted(ends) == [(0, 0, 0), (1, 0, -9), (1, 1, 0), (2, 0, 0)]  # the SIGKILLed life: -SIGKILL
    lines = [json.loads(x) for x in (tmp_path / "g1.jsonl").read_text().splitlines()]
    expected = [(s, 0) for s in range(1, 7)] + [(s, 1) for s in range(13, 21)]
    assert [(r["step"], r["life"]) for r in lines] == expected
    assert "--kill 1@6: group 1 SIGKILLed after its step 6" in err.getvalue()
    assert "--rejoin 1@12: group 1 started again at step 12" in err.getvalue()
    assert f"[g1] group 1 life 1 lighthouse {lighthouse_page}" in out.getvalue()


@pytest.mark.slow
def test_a_group_that_fails_on_its_own_fails_the_job_once_the_others_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lighthouse_page: str
) -> None:
    script = tmp_path / "group.py"
    script.write_text(STAND_IN)
    monkeypatch.setenv("FAIL", "1")
    config = LaunchConfig(python_cmd(str(script), str(tmp_path), "0", "0"), nproc=3, timeout_s=60)
    err = io.StringIO()
    result = launch_groups(
        config, [], _progress(tmp_path), lighthouse=lighthouse_page, out=io.StringIO(), err=err
    )
    assert (result.returncode, result.failed_rank) == (3, 2)
    assert result.message == "group 2 exited with code 3"
    assert "group 2 exited with code 3; the others go on" in err.getvalue()
    assert result.rank_returncodes == [0, 0, 3]
    assert _progress(tmp_path)(0) == 20  # the others finished


@pytest.mark.slow
def test_the_launcher_times_out_with_the_groups_still_running(tmp_path: Path, lighthouse_page: str) -> None:
    script = tmp_path / "group.py"
    script.write_text(STAND_IN)
    config = LaunchConfig(python_cmd(str(script), str(tmp_path), "2", "0"), nproc=2, timeout_s=2)
    err = io.StringIO()
    result = launch_groups(
        config, [], _progress(tmp_path), lighthouse=lighthouse_page, out=io.StringIO(), err=err
    )
    assert result.timed_out and result.returncode == 124
    assert result.message == "timed out; groups still running: 1"


def test_a_kill_step_counts_for_the_schedule_once_the_group_holds(tmp_path: Path) -> None:
    """The launcher SIGKILLs group G after its step N only once G logged its ``hold`` (written after its
    part of a checkpoint of step N is on disk), not at the step record: a kill that coincided with a
    checkpoint step lost the part, and the first participant waited out --collective-timeout for it (seen
    with ``--checkpoint-every 8 --kill 1@8`` on nodes sharded with --fsdp). Other steps count at once."""
    from lioncub.train.fault_tolerant import GroupLogs
    from lioncub.train.replica_group import log_name

    (tmp_path / "groups").mkdir()
    logs = GroupLogs(tmp_path, 2, {(1, 8)})
    lines = {0: [], 1: []}

    def write(group: int, rec: dict) -> None:
        lines[group].append(json.dumps(rec) + "\n")
        (tmp_path / log_name(group)).write_text("".join(lines[group]))

    for step in range(1, 9):
        write(0, {"kind": "step", "step": step})
        write(1, {"kind": "step", "step": step})
    write(1, {"kind": "checkpoint", "step": 8})
    assert (logs.progress(0), logs.progress(1)) == (8, 7)  # group 1's step 8 is a kill's: not yet
    write(1, {"kind": "hold", "step": 8, "group": 1})
    assert logs.progress(1) == 8
