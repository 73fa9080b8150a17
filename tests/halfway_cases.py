"""Inputs at exact half-way levels of the normalised quantizers, with their exact levels (an oracle in
float64): shared by tests/test_halfway.py and the Triton interpreter cases of tests/kernels_interp.py.

A level ``(x / M) · (s / k)`` that lies exactly half-way between two integers must round to the even one.
The inputs are built so that M = μ·2^p (μ a small odd integer) is known in advance and ``x / M`` is a
dyadic ratio with few bits: the exact level is computed in float64 without rounding.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
import torch
from hypothesis import assume
from hypothesis import strategies as st

from lioncub.ops import quantize as Q

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: significand bits of each dtype (a dyadic ratio o / 2^E with o < 2^bits is exact)
BITS = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11, torch.float64: 53}
#: exponents p of M = μ·2^p (narrowed per case: every value normal, every sum finite)
EXPONENTS = {
    torch.float32: (-100, 100),
    torch.bfloat16: (-100, 100),
    torch.float16: (-14, 15),
    torch.float64: (-900, 900),
}


#: the level budgets of 2/4/8-bit votes for 1..16 workers (odd, even, powers of two), and a few more
def level_budget(n: int, bits: int) -> int:
    """The level budget of a quantized vote (0: none)."""
    try:
        return Q.level_budget(n, bits, "signed" if bits == 8 else "offset")
    except ValueError:
        return 0


BUDGETS = sorted(
    {level_budget(n, bits) for n in range(1, 17) for bits in (2, 4, 8)} - {0} | {255, 1000, 3000, 32767}
)
#: the minimal example of a half-way level: 8bit, N = 2 (s = 63), a scalar parameter, c = (+0.8797774, −0.3):
#: each level is ±31.5; scaled by float32(s / (k·M)) they were (32, −31), a vote of +1 instead of 0
MINIMAL = (0.8797774, -0.3)


def halfway_exponent(s: int, k: float) -> int:
    """E such that the ratios ``x / M = o / 2^E`` (o odd) are exactly the half-way points of
    ``(x / M) · (s / k)`` for k ∈ {1, 2}: with ``s = 2^a·b`` (b odd), E = a − log2(k) + 1 and the level
    is ``o·b/2``."""
    a = (s & -s).bit_length() - 1
    return a - int(math.log2(k)) + 1


class Case(NamedTuple):
    x: torch.Tensor  #: the input, ``chunks · chunk`` elements
    chunk: int  #: elements per normalised group (each group has its own M)
    s: int
    k: float
    want: np.ndarray  #: the exact levels (int64)
    halfway: np.ndarray  #: bool: the entries whose exact level is half-way and inside (−s, s)


def _exact(ratios: np.ndarray, s: int, k: float) -> tuple[np.ndarray, np.ndarray]:
    """Exact levels of the signed ratios ``x / M`` (float64, exact: few-bit dyadic ratios and s / k)."""
    t = ratios * (s / k)
    frac = np.abs(t - np.trunc(t))
    return np.clip(np.rint(t), -s, s).astype(np.int64), (frac == 0.5) & (np.abs(t) < s)


@functools.cache
def _l1_ratios(e: int, others: bool) -> st.SearchStrategy[float]:
    """L1's ratios ``o / 2^E`` (o odd, in (0, 2)), and with ``others`` ratios ``q / 128`` besides (not
    half-way in general); built once per (E, others), not per drawn group."""
    odd = st.integers(0, (1 << e) - 1).map(lambda i: (2 * i + 1) / 2**e)
    return odd | st.integers(1, 255).map(lambda q: q / 128) if others else odd


@functools.cache
def _linf_ratios(e: int) -> st.SearchStrategy[float]:
    """L∞'s ratios ``o / 2^E <= 1`` (o odd), built once per E."""
    return st.integers(0, max(1, (1 << e) // 2) - 1).map(lambda i: (2 * i + 1) / 2**e)


@st.composite
def halfway_cases(draw, name: str = "l1", dtypes=FLOATS) -> Case:
    """Groups of ``chunk`` values with a normaliser M = μ·2^p (μ odd) and many entries at exact half-way
    ratios. L1: pairs of ratios (r, 2 − r) around 1 (mean |x| = M exactly); L∞: ratios ≤ 1 and one 1;
    Lp and L0: equal magnitudes (the only inputs whose M is exact for them)."""
    dtype = draw(st.sampled_from(dtypes))
    k = draw(st.sampled_from([2.0, 1.0]))
    s = draw(st.sampled_from(BUDGETS))
    e = halfway_exponent(s, k)
    assume(e + 1 <= BITS[dtype] and e <= 20)
    if name in ("lp", "l0"):  # equal magnitudes: a half-way level needs s / k = j + 1/2
        assume(e == 0)
    pairs = draw(st.integers(1, 12))
    chunk = 2 * pairs
    lo, hi = EXPONENTS[dtype]
    values, ratios = [], []
    # M = μ·2^p with μ odd: s / (k·M) is then (in general) no float32, so a scaling by float32(s / (k·M))
    # misses the half-way points;
    # μ small enough that every value, and every partial sum of the L1 mean, is exact in the dtype
    sums = chunk.bit_length() if name == "l1" else 0
    others = name == "l1" and BITS[dtype] - 8 - sums >= 1  # ratios q/128 (8 bits) besides o/2^E
    spare = BITS[dtype] - max(e + 1, 8 if others else 0) - sums
    assume(spare >= 1)
    for _ in range(draw(st.integers(1, 3))):
        mu = 2 * draw(st.integers(0, (1 << min(spare, 12)) // 2 - 1)) + 1
        # every value r·M (r >= 2^-E, or 1/128) normal, and 2·M·chunk (the L1 sum) finite
        info = torch.finfo(dtype)
        low = max(lo, math.ceil(math.log2(info.tiny)) + max(e, 7 if others else 0))
        high = min(hi, math.floor(math.log2(info.max)) - 1 - mu.bit_length() - chunk.bit_length())
        assume(low <= high)
        m = mu * 2.0 ** draw(st.integers(low, high))
        if name == "l1":
            rs = draw(st.lists(_l1_ratios(e, others), min_size=pairs, max_size=pairs))
            group = [v for r in rs for v in (r, 2.0 - r)]
        elif name == "linf":
            group = [1.0, *draw(st.lists(_linf_ratios(e), min_size=chunk - 1, max_size=chunk - 1))]
        else:
            group = [1.0] * chunk
        group = np.array(group)
        # the signs: bit j of one drawn integer is entry j's (all positive, all negative, any mix), one
        # choice instead of a list of ``chunk`` booleans (each element of a list costs hypothesis a span)
        negative = draw(st.integers(0, (1 << chunk) - 1)) >> np.arange(chunk) & 1
        signs = np.where(negative == 1, -1.0, 1.0)
        order = np.random.default_rng(draw(st.integers(0, 2**16))).permutation(chunk)
        r = (signs * group)[order]
        ratios.append(r)
        values.append(r * m)
    x = torch.from_numpy(np.concatenate(values)).to(dtype)
    assert np.array_equal(x.double().numpy(), np.concatenate(values)), "the values must be exact"
    want, halfway = _exact(np.concatenate(ratios), s, k)
    return Case(x, chunk, s, k, want, halfway)
