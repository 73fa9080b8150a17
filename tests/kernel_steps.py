"""LionCub steps that count the kernel calls they make: the ranks of tests/test_kernels.py (the Triton
kernels, also run by its background job under ``TRITON_INTERPRET=1``) and of tests/test_cpu_kernels.py (the
fused C kernels)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

from lioncub.ops import kernels


@contextlib.contextmanager
def counted_calls(module: ModuleType, names: tuple[str, ...]) -> Iterator[dict[str, int]]:
    """Count the calls of ``module``'s functions ``names`` (by name) while the block runs; the functions are
    restored after it (the rank may be a pooled worker, tests/processes.py, that runs other tests next)."""
    calls: dict[str, int] = {}
    originals = {name: getattr(module, name) for name in names}
    for name, original in originals.items():

        def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(module, name, counted)
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(module, name, original)


#: the presets of :func:`worker_lioncub_kernels` in tests/test_kernels.py (and its interpreter run)
STEP_PRESETS = ["1bit", "8bit", "8bit-sign"]


def worker_lioncub_kernels(rank: int, world: int, presets: list[str], out: str | None) -> dict:
    """3 steps of every preset on two fp32 tensors with rank-dependent gradients; counts the kernel calls
    the step made (under ``TRITON_INTERPRET=1`` the kernels take CPU tensors, as they take CUDA ones).
    Rank 0 also saves the results to ``out`` (if given)."""
    from lioncub.optim import LionCub

    results: dict[str, Any] = {}
    counted = ("majority_pack", "quantize_l1", "apply_votes_", "apply_votes_multi_", "lion_directions_")
    with counted_calls(kernels, counted) as calls:
        for preset in presets:
            torch.manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(37, 11)), torch.nn.Parameter(torch.randn(5))]
            opt = LionCub(params, lr=0.01, weight_decay=0.1, variant=preset)
            for step in range(1, 4):
                g = torch.Generator().manual_seed(100 * step + rank)
                for p in params:
                    p.grad = torch.randn(p.shape, generator=g)
                opt.step()
            results[preset] = {
                "params": [p.detach().clone() for p in params],
                "momenta": [opt.state[p]["exp_avg"].clone() for p in params],
            }
    results["calls"] = calls
    results["backend"] = kernels.backend_for(torch.zeros(1))
    if out is not None and rank == 0:
        torch.save(results, out)
    return results
