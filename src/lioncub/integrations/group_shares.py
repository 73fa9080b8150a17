"""A replica group of several ranks that votes as one (:mod:`lioncub.integrations.torchft`): the shares.

Inside the group the ranks are plain data parallelism: DDP over the group's own process group averages
their gradients, so the L ranks hold one replica, one update and one momentum, and the group is **one
voter** (the vote's N is the number of groups). The vote between the groups is split across the group's
ranks so that the group's NIC carries one vote's bytes, as a single rank's would:

* rank ℓ of every group owns the same share of the parameters (:func:`shard`: whole tensors, largest first,
  each to the rank with the fewest elements so far);
* its ``LionCub`` holds only that share (its momenta, its vote with rank ℓ of the other groups);
* after every step, and after a heal, each rank broadcasts its share to the others of its group
  (:meth:`GroupShares.broadcast`, one broadcast per rank and dtype).

torchft heals the ranks of a group that is behind together, each from its peer rank; at the first quorum
with ``init_sync`` it picks each rank's source by its rank, so that only some ranks of a group heal: the
ranks agree on a heal (:meth:`GroupShares.agree_on_heal`) before they broadcast.

The shares are the optimizer's own mechanism for "which part of the model this rank votes on" with DDP
inside: ``LionCub(params, process_group=mesh)`` on a ``("replicate", "shard")`` mesh with plain parameters
takes the same share (:func:`lioncub.optim.shards.share_owners`) and broadcasts it the same way
(:func:`lioncub.optim.shards.broadcast_shares`) after its step (docs/shards.md). Here torchft's group
(a :class:`~lioncub.collectives.GroupComm`, whose members change) is the replicate dimension, the caller
hands the optimizer its share, and the broadcast waits for torchft's commit (a step is shared once the
group's ranks agree that it stands).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lioncub.optim.shards import broadcast_shares, share_owners

__all__ = ["GroupShares", "agree_on_heal", "shard", "share_of"]


def shard(params: Sequence[torch.Tensor], parts: int) -> list[int]:
    """Which of ``parts`` ranks owns each tensor of ``params``: whole tensors, largest first, each to the
    rank with the fewest elements so far (ties: the lowest rank). The same on every rank and group for the
    same shapes. A list of owners, one per tensor of ``params``, in its order (the assignment of
    ``LionCub(process_group=mesh)`` with DDP inside the mesh's shard dimension:
    :func:`lioncub.optim.shards.share_owners`)."""
    return share_owners(params, parts)


def share_of(params: Sequence[torch.Tensor], parts: int, part: int) -> list[torch.Tensor]:
    """The tensors of ``params`` that rank ``part`` of ``parts`` owns (:func:`shard`), in their order."""
    return [p for p, owner in zip(params, shard(params, parts), strict=True) if owner == part]


class GroupShares:
    """The shares of ``params`` (all the model's parameters, in the same order on every rank) among the
    ``size`` ranks of ``group_pg`` (None: the default group); ``held``: the tensors rank ``rank``'s
    optimizer steps, which must be exactly its share (in any order); ``where`` names this rank in
    messages."""

    def __init__(
        self,
        params: Sequence[torch.Tensor] | None,
        held: Sequence[torch.Tensor],
        rank: int,
        size: int,
        group_pg: Any,
        where: str,
    ) -> None:
        if params is None:
            raise ValueError(
                f"attach: {where}, a group of {size} ranks: give params=the model's parameters; the "
                "optimizer holds this rank's share of them (see shard)"
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"{where}: init_process_group first (the group's ranks share over group_pg)")
        if dist.get_world_size(group_pg) != size:
            raise ValueError(f"{where}: group_pg has {dist.get_world_size(group_pg)} ranks, not {size}")
        self.size, self.rank, self.group_pg = size, rank, group_pg
        params = list(params)
        mine = {id(p) for p in share_of(params, size, rank)}
        ids = [id(p) for p in held]
        if sorted(ids) != sorted(mine):
            raise ValueError(
                f"attach: {where}: the optimizer must hold exactly this rank's share of params ({len(mine)} "
                f"tensors of shard(params, {self.size})); it holds {len(ids)}, {len(set(ids) - mine)} of "
                "them not in the share"
            )
        self.shares = [(r, share_of(params, size, r)) for r in range(size)]

    def broadcast(self) -> None:
        """Every rank's share to the others of the group (collective in the group;
        :func:`lioncub.optim.shards.broadcast_shares`, as ``LionCub`` on a mesh does after its step)."""
        broadcast_shares(self.shares, self.rank, self.group_pg)

    def agree_on_heal(self, mine: tuple[str, int] | None) -> tuple[str, int] | None:
        """:func:`agree_on_heal` over the group."""
        return agree_on_heal(mine, self.size, self.group_pg)


def agree_on_heal(mine: tuple[str, int] | None, size: int, group_pg: Any) -> tuple[str, int] | None:
    """What the ``size`` ranks of ``group_pg`` (None: the default group) healed at this quorum (``mine``:
    this rank's (source, bytes received), or None) as (the sources, comma-separated, and the bytes all
    received), or None if none did (collective in the group)."""
    any_healed = torch.tensor([int(mine is not None)], dtype=torch.int64)
    dist.all_reduce(any_healed, group=group_pg)
    if not any_healed.item():
        return None
    every: list[tuple[str, int] | None] = [None] * size
    dist.all_gather_object(every, mine, group=group_pg)
    got = [h for h in every if h is not None]
    return ",".join(sorted({source for source, _ in got})), sum(nbytes for _, nbytes in got)
