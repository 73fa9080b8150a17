"""Keeping the replicas identical: the same parameter list on every rank (checked at construction), rank
0's initial parameters everywhere, and exact checksums compared across ranks.

Every function here is collective on ``comm``'s group.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from lioncub.collectives import Comm, flat_views

__all__ = [
    "ReplicaDivergenceError",
    "ReplicaMismatchError",
    "broadcast_parameters",
    "check_replicas",
    "check_same_parameters",
    "parameter_checksum",
]


class ReplicaDivergenceError(RuntimeError):
    """The parameters of the ranks are no longer identical."""


class ReplicaMismatchError(ValueError):
    """The ranks were given different parameter lists (names, shapes, dtypes or order)."""


def check_same_parameters(
    comm: Comm, named: list[tuple[str, torch.Tensor]], param_groups: list[dict[str, Any]]
) -> None:
    """All-gather a hash of (group, name, shape, dtype) of every optimized parameter, in order; on a
    mismatch every rank gathers the lists and raises :class:`ReplicaMismatchError` naming the first
    differing parameter (instead of a hang or a vote over misaligned buffers later)."""
    n = comm.world_size
    if comm.alone:
        return
    group_of = {id(p): gi for gi, g in enumerate(param_groups) for p in g["params"]}
    layout = [
        f"group {group_of[id(p)]} {name} {tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}"
        for name, p in named
    ]
    digest = hashlib.sha256("\n".join(layout).encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
    gathered = torch.empty(n, 1, dtype=torch.int64, device=comm.device)
    comm.all_gather(gathered, mine.to(comm.device), "parameter layout check").wait()
    if bool((gathered == gathered[0]).all()):
        return
    layouts = comm.all_gather_object(layout, "parameter layout gather")
    rank = next(r for r in range(n) if layouts[r] != layouts[0])
    ours, other = layouts[0], layouts[rank]
    i = next(
        (i for i in range(min(len(ours), len(other))) if ours[i] != other[i]), min(len(ours), len(other))
    )
    first = ours[i] if i < len(ours) else "(no parameter)"
    theirs = other[i] if i < len(other) else "(no parameter)"
    raise ReplicaMismatchError(
        f"rank {comm.rank}: the ranks do not optimize the same parameters: rank 0 has "
        f"{len(layouts[0])} tensors, rank {rank} has {len(other)}; first difference at position {i}: "
        f"rank 0 {first!r}, rank {rank} {theirs!r} (build the same model, in the same order, on every "
        "rank)"
    )


@torch.no_grad()
def broadcast_parameters(comm: Comm, buckets: Sequence[Sequence[torch.Tensor]]) -> None:
    """Copy rank 0's parameters to every rank, one flat broadcast per bucket of parameters."""
    if comm.alone:
        return
    for params in buckets:
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        comm.broadcast(flat, 0, "initial parameter broadcast").wait()
        for p, view in zip(params, flat_views(flat, params), strict=True):
            p.copy_(view)


@torch.no_grad()
def parameter_checksum(params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 ``[2]`` on ``device``: the sum of the parameters' raw bits and a position-weighted sum (exact:
    any difference in any bit of any parameter changes it, short of a contrived collision)."""
    total = torch.zeros(2, dtype=torch.int64, device=device)
    for p in params:
        raw = p.detach().reshape(-1).view(_int_view(p.dtype)).to(torch.int64)
        total[0] += raw.sum()
        total[1] += (raw * torch.arange(1, raw.numel() + 1, device=raw.device) % 1_000_003).sum()
    return total.to(device)


def check_replicas(comm: Comm, checksum: torch.Tensor, step: int) -> None:
    """All-gather every rank's :func:`parameter_checksum`; raise :class:`ReplicaDivergenceError` on a mismatch
    (on every rank, naming the ranks that disagree with rank 0)."""
    n = comm.world_size
    if comm.alone:
        return
    mine = checksum
    gathered = torch.empty(n, 2, dtype=torch.int64, device=comm.device)
    comm.all_gather(gathered, mine, "replica checksum all-gather").wait()
    differing = [r for r in range(n) if not torch.equal(gathered[r], gathered[0])]
    if differing:
        raise ReplicaDivergenceError(
            f"rank {comm.rank}: parameters differ between ranks at step {step}: "
            f"ranks {differing} disagree with rank 0 (checksums {gathered.tolist()})"
        )


def _int_view(dtype: torch.dtype) -> torch.dtype:
    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        torch.empty(0, dtype=dtype).element_size()
    ]
