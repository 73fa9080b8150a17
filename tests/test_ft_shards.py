"""FSDP2 inside the fault-tolerant replica groups (docs/shards.md, "How to say it"; issue 46): the vote on a
replica's shards over a ``VoteMesh`` whose replicate dimension is a group whose members change
(:class:`~lioncub.collectives.GroupComm`, as torchft holds it) and whose shard dimension is the replica's own
``(1, S)`` mesh, held bit for bit to the unsharded vote of the same voters; the optimizer state a heal
carries between groups (:func:`lioncub.integrations.torchft.portable_state`), rank by rank, bit for bit."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from lioncub import LionCub
from lioncub.collectives import GroupComm
from lioncub.optim import Checks, VoteMesh
from lioncub.optim.topology import who_votes

from processes import run_workers


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial model in every replica
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))


def worker_ft_shards(rank: int, world: int, variants: list[str]) -> list[str]:
    """2 replicas × 2 shards: replica r's mesh of its own ``[[2r, 2r+1]]`` (the replicate dimension of one
    rank), the vote between the replicas over a ``GroupComm`` of the ranks holding the same shard. After
    every step each rank's shards equal the rows of the unsharded vote of the replicas' gradients (as a
    replica's mean); then replica 1's ranks take replica 0's state through the heal's portable form
    (each from the same shard rank) and both replicas step on, bit for bit with the unsharded vote. For
    each of ``variants`` (one set of groups: their setup is most of the cost)."""
    replica = rank // 2
    singles = [dist.new_group([r]) for r in range(world)]
    replicates = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mesh = DeviceMesh.from_group(
        [singles[rank], shards[replica]], "cpu", mesh=[[2 * replica, 2 * replica + 1]],
        mesh_dim_names=("replicate", "shard"),
    )  # fmt: skip
    return [f"{variant}: {line}" for variant in variants for line in _vote(rank, variant, mesh, replicates)]


def _vote(rank: int, variant: str, mesh: DeviceMesh, replicates: list[dist.ProcessGroup]) -> list[str]:
    """:func:`worker_ft_shards` for ``variant``: what differs from the unsharded vote."""
    from lioncub.integrations.torchft import from_storable, load_portable, portable_state, storable

    replica, shard = divmod(rank, 2)
    model, whole = _model(), _model()
    for layer in model:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    comm = GroupComm(replicates[shard], rank=replica, world_size=2)
    opt = LionCub(model.parameters(), lr=0.1, variant=variant, process_group=VoteMesh(comm, mesh),
                  checks=Checks(broadcast_init=False))  # fmt: skip
    ref = LionCub(whole.parameters(), lr=0.1, variant=variant, process_group=replicates[shard])
    assert opt.shards is not None and opt.shares is None
    bad: list[str] = []

    def step(n: int) -> None:
        g = torch.Generator().manual_seed(10 * n + replica)  # the replica's mean gradient
        for p, w in zip(model.parameters(), whole.parameters(), strict=True):
            w.grad = torch.randn(w.shape, generator=g)
            p.grad = distribute_tensor(w.grad, p.device_mesh, p.placements)
        opt.step()
        ref.step()
        for i, (p, w) in enumerate(zip(model.parameters(), whole.parameters(), strict=True)):
            assert isinstance(p, DTensor)
            rows = -(-w.shape[0] // 2)
            mine = w.detach()[shard * rows : (shard + 1) * rows]
            if not torch.equal(p.to_local(), mine):
                bad.append(f"step {n}: parameter {i}'s shard")
            momentum = ref.state[w]["exp_avg"][shard * rows : (shard + 1) * rows]
            if not torch.equal(opt.state[p]["exp_avg"], momentum):
                bad.append(f"step {n}: parameter {i}'s momentum")

    for n in range(2):
        step(n)
    # the heal: replica 1's ranks take replica 0's state (each shard rank from the same shard rank), the
    # unsharded reference its replica 0's state dict (as ReplicaGroup heals an unsharded group); the state
    # goes as a checkpoint part holds it (storable, torch.save, torch.load(weights_only=True)), so that a
    # resume from a part is held to the same bits
    if replica == 0:
        part = io.BytesIO()
        torch.save(storable(portable_state(opt)), part)
        dist.send_object_list([part.getvalue(), ref.state_dict()], dst=2 + shard)
    else:
        got: list[object] = [None, None]
        dist.recv_object_list(got, src=shard)
        assert isinstance(got[0], bytes)
        load_portable(opt, from_storable(torch.load(io.BytesIO(got[0]), weights_only=True)))
        ref.load_state_dict(got[1], allow_world_size_change=True)  # type: ignore[arg-type]  # a state dict
    for n in range(2, 4):
        step(n)
    return bad


@pytest.mark.slow
def test_the_vote_on_a_replica_groups_shards_is_the_unsharded_vote() -> None:
    """``1bit`` (elementwise) and ``8bit`` (a quantizer whose norms are the whole tensors': the shard
    group's gather runs on the replica's own mesh)."""
    assert run_workers(worker_ft_shards, 4, ["1bit", "8bit"], timeout=180) == [[]] * 4


def test_a_vote_mesh_of_shards_needs_the_replicas_own_mesh() -> None:
    with pytest.raises(TypeError, match=r"VoteMesh\(\.\.\.\) is for plain parameters .* shape \(1, S\)"):
        who_votes(VoteMesh(None, None), sharded=True)


def test_fault_tolerant_shards_take_checkpoints() -> None:
    """``--fsdp --fault-tolerant`` takes ``--checkpoint-every`` and ``--stop-at`` (each rank's part holds its
    shards: tests/test_replica_groups_cli.py resumes such a run to the bits of the whole one)."""
    from lioncub.train.config import TrainConfig

    nodes = {"variant": "1bit", "nproc": 4, "nnodes": 2, "link": "1gbit", "fault_tolerant": True, "steps": 24}
    config = TrainConfig.from_values({**nodes, "fsdp": True, "checkpoint_every": 8, "stop_at": 12})
    assert config.cluster.fsdp and (config.run.checkpoint_every, config.run.stop_at) == (8, 12)
