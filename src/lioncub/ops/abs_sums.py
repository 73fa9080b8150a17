"""The float64 sums ``Σ|x|`` on Triton's device: the L1 normaliser's sums (:mod:`lioncub.ops.normalizers`)
and the fused L1 quantizer's pass 1 (:mod:`lioncub.ops.kernels`), in two Triton launches for any number of
rows or groups, without a float64 copy of the input.

Stage 1 sums |x| over tiles of at most ``_TILE`` elements laid out from each group's start (one program per
tile, ``_TILE_BLOCK`` lanes); stage 2 adds each group's tiles (one program per group). Both orders depend on
a group's own elements only, never on the other groups of the launch: a row summed alone and the same
elements summed as a group of a bucket give the same bits. The tile and group tables are device tables
(:class:`lioncub.ops.triton_launch.DeviceTables`), made once per layout.

This module sits in the lowest layer: it imports torch and :mod:`lioncub.ops.triton_launch`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

import torch

from lioncub.ops import triton_launch

__all__ = ["group_tables", "l1_abs_sums", "l1_sums_backend", "run_l1_sums"]

_TILE_BLOCK = 1024
_TILE_BLOCKS = 4
_TILE = _TILE_BLOCK * _TILE_BLOCKS
_GROUP_BLOCK = 256  # lanes of stage 2 (a group of 1M elements: 256 partials, one pass)
_TINY32 = float(torch.finfo(torch.float32).tiny)
_MAX32 = float(torch.finfo(torch.float32).max)


def l1_sums_backend(x: torch.Tensor) -> str:
    """``"triton"`` where :func:`l1_abs_sums` runs ``x`` (Triton's device, float32/bfloat16/float16,
    contiguous), else ``"torch"``."""
    return "torch" if triton_launch.why_not_triton([x], [x]) else "triton"


def group_tables(
    device: torch.device, key: Hashable, layout: Callable[[], tuple[Sequence[int], ...]]
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(tiles int64 ``[T, 2]``: start, length; groups int64 ``[G, 4]``: first tile, end tile, length,
    segment; T; G) on ``device``, made once per ``key`` from ``layout()``: the groups' starts, lengths
    and segments."""
    tables = triton_launch.TABLES
    counts = tables.peek(("tile counts", device, key))
    if counts is not None:
        tiles = tables.peek(("tile table", device, key))
        groups = tables.peek(("group table", device, key))
        if tiles is not None and groups is not None:
            return tiles, groups, counts[0], counts[1]
    starts, lengths, segs = layout()
    start = torch.as_tensor(starts, dtype=torch.int64, device="cpu")
    length = torch.as_tensor(lengths, dtype=torch.int64, device="cpu")
    n_tiles = (length + _TILE - 1) // _TILE
    end = torch.cumsum(n_tiles, 0)
    first = end - n_tiles
    owner = torch.repeat_interleave(torch.arange(len(lengths), device="cpu"), n_tiles)
    k = torch.arange(int(end[-1]) if len(lengths) else 0, device="cpu") - first[owner]
    tiles = torch.stack([start[owner] + k * _TILE, torch.clamp(length[owner] - k * _TILE, max=_TILE)], 1)
    groups = torch.stack([first, end, length, torch.as_tensor(segs, dtype=torch.int64, device="cpu")], 1)
    tables.put(("tile counts", device, key), (tiles.shape[0], groups.shape[0]))
    return (
        tables.get(("tile table", device, key), tiles.reshape(-1), torch.int64, device),
        tables.get(("group table", device, key), groups.reshape(-1), torch.int64, device),
        tiles.shape[0],
        groups.shape[0],
    )


def run_l1_sums(
    flat: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor, int, int], out: torch.Tensor,
    wide: torch.Tensor | None,
) -> None:  # fmt: skip
    """Stages 1 and 2 over ``flat`` with the :func:`group_tables` ``tables``: the sums (``wide`` None) or
    the quantizer's divisors and its per-segment float64-work flags ``wide`` into ``out``."""
    tiles, groups, n_tiles, n_groups = tables
    partial = torch.empty(max(n_tiles, 1), dtype=torch.float64, device=flat.device)
    with triton_launch.on_device(flat):
        if n_tiles:
            triton_launch.triton_module().abs_sum_tiles_kernel[(n_tiles,)](
                triton_launch.raw(flat),
                tiles,
                partial,
                BLOCK=_TILE_BLOCK,
                TILE_BLOCKS=_TILE_BLOCKS,
                KIND=triton_launch.TRITON_DTYPES[flat.dtype],
                **triton_launch.launch_options(),
            )
        triton_launch.triton_module().abs_sum_groups_kernel[(n_groups,)](
            partial,
            groups,
            out,
            out if wide is None else wide,
            _TINY32,
            _MAX32,
            math.inf,
            BLOCK=_GROUP_BLOCK,
            FINISH=wide is not None,
            **triton_launch.launch_options(),
        )


def l1_abs_sums(rows: torch.Tensor) -> torch.Tensor:
    """``Σ|x|`` of each row of ``rows`` (``[m, n]`` float32/bfloat16/float16 on Triton's device) in float64,
    float64 ``[m]``, in 2 launches and without a float64 copy; a row's bits depend on its own elements
    only (the fused quantizer's pass 1 sums a bucket's groups in the same order)."""
    m, n = rows.shape
    flat = rows.reshape(-1)
    out = torch.zeros(m, dtype=torch.float64, device=rows.device)
    if m and n:
        tables = group_tables(rows.device, ("rows", m, n), lambda: (range(0, m * n, n), [n] * m, [0] * m))
        run_l1_sums(flat, tables, out, None)
    return out
