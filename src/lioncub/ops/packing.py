"""Bit packing of small unsigned lanes into ``uint8`` and the lane-overflow rule.

Pure tensor functions (CPU and CUDA), no Python loop over elements.

* 1-bit: :func:`pack_bits` / :func:`unpack_bits` use the bit order of ``numpy.packbits(bitorder="big")``:
  element ``8·j + i`` is bit ``7 − i`` (MSB first) of byte ``j``. :func:`pack_signs` and
  :func:`unpack_signs` are the fast paths for Lion votes (``x ≥ 0`` → 1, exact zeros vote "+", NaN
  votes "−" on every device and dtype).
* p-bit lanes (p ∈ {1, 2, 4, 8}): :func:`pack_lanes` / :func:`unpack_lanes`, first element in the high
  lane of a byte (the same MSB-first order).
* Signed levels in ``[−s, s]`` travel as unsigned lanes ``q + s`` (:func:`offset_encode`), so a lane-wise
  integer SUM of N workers never borrows; :func:`offset_decode` subtracts ``N·s``.
* :func:`lane_sum_fits` says whether the lane-wise SUM of N workers can overflow its lane, which is the
  failure of packed-bit allreduces that sum bytes (a carry corrupts the neighbouring lane);
  :func:`require_lane_sum_fits` refuses such a sum. The rule, :func:`packed_size` and :data:`LANE_BITS` are
  :mod:`lioncub.transports`' (imported here).

Lengths need not be multiples of 8: packing pads with zero bits, unpacking takes the true length ``n``
and drops the padding.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from lioncub.transports import LANE_BITS, check_lane_bits, lane_sum_fits, max_lane_workers, packed_size

__all__ = [
    "LANE_BITS",
    "count_votes",
    "lane_sum_fits",
    "majority_signs",
    "map_lanes",
    "margin_signs",
    "max_lane_workers",
    "offset_decode",
    "offset_encode",
    "pack_bits",
    "pack_lanes",
    "pack_majority",
    "pack_signs",
    "packed_size",
    "require_lane_sum_fits",
    "unpack_bits",
    "unpack_lanes",
    "unpack_signs",
]

# Multiplying an int64 that holds eight 0/1 bytes (little-endian: element i in bits 8i..8i+7) by this
# constant moves byte i's bit to bit 63 − i; no other partial product reaches bits 56..63, and the ones
# below never carry into them, so ``(w * _GATHER) >> 56`` is the MSB-first packed byte.
_GATHER = 0x8040201008040201 - (1 << 64)  # as a signed int64
_LITTLE = sys.byteorder == "little"


def _gather_bytes(bits01: torch.Tensor) -> torch.Tensor:
    """``uint8``/``bool`` tensor of 0/1 values, length a multiple of 8 → packed ``uint8`` (MSB first)."""
    if _LITTLE and bits01.is_contiguous():
        words = bits01.view(torch.uint8).view(torch.int64)
        return words.mul_(_GATHER).bitwise_right_shift_(56).to(torch.uint8)
    # Portable path: weighted sum over the 8 bits of each byte.
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=bits01.device)
    return (bits01.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a 0/1 tensor (``bool`` or integer, any shape, flattened) into ``uint8``, MSB first.

    Args:
        bits: ``n`` values in {0, 1} (values other than 0 count as 1 for ``bool``; integer inputs must
            already be 0/1).
    Returns:
        ``uint8`` tensor of length ``ceil(n / 8)``, equal to ``numpy.packbits(bits, bitorder="big")``.
    """
    flat = bits.reshape(-1)
    n = flat.numel()
    nbytes = (n + 7) // 8
    buf = torch.zeros(nbytes * 8, dtype=torch.uint8, device=flat.device)
    buf[:n] = flat.to(torch.uint8) if flat.dtype != torch.bool else flat.view(torch.uint8)
    return _gather_bytes(buf)


