"""The bytes one rank holds: ``summary.json``'s ``memory``.

``{"parameters": B, "gradients": B, "optimizer_state": B, "peak_rss": B}``, each the largest over the
run's ranks (:func:`largest_over_ranks`; a fault-tolerant run: over its groups' ranks):

* ``parameters``: the model's parameters on this rank (:func:`parameter_bytes`);
* ``gradients``: their ``.grad`` after the backward of the rank's first step (:func:`gradient_bytes`; every
  backward of a run allocates the same gradients);
* ``optimizer_state``: the tensors of ``optimizer.state`` at the end of the run (:func:`state_bytes`):
  the momenta, with local steps also the anchors and the outer momenta (``LionCub`` keeps every
  per-parameter tensor there, on FSDP2's parameters too: the shards' own);
* ``peak_rss``: the rank's peak resident set size as the OS reports it (:func:`peak_rss_bytes`).

A tensor counts ``numel() * element_size()`` bytes; a ``DTensor`` (FSDP2's parameters and gradients) its
local shard (``to_local()``), so a sharded model counts what a rank holds, not the whole. Not counted by the
first three (the peak RSS holds them): DDP's gradient buckets (a flat copy of the gradients, with
``gradient_as_bucket_view`` off as here), the vote's work buffers (``LionCub``'s contribution and packing
buffers per bucket), the replicas a local-steps window keeps aside while the shared parameters are shown,
activations, the data, and torch's allocator caches.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "MEMORY_KEYS",
    "gradient_bytes",
    "largest_of",
    "largest_over_ranks",
    "parameter_bytes",
    "peak_rss_bytes",
    "rank_memory",
    "state_bytes",
    "tensor_bytes",
]

#: the fields of ``summary.json``'s ``memory``, in order
MEMORY_KEYS = ("parameters", "gradients", "optimizer_state", "peak_rss")


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` on this rank: ``numel() * element_size()``, of a ``DTensor``'s local shard."""
    # a DTensor exists only once torch.distributed.tensor was imported (which takes a second): not here
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        with torch.no_grad():
            t = t.to_local()
    return t.numel() * t.element_size()


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` without repeats (the same tensor object twice counts once)."""
    return list({id(t): t for t in tensors}.values())


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters on this rank (tied ones once)."""
    return sum(tensor_bytes(p) for p in model.parameters())


def gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of the gradients ``model``'s parameters hold (``p.grad``; ``None`` counts 0)."""
    return sum(tensor_bytes(g) for g in _unique(p.grad for p in model.parameters() if p.grad is not None))


def _tensors_in(value: Any) -> Iterable[torch.Tensor]:
    """The tensors in a state entry: itself, or inside its dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)


def state_bytes(*optimizers: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in the ``state`` of ``optimizers`` (each parameter's momentum and whatever
    else the optimizer keeps per parameter there; a tensor held twice counts once)."""
    tensors = (t for opt in optimizers for entry in opt.state.values() for t in _tensors_in(entry))
    return sum(tensor_bytes(t) for t in _unique(tensors))


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (``getrusage``: KiB on Linux, bytes on macOS). A
    rank forked from a preloaded interpreter counts the pages it shares with it too."""
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024


def rank_memory(
    model: torch.nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    gradients: int,
    *,
    extra_state: int = 0,
) -> dict[str, int]:
    """This rank's ``memory`` (module docstring): ``gradients`` as measured after a backward, the state of
    ``optimizers`` and ``extra_state`` bytes kept outside them (torchft's DiLoCo: its backup and outer
    state)."""
    return {
        "parameters": parameter_bytes(model),
        "gradients": gradients,
        "optimizer_state": state_bytes(*optimizers) + extra_state,
        "peak_rss": peak_rss_bytes(),
    }


def largest_over_ranks(
    memory: Mapping[str, int], device: torch.device, group: dist.ProcessGroup | None = None
) -> dict[str, int]:
    """Each field of ``memory``, the largest over the ranks of ``group`` (default: the global group; one
    allreduce of four int64). Collective."""
    values = torch.tensor([int(memory[k]) for k in MEMORY_KEYS], dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(MEMORY_KEYS, (int(v) for v in values.tolist()), strict=True))


def largest_of(memories: Iterable[Mapping[str, int]]) -> dict[str, int] | None:
    """Each field, the largest over ``memories`` (the groups of a fault-tolerant run); ``None`` if empty."""
    found = list(memories)
    if not found:
        return None
    return {k: max(int(m[k]) for m in found) for k in MEMORY_KEYS}
