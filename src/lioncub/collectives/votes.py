"""Vote algorithms: each combines the workers' local Lion directions into one update, identical on
every rank.

Every algorithm takes this rank's flat local tensor (the pre-sign update ``c_i``, or the gradient for
the dense baselines) and returns, through ``start(...).wait()``:

=====================  =========================================================  =====================
class                  wire                                                       result
=====================  =========================================================  =====================
:class:`OneBitVote`    votes ``c ≥ 0`` packed 8/byte; all-to-all of slices, local  ``int8`` ±1 (ties
                       count + tie rule, all-gather of packed slice results        alternate +1/−1)
:class:`LaneVote`      0/1 votes in p-bit lanes, uint8 allreduce SUM              ``sign(2·count − N)``
:class:`SignSumVote`   ``sign(c)`` as int8, allreduce SUM                          ``sign(Σ sign c_i)``
:class:`QuantizedVote` quantizer levels (int8, or offset p-bit lanes), SUM         ``sign(Σ q_i)``
:class:`AverageVote`   ``sign(c)`` as int8, allreduce SUM                          ``Σ sign c_i / N``
:class:`ServerVote`    packed votes to rank 0, count there, 2-bit (majority) or    majority or average
                       count lanes (average) sent back
:class:`DenseMean`     gradient in fp32/bf16/fp16, ÷N, allreduce SUM              the mean gradient
=====================  =========================================================  =====================

Exact zeros of ``c`` vote "+" wherever a vote is one bit (1-bit, lanes, server), as in the papers' code;
the int8 and quantized paths carry them as 0. With ``N = 1`` there is nothing to exchange and every
sign vote is ``sign(c)`` (plain Lion).

Fused CPU step (:mod:`lioncub.ops.native`): a vote's :meth:`~VoteAlgorithm.encoding` says what its first
step makes of ``c`` (votes in bit lanes, or ``sign(c)`` in int8); the optimizer then writes that payload
straight from the momentum and the gradient into :meth:`~VoteAlgorithm.payload` and passes it to
``start(..., encoded=)``, and :meth:`Pending.wait_raw` hands over the result before its decode (the packed
majority bits, or the integer sums whose sign is the vote) for an apply that decodes as it goes. Both give
the bits of the plain path.

Non-finite ``c`` (the optimizer skips such steps before voting) still gives a defined, in-range result:
a one-bit vote of NaN is "−" (``NaN ≥ 0`` is false) and of ±Inf is ±; ``sign(NaN)`` is 0 on the int8
paths and for ``N = 1``; a quantized vote abstains (levels 0) on a tensor or chunk holding NaN or ±Inf
(see :mod:`lioncub.ops.quantize`). :class:`DenseMean` is a mean and propagates NaN and Inf.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

from lioncub.collectives.base import Comm, Handle
from lioncub.ops import kernels, native, packing, quantize

__all__ = [
    "AverageVote",
    "DenseMean",
    "Encoding",
    "LaneVote",
    "OneBitVote",
    "Pending",
    "QuantizedVote",
    "RawResult",
    "ServerVote",
    "SignSumVote",
    "VoteAlgorithm",
    "auto_lane_bits",
]

# Quantizers that accept ``out=`` (write the levels straight into the exchange buffer).
_WRITES_INTO = frozenset({"l1", "l0", "linf", "lp"})


def auto_lane_bits(n_workers: int, max_lane_value: int = 1) -> int:
    """Narrowest lane width in (2, 4, 8) whose N-way SUM of values ≤ ``max_lane_value`` cannot overflow."""
    for bits in (2, 4, 8):
        if packing.lane_sum_fits(n_workers, bits, max_lane_value):
            return bits
    packing.require_lane_sum_fits(n_workers, 8, max_lane_value, what="bits='auto'")
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Encoding:
    """The payload a vote's first step makes of the local direction ``c`` (d elements), which the fused
    CPU direction kernels write straight from the momentum and the gradient.

    ``kind="lanes"``: the votes ``[c ≥ 0]`` in ``bits``-bit lanes, uint8 — ``bits=1`` as
    :func:`lioncub.ops.packing.pack_signs` (padding votes "+" up to a multiple of ``pad_to`` bits), wider
    lanes as :func:`lioncub.ops.packing.pack_lanes` (zero lanes up to a whole byte). ``kind="sign"``:
    ``sign(c)`` as int8 (NaN → 0). ``kind="scaled"`` (:class:`DenseMean`): the gradient itself, converted
    to the wire dtype and divided by ``bits`` (N), padded to a multiple of ``pad_to`` (N) elements."""

    kind: Literal["lanes", "sign", "scaled"]
    bits: int = 1
    pad_to: int = 8

    def numel(self, d: int) -> int:
        """Payload elements for d directions."""
        if self.kind == "scaled":
            return -(-d // self.pad_to) * self.pad_to
        if self.kind == "sign":
            return d
        if self.bits == 1:
            return -(-d // self.pad_to) * self.pad_to // 8
        return packing.packed_size(d, self.bits)

    @property
    def dtype(self) -> torch.dtype:
        return torch.int8 if self.kind == "sign" else torch.uint8


class RawResult(NamedTuple):
    """A vote's result before its decode (:meth:`Pending.wait_raw`), for an apply that decodes as it goes.

    ``kind="bits"``: ``data`` packed uint8, the update is +1 where a bit is set, −1 elsewhere;
    ``kind="sum"``: ``data`` int8, the update is its sign; ``kind="lanes"``: ``data`` uint8 of ``bits``-bit
    lanes (:func:`lioncub.ops.packing.pack_lanes`), the update of a lane holding v is ``table[v]``;
    ``kind="mean"``: ``data`` int8, the update is ``data / divisor`` in the parameter's dtype;
    ``kind="values"``: ``data`` is the mean gradient of the dense presets in the wire dtype."""

    kind: Literal["bits", "sum", "lanes", "mean", "values"]
    data: torch.Tensor
    bits: int = 1
    table: tuple[int, ...] = ()
    divisor: int = 1


def _once(fn: Any) -> Any:
    """``fn()`` evaluated on the first call only (the result is kept)."""
    box: list[Any] = []

    def call() -> Any:
        if not box:
            box.append(fn())
        return box[0]

    return call


@dataclass
class Pending:
    """A vote in flight. ``advance()`` runs the work between phases of a multi-phase vote and posts the
    next phase without waiting for it (call it on every pending vote before waiting on the first, so
    that phase 2 of one bucket overlaps the work of the next); ``wait()`` finishes and returns the
    aggregated update; ``wait_raw()`` (where ``raw`` is set) finishes and returns it before its decode, a
    :class:`RawResult`."""

    finish: Any  # Callable[[], torch.Tensor]
    value: torch.Tensor | None = None
    middle: Any = None  # Callable[[], None]: the between-phases step of a two-phase vote
    raw: Any = None  # Callable[[], RawResult] (kept after the first call), or None

    def advance(self) -> None:
        if self.middle is not None:
            middle, self.middle = self.middle, None
            middle()

    def wait(self) -> torch.Tensor:
        if self.value is None:
            self.advance()
            self.value = self.finish()
        return self.value

    def wait_raw(self) -> RawResult | None:
        if self.raw is None:
            return None
        self.advance()
        return self.raw()


class VoteAlgorithm(ABC):
    """One way to aggregate the workers' local directions. Subclasses document their wire format."""

    name: str = ""
    #: result dtype: "vote" → int8 in {−1, 0, +1}; "value" → floating (mean of signs or of gradients)
    result: Literal["vote", "value"] = "vote"

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._buffers: dict[tuple[Hashable, str], torch.Tensor] = {}

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def buffer(self, key: Hashable | None, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reusable scratch tensor (fresh when ``key`` is None); avoids page faults on large buckets."""
        device = self.comm.device
        if key is None:
            return torch.empty(numel, dtype=dtype, device=device)
        buf = self._buffers.get((key, name))
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[(key, name)] = buf
        return buf

    @abstractmethod
    def start(
        self,
        local: torch.Tensor,
        *,
        step: int,
        key: Hashable | None = None,
        segments: Sequence[int] | None = None,
        encoded: torch.Tensor | None = None,
    ) -> Pending:
        """Start aggregating ``local`` (1-D). ``step`` (≥ 1) drives the tie rule; ``key`` names the
        bucket (reusable buffers; buckets in flight at once need distinct keys); ``segments`` are the
        lengths of the parameter tensors in ``local`` (per-tensor quantizer normalisation); ``encoded``:
        the :meth:`encoding` of ``local`` already made (then ``local`` is only read for its length)."""

    def encoding(self) -> Encoding | None:
        """The payload :meth:`start` takes as ``encoded=`` instead of computing it from ``local``, or
        ``None`` (the vote needs ``c`` itself)."""
        return None

    def payload(self, key: Hashable | None, d: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The reusable buffer of :meth:`encoding` for a bucket of ``d`` elements (of ``dtype``)."""
        enc = self.encoding()
        if enc is None:
            raise ValueError(f"{self!r} takes no encoded payload")
        return self.buffer(key, "payload", enc.numel(d), enc.dtype)

    def wire_bytes(self, numel: int) -> tuple[float, float]:
        """(sent, received) bytes per rank for one ``start`` of ``numel`` elements (the formula)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(N={self.world_size})"


def _sign_int8(local: torch.Tensor) -> torch.Tensor:
    """``sign(local)`` as int8, NaN → 0 (casting a NaN ``torch.sign`` to int8 would be undefined)."""
    return torch.gt(local, 0).view(torch.int8) - torch.lt(local, 0).view(torch.int8)


def _sign_of_sum(total: torch.Tensor) -> torch.Tensor:
    return torch.sign(total).to(torch.int8)


def _signs_of(lane_values: range, scale: int, offset: int) -> tuple[int, ...]:
    """``sign(scale·v + offset)`` for every lane value v (a lookup table for :func:`packing.map_lanes`)."""
    return tuple((scale * v + offset > 0) - (scale * v + offset < 0) for v in lane_values)


# ----------------------------------------------------------------------------------------------- 1-bit


class OneBitVote(VoteAlgorithm):
    """Lion Cub's 1-bit compressed allreduce for the majority vote.

    1. votes ``b = [c ≥ 0]`` padded with "+" to a multiple of ``8·N``, packed 8 per byte, split in N
       slices; 2. all-to-all: rank r receives slice r of every worker; 3. rank r counts the "+" votes of
       its slice; a tie (``2·count = N``) becomes +1 on odd steps and −1 on even steps (the same on every
       rank); 4. the slice's result is packed and all-gathered. Result: ``int8`` ±1 (never 0).

    Bytes per rank: ``2·(N−1)/N · d_pad / 8`` (``d_pad``: d rounded up to a multiple of 8N).
    """

    name = "1bit"

    def encoding(self):
        return Encoding("lanes", 1, 8 * self.world_size) if self.world_size > 1 else None

    def start(self, local, *, step, key=None, segments=None, encoded=None):
        n = self.world_size
        d = local.numel()
        if n == 1:
            return Pending(lambda: _sign_int8(local))
        nbytes = -(-d // (8 * n)) * n  # padded bits / 8
        if encoded is None:
            packed = packing.pack_signs(local, pad_to=8 * n, out=self.payload(key, d))
        else:
            packed = encoded
        recv = self.buffer(key, "recv", nbytes, torch.uint8)
        slice_bytes = nbytes // n
        handle = self.comm.all_to_all(
            recv.view(n, slice_bytes), packed.view(n, slice_bytes), "1-bit all-to-all"
        )
        tie_positive = step % 2 == 1
        gathered = self.buffer(key, "gathered", nbytes, torch.uint8).view(n, slice_bytes)
        phase2: list[Handle] = []

        def middle() -> None:  # count this rank's slice, post the all-gather of its result
            handle.wait()
            rows = recv.view(n, slice_bytes)
            if kernels.backend_for(rows) != "torch":  # GPU, CPU: unpack, count, tie rule, repack in one pass
                mine = kernels.majority_pack(
                    rows, tie_positive, n_workers=n, out=self.buffer(key, "mine", slice_bytes, torch.uint8)
                )
            else:
                mine = packing.pack_majority(packing.count_votes(rows, slice_bytes * 8), n, tie_positive)
            phase2.append(self.comm.all_gather(gathered, mine, "1-bit all-gather"))

        @_once
        def raw() -> RawResult:
            phase2[0].wait()
            return RawResult("bits", gathered.view(-1))

        def finish() -> torch.Tensor:
            out = self.buffer(key, "result", d, torch.int8)
            return packing.unpack_signs(raw().data, d, torch.int8, out=out)

        return Pending(finish, middle=middle, raw=raw)

    def wire_bytes(self, numel):
        n = self.world_size
        padded = -(-numel // (8 * n)) * 8 * n
        each = (n - 1) / n * padded / 8
        return 2 * each, 2 * each


# ---------------------------------------------------------------------------------------- p-bit lanes


class LaneVote(VoteAlgorithm):
    """Majority vote of 0/1 votes summed in packed p-bit lanes (Lion Cub "4bit": p = 4).

    Each worker packs ``[c ≥ 0]`` into p-bit lanes (8/p per byte); a uint8 allreduce SUM leaves the count
    of "+" votes in each lane, which cannot carry into its neighbour while ``N ≤ 2^p − 1``; the update is
    ``sign(2·count − N)`` (ties stay 0; correct for odd N). ``bits="auto"`` takes the narrowest lane
    that fits N. Bytes per rank: ``2·(N−1)/N · d·p/8``.
    """

    name = "lanes"

    def __init__(self, comm: Comm, bits: int | Literal["auto"] = 4) -> None:
        super().__init__(comm)
        n = comm.world_size
        if bits == "auto":
            bits = 8 if n == 1 else auto_lane_bits(n)
        if bits not in (2, 4, 8):
            raise ValueError(f"bits={bits!r} for a lane vote must be 2, 4, 8 or 'auto'")
        packing.require_lane_sum_fits(n, bits, 1, what=f"{bits}-bit vote")
        self.bits = bits
        self.name = f"{bits}bit-vote"

    def encoding(self):
        return Encoding("lanes", self.bits) if self.world_size > 1 else None

    def start(self, local, *, step, key=None, segments=None, encoded=None):
        n, d = self.world_size, local.numel()
        if n == 1:
            return Pending(lambda: _sign_int8(local))
        if encoded is None:
            votes = torch.ge(local, 0).view(torch.uint8)
            lanes = packing.pack_lanes(votes, self.bits)
        else:
            lanes = encoded
        handle = self.comm.all_reduce(lanes, f"{self.bits}-bit vote allreduce")
        table = _signs_of(range(1 << self.bits), 2, -n)  # a lane counts "+" votes: sign(2·count − N)
        raw = _once(lambda: (handle.wait(), RawResult("lanes", lanes, self.bits, table))[1])
        return Pending(lambda: packing.map_lanes(raw().data, self.bits, d, table), raw=raw)

    def wire_bytes(self, numel):
        n = self.world_size
        each = 2 * (n - 1) / n * packing.packed_size(numel, self.bits)
        return each, each


class SignSumVote(VoteAlgorithm):
    """Direct allreduce of ``sign(c)`` in int8 and the sign of the sum (Lion Cub "8bit w/o L1").

    Exact zeros count 0 and ties stay 0. Needs ``N ≤ 127``. Bytes per rank: ``2·(N−1)/N · d``.
    """

    name = "int8-sign"

    def __init__(self, comm: Comm) -> None:
        super().__init__(comm)
        quantize.level_budget(comm.world_size, 8, "signed")  # raises beyond 127 workers

    def encoding(self):
        return Encoding("sign") if self.world_size > 1 else None

    def start(self, local, *, step, key=None, segments=None, encoded=None):
        signs = _sign_int8(local) if encoded is None else encoded
        if self.world_size == 1:
            return Pending(lambda: signs)
        handle = self.comm.all_reduce(signs, "int8 sign allreduce")
        raw = _once(lambda: RawResult("sum", handle.wait()))
        return Pending(lambda: _sign_of_sum(raw().data), raw=raw)

    def wire_bytes(self, numel):
        each = 2 * (self.world_size - 1) / self.world_size * numel
        return each, each


class AverageVote(SignSumVote):
    """Distributed Lion averaging: ``Σ_i sign(c_i) / N`` (values in {−1, −1+2/N, …, 1}) over an int8
    allreduce. Result: in the dtype of ``local``."""

    name = "dlion-avg"
    result = "value"

    def start(self, local, *, step, key=None, segments=None, encoded=None):
        signs = _sign_int8(local) if encoded is None else encoded
        n = self.world_size
        if n == 1:
            return Pending(lambda: signs.to(local.dtype))
        handle = self.comm.all_reduce(signs, "int8 sign allreduce (average)")
        raw = _once(lambda: RawResult("mean", handle.wait(), divisor=n))

        def finish() -> torch.Tensor:  # the sum / N, into a reused buffer (no fresh pages per step)
            out = self.buffer(key, "average", local.numel(), local.dtype)
            return out.copy_(raw().data).div_(n)

        return Pending(finish, raw=raw)


class QuantizedVote(VoteAlgorithm):
    """Lion Cub's quantized vote: ``sign(Σ_i Q(c_i))`` with integer levels summed without overflow.

    ``bits = 8``: signed int8 levels in ``[−s, s]``, ``s = ⌊127/N⌋`` (the paper's "Lion Cub (8bit)"
    with ``quantizer="l1"``). ``bits ∈ {2, 4}``: offset lanes ``q + s``, ``s = ⌊(2^p − 1)/(2N)⌋``,
    packed and summed as uint8. ``bits="auto"``: the narrowest of 2/4/8 that leaves at least one level.
    The normaliser is computed per parameter tensor (``segments``), as the authors' code, unless
    ``chunk_size`` is set. Bytes per rank: ``2·(N−1)/N · d·p/8``.
    """

    name = "quantized"

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
            bits = next((b for b in (2, 4, 8) if _budget(n, b, raise_error=False)), 8)
        if bits not in (2, 4, 8):
            raise ValueError(f"bits={bits!r} for a quantized vote must be 2, 4, 8 or 'auto'")
        self.bits = bits
        self.levels = _budget(n, bits)
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
        if n == 1:
            return Pending(lambda: _sign_of_sum(levels))
        if self.bits == 8:
            handle = self.comm.all_reduce(levels, f"int8 {self.quantizer} allreduce")
            raw = _once(lambda: RawResult("sum", handle.wait()))
            return Pending(lambda: _sign_of_sum(raw().data), raw=raw)
        lanes = packing.pack_lanes(packing.offset_encode(levels, self.levels), self.bits)
        handle = self.comm.all_reduce(lanes, f"{self.bits}-bit {self.quantizer} allreduce")
        table = _signs_of(range(1 << self.bits), 1, -n * self.levels)  # lane Σ(q_i + s) → sign(Σ q_i)
        raw = _once(lambda: (handle.wait(), RawResult("lanes", lanes, self.bits, table))[1])
        return Pending(lambda: packing.map_lanes(raw().data, self.bits, d, table), raw=raw)

    def wire_bytes(self, numel):
        each = 2 * (self.world_size - 1) / self.world_size * packing.packed_size(numel, self.bits)
        return each, each


def _budget(n: int, bits: int, raise_error: bool = True) -> int:
    try:
        return quantize.level_budget(n, bits, "signed" if bits == 8 else "offset")
    except ValueError:
        if raise_error:
            raise
        return 0


# ------------------------------------------------------------------------------------ parameter server


class ServerVote(VoteAlgorithm):
    """Distributed Lion's parameter server: every worker sends its packed 1-bit votes to ``root``,
    which counts them and sends back the majority (2-bit lanes holding ``u + 1``) or, for
    ``aggregation="average"``, the count (lanes wide enough for N) from which every rank forms
    ``(2·count − N)/N``. Root's ingress carries ``(N−1)·d/8`` bytes: the cost grows linearly with N.
    """

    name = "server"

    def __init__(
        self,
        comm: Comm,
        aggregation: Literal["majority", "average"] = "majority",
        root: int = 0,
    ) -> None:
        super().__init__(comm)
        if aggregation not in ("majority", "average"):
            raise ValueError(f"aggregation={aggregation!r} is not one of 'majority', 'average'")
        if not 0 <= root < comm.world_size:
            raise ValueError(f"root={root} must be a rank in [0, {comm.world_size})")
        self.aggregation = aggregation
        self.root = root
        self.result = "vote" if aggregation == "majority" else "value"
        self.down_bits = 2 if aggregation == "majority" else auto_lane_bits(comm.world_size + 1)
        self.name = f"server-{aggregation}"

    def _finish_local(self, local: torch.Tensor) -> torch.Tensor:
        if self.aggregation == "majority":
            return _sign_int8(local)
        return _sign_int8(local).to(local.dtype)

    def encoding(self):
        return Encoding("lanes", 1, 8) if self.world_size > 1 else None

    def start(self, local, *, step, key=None, segments=None, encoded=None):
        n, d, r = self.world_size, local.numel(), self.comm.rank
        if n == 1:
            return Pending(lambda: self._finish_local(local))
        up = packing.pack_signs(local) if encoded is None else encoded
        down = self.buffer(key, "down", packing.packed_size(d, self.down_bits), torch.uint8)
        if r == self.root:
            inbox = self.buffer(key, "inbox", n * up.numel(), torch.uint8).view(n, up.numel())
            inbox[r].copy_(up)
            handle = self.comm.exchange_p2p([], [(j, inbox[j]) for j in range(n) if j != r], "server gather")
        else:
            handle = self.comm.exchange_p2p([(self.root, up)], [], "server gather")

        majority = self.aggregation == "majority"

        @_once
        def receive() -> None:
            handle.wait()
            if r == self.root:
                if majority and kernels.backend_for(inbox, down) == "cpu":  # count, sign, lanes in one pass
                    native.server_majority(inbox, down, n_bits=d)
                else:
                    count = packing.count_votes(inbox, d).to(torch.int16)
                    lanes = (torch.sign(2 * count - n) + 1) if majority else count
                    down.copy_(packing.pack_lanes(lanes.to(torch.uint8), self.down_bits))
                self.comm.exchange_p2p([(j, down) for j in range(n) if j != r], [], "server broadcast").wait()
            else:
                self.comm.exchange_p2p([], [(self.root, down)], "server broadcast").wait()

        def finish() -> torch.Tensor:
            receive()
            lanes = packing.unpack_lanes(down, self.down_bits, d).to(torch.int16)
            if majority:
                return (lanes - 1).to(torch.int8)
            return (2 * lanes - n).to(local.dtype) / n

        if not majority:
            return Pending(finish)
        table = tuple(v - 1 for v in range(1 << self.down_bits))  # lanes hold u + 1
        raw = _once(lambda: (receive(), RawResult("lanes", down, self.down_bits, table))[1])
        return Pending(finish, raw=raw)

    def wire_bytes(self, numel):
        n = self.world_size
        up, down = packing.packed_size(numel, 1), packing.packed_size(numel, self.down_bits)
        if self.comm.rank == self.root:
            return (n - 1) * down, (n - 1) * up
        return up, down


# --------------------------------------------------------------------------------------- dense mean


class DenseMean(VoteAlgorithm):
    """The global-Lion baselines: gradients cast to ``wire_dtype`` and divided by N (as DDP's allreduce
    (fp32) and ``fp16_compress_hook`` / ``bf16_compress_hook``), summed, cast back.

    The sum is a reduce-scatter + all-gather built from an all-to-all (rank r receives slice r of every
    worker and adds the N slices **in rank order 0, 1, …, N−1** in ``wire_dtype``) rather than the backend's
    allreduce, whose summation order depends on where an element falls in the buffer: with it, the mean of
    N ≥ 3 floats changed in the last bit with the bucket layout. Here every element is
    ``((g_0/N + g_1/N) + g_2/N) + …`` whatever the bucketing, so the overlapped path (DDP's buckets) and the
    step's own buckets agree bit for bit. Bytes per rank: ``2·(N−1)/N · d_pad·size(wire_dtype)`` (``d_pad``:
    d rounded up to a multiple of N), as a ring allreduce. As DDP, NaN and ±Inf propagate, and values at
    the edge of or beyond the wire dtype's range (fp16: 65504) can become ±Inf.
    """

    name = "dense"
    result = "value"

    def __init__(self, comm: Comm, wire_dtype: torch.dtype | None = None) -> None:
        super().__init__(comm)
        if wire_dtype not in (None, torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"wire_dtype={wire_dtype} must be None, float32, bfloat16, float16 or float64")
        self.wire_dtype = wire_dtype
        self.name = {None: "dense", torch.float32: "32bit", torch.bfloat16: "16bit"}.get(wire_dtype, "dense")

    def encoding(self):
        n = self.world_size
        return Encoding("scaled", n, n) if n > 1 else None

    def payload(self, key, d, dtype=None):
        n = self.world_size
        return self.buffer(key, "send", -(-d // n) * n, self.wire_dtype or dtype or torch.float32)

    def start(self, local, *, step, key=None, segments=None, encoded=None):
        n, d = self.world_size, local.numel()
        if n == 1:  # nothing travels, nothing is rounded: plain Lion
            return Pending(lambda: local)
        dtype = self.wire_dtype or local.dtype
        piece = -(-d // n)  # elements of the slice each rank sums
        send = self.buffer(key, "send", n * piece, dtype)
        send[d:].zero_()
        if encoded is None:
            send[:d].copy_(local).div_(n)  # cast, then divide in the wire dtype, as DDP's hooks
        elif encoded.data_ptr() != send.data_ptr():
            raise ValueError("DenseMean: the encoded contribution must be written into payload()")
        recv = self.buffer(key, "recv", n * piece, dtype).view(n, piece)
        handle = self.comm.all_to_all(recv, send.view(n, piece), f"{self.name} gradient reduce-scatter")
        gathered = self.buffer(key, "gathered", n * piece, dtype).view(n, piece)
        phase2: list[Handle] = []

        def middle() -> None:  # this rank's slice: the N contributions added in rank order
            handle.wait()
            total = self.buffer(key, "total", piece, dtype).copy_(recv[0])
            for row in recv[1:]:
                total.add_(row)
            phase2.append(self.comm.all_gather(gathered, total, f"{self.name} gradient all-gather"))

        def finish() -> torch.Tensor:
            phase2[0].wait()
            return gathered.view(-1)[:d].to(local.dtype)

        def raw() -> RawResult:  # the mean in the wire dtype (a fused apply widens it as it reads)
            phase2[0].wait()
            return RawResult("values", gathered.view(-1)[:d])

        return Pending(finish, middle=middle, raw=raw)

    def wire_bytes(self, numel, dtype: torch.dtype = torch.float32):
        n = self.world_size
        padded = -(-numel // n) * n
        bits = torch.finfo(self.wire_dtype or dtype).bits
        each = 2 * (n - 1) / n * padded * bits / 8
        return each, each
