"""Momentum synchronization for :class:`~lioncub.optim.LionCub` (Lion Cub §3.7): which momenta, and when.

Which (``MomentumSync(params)``, or ``LionCub(momentum_sync=params)``):

* ``"none"`` — never (pure Distributed Lion);
* ``"all"`` — every parameter's momentum;
* ``"io"`` — the input and output layers, found in the ``model``: every ``nn.Embedding`` (token and
  position embeddings) or, without embeddings, the first convolution / linear layer and a BatchNorm
  right after it (a CNN's stem); and the last ``nn.Linear`` (the LM head — the same tensor as the
  token embedding when tied — or a classifier);
* a list of patterns: ``fnmatch`` patterns of parameter names (``"transformer.wte.*"``), or names of
  param groups (their ``"name"`` key).

When (:class:`MomentumSync`): at every step ``t`` with ``t % every == 0`` (the paper: 10), or on the
exponentially spaced schedule of the authors' code, ``T = {0, t_1, t_2, …}`` with ``t_{j+1} = t_j +
⌊2^{j/K}⌋`` (``exp_k=K``; the increment is at least 1); in both cases only while ``t ≤ until`` if that is
set. The schedule is a function of the optimizer step, which checkpoints keep, so a resumed run
syncs at the same steps.

The sync itself is an allreduce of the chosen momenta (flattened per dtype, fp32 or bf16 on the wire, in
buckets of at most 25 MiB: :func:`synchronize`) divided by N: afterwards every rank holds the mean of the
ranks' momenta.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lioncub._validate import OptionError, is_int
from lioncub.collectives import Comm

__all__ = ["MomentumSync", "find_io_parameters", "select_parameters", "synchronize"]

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm, nn.LayerNorm)


def find_io_parameters(model: nn.Module) -> list[str]:
    """Names (as in ``model.named_parameters()``) of the input and output layers' parameters."""
    modules = list(model.named_modules())
    inputs: list[str] = [name for name, m in modules if isinstance(m, nn.Embedding)]
    if not inputs:
        layers = [(i, name) for i, (name, m) in enumerate(modules) if isinstance(m, (*_CONV, nn.Linear))]
        if layers:
            first_index, first = layers[0]
            inputs.append(first)
            later = [name for name, m in modules[first_index + 1 :] if not list(m.children())]
            if later and isinstance(dict(modules)[later[0]], _NORM):
                inputs.append(later[0])  # the stem's normalisation
    linears = [name for name, m in modules if isinstance(m, nn.Linear)]
    outputs = linears[-1:]
    chosen = {id(p) for prefix in inputs + outputs for p in dict(modules)[prefix].parameters(recurse=False)}
    return [name for name, p in model.named_parameters() if id(p) in chosen]


def select_parameters(
    spec: str | Sequence[str],
    named: Iterable[tuple[str, torch.Tensor]],
    groups: Sequence[dict[str, Any]],
    model: nn.Module | None,
) -> list[tuple[str, torch.Tensor]]:
    """The (name, parameter) pairs whose momenta ``spec`` selects (see the module docstring)."""
    named = list(named)
    if spec == "none":
        return []
    if spec == "all":
        return named
    if spec == "io":
        if model is None:
            raise ValueError("momentum_sync='io' needs model= (the module the parameters belong to)")
        io = set(find_io_parameters(model))
        return [(n, p) for n, p in named if n in io]
    allowed = (
        "allowed values are 'none', 'all', 'io' or a non-empty list of parameter-name patterns / "
        "param-group names"
    )
    if isinstance(spec, str):
        raise ValueError(f"momentum_sync={spec!r}: {allowed}")
    if (
        not isinstance(spec, Sequence)
        or isinstance(spec, bytes)
        or not spec
        or not all(isinstance(pat, str) and pat for pat in spec)
    ):
        raise ValueError(f"momentum_sync={spec!r}: {allowed} (strings)")
    group_names = {g.get("name") for g in groups} - {None}
    by_group = {id(p) for g in groups if g.get("name") in spec for p in g["params"]}
    chosen = [
        (n, p) for n, p in named if id(p) in by_group or any(fnmatch.fnmatchcase(n, pat) for pat in spec)
    ]
    unused = [
        pat
        for pat in spec
        if pat not in group_names and not any(fnmatch.fnmatchcase(n, pat) for n, _ in named)
    ]
    if unused:
        raise ValueError(
            f"momentum_sync: {unused} match no parameter name and no param group "
            f"(groups: {sorted(map(str, group_names))}; e.g. parameters {[n for n, _ in named[:4]]})"
        )
    return chosen


