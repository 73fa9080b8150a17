"""The Triton kernels of :mod:`lioncub.ops.kernels` (the L1 quantizer's second pass, the 1-bit majority,
the apply from int8 votes), with the arithmetic helpers that make them round as torch does (see the
:mod:`lioncub.ops.kernels` module docstring). ``HAVE_TRITON`` is False where Triton is not importable; the
kernels then do not exist and :mod:`lioncub.ops.kernels` takes its other backends.
"""

from __future__ import annotations

__all__ = [
    "HAVE_TRITON",
    "TRITON_ERROR",
    "abs_sum_groups_kernel",
    "abs_sum_tiles_kernel",
    "apply_kernel",
    "apply_multi_kernel",
    "lion_kernel",
    "majority_kernel",
    "quantize_kernel",
]

try:  # the torch backend serves everything when Triton is missing or broken
    import triton
    import triton.language as tl

    HAVE_TRITON = True
    TRITON_ERROR = ""
except Exception as _err:  # ImportError, or an install whose import fails
    triton = None
    tl = None
    HAVE_TRITON = False
    TRITON_ERROR = f"{type(_err).__name__}: {_err}"


if HAVE_TRITON:

    @triton.jit
    def _load_f32(ptr, offs, mask, KIND: tl.constexpr):
        if KIND == 1:  # bfloat16 stored as int16 bits: widen exactly
            v = tl.load(ptr + offs, mask=mask, other=0)
            return (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            return tl.load(ptr + offs, mask=mask, other=0).to(tl.float32)

    @triton.jit
    def _bf16_bits(x):
        """float32 → bfloat16 bits (int32 in [0, 65535]), round half to even, NaN → 0x7FC0."""
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return tl.where(x != x, 0x7FC0, r.to(tl.int32))

    @triton.jit
    def _round(x, KIND: tl.constexpr):
        """Round a float32 value to the storage dtype and back (exact), as a torch op's output does."""
        if KIND == 1:
            return (_bf16_bits(x) << 16).to(tl.float32, bitcast=True)
        elif KIND == 2:
            return x.to(tl.float16).to(tl.float32)
        else:
            return x

    @triton.jit
    def _store_f32(ptr, offs, x, mask, KIND: tl.constexpr):
        """Store an already rounded float32 value in the storage dtype (exact)."""
        if KIND == 1:
            tl.store(ptr + offs, (x.to(tl.int32, bitcast=True) >> 16).to(tl.int16), mask=mask)
        elif KIND == 2:
            tl.store(ptr + offs, x.to(tl.float16), mask=mask)
        else:
            tl.store(ptr + offs, x, mask=mask)

    @triton.jit
    def _fma(a, b, c, EMULATE: tl.constexpr):
        """float32 ``a·b + c`` rounded once: ``tl.fma`` compiled, an exact emulation when EMULATE."""
        if EMULATE:
            p = a.to(tl.float64) * b  # exact (b: a float32 scalar)
            c64 = c.to(tl.float64)
            s = p + c64
            bb = s - p  # TwoSum: p + c64 == s + e exactly
            aa = s - bb
            e = (p - aa) + (c64 - bb)
            bits = s.to(tl.int64, bitcast=True)
            finite = (s - s) == 0
            fix = finite & (e != 0) & ((bits & 1) == 0)  # round to odd: move to the odd neighbour
            step = tl.where((e > 0) == (s > 0), 1, -1).to(tl.int64)
            bits = tl.where(fix, bits + step, bits)
            return bits.to(tl.float64, bitcast=True).to(tl.float32)
        else:
            return tl.fma(a, b, c)

    @triton.jit
    def abs_sum_tiles_kernel(
        x_ptr, tiles_ptr, partial_ptr, BLOCK: tl.constexpr, TILE_BLOCKS: tl.constexpr, KIND: tl.constexpr
    ):
        """Pass 1 of the L1 quantizer, stage 1: ``partial[t] = Σ|x|`` over tile t in float64 (tiles: int64
        ``[T, 2]`` start and length, ≤ BLOCK·TILE_BLOCKS elements, laid out from each group's start, so
        that a group's sum does not depend on where it lies). Lane i adds elements i, i + BLOCK, ... in
        order, then the lanes are summed (Triton's fixed reduction tree): the same order at every call."""
        pid = tl.program_id(0).to(tl.int64)
        start = tl.load(tiles_ptr + 2 * pid)
        length = tl.load(tiles_ptr + 2 * pid + 1)
        acc = tl.zeros([BLOCK], dtype=tl.float64)
        for k in tl.static_range(TILE_BLOCKS):
            offs = k * BLOCK + tl.arange(0, BLOCK)
            mask = offs < length
            acc += tl.abs(_load_f32(x_ptr, start + offs, mask, KIND)).to(tl.float64)
        tl.store(partial_ptr + pid, tl.sum(acc, axis=0))

    @triton.jit
    def abs_sum_groups_kernel(
        partial_ptr,
        groups_ptr,
        out_ptr,
        wide_ptr,
        tiny,
        huge,
        inf,
        BLOCK: tl.constexpr,
        FINISH: tl.constexpr,
    ):
        """Stage 2: per group g (groups: int64 ``[G, 4]``: first tile, end tile, length, segment), the sum
        of its tiles' partials in float64 (lane i adds partials i, i + BLOCK, ... in order, then the lanes);
        FINISH: the L1 divisor of :func:`lioncub.ops.quantize.l1_divisors` (``mean = sum / length``; 1
        where it is 0, +Inf where it is not finite) and, where it is no normal float32 (``< tiny`` or a
        finite ``> huge``), 1 in ``wide[segment]`` (an atomic max: the same result in any order); else
        the sum."""
        g = tl.program_id(0).to(tl.int64)
        t0 = tl.load(groups_ptr + 4 * g)
        t1 = tl.load(groups_ptr + 4 * g + 1)
        acc = tl.zeros([BLOCK], dtype=tl.float64)
        for k in range(0, t1 - t0, BLOCK):
            offs = t0 + k + tl.arange(0, BLOCK)
            acc += tl.load(partial_ptr + offs, mask=offs < t1, other=0.0)
        total = tl.sum(acc, axis=0)
        if FINISH:
            length = tl.load(groups_ptr + 4 * g + 2)
            mean = total / length.to(tl.float64)
            finite = (mean - mean) == 0  # false for NaN and ±Inf
            d = tl.where(finite, tl.where(mean > 0, mean, 1.0), inf)
            wide = (d < tiny) | ((d > huge) & (d < inf))
            tl.store(out_ptr + g, d)
            seg = tl.load(groups_ptr + 4 * g + 3)
            tl.atomic_max(wide_ptr + seg, wide.to(tl.int32), mask=wide)
        else:
            tl.store(out_ptr + g, total)

    @triton.jit
    def quantize_kernel(
        x_ptr,
        out_ptr,
        divisor_ptr,
        scale_ptr,
        wide_ptr,
        seg_start_ptr,
        group_base_ptr,
        n,
        n_seg,
        chunk,
        levels,
        BLOCK: tl.constexpr,
        KIND: tl.constexpr,
        SEARCH: tl.constexpr,
        CHUNKED: tl.constexpr,
        ANY_WIDE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        seg = tl.zeros([BLOCK], dtype=tl.int32)
        for k in tl.static_range(SEARCH):  # binary search: the last segment start <= offs
            cand = seg + (1 << (SEARCH - 1 - k))
            ok = cand < n_seg
            start = tl.load(seg_start_ptr + cand, mask=ok & mask, other=0)
            seg = tl.where(ok & (start <= offs), cand, seg)
        group = tl.load(group_base_ptr + seg, mask=mask, other=0).to(tl.int64)
        if CHUNKED:
            local = offs - tl.load(seg_start_ptr + seg, mask=mask, other=0)
            group += local // chunk
        d = tl.load(divisor_ptr + group, mask=mask, other=1.0)  # float64: M, 1 (all zeros) or +Inf
        scale = tl.load(scale_ptr)  # float64 levels / k
        x = _load_f32(x_ptr, offs, mask, KIND)
        t = tl.math.div_rn(x, d.to(tl.float32)) * scale.to(tl.float32)  # (x / M) · (s / k), as the torch path
        t = tl.where(t != t, 0.0, t)
        t = tl.minimum(tl.maximum(t, -levels), levels)  # levels: float32, integral
        q = (t + 12582912.0) - 12582912.0  # round half to even (|t| <= 2^22)
        if ANY_WIDE:  # float64 work for segments with a normaliser that is no normal float32
            wide = tl.load(wide_ptr + seg, mask=mask, other=0) != 0
            if tl.max(wide.to(tl.int32), axis=0) > 0:  # only blocks holding such a chunk pay for it
                t64 = (x.to(tl.float64) / d) * scale
                t64 = tl.where(t64 != t64, 0.0, t64)
                t64 = tl.minimum(tl.maximum(t64, -levels), levels)
                q64 = (t64 + 6755399441055744.0) - 6755399441055744.0
                q = tl.where(wide, q64.to(tl.float32), q)  # integral, |q| <= 2^22: exact
        tl.store(out_ptr + offs, q.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _bump(c, carry):
        """One bit plane of a bit-sliced counter plus a carry word: (sum bit, carry out), 32 lanes at once."""
        return c ^ carry, c & carry

    @triton.jit
    def _borrow(c, b, ones, threshold, j: tl.constexpr):
        """Bit plane ``j`` of ``count − threshold``: the borrow out of it, given the borrow ``b`` into it
        (``ones``: all bits set; ``c ^ ones`` is ``~c``, which the interpreter cannot take on uint32)."""
        t = ((threshold >> j) & 1) != 0
        return tl.where(t, (c ^ ones) | b, (c ^ ones) & b)

    @triton.jit
    def _row_word(base, w, wmask, out_bytes, WORDS: tl.constexpr):
        """A row's 32-bit words ``w`` from ``base`` (its start): one load per word where ``WORDS`` (int32
        rows), else 4 byte loads OR-ed into a word (little-endian, as GPUs and x86 load them)."""
        if WORDS:
            v = tl.load(base + w, mask=wmask, other=0).to(tl.uint32, bitcast=True)
        else:
            at = base + w * 4
            v = tl.load(at, mask=wmask, other=0).to(tl.uint32)
            v |= tl.load(at + 1, mask=w * 4 + 1 < out_bytes, other=0).to(tl.uint32) << 8
            v |= tl.load(at + 2, mask=w * 4 + 2 < out_bytes, other=0).to(tl.uint32) << 16
            v |= tl.load(at + 3, mask=w * 4 + 3 < out_bytes, other=0).to(tl.uint32) << 24
        return v

    @triton.jit
    def _add_word(
        c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, v, PLANES: tl.constexpr
    ):  # fmt: skip
        """The bit-sliced counters ``c0..c15`` plus the row word ``v``: a ripple carry over the first
        ``PLANES`` planes (2 bitwise ops per plane for 32 bits); the planes above are returned as they are."""
        c0, carry = _bump(c0, v)
        if PLANES > 1:
            c1, carry = _bump(c1, carry)
        if PLANES > 2:
            c2, carry = _bump(c2, carry)
        if PLANES > 3:
            c3, carry = _bump(c3, carry)
        if PLANES > 4:
            c4, carry = _bump(c4, carry)
        if PLANES > 5:
            c5, carry = _bump(c5, carry)
        if PLANES > 6:
            c6, carry = _bump(c6, carry)
        if PLANES > 7:
            c7, carry = _bump(c7, carry)
        if PLANES > 8:
            c8, carry = _bump(c8, carry)
        if PLANES > 9:
            c9, carry = _bump(c9, carry)
        if PLANES > 10:
            c10, carry = _bump(c10, carry)
        if PLANES > 11:
            c11, carry = _bump(c11, carry)
        if PLANES > 12:
            c12, carry = _bump(c12, carry)
        if PLANES > 13:
            c13, carry = _bump(c13, carry)
        if PLANES > 14:
            c14, carry = _bump(c14, carry)
        if PLANES > 15:
            c15, carry = _bump(c15, carry)
        return c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15

    @triton.jit
    def _wins(c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, ones, threshold):
        """The bits whose count (planes ``c0..c15``) is ≥ ``threshold``: no borrow out of the bit-sliced
        ``count − threshold`` over the 16 planes (the unused ones are 0)."""
        borrow = ones ^ ones  # zero
        borrow = _borrow(c0, borrow, ones, threshold, 0)
        borrow = _borrow(c1, borrow, ones, threshold, 1)
        borrow = _borrow(c2, borrow, ones, threshold, 2)
        borrow = _borrow(c3, borrow, ones, threshold, 3)
        borrow = _borrow(c4, borrow, ones, threshold, 4)
        borrow = _borrow(c5, borrow, ones, threshold, 5)
        borrow = _borrow(c6, borrow, ones, threshold, 6)
        borrow = _borrow(c7, borrow, ones, threshold, 7)
        borrow = _borrow(c8, borrow, ones, threshold, 8)
        borrow = _borrow(c9, borrow, ones, threshold, 9)
        borrow = _borrow(c10, borrow, ones, threshold, 10)
        borrow = _borrow(c11, borrow, ones, threshold, 11)
        borrow = _borrow(c12, borrow, ones, threshold, 12)
        borrow = _borrow(c13, borrow, ones, threshold, 13)
        borrow = _borrow(c14, borrow, ones, threshold, 14)
        borrow = _borrow(c15, borrow, ones, threshold, 15)
        return borrow ^ ones

    @triton.jit
    def _store_bytes(out_ptr, byte, bmask, win, shift, n_bits):
        """The 4 bytes of each word of ``win`` at byte indices ``byte`` ``[BLOCK_W, 4]``; bits at positions
        ≥ ``n_bits`` are 0."""
        out = (win[:, None] >> shift[None, :]) & 0xFF
        valid = tl.minimum(tl.maximum(n_bits - byte * 8, 0), 8)  # bits of each byte below n_bits
        keep = (0xFF00 >> valid) & 0xFF  # MSB first: the top `valid` bits
        tl.store(out_ptr + byte, (out & keep.to(tl.uint32)).to(tl.uint8), mask=bmask)

    @triton.jit
    def majority_kernel(
        rows_ptr,
        out_ptr,
        n_rows,
        row_stride,
        out_bytes,
        n_bits,
        threshold,
        BLOCK_W: tl.constexpr,
        PLANES: tl.constexpr,
        WORDS: tl.constexpr,
    ):
        """Majority of ``n_rows`` packed rows over ``BLOCK_W`` 32-bit words (4·BLOCK_W bytes) per program.

        Counts bit-sliced: plane ``c_j`` holds bit j of the 32 per-bit counts of a word, so adding a row
        word is a ripple carry over the planes (:func:`_add_word`), and ``count ≥ threshold`` is the borrow
        out of a bit-sliced subtraction (:func:`_wins`). ``WORDS``: the rows are int32 words (row length a
        multiple of 4 bytes, aligned; ``row_stride`` in words), one load per 4 bytes; else uint8
        (``row_stride`` in bytes), 4 byte loads OR-ed into a word (:func:`_row_word`). Bits at positions
        ≥ ``n_bits`` are 0.
        """
        pid = tl.program_id(0)
        w = pid.to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)  # word index
        lane = tl.arange(0, 4)
        byte = w[:, None] * 4 + lane[None, :]  # [BLOCK_W, 4] byte index
        bmask = byte < out_bytes
        wmask = w * 4 < out_bytes
        shift = (lane * 8).to(tl.uint32)
        zero = tl.zeros([BLOCK_W], dtype=tl.uint32)
        ones = tl.full([BLOCK_W], 0xFFFFFFFF, tl.uint32)
        c0, c1, c2, c3, c4, c5, c6, c7 = zero, zero, zero, zero, zero, zero, zero, zero
        c8, c9, c10, c11, c12, c13, c14, c15 = zero, zero, zero, zero, zero, zero, zero, zero
        base = rows_ptr
        for _r in range(0, n_rows):
            v = _row_word(base, w, wmask, out_bytes, WORDS)
            c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = _add_word(
                c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, v, PLANES
            )
            base += row_stride  # pointer arithmetic: no 32-bit product r·stride to overflow
        win = _wins(c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, ones, threshold)
        _store_bytes(out_ptr, byte, bmask, win, shift, n_bits)

    @triton.jit
    def apply_kernel(
        p_ptr,
        u_ptr,
        m_ptr,
        g_ptr,
        n,
        neg_lr,
        decay,
        beta2,
        alpha2,
        BLOCK: tl.constexpr,
        KIND: tl.constexpr,
        DECAY: tl.constexpr,
        MOMENTUM: tl.constexpr,
        NEG: tl.constexpr,
        EMULATE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        u = tl.load(u_ptr + offs, mask=mask, other=0).to(tl.float32)
        p = _load_f32(p_ptr, offs, mask, KIND)
        if DECAY:
            p = _round(p * decay, KIND)
        p = _round(_fma(u, neg_lr, p, EMULATE), KIND)
        _store_f32(p_ptr, offs, p, mask, KIND)
        if MOMENTUM:
            m = _load_f32(m_ptr, offs, mask, KIND)
            g = _load_f32(g_ptr, offs, mask, KIND)
            if NEG:
                g = g * -1.0  # not -g: Triton negates as 0 - g, which turns -(+0.0) into +0.0
            t = _round(m * beta2, KIND)
            _store_f32(m_ptr, offs, _round(_fma(g, alpha2, t, EMULATE), KIND), mask, KIND)

    # -- per bucket: one launch over all its tensors, each one's address read from a pointer table

    @triton.jit
    def _elem_ptr(addr, KIND: tl.constexpr):
        """An int64 address as a pointer to the storage dtype (bfloat16: its int16 bits)."""
        if KIND == 1:
            return addr.to(tl.pointer_type(tl.int16))
        elif KIND == 2:
            return addr.to(tl.pointer_type(tl.float16))
        else:
            return addr.to(tl.pointer_type(tl.float32))

    @triton.jit
    def _locate(layout_ptr, n_tensors, BLOCK: tl.constexpr, SEARCH: tl.constexpr):
        """This program's tensor ``i`` (binary search for the last tensor whose first block is ≤ the
        program's; layout: int64 ``[T, 3]`` first block, elements, start in the flat buffer), the offsets
        of its block in the tensor, their mask and the tensor's start."""
        pid = tl.program_id(0).to(tl.int64)
        i = tl.zeros([], dtype=tl.int64)
        for k in tl.static_range(SEARCH):
            cand = i + (1 << (SEARCH - 1 - k))
            ok = cand < n_tensors
            first = tl.load(layout_ptr + 3 * cand, mask=ok, other=0)
            i = tl.where(ok & (first <= pid), cand, i)
        numel = tl.load(layout_ptr + 3 * i + 1)
        offs = (pid - tl.load(layout_ptr + 3 * i)) * BLOCK + tl.arange(0, BLOCK)
        return i, offs, offs < numel, tl.load(layout_ptr + 3 * i + 2)

    @triton.jit
    def _grad(g_table, i, offs, mask, KIND: tl.constexpr, NEG: tl.constexpr):
        """Tensor i's gradient (address 0: none, zeros), negated (``* -1``, as ``-g``) under NEG."""
        g_addr = tl.load(g_table + i)
        has_g = g_addr != 0
        g = _load_f32(_elem_ptr(g_addr, KIND), offs, mask & has_g, KIND)
        if NEG:
            g = tl.where(has_g, g * -1.0, g)  # not -g: Triton negates as 0 - g (+0.0 for +0.0)
        return g

    @triton.jit
    def lion_kernel(
        out_ptr,
        m_table,
        g_table,
        layout_ptr,
        n_tensors,
        beta,
        alpha,
        BLOCK: tl.constexpr,
        SEARCH: tl.constexpr,
        KIND: tl.constexpr,
        NEG: tl.constexpr,
        EMULATE: tl.constexpr,
    ):
        """``out[start_i + j] = β·m_i[j] + (1−β)·g_i[j]`` (rounded as ``m.mul(β).add_(g, alpha=1−β)``) for
        every tensor i of the tables."""
        i, offs, mask, start = _locate(layout_ptr, n_tensors, BLOCK, SEARCH)
        m = _load_f32(_elem_ptr(tl.load(m_table + i), KIND), offs, mask, KIND)
        g = _grad(g_table, i, offs, mask, KIND, NEG)
        t = _round(m * beta, KIND)
        _store_f32(out_ptr, start + offs, _round(_fma(g, alpha, t, EMULATE), KIND), mask, KIND)

    @triton.jit
    def apply_multi_kernel(
        u_ptr,
        p_table,
        m_table,
        g_table,
        layout_ptr,
        n_tensors,
        neg_lr,
        decay,
        beta2,
        alpha2,
        BLOCK: tl.constexpr,
        SEARCH: tl.constexpr,
        KIND: tl.constexpr,
        DECAY: tl.constexpr,
        MOMENTUM: tl.constexpr,
        NEG: tl.constexpr,
        EMULATE: tl.constexpr,
    ):
        """:func:`apply_kernel` for every tensor i of the tables (its votes at ``u[start_i:]``)."""
        i, offs, mask, start = _locate(layout_ptr, n_tensors, BLOCK, SEARCH)
        u = tl.load(u_ptr + start + offs, mask=mask, other=0).to(tl.float32)
        p_ptr = _elem_ptr(tl.load(p_table + i), KIND)
        p = _load_f32(p_ptr, offs, mask, KIND)
        if DECAY:
            p = _round(p * decay, KIND)
        p = _round(_fma(u, neg_lr, p, EMULATE), KIND)
        _store_f32(p_ptr, offs, p, mask, KIND)
        if MOMENTUM:
            m_ptr = _elem_ptr(tl.load(m_table + i), KIND)
            m = _load_f32(m_ptr, offs, mask, KIND)
            g = _grad(g_table, i, offs, mask, KIND, NEG)
            t = _round(m * beta2, KIND)
            _store_f32(m_ptr, offs, _round(_fma(g, alpha2, t, EMULATE), KIND), mask, KIND)
