"""Votes between replica groups whose members change (issue 35): :class:`lioncub.collectives.GroupComm`,
the comm that issues every operation as a process-group object's own methods (torchft's reconfigurable
groups are objects ``torch.distributed`` does not know).

The oracle of the parity tests is the plain path: the same optimizer on the same rank-dependent gradients
with ``torch.distributed``'s own collectives (:class:`~lioncub.collectives.Comm`), bit for bit —
parameters, momenta, bytes counted.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lioncub.collectives import GroupComm
from lioncub.optim import PRESETS, LionCub

from processes import run_workers

STEPS = 4


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)  # the same initial values on every rank
    shapes = [(37, 24), (24,), (40, 24), (3,)]  # some shorter than a 1-bit vote's 8·N padding
    return [torch.nn.Parameter(torch.randn(s)) for s in shapes]


def _steps(opt: LionCub, params: list[torch.nn.Parameter], rank: int) -> None:
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
            if step == 2:
                p.grad[..., :2] = 0.0  # exact zeros on every rank: ties, the zero rule
        opt.step()


def _parity(rank: int, world_size: int, variant: str, exchange: str, local_steps: int | None) -> dict:
    """The same optimizer over the default group through :class:`Comm` and through :class:`GroupComm`
    on the default group's object."""
    out = {}
    for name in ("plain", "group"):
        params = _params()
        group = (
            GroupComm(dist.group.WORLD, rank=rank, world_size=world_size, exchange=exchange)
            if name == "group"
            else None
        )
        opt = LionCub(
            params, lr=0.01, weight_decay=0.1, variant=variant, process_group=group, local_steps=local_steps
        )
        if name == "plain":
            opt.comm.exchange = exchange
        _steps(opt, params, rank)
        out[name] = {
            "params": [p.detach().clone() for p in params],
            "momenta": [opt.state[p]["exp_avg"].clone() for p in params],
            "sent": opt.comm.counter.bytes_sent,
        }
    return out


@pytest.mark.parametrize(
    ("variant", "exchange", "local_steps"),
    [
        *[(v, "p2p", None) for v in PRESETS],
        ("1bit", "native", None),
        ("8bit", "native", None),
        ("1bit", "p2p", 2),
        ("32bit", "p2p", 2),
    ],
)
def test_group_comm_votes_bitwise_as_the_plain_comm(
    variant: str, exchange: str, local_steps: int | None
) -> None:
    for r, result in enumerate(run_workers(_parity, 3, variant, exchange, local_steps)):
        plain, group = result["plain"], result["group"]
        for what in ("params", "momenta"):
            for i, (a, b) in enumerate(zip(plain[what], group[what], strict=True)):
                assert torch.equal(a, b), (variant, r, what, i)
        assert plain["sent"] == group["sent"] > 0, (variant, r)


def _exchanges(rank: int, world_size: int) -> list:
    """Each exchange of a :class:`GroupComm` on 3 ranks, and the object collectives (pickled objects of
    different sizes)."""
    comm = GroupComm(dist.group.WORLD, rank=rank, world_size=world_size)
    objects = comm.all_gather_object({"rank": rank, "text": "x" * (rank * 100)}, "objects")
    gathered = comm.gather_object(("step", rank), 1, "gather")
    out = torch.zeros(world_size, 2)
    comm.all_gather(out, torch.full((2,), float(rank)), "rows").wait()
    total = torch.tensor([float(rank + 1)])
    comm.all_reduce(total, "sum").wait()
    root = torch.tensor([float(rank)])
    comm.broadcast(root, 2, "root").wait()
    return [objects, gathered, out, total, root]


def test_group_comm_exchanges_and_objects() -> None:
    results = run_workers(_exchanges, 3)
    for r, (objects, gathered, out, total, root) in enumerate(results):
        assert objects == [{"rank": j, "text": "x" * (j * 100)} for j in range(3)]
        assert gathered == ([("step", j) for j in range(3)] if r == 1 else None)
        assert torch.equal(out, torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]))
        assert total.item() == 6.0 and root.item() == 2.0


def test_group_comm_refuses_a_rank_outside_its_size() -> None:
    with pytest.raises(ValueError, match="need 0 <= rank < world_size"):
        GroupComm(object(), rank=3, world_size=3)
    with pytest.raises(ValueError, match="exchange='fast'"):
        GroupComm(object(), rank=0, world_size=1, exchange="fast")  # type: ignore[arg-type]