@dataclass(frozen=True)
class MomentumSync:
    """Which momenta :class:`~lioncub.optim.LionCub` averages over the ranks, when, and in which dtype.

    Args:
        params: ``"none"`` (default), ``"all"``, ``"io"`` (the input and output layers of the optimizer's
            ``model=``) or a list of parameter-name patterns / param-group names (see the module docstring).
        every: sync at every step ``t`` with ``t % every == 0`` (the paper: 10).
        until: only while ``t ≤ until`` (``None``: always).
        exp_k: instead of ``every``, the authors' exponentially spaced schedule with this ``K``.
        dtype: the wire dtype of the allreduce: ``torch.float32`` (default), ``torch.bfloat16`` or
            ``torch.float64``.

    Each field is checked here, once; ``LionCub(momentum_sync="io")`` is ``MomentumSync("io")``.
    """

    params: str | Sequence[str] = "none"
    every: int = 10
    until: int | None = None
    exp_k: int | None = None
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not is_int(self.every, 1):
            raise OptionError(
                "MomentumSync", "every", self.every, "must be an int >= 1 (steps)", prefix="MomentumSync: "
            )
        if self.until is not None and not is_int(self.until, 0):
            raise ValueError(f"MomentumSync: until={self.until!r} must be None or an int >= 0 (steps)")
        if self.exp_k is not None and not is_int(self.exp_k, 1):
            raise ValueError(f"MomentumSync: exp_k={self.exp_k!r} must be None or an int >= 1")
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float64):
            raise ValueError(
                f"MomentumSync: dtype={self.dtype} must be torch.float32, torch.bfloat16 or torch.float64"
            )

    def due(self, step: int) -> bool:
        """Whether the momenta are synchronized after optimizer step ``step`` (1, 2, …)."""
        if self.until is not None and step > self.until:
            return False
        if self.exp_k is None:
            return step % self.every == 0
        return step in _exponential_steps(self.exp_k, step)

    def describe(self) -> str:
        """``"every 10 steps"``, ``"on the exponential schedule K=4 until step 100"``."""
        when = (
            f"every {self.every} steps"
            if self.exp_k is None
            else f"on the exponential schedule K={self.exp_k}"
        )
        return when + ("" if self.until is None else f" until step {self.until}")


def synchronize(
    comm: Comm, momenta: Sequence[torch.Tensor], dtype: torch.dtype, *, bucket_mb: float = 25.0
) -> None:
    """Average ``momenta`` over ``comm``'s ranks in place, in ``dtype`` on the wire, divided by N. Collective.

    Per momentum dtype, the momenta flattened one after another go through one staging buffer of at most
    ``bucket_mb`` MiB of ``dtype`` (a momentum larger than that is cut across several fillings): one
    allreduce per filling, so the extra memory is one bucket (and a contiguous copy of a non-contiguous
    momentum while it is staged), not a copy of every momentum. Momenta of a dtype that fit in one bucket
    travel in one allreduce, as before; with more, the mean is the same on every rank, and the same bits as
    one allreduce at N ≤ 2 (at N ≥ 3 the backend's allreduce may add an element's N terms in another
    order, so its last bit may differ)."""
    cap = max(1, int(bucket_mb * 2**20) // dtype.itemsize)  # elements of one bucket
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for m in momenta:
        if m.numel():
            by_dtype.setdefault(m.dtype, []).append(m)
    for moms in by_dtype.values():
        stage = torch.empty(min(sum(m.numel() for m in moms), cap), dtype=dtype, device=moms[0].device)
        staged: list[_Piece] = []
        filled = 0
        for m in moms:
            copied = not m.is_contiguous()
            flat = m.contiguous().view(-1)  # the momentum's own storage, or a copy written back at its end
            start = 0
            while start < m.numel():
                take = min(m.numel() - start, stage.numel() - filled)
                stage[filled : filled + take].copy_(flat[start : start + take])
                staged.append(_Piece(m, flat, start, take, copied))
                filled, start = filled + take, start + take
                if filled == stage.numel():
                    _average(comm, stage, staged)
                    staged, filled = [], 0
        if staged:
            _average(comm, stage[:filled], staged)


@dataclass
class _Piece:
    """Elements ``[start, start + length)`` of ``momentum`` flattened (``flat``: 1-D, the momentum's own
    storage, or a contiguous copy where ``copied``)."""

    momentum: torch.Tensor
    flat: torch.Tensor
    start: int
    length: int
    copied: bool


def _average(comm: Comm, chunk: torch.Tensor, pieces: list[_Piece]) -> None:
    """Allreduce ``chunk`` (1-D, the ``pieces`` one after another), divide by N and copy it back into the
    momenta (a copied momentum once its last piece is back)."""
    comm.all_reduce(chunk, "momentum sync").wait()
    chunk.div_(comm.world_size)
    at = 0
    for piece in pieces:
        piece.flat[piece.start : piece.start + piece.length].copy_(chunk[at : at + piece.length])
        at += piece.length
        if piece.copied and piece.start + piece.length == piece.momentum.numel():
            piece.momentum.copy_(piece.flat.view(piece.momentum.shape))


def _exponential_steps(k: int, up_to: int) -> set[int]:
    steps, t, j = {0}, 0, 0
    while t <= up_to:
        t += max(1, int(2 ** (j / k)))
        j += 1
        steps.add(t)
    return steps
