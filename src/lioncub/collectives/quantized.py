"""Lion Cub's quantized vote: the sign of the sum of the workers' integer levels (:class:`QuantizedVote`)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Literal

import torch

from lioncub import transports
from lioncub.collectives.base import Comm
from lioncub.collectives.formats import Decoded, LaneTable, SignOfSum
from lioncub.collectives.protocol import Pending
from lioncub.collectives.signvote import SignVote
from lioncub.ops import kernels, packing, quantize

__all__ = ["QuantizedVote"]

# Quantizers that accept ``out=`` (write the levels straight into the exchange buffer).
_WRITES_INTO = frozenset({"l1", "l0", "linf", "lp"})


class QuantizedVote(SignVote):
    """Lion Cub's quantized vote: ``sign(Σ_i Q(c_i))`` with integer levels summed without overflow.

    ``bits = 8``: signed int8 levels in ``[−s, s]``, ``s = ⌊127/N⌋`` (the paper's "Lion Cub (8bit)"
    with ``quantizer="l1"``), the sign of the int8 sum. ``bits ∈ {2, 4}``: offset lanes ``q + s``,
    ``s = ⌊(2^p − 1)/(2N)⌋``, packed and summed as uint8, read through a lane table. ``bits="auto"``: the
    narrowest of 2/4/8 that leaves at least one level (:func:`lioncub.transports.level_budget`). The
    normaliser is computed per parameter tensor (``segments``), as the authors' code, unless
    ``chunk_size`` is set. The quantizer needs ``c`` itself (no fused payload). Bytes per rank:
    ``2·(N−1)/N · d·p/8``.
    """

    name = "quantized"
    facts = transports.FACTS["quantized"]

    def __init__(
        self,
        comm: Comm,
        quantizer: str = "l1",
        bits: int | Literal["auto"] = 8,
        *,
        clip_multiple: float = 2.0,
        chunk_size: int | None = None,
        options: dict[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(comm)
        if quantizer not in quantize.QUANTIZERS:
            raise ValueError(f"quantizer={quantizer!r} is not one of {sorted(quantize.QUANTIZERS)}")
        n = comm.world_size
        if bits == "auto":
            bits = self.facts.lane_bits("auto", n) or 8
        if bits not in transports.LANE_WIDTHS:
            raise ValueError(f"bits={bits!r} for a quantized vote must be 2, 4, 8 or 'auto'")
        self.bits = bits
        self.levels = quantize.level_budget(n, bits, transports.quantized_encoding(bits))
        self.quantizer = quantizer
        self.options = dict(options or {})
        if quantizer not in ("sign", "qsgd", "log"):
            self.options.setdefault("clip_multiple", clip_multiple)
        if quantizer != "sign":
            self.options.setdefault("chunk_size", chunk_size)
        self.generator: torch.Generator | None = None
        if quantizer == "qsgd":
            self.generator = torch.Generator(device=comm.device)
            self.generator.manual_seed(seed * 1_000_003 + comm.rank)
            self.options["generator"] = self.generator
        self.name = f"{bits}bit-{quantizer}"

    def levels_of(
        self, local: torch.Tensor, segments: Sequence[int] | None, key: Hashable | None = None
    ) -> torch.Tensor:
        """This worker's integer levels (int8) for ``local``, normalised per segment (``key``: the bucket,
        whose level buffer the fused quantizer reuses)."""
        if (
            self.quantizer == "l1"
            and set(self.options) <= {"clip_multiple", "chunk_size"}
            and kernels.backend_for(local) != "torch"
        ):  # GPU (Triton), CPU (C): the fused quantizer (bit for bit the same levels)
            return kernels.quantize_l1(
                local,
                self.levels,
                clip_multiple=self.options["clip_multiple"],
                chunk_size=self.options["chunk_size"],
                segments=segments,
                out=self.buffer(key, "levels", local.numel(), quantize.level_dtype(self.levels)),
            )
        out = torch.empty(local.numel(), dtype=torch.int8, device=local.device)
        pos = 0
        for length in segments or [local.numel()]:
            piece, dst = local[pos : pos + length], out[pos : pos + length]
            if self.quantizer in _WRITES_INTO:
                quantize.quantize(self.quantizer, piece, self.levels, out=dst, **self.options)
            else:
                dst.copy_(quantize.quantize(self.quantizer, piece, self.levels, **self.options))
            pos += length
        if pos != local.numel():
            raise ValueError(f"segments add up to {pos}, but the tensor has {local.numel()} elements")
        return out

    def start(self, local, *, step, key=None, segments=None, encoded=None):
        n, d = self.world_size, local.numel()
        levels = self.levels_of(local, segments, key)
        if self.comm.alone:
            return Pending(lambda: Decoded(torch.sign(levels).to(torch.int8)))
        if self.bits == 8:
            handle = self.comm.all_reduce(levels, f"int8 {self.quantizer} allreduce")
            return Pending(lambda: SignOfSum(handle.tensor()))
        bits = int(self.bits or 8)  # 2 or 4 here (set in __init__)
        lanes = packing.pack_lanes(packing.offset_encode(levels, self.levels), bits)
        handle = self.comm.all_reduce(lanes, f"{bits}-bit {self.quantizer} allreduce")
        table = LaneTable.signs(range(1 << bits), 1, -n * self.levels)  # lane Σ(q_i + s) → sign(Σ q_i)
        return Pending(lambda: LaneTable(handle.tensor(), bits, table, d))
