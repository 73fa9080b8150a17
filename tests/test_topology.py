"""Who votes with whom (issue 46 item 2, issue 48 items 4 and 6): ``LionCub``'s one ``process_group``
argument resolved by :func:`lioncub.optim.topology.who_votes`; a launcher's job that forgot
``init_process_group`` refused on every rank (in-process with the launcher's environment, and once under
``torchrun``); the optimizer's warnings naming the caller's line.

The mesh shapes on gloo ranks (``("replicate", "shard")`` on FSDP2's shards and with DDP inside) are
``test_shards.py``'s; ``("node", "local")`` is ``test_hierarchical.py``'s."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import background
import torchrun_runs
from lioncub import LionCub
from lioncub.collectives import Comm, GroupComm
from lioncub.optim import Checks, Lion, VoteMesh
from lioncub.optim.topology import LOCAL, who_votes

from processes import run_workers


@pytest.fixture
def no_group(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No default process group (whatever an earlier test of this process left) and no launcher."""
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.linspace(-1.0, 1.0, 7).reshape(7, 1)), torch.nn.Parameter(torch.ones(3))]


def test_the_accepted_shapes_and_the_rest(no_group: pytest.MonkeyPatch) -> None:
    assert who_votes(None).group is False and who_votes(LOCAL).group is False  # alone: nothing to vote with
    assert who_votes(None).part == "whole"
    with pytest.raises(
        ValueError, match=r"process_group='locals': the one string accepted is 'local' \(None"
    ):
        who_votes("locals")
    with pytest.raises(
        ValueError,
        match=r"process_group: a int is not one of None .* a ProcessGroup, a DeviceMesh .* or a VoteMesh",
    ):
        who_votes(3)


def test_a_vote_mesh_is_refused_where_it_cannot_vote(no_group: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        ValueError, match=r"VoteMesh\(broadcast='later'\): allowed values are 'step', 'caller'"
    ):
        who_votes(VoteMesh(None, None, broadcast="later"))  # type: ignore[arg-type]  # the wrong value is the test
    with pytest.raises(
        ValueError, match=r"topology='hierarchical' on a VoteMesh's shares .* dims \('node', 'local'\)"
    ):
        who_votes(VoteMesh(None, None), "hierarchical")
    with pytest.raises(
        TypeError, match=r"VoteMesh\(\.\.\.\) is for plain parameters .* FSDP2's parameters take"
    ):
        who_votes(VoteMesh(None, None), sharded=True)
    with pytest.raises(ValueError, match=r"process_group=VoteMesh\(\.\.\.\): init_process_group first"):
        who_votes(VoteMesh(None, None))


def test_local_runs_alone_as_lion_even_under_a_launcher(no_group: pytest.MonkeyPatch) -> None:
    no_group.setenv("WORLD_SIZE", "2")
    no_group.setenv("RANK", "1")
    mine, ref = _params(), _params()
    opt = LionCub(mine, lr=0.1, weight_decay=0.5, variant="1bit", process_group="local")
    lion = Lion(ref, lr=0.1, weight_decay=0.5)
    for p, q in zip(mine, ref, strict=True):
        p.grad = torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) - 2.5
        q.grad = p.grad.clone()
    opt.step()
    lion.step()
    assert opt.single_process and opt.comm.world_size == 1
    assert all(torch.equal(p, q) for p, q in zip(mine, ref, strict=True)) and not torch.equal(
        mine[1], _params()[1]
    )


@pytest.mark.parametrize(
    ("world", "rank", "refused"), [("2", "1", True), ("4", "0", True), ("1", "0", False)]
)
def test_a_launcher_without_a_process_group_is_refused(
    no_group: pytest.MonkeyPatch, world: str, rank: str, refused: bool
) -> None:
    no_group.setenv("WORLD_SIZE", world)
    no_group.setenv("RANK", rank)
    if not refused:
        assert LionCub(_params()).single_process
        return
    with pytest.raises(
        RuntimeError, match=rf"rank {rank} of WORLD_SIZE={world}: .*init_process_group.*process_group='local'"
    ):
        LionCub(_params())


def test_without_rank_there_is_no_launcher(no_group: pytest.MonkeyPatch) -> None:
    no_group.setenv("WORLD_SIZE", "2")  # set by hand, not a launcher's rank
    assert LionCub(_params()).single_process


def test_a_comm_is_deprecated_at_the_callers_line(no_group: pytest.MonkeyPatch) -> None:
    with pytest.warns(
        DeprecationWarning, match=r"process_group=a Comm\) is deprecated: pass its process group"
    ) as seen:
        line = sys._getframe().f_lineno + 1
        opt = LionCub(_params(), process_group=Comm.single("cpu"))
    assert [(w.filename, w.lineno) for w in seen] == [(__file__, line)]
    assert opt.single_process


