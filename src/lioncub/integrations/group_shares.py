"""A replica group of several ranks that votes as one (:mod:`lioncub.integrations.torchft`): its ranks'
agreement on a heal.

Inside the group the ranks are plain data parallelism: DDP over the group's own process group averages
their gradients, so the L ranks hold one replica, one update and one momentum, and the group is **one
voter** (the vote's N is the number of groups). The vote between the groups is split across the group's
ranks, so that the group's NIC carries one vote's bytes: each rank's ``LionCub`` holds all the
parameters over ``VoteMesh(group.comm, group_pg, broadcast="caller")`` and votes on its share of whole
tensors (``opt.shares``, :class:`lioncub.optim.shards.ShareView`; docs/shards.md, "DDP inside"), which the
``ReplicaGroup`` broadcasts to the group once its ranks agree that a step stands, and after a heal.

torchft heals the ranks of a group that is behind together, each from its peer rank; at the first quorum
with ``init_sync`` it picks each rank's source by its rank, so that only some ranks of a group heal: the
ranks agree on a heal (:func:`agree_on_heal`) before they broadcast.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lioncub.optim.shards import share_owners

__all__ = ["agree_on_heal", "shard", "share_of"]

_DEPRECATED = (
    "lioncub.integrations.group_shares.{name} is deprecated: build each rank's LionCub on all the "
    "parameters with process_group=VoteMesh(group.comm, group_pg, broadcast='caller') (lioncub.optim) and "
    "call group.attach(opt); the optimizer takes its share itself (opt.shares)"
)


def shard(params: Sequence[torch.Tensor], parts: int) -> list[int]:
    """Deprecated (a ``DeprecationWarning``): :func:`lioncub.optim.shards.share_owners`, the owner of
    each tensor of ``params`` among ``parts`` ranks."""
    warnings.warn(_DEPRECATED.format(name="shard"), DeprecationWarning, stacklevel=2)
    return share_owners(params, parts)


def share_of(params: Sequence[torch.Tensor], parts: int, part: int) -> list[torch.Tensor]:
    """Deprecated (a ``DeprecationWarning``): the tensors of ``params`` that rank ``part`` of ``parts``
    owns (:func:`lioncub.optim.shards.share_owners`), in their order."""
    warnings.warn(_DEPRECATED.format(name="share_of"), DeprecationWarning, stacklevel=2)
    return [p for p, owner in zip(params, share_owners(params, parts), strict=True) if owner == part]


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