def out_buffer(out: torch.Tensor | None, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``out`` checked to be a contiguous 1-D buffer of ``n`` elements of ``dtype``, or a new one."""
    if out is None:
        return torch.empty(n, dtype=dtype, device=device)
    if out.dtype != dtype or out.numel() != n or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of {n} elements, got {out.dtype} {tuple(out.shape)}"
        )
    return out.view(-1)


def pack_signs(
    x: torch.Tensor, *, pad_to: int = 8, out: torch.Tensor | None = None, zeros_vote_plus: bool = True
) -> torch.Tensor:
    """Pack the votes ``x ≥ 0`` of a real tensor into ``uint8`` (exact zeros vote "+"; with
    ``zeros_vote_plus=False`` the votes are ``x > 0``: zeros vote "−").

    Args:
        x: real tensor, any shape (flattened), any float or signed integer dtype. Callers check for
            non-finite values first, but the votes are defined: ``+Inf`` and ``−0.0`` vote "+",
            ``−Inf`` and NaN (of either sign bit) vote "−", as ``x ≥ 0`` says.
        pad_to: the packed length in bits is rounded up to a multiple of this (a multiple of 8);
            padding votes "+" so that it never creates a tie of its own.
        out: optional preallocated ``uint8`` result (reusing it avoids page faults on large tensors).
    Returns:
        ``uint8`` tensor of ``ceil(n / pad_to) · pad_to / 8`` bytes.
    """
    if pad_to <= 0 or pad_to % 8:
        raise ValueError(f"pad_to={pad_to} must be a positive multiple of 8")
    flat = x.reshape(-1)
    n = flat.numel()
    nbytes = -(-n // pad_to) * pad_to // 8
    out = out_buffer(out, nbytes, torch.uint8, flat.device)
    full = n // 8 * 8  # elements that fill whole bytes
    vote = torch.ge if zeros_vote_plus else torch.gt
    if full and _numpy_path(flat) and flat.dtype in _NUMPY_VOTE:
        _pack_signs_numpy(flat[:full], out[: full // 8], zeros_vote_plus)
    elif full:
        out[: full // 8] = _gather_bytes(vote(flat[:full], 0))
    tail = torch.ones((nbytes - full // 8) * 8, dtype=torch.bool, device=flat.device)
    if tail.numel():
        vote(flat[full:], 0, out=tail[: n - full])
        out[full // 8 :] = _gather_bytes(tail)
    return out


def _numpy_path(t: torch.Tensor) -> bool:
    """Whether ``t`` takes the numpy (CPU) kernels; the torch kernels serve every other device."""
    return t.device.type == "cpu"


# Elements per cache-sized piece in the CPU loops (a multiple of 8).
_PIECE = 1 << 18

# CPU dtypes whose votes numpy computes with SIMD kernels: the view dtype and whether to test raw bits.
_NUMPY_VOTE = {
    torch.float32: (torch.float32, False),
    torch.float64: (torch.float64, False),
    torch.float16: (torch.float16, False),
    torch.bfloat16: (torch.int16, True),  # numpy has no bfloat16: compare the raw bits (as uint16)
}

# bfloat16 bits (as uint16) of +Inf and −0.0: x ≥ 0 exactly for bits ≤ +Inf (+0 … +Inf) and for −0.0;
# positive NaNs (0x7F81 … 0x7FFF) lie above +Inf, so they vote "−" like ``torch.ge`` says.
_BF16_POS_INF, _BF16_NEG_ZERO = 0x7F80, 0x8000


def _pack_signs_numpy(flat: torch.Tensor, out: torch.Tensor, zeros_vote_plus: bool = True) -> None:
    """CPU fast path: numpy's vectorised compare and ``packbits`` over cache-sized pieces."""
    view_dtype, raw_bits = _NUMPY_VOTE[flat.dtype]
    src = flat.contiguous().view(view_dtype).numpy()
    if raw_bits:
        src = src.view(np.uint16)
    dst = out.numpy()
    bits = np.empty(min(_PIECE, src.size), dtype=bool)
    for c0 in range(0, src.size, _PIECE):
        c1 = min(c0 + _PIECE, src.size)
        b = bits[: c1 - c0]
        if raw_bits:
            np.less_equal(src[c0:c1], _BF16_POS_INF, out=b)
            if zeros_vote_plus:
                b |= src[c0:c1] == _BF16_NEG_ZERO
            else:
                b &= src[c0:c1] != 0  # +0.0 (−0.0 lies above +Inf as bits: already "−")
        elif zeros_vote_plus:
            np.greater_equal(src[c0:c1], 0, out=b)
        else:
            np.greater(src[c0:c1], 0, out=b)
        dst[c0 // 8 : c1 // 8] = np.packbits(b, bitorder="big")


def _spread_table(device: torch.device, signed: bool) -> torch.Tensor:
    """int64[256]: for byte value v, eight bytes (address order); byte i is bit 7−i of v as 0/1, or as
    int8 −1/+1 when ``signed``."""
    key = (device, signed)
    table = _SPREAD_CACHE.get(key)
    if table is None:
        v = torch.arange(256, dtype=torch.int64)
        shifts = torch.arange(7, -1, -1, dtype=torch.int64)
        bitmat = (v[:, None] >> shifts) & 1  # [256, 8], column i = bit 7-i
        zero = 0xFF if signed else 0  # a 0 bit becomes 0xFF = int8 −1 (signs) or 0 (bits)
        byte_vals = torch.where(bitmat.bool(), 1, zero).to(torch.int64)
        if not _LITTLE:
            raise NotImplementedError("unpacking is implemented for little-endian hosts only")
        table = (byte_vals << (8 * torch.arange(8, dtype=torch.int64))).sum(dim=1)  # little-endian words
        table = table.to(device)
        _SPREAD_CACHE[key] = table
    return table


_SPREAD_CACHE: dict[tuple[torch.device, bool], torch.Tensor] = {}


def _spread(packed: torch.Tensor, n: int, signed: bool, out: torch.Tensor) -> torch.Tensor:
    """Look up eight output values per packed byte into ``out`` (length ``n``, any real dtype)."""
    packed = packed.reshape(-1)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    if n < 0 or n > packed.numel() * 8:
        raise ValueError(f"n={n} does not fit in {packed.numel()} packed bytes")
    table = _spread_table(packed.device, signed)
    nbytes = (n + 7) // 8
    piece = _PIECE // 8 if packed.device.type == "cpu" else max(nbytes, 1)
    index = torch.empty(min(piece, nbytes), dtype=torch.int64, device=packed.device)
    words = torch.empty(min(piece, nbytes), dtype=torch.int64, device=packed.device)
    for b0 in range(0, nbytes, piece):
        b1 = min(b0 + piece, nbytes)
        idx = index[: b1 - b0].copy_(packed[b0:b1])
        w = torch.index_select(table, 0, idx, out=words[: b1 - b0])
        e0, e1 = b0 * 8, min(b1 * 8, n)
        out[e0:e1].copy_(w.view(torch.int8)[: e1 - e0])
    return out


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``uint8`` bytes → ``bool`` tensor of length ``n``."""
    out = torch.empty(max(n, 0), dtype=torch.uint8, device=packed.device)
    return _spread(packed, n, False, out).view(torch.bool)


def unpack_signs(
    packed: torch.Tensor, n: int, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Packed votes → ±1 of length ``n`` in ``dtype`` (bit 1 → +1, bit 0 → −1).

    ``out``: optional preallocated result of ``n`` elements of ``dtype`` (avoids page faults).
    """
    out = out_buffer(out, max(n, 0), dtype, packed.device)
    return _spread(packed, n, True, out)  # table bytes 0x01 / 0xFF are int8 +1 / −1


def pack_lanes(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned lanes of ``bits`` bits (values in ``[0, 2**bits − 1]``) into ``uint8``.

    The first element goes into the highest lane of the first byte. ``bits = 8`` returns the values as
    ``uint8``; ``bits = 1`` equals :func:`pack_bits`. Values are not range-checked here (callers encode
    them); out-of-range values would bleed into the neighbouring lane.
    """
    check_lane_bits(bits)
    flat = values.reshape(-1)
    if bits == 8:
        return flat.to(torch.uint8)
    if bits == 1:
        return pack_bits(flat)
    per_byte = 8 // bits
    n = flat.numel()
    nbytes = (n + per_byte - 1) // per_byte
    buf = torch.zeros(nbytes * per_byte, dtype=torch.uint8, device=flat.device)
    buf[:n] = flat
    lanes = buf.view(nbytes, per_byte)
    out = lanes[:, 0] << (8 - bits)
    for i in range(1, per_byte):
        out |= lanes[:, i] << (8 - bits * (i + 1))
    return out


def unpack_lanes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_lanes`: ``uint8`` → ``uint8`` lane values of length ``n``."""
    check_lane_bits(bits)
    packed = packed.reshape(-1)
    per_byte = 8 // bits
    if n < 0 or n > packed.numel() * per_byte:
        raise ValueError(f"n={n} lanes do not fit in {packed.numel()} bytes of {bits}-bit lanes")
    if bits == 8:
        return packed[:n].to(torch.uint8)
    if bits == 1:
        return unpack_bits(packed, n).view(torch.uint8)
    nbytes = (n + per_byte - 1) // per_byte
    shifts = torch.arange(8 - bits, -1, -bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    lanes = (packed[:nbytes, None] >> shifts) & mask
    return lanes.reshape(-1)[:n]


def offset_encode(levels: torch.Tensor, max_level: int) -> torch.Tensor:
    """Signed levels in ``[−s, s]`` → unsigned lanes ``q + s`` in ``[0, 2s]`` (``uint8``, s ≤ 127)."""
    if not 0 <= max_level <= 127:
        raise ValueError(f"max_level={max_level} must be in [0, 127] for uint8 lanes")
    return (levels.to(torch.int16) + max_level).to(torch.uint8)


def offset_decode(lane_sums: torch.Tensor, n_workers: int, max_level: int) -> torch.Tensor:
    """Lane-wise sums of N offset-encoded lanes → the signed sum ``Σ q_i`` as ``int16``."""
    return lane_sums.to(torch.int16) - n_workers * max_level


def require_lane_sum_fits(n_workers: int, bits: int, max_lane_value: int, *, what: str = "lane") -> None:
    """Raise ``ValueError`` naming the limit when a lane-wise SUM of N workers could overflow."""
    if not lane_sum_fits(n_workers, bits, max_lane_value):
        limit = max_lane_workers(bits, max_lane_value) if max_lane_value >= 1 else 0
        raise ValueError(
            f"{what}: a {bits}-bit lane summed over {n_workers} workers can overflow "
            f"({n_workers} x {max_lane_value} > {(1 << bits) - 1}); {bits}-bit lanes with values up to "
            f"{max_lane_value} support at most {limit} workers - use wider lanes (bits='auto')"
        )


def count_votes(rows: torch.Tensor, n_bits: int) -> torch.Tensor:
    """Per bit position, the number of 1 bits across the rows of ``rows``.

    Args:
        rows: ``uint8 [N, B]``, each row MSB-first packed votes (:func:`pack_signs`/:func:`pack_bits`).
        n_bits: bit positions to count (≤ 8·B).
    Returns:
        ``uint8`` (N ≤ 255) or ``int16`` counts of length ``n_bits``.
    """
    n = rows.shape[0]
    if n_bits > rows.shape[1] * 8:
        raise ValueError(f"n_bits={n_bits} does not fit in rows of {rows.shape[1]} bytes")
    wide = n > 255
    if _numpy_path(rows):  # numpy's unpackbits and adds are vectorised
        src = rows.contiguous().numpy()
        counts = np.unpackbits(src[0], count=n_bits).astype(np.int16 if wide else np.uint8)
        for j in range(1, n):
            counts += np.unpackbits(src[j], count=n_bits)
        return torch.from_numpy(counts)
    bits = unpack_bits(rows.reshape(-1), rows.numel() * 8).view(n, -1)[:, :n_bits]
    return bits.sum(dim=0, dtype=torch.int16 if wide else torch.uint8)


def pack_majority(counts: torch.Tensor, n_workers: int, tie_positive: bool) -> torch.Tensor:
    """Packed result bits of a vote: 1 where ``2·count > N`` or, on a tie, where ``tie_positive``."""
    threshold = (n_workers + 1) // 2 if tie_positive else n_workers // 2 + 1  # smallest count that wins
    if _numpy_path(counts):
        return torch.from_numpy(np.packbits(counts.numpy() >= threshold, bitorder="big"))
    return pack_bits(counts >= threshold)


def majority_signs(counts: torch.Tensor, n_workers: int, tie_positive: bool) -> torch.Tensor:
    """int8 ±1 per element of a vote's ``counts`` (integers in ``[0, N]``): +1 where ``2·count > N`` or, on
    a tie, where ``tie_positive`` (as :func:`pack_majority`, unpacked). One comparison and two int8 passes."""
    threshold = (n_workers + 1) // 2 if tie_positive else n_workers // 2 + 1  # smallest count that wins
    return torch.ge(counts, threshold).to(torch.int8).mul_(2).sub_(1)


def margin_signs(counts: torch.Tensor, n_workers: int) -> torch.Tensor:
    """int8 ``sign(2·count − N)`` per element of ``counts`` (integers in ``[0, N]``), 0 at a tie:
    ``[count > ⌊N/2⌋] − [count < ⌈N/2⌉]``."""
    above = torch.gt(counts, n_workers // 2).to(torch.int8)
    return above.sub_(torch.lt(counts, (n_workers + 1) // 2).view(torch.int8))


def _lane_table(bits: int, values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A 256-entry table: for each byte, its 8/bits lanes mapped through ``values`` as int8, packed
    little-endian into one integer of 8·(8/bits) bits."""
    key = (bits, values, device)
    table = _LANE_TABLES.get(key)
    if table is None:
        if not all(-128 <= v <= 127 for v in values):
            raise ValueError(f"values must be int8 (in [-128, 127]), got {values}")
        per = 8 // bits
        lanes = unpack_lanes(torch.arange(256, dtype=torch.uint8), bits, 256 * per).view(256, per)
        mapped = torch.tensor(values, dtype=torch.int64)[lanes.long()] & 0xFF  # int8 bytes
        word = (mapped << (8 * torch.arange(per, dtype=torch.int64))).sum(dim=1)
        dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[per]
        if per < 8:  # reinterpret the low 8·per bits as a signed integer (int64 words wrap already)
            word = word - (word >= (1 << (8 * per - 1))).to(torch.int64) * (1 << (8 * per))
        table = word.to(dtype)
        table = table.to(device)
        _LANE_TABLES[key] = table
    return table


_LANE_TABLES: dict[tuple[int, tuple[int, ...], torch.device], torch.Tensor] = {}


def map_lanes(packed: torch.Tensor, bits: int, n: int, values: tuple[int, ...]) -> torch.Tensor:
    """Unpack ``n`` lanes of ``bits`` bits and map each lane value v to ``values[v]`` (int8), in one
    table lookup per byte: e.g. summed vote counts straight to ``sign(2·count − N)``."""
    check_lane_bits(bits)
    if len(values) != 1 << bits:
        raise ValueError(f"values must have {1 << bits} entries for {bits}-bit lanes, got {len(values)}")
    packed = packed.reshape(-1)
    per = 8 // bits
    if n < 0 or n > packed.numel() * per:
        raise ValueError(f"n={n} lanes do not fit in {packed.numel()} bytes of {bits}-bit lanes")
    table = _lane_table(bits, tuple(values), packed.device)
    nbytes = (n + per - 1) // per
    words = table.index_select(0, packed[:nbytes].to(torch.int64))
    return words.view(torch.int8)[:n]