def worker_warning_lines(rank: int, world: int) -> list[tuple[str, int]]:
    """The identical-gradients warning of a first step (rank 0 warns), from ``opt.step()`` and from a
    GradScaler's ``scaler.step(opt)`` (torch's frames between): where each points."""
    lines = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for scaled in (False, True):
            params = _params()
            for p in params:
                p.grad = torch.full_like(p, 0.5)  # the same on every rank: as if DDP had averaged them
            opt = LionCub(params, variant="1bit")
            if scaled:
                scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
                scaler.scale(torch.ones(()))  # the scaler's scale, made lazily
                lines.append(sys._getframe().f_lineno + 1)
                scaler.step(opt)
            else:
                lines.append(sys._getframe().f_lineno + 1)
                opt.step()
    seen = [(w.filename, w.lineno) for w in caught if "identical on every rank" in str(w.message)]
    return seen if rank == 0 else [(__file__, line) for line in lines]


def test_the_optimizers_warnings_name_the_callers_line() -> None:
    warned, expected = run_workers(worker_warning_lines, 2)
    assert warned == expected and [f for f, _ in warned] == [__file__] * 2


def worker_vote_mesh(rank: int, world: int) -> list[str]:
    """2 replicas × 2 shares given as groups (``VoteMesh``): the replicate dimension a ``GroupComm`` (as
    torchft's replica groups of several ranks hold it), the caller broadcasting the shares. Against the
    unsharded vote of the replicas' mean gradients over the same groups: after ``step()`` this rank's
    share equals it and the rest is untouched; after ``opt.shares.broadcast()`` all of it does."""
    replica, share = divmod(rank, 2)
    replicates = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.manual_seed(0)
    model, whole = torch.nn.Linear(6, 5), torch.nn.Linear(6, 5)
    whole.load_state_dict(model.state_dict())
    comm = GroupComm(replicates[share], rank=replica, world_size=2)
    mesh = VoteMesh(replicate=comm, shard=shards[replica], broadcast="caller")
    opt = LionCub(
        model.parameters(), lr=0.1, variant="1bit", process_group=mesh, checks=Checks(broadcast_init=False)
    )
    ref = LionCub(whole.parameters(), lr=0.1, variant="1bit", process_group=replicates[share])
    assert opt.shares is not None
    bad = []
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + replica)  # the replica's mean gradient
        for p, w in zip(model.parameters(), whole.parameters(), strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            w.grad = p.grad.clone()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        ref.step()
        for i, (p, w, b) in enumerate(zip(model.parameters(), whole.parameters(), before, strict=True)):
            if not torch.equal(p, w if opt.shares.owns(p) else b):
                bad.append(f"step {step}: parameter {i} before the caller's broadcast")
        opt.shares.broadcast()
        bad += [
            f"step {step}: parameter {i}"
            for i, (p, w) in enumerate(zip(model.parameters(), whole.parameters(), strict=True))
            if not torch.equal(p, w)
        ]
    if sum(opt.shares.owns(p) for p in model.parameters()) != 1:
        bad.append("each rank owns one of the two tensors")
    return bad


def test_a_vote_mesh_of_groups_votes_shares_and_the_caller_broadcasts() -> None:
    assert run_workers(worker_vote_mesh, 4, timeout=120) == [[]] * 4


#: tests/torchrun_runs.py's jobs (shared with tests/test_reliability.py), one torchrun agent's interpreter
#: for both, started in the background when collection ends (tests/background.py): its ``forgot_init`` is a
#: torchrun job of 2 ranks that build LionCub without init_process_group
BACKGROUND = {"torchruns": torchrun_runs.job}


@pytest.mark.slow
@pytest.mark.background("torchruns")
def test_torchrun_without_init_process_group_fails_on_every_rank() -> None:
    proc = background.result("torchruns", BACKGROUND["torchruns"])
    done = torchrun_runs.runs(background.workdir("torchruns"), proc)["forgot_init"]
    out = done["output"]
    assert done["rc"] != 0 and "trained alone" not in out, out[-3000:]
    for rank in (0, 1):
        assert f"RuntimeError: rank {rank} of WORLD_SIZE=2: LionCub has no process group" in out, out[-3000:]
    assert out.count("call torch.distributed.init_process_group(...) before building the optimizer") >= 2
    assert Path(background.workdir("torchruns"), "started.1").exists()
