"""Property-based fuzzing (hypothesis) of the quantizers, the bit packing and the vote collectives.

What is fuzzed
  * Every quantizer in :data:`lioncub.ops.quantize.QUANTIZERS` (sign, l1, l0 with and without ``eps``, linf,
    lp for several p, qsgd with the ∞- and 2-norm, log), whole-tensor and chunked, at the level budgets
    that 2-, 4- and 8-bit lanes leave for 1..16 workers and at any level count up to 2^30 − 1, and
    :func:`~lioncub.ops.quantize.lp_normalizer`; inputs in fp32/bf16/fp16/fp64 of odd lengths (0, 1, 7, 9,
    63, 65, 129, ...) mixing extreme magnitudes (±3.4e38, the largest value of each dtype, subnormals
    down to 1e-45 / 5e-324, 0, -0.0), values at rounding half-way points and NaN/±Inf.
  * :mod:`lioncub.ops.packing`: sign votes (every float and signed integer dtype, NaN of either sign bit and
    any payload, on the numpy CPU kernel and on the torch kernel that CUDA runs), 1-bit and p-bit lanes,
    lane lookups, offset lanes, vote counting and majority.
  * Every vote algorithm of :mod:`lioncub.collectives` on N = 1..16 ranks simulated in one process
    (``tests/sim_comm.py``): :class:`SimComm` stands in for :class:`~lioncub.collectives.Comm` (the
    algorithms only call its exchanges) and executes each collective once every rank has posted it, with
    the wire arithmetic of gloo/NCCL: an integer SUM wraps around modulo 2^bits, so a lane or int8 overflow
    would show up as a wrong vote. One test checks the simulator against real gloo ranks.

Properties
  * Nothing raises except a ``ValueError``/``TypeError`` whose message names the offending option.
  * Quantized levels lie in ``[-s, s]`` in ``level_dtype(s)`` and equal a float64 numpy oracle (up to a
    rounding half-way point, or the rounding of a subnormal or half-precision normaliser); zero stays
    zero; the torch and numpy kernels and ``out=`` agree; the integer SUM of N workers' levels never
    overflows its lane (signed int8, or offset 2/4-bit lanes summed as uint8 bytes).
  * Packing round trips are exact; sign votes are ``x >= 0`` of the float64 value (NaN votes "-").
  * Every vote equals a numpy reference, is identical on all ranks and lies in {-1, 0, 1} (the mean
    variants: the exact mean of the signs); the dense mean of finite values is finite and close to the
    float64 mean.

NaN/Inf contract (documented in the modules, checked here)
  * sign: NaN -> 0, ±Inf -> ±1.
  * l1, l0, linf, lp, qsgd, log: a tensor (or, with ``chunk_size``, a chunk) holding any NaN or ±Inf maps
    to all-zero levels; other chunks are unaffected. ``lp_normalizer`` is finite exactly for finite rows.
  * 1-bit votes (pack_signs, OneBitVote, LaneVote, ServerVote): NaN votes "-", +Inf and -0.0 vote "+".
  * int8 sign votes (SignSumVote, AverageVote) and every N = 1 vote: sign(NaN) = 0.
  * QuantizedVote: as its quantizer; DenseMean propagates NaN/Inf (it is a mean).
"""

from __future__ import annotations

import itertools
import math
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lioncub.collectives import (
    AverageVote,
    DenseMean,
    LaneVote,
    OneBitVote,
    QuantizedVote,
    ServerVote,
    SignSumVote,
)
from lioncub.ops import packing
from lioncub.ops import quantize as Q
from profiles import examples
from sim_comm import SimComm, SimWorld, run_vote

from processes import run_workers


def fuzz(max_examples: int) -> settings:
    return settings(
        max_examples=examples(max_examples),  # scaled by the hypothesis profile (tests/profiles.py)
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


NAN, INF = float("nan"), float("inf")
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
LENGTHS = (0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 63, 64, 65, 129)
EXTREMES = (
    0.0, -0.0, 1.0, -1.0, 0.5, -1.5, 2.5, 3.4e38, -3.4e38, 3.3895e38, 65504.0, -65504.0, 6.0e-8,
    1e-45, -1e-45, 1e-40, 1.1754944e-38, 1.7e308, -1.7e308, 1e-307, 2.2e-308, 5e-324, -5e-324,
)  # fmt: skip
NON_FINITE = (NAN, -NAN, INF, -INF)
BUDGET_BITS = (2, 4, 8)


# ------------------------------------------------------------------------------------------ strategies


def _ldexp(mantissa: float, exponent: int) -> float:
    with np.errstate(over="ignore"):
        return float(np.ldexp(mantissa, exponent))  # ±inf beyond float64 (clipped by to_tensor)


#: an element of :func:`float_arrays` before its binade is known: an extreme, (mantissa, negative) to scale
#: into the array's binade, or any double (built once: a strategy built per draw costs more than the draw)
ELEMENT = (
    st.sampled_from(EXTREMES)
    | st.tuples(
        st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0]) | st.floats(-4, 4), st.booleans()
    )
    | st.floats(allow_nan=False, allow_infinity=False)
)


@st.composite
def float_arrays(
    draw, n: int | None = None, non_finite: bool = True, rows: int | None = None, dtype=torch.float64
) -> np.ndarray:
    """float64 values ``[n]`` (or ``[rows, n]``): extremes, small mantissas in one random binade of
    ``dtype``'s range (ties at rounding half-way points, equal values) and any double. Short arrays are
    drawn element by element; longer ones spread a drawn pool of values with a seeded generator (cheap
    to draw, ties frequent)."""
    n = draw(st.sampled_from(LENGTHS)) if n is None else n
    shape = (n,) if rows is None else (rows, n)
    info = torch.finfo(dtype)
    exponent = draw(st.integers(math.floor(math.log2(info.tiny)) - info.bits, math.ceil(math.log2(info.max))))

    def values_of(elements: list) -> np.ndarray:  # (mantissa, negative) scaled into the binade 2^exponent
        scaled = [_ldexp(-e[0] if e[1] else e[0], exponent) if isinstance(e, tuple) else e for e in elements]
        return np.array(scaled, dtype=np.float64)

    size = math.prod(shape)
    if size <= 9 and draw(st.booleans()):
        values = values_of(draw(st.lists(ELEMENT, min_size=size, max_size=size)))
        rng = np.random.default_rng(0)
    else:
        pool = values_of(draw(st.lists(ELEMENT, min_size=1, max_size=8)))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        values = pool[rng.integers(pool.size, size=size)]
        if draw(st.booleans()):  # jitter: distinct values (never larger, so never an overflow)
            values = values * rng.uniform(0.5, 1.0, size)
    if non_finite and size and draw(st.integers(0, 3)) == 0:  # a quarter of the arrays get NaN/±Inf
        where = rng.integers(size, size=draw(st.integers(1, 3)))
        values[where] = rng.choice(np.array(NON_FINITE), size=where.size)
    return values.reshape(shape)


def to_tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Finite values are clipped into the dtype's range first (a cast must not invent an Inf)."""
    top = torch.finfo(dtype).max
    with np.errstate(invalid="ignore"):
        clipped = np.where(np.isfinite(values), np.clip(values, -top, top), values)
    return torch.from_numpy(clipped).to(dtype)


@st.composite
def float_tensors(draw, dtype=None, n=None, non_finite=True, rows=None) -> torch.Tensor:
    dtype = draw(st.sampled_from(FLOATS)) if dtype is None else dtype
    return to_tensor(draw(float_arrays(n, non_finite, rows, dtype)), dtype)


# Level counts: the budgets of 2/4/8-bit lanes for 1..16 workers, int16 and int32 ranges, float32 limits.
LEVELS = (
    st.sampled_from([1, 2, 3, 5, 7, 15, 31, 63, 127])
    | st.sampled_from([128, 255, 32767, 32768, 1 << 24, (1 << 24) + 1, (1 << 30) - 1])
    | st.integers(1, (1 << 30) - 1)
)


@st.composite
def quantizer_options(draw, name: str) -> dict[str, Any]:
    """Options as :class:`QuantizedVote` passes them: every knob each quantizer accepts."""
    opts: dict[str, Any] = {}
    if name in ("l1", "l0", "linf", "lp"):
        opts["clip_multiple"] = draw(st.sampled_from([2.0, 1.0, 0.5, 3.0, 1e-3]))
    if name == "lp":
        opts["p"] = draw(st.sampled_from([0.5, 1, 1.5, 2.0, 3.0, 7.5]))
    if name == "l0":
        opts["eps"] = draw(st.sampled_from([None, 1e-12]))
    if name == "qsgd":
        opts["norm"] = draw(st.sampled_from(["inf", "2"]))
    if name != "sign":
        opts["chunk_size"] = draw(st.sampled_from([None, 1, 3, 7, 64]))
    return opts


# -------------------------------------------------------------------------------- quantizer oracle


def _groups(n: int, chunk: int | None) -> list[slice]:
    step = chunk or max(n, 1)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _ratios(a: np.ndarray, p: float, eps: float | None) -> tuple[np.ndarray, float]:
    """``|x| / M`` computed scale-free (no subnormal or overflowing M involved) and M itself (float64),
    for a finite group ``a = |x|`` that is not all zeros."""
    top = a.max()
    with np.errstate(divide="ignore", over="ignore"):
        if p == math.inf:
            return a / top, top
        if p == 0:
            logs = np.log(a)
            mean_log = np.mean(logs[a > 0]) if eps is None else np.mean(np.log(a + eps))
            return np.where(a > 0, np.exp(logs - mean_log), 0.0), float(np.exp(mean_log))
        rel = a / top
        c = np.mean(rel**p) ** (1 / p)
        return rel / c, float(top * c)


def _norm_slack(dtype: torch.dtype, name: str, p: float, m: float) -> float:
    """How far (relative) the kernel's normaliser may lie from M: float32 arithmetic (1e-5 covers the
    float32 scaling too), a sum rounded to the input dtype (L1 of bf16/fp16), the last place of a
    subnormal float64."""
    rel = 1e-5
    if p == 1 and name != "qsgd":
        rel = {torch.bfloat16: 8e-3, torch.float16: 2e-3}.get(dtype, rel)
    return rel + (2e-323 / m if dtype == torch.float64 else 0.0)


def _scaled_bounds(t: np.ndarray, slack: float) -> tuple[np.ndarray, np.ndarray]:
    """The range of ``t' = t·M/M'`` over the kernel's possible normalisers ``M' = M·(1 ± slack)``."""
    f_lo = 1 / (1 + slack)
    f_hi = 1 / (1 - slack) if slack < 1 else math.inf
    with np.errstate(invalid="ignore", over="ignore"):
        a, b = t * f_lo, t * f_hi
        a, b = np.where(t == 0, 0.0, a), np.where(t == 0, 0.0, b)
    return np.minimum(a, b), np.maximum(a, b)


def _level_bounds(t: np.ndarray, slack: float, s: int) -> tuple[np.ndarray, np.ndarray]:
    """Levels ``clip(round(t'))`` for every ``t' = t·M/M'`` with the kernel's normaliser ``M·(1 ± slack)``."""
    lo, hi = _scaled_bounds(t, slack)
    return np.clip(np.rint(lo), -s, s), np.clip(np.rint(hi), -s, s)


def check_levels(name: str, x: torch.Tensor, s: int, opts: dict[str, Any], q: torch.Tensor) -> None:
    """Assert that ``q = quantize(name, x, s, **opts)`` is what the float64 oracle allows."""
    assert q.shape == x.shape
    assert q.dtype == (torch.int8 if name == "sign" else Q.level_dtype(s))
    xs = x.reshape(-1).double().numpy()
    got = q.reshape(-1).to(torch.int64).numpy()
    bound = 1 if name == "sign" else s
    assert np.all(np.abs(got) <= bound), f"levels outside [-{bound}, {bound}]"
    if name == "sign":
        assert np.array_equal(got, np.nan_to_num(np.sign(xs)).astype(np.int64))
        return
    k = opts.get("clip_multiple", 2.0)  # the quantizers' default
    p = {"l1": 1.0, "l0": 0.0, "linf": math.inf, "lp": opts.get("p", 1.0), "log": math.inf}.get(name)
    if name == "qsgd":
        p = math.inf if opts["norm"] == "inf" else 2.0
    for g in _groups(xs.size, opts.get("chunk_size")):
        xg, qg = xs[g], got[g]
        if not np.isfinite(xg).all() or not np.any(xg):  # NaN/Inf: the chunk abstains; zeros stay zero
            assert not qg.any(), f"chunk {g} with NaN/Inf or all zeros must map to zeros, got {qg}"
            continue
        a, sign = np.abs(xg), np.sign(xg)
        assert np.all(qg[xg == 0] == 0) and np.all(np.sign(qg[qg != 0]) == sign[qg != 0])
        if name == "log":
            logs = np.log2(a.max()) - np.log2(np.where(a > 0, a, 1.0))
            allowed = []
            for e in (np.floor(logs), np.ceil(logs)):
                mag = np.rint(s * np.exp2(-np.minimum(e, 64.0)))
                allowed.append(np.where(a > 0, mag, 0.0))
            near_tie = np.abs(logs - np.floor(logs) - 0.5) < 1e-9
            want = np.where(logs - np.floor(logs) < 0.5, allowed[0], allowed[1])
            ok = (np.abs(qg) == want) | (near_tie & ((np.abs(qg) == allowed[0]) | (np.abs(qg) == allowed[1])))
            assert ok.all(), f"log levels {qg} for {xg}, want {want * sign}"
            continue
        ratio, m = _ratios(a, p, opts.get("eps") if name == "l0" else None)
        if x.dtype == torch.float64 and m < 2e-323 and not qg.any():
            continue  # a normaliser at the last subnormal places may underflow to 0: zeros (documented)
        m = max(m, 5e-324)
        if name == "qsgd":  # levels: floor or ceil of s·|x|/‖x‖, ‖x‖_2 = √n·RMS
            if p == 2.0:
                ratio = ratio / math.sqrt(a.size)
            lo, hi = _scaled_bounds(ratio * s, _norm_slack(x.dtype, name, p, m))
            lo, hi = np.clip(np.floor(lo), 0, s), np.clip(np.ceil(hi), 0, s)
            mags = np.abs(qg)
            assert np.all((lo <= mags) & (mags <= hi)), f"qsgd {qg} for {xg}, want {lo}..{hi}"
            continue
        lo, hi = _level_bounds(sign * ratio * (s / k), _norm_slack(x.dtype, name, p, m), s)
        assert np.all((lo <= qg) & (qg <= hi)), (
            f"{name} levels {qg} for {xg} (s={s}, {opts}), want {lo}..{hi}"
        )


def call_quantizer(name: str, x: torch.Tensor, s: int, opts: dict[str, Any], **extra) -> torch.Tensor:
    if name == "qsgd":
        extra.setdefault("generator", torch.Generator().manual_seed(7))
    return Q.quantize(name, x, s, **opts, **extra)


@fuzz(300)
@given(st.sampled_from(sorted(Q.QUANTIZERS)), st.data())
def test_quantizers_match_float64_oracle(name: str, data: st.DataObject) -> None:
    x = data.draw(float_tensors())
    s = data.draw(LEVELS)
    opts = data.draw(quantizer_options(name))
    q = call_quantizer(name, x, s, opts)
    check_levels(name, x, s, opts, q)
    # deterministic (qsgd: for one generator seed), the torch kernel (what CUDA runs) and out= agree
    assert torch.equal(call_quantizer(name, x, s, opts), q)
    with mock.patch.object(Q, "_numpy_path", lambda t: False):
        assert torch.equal(call_quantizer(name, x, s, opts), q)
    if name in ("l1", "l0", "linf", "lp"):
        out = torch.full(x.shape, 99, dtype=Q.level_dtype(s))
        assert call_quantizer(name, x, s, opts, out=out) is out and torch.equal(out, q)


F64 = torch.float64
REGRESSIONS = [  # (name, values, dtype, s, options, expected levels): inputs fuzzing found to be wrong
    ("l1", [1e-307] * 3, F64, 127, {}, [64] * 3),  # s/(k·M) overflowed float64: 127 instead of 64
    ("l1", [5e-324, 5e-324, 0.0], F64, 127, {}, [64, 64, 0]),  # the same, and 0·inf = NaN cast to int8
    ("l1", [1.7e308] * 2, F64, 127, {}, [64, 64]),  # k·M and the float64 L1 sum overflowed: zeros
    ("qsgd", [1.5e308] * 2, F64, 127, {"norm": "2"}, None),  # RMS·√n overflowed: zeros
    ("l1", [1.0], torch.float32, (1 << 30) - 1, {"clip_multiple": 1.0}, [(1 << 30) - 1]),  # was 2^30
    ("l1", [1.0, -2.0, 3.0, 0.5, 4.0], torch.float32, 15, {"chunk_size": 64}, [4, -7, 11, 2, 14]),  # padding
    ("qsgd", [1.0, -2.0, 3.0, 0.5, 4.0], F64, 15, {"chunk_size": 64, "norm": "2"}, None),  # the same
    ("l0", [0.0, 0.0, 1.7e308], F64, 2, {}, [0, 0, 1]),  # 2^1024 unit overflowed: normaliser 0
    ("l0", [3.4e38, 1e-307], F64, 1, {}, [1, 0]),  # 1e-307 underflowed relative to the max
    ("l1", [1.0, NAN, 2.0, -3.0], torch.float32, 15, {}, [0] * 4),  # NaN: others scaled by s/k
    ("l0", [1.0, NAN, 2.0, -3.0], torch.float32, 15, {}, [0] * 4),  # NaN: a finite normaliser
    ("lp", [1.0, INF, 2.0], torch.float32, 15, {"p": 1.5}, [0] * 3),  # Inf: [8, 15, 15]
    ("qsgd", [1.0, NAN, 2.0], torch.float32, 15, {"norm": "inf"}, [0] * 3),  # NaN: others vs 1
]


@pytest.mark.parametrize("name, values, dtype, s, opts, want", REGRESSIONS)
def test_regressions_found_by_fuzzing(name, values, dtype, s, opts, want) -> None:
    x = torch.tensor(values, dtype=dtype)
    q = call_quantizer(name, x, s, opts)
    check_levels(name, x, s, opts, q)
    if want is not None:
        assert q.tolist() == want
    with mock.patch.object(Q, "_numpy_path", lambda t: False):
        assert torch.equal(call_quantizer(name, x, s, opts), q)


@fuzz(100)
@given(st.sampled_from(sorted(set(Q.QUANTIZERS) - {"sign"})), st.data())
def test_non_finite_chunks_abstain_and_leave_the_others_alone(name: str, data: st.DataObject) -> None:
    """Poisoning one chunk with NaN/±Inf zeros that chunk and changes no level of any other chunk."""
    dtype = data.draw(st.sampled_from(FLOATS))
    chunk = data.draw(st.sampled_from([1, 3, 7, 64]))
    x = data.draw(float_tensors(dtype, n=data.draw(st.integers(1, 130)), non_finite=False))
    opts = data.draw(quantizer_options(name)) | {"chunk_size": chunk}
    s = data.draw(LEVELS)
    where = data.draw(st.integers(0, x.numel() - 1))
    check_poisoned_chunk(name, x, s, opts, where, data.draw(st.sampled_from(NON_FINITE)))


def check_poisoned_chunk(name: str, x: torch.Tensor, s: int, opts: dict, where: int, value: float) -> None:
    chunk = opts["chunk_size"]
    clean = call_quantizer(name, x, s, opts)
    poisoned = x.clone()
    poisoned[where] = value
    q = call_quantizer(name, poisoned, s, opts)
    bad = slice(where // chunk * chunk, (where // chunk + 1) * chunk)
    assert not q[bad].any()
    keep = torch.ones(x.numel(), dtype=torch.bool)
    keep[bad] = False
    assert torch.equal(q[keep], clean[keep])  # qsgd too: its uniform draws do not depend on the values


def test_poisoned_chunk_regression() -> None:
    """A NaN in one chunk sent every chunk's fp16 L1 sum to float64, which moved a level elsewhere."""
    x = torch.tensor([0.8184, 0.6348, 0.5205, 0.5083, 0.9067, 0.9565, 0.8032, 0.8647, 0.7720, 0.9678])
    check_poisoned_chunk("l1", x.half(), 128, {"clip_multiple": 1.0, "chunk_size": 3}, 0, NAN)


@fuzz(100)
@given(st.sampled_from([0, 0.5, 1, 1.5, 2, 3, math.inf]), st.sampled_from([None, 1e-12]), st.data())
def test_lp_normalizer_is_finite_exactly_for_finite_rows(p: float, eps: float | None, data) -> None:
    """Against the float64 oracle (sums of fp32/bf16/fp16 rows round in their dtype: looser)."""
    dtype = data.draw(st.sampled_from(FLOATS))
    rows, n = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 40))
    x = data.draw(float_tensors(dtype, n=n, rows=rows))
    eps = eps if p == 0 else None
    norm = Q.lp_normalizer(x, p, eps=eps)
    assert norm.dtype == torch.float64 and norm.shape == (rows,)
    for row, m in zip(x.double().numpy(), norm.tolist(), strict=True):
        if not np.isfinite(row).all():
            assert not math.isfinite(m), f"a row with NaN/Inf must not get a finite normaliser, got {m}"
            continue
        a = np.abs(row)
        want = _ratios(a, p, eps)[1] if a.any() else (eps if eps is not None else 0.0)
        rel = {torch.float64: 1e-9, torch.float32: 1e-5}.get(dtype, 1e-2)
        assert m >= 0 and m == pytest.approx(want, rel=rel, abs=4e-323)


# ------------------------------------------------------------------------ level budgets and overflow


@fuzz(200)
@given(st.integers(1, 300), st.integers(1, 16), st.sampled_from(["signed", "offset", "vote"]))
def test_level_budget_is_the_largest_that_fits_or_names_the_limit(n: int, bits: int, encoding: str) -> None:
    top = (1 << (bits - 1)) - 1 if encoding == "signed" else (1 << bits) - 1
    span = {"signed": lambda s: s, "offset": lambda s: 2 * s, "vote": lambda s: s}[encoding]
    try:
        s = Q.level_budget(n, bits, encoding)
    except ValueError as err:
        msg = str(err)
        assert f"n_workers={n}" in msg and f"{bits}-bit" in msg and "at most" in msg and "bits" in msg
        assert n * span(1) > top  # really no room for one level
        return
    assert n * span(s) <= top
    assert encoding == "vote" or n * span(s + 1) > top


@fuzz(100)
@given(st.sampled_from(BUDGET_BITS), st.sampled_from(sorted(Q.QUANTIZERS)), st.data())
def test_summed_levels_never_overflow_the_lane(bits: int, name: str, data: st.DataObject) -> None:
    """The wire of a quantized vote: int8 SUM (8-bit) or uint8 byte SUM of offset lanes (2/4-bit), both
    wrapping like the real allreduce, decode to the exact integer sum of the N workers' levels, for every
    N up to 16 that the level budget admits (the largest s it allows, so the extremes ±s do occur)."""
    encoding = "signed" if bits == 8 else "offset"
    n = data.draw(st.integers(1, min(16, {8: 127, 4: 7, 2: 1}[bits])))
    s = Q.level_budget(n, bits, encoding)
    d = data.draw(st.sampled_from(LENGTHS))
    opts = data.draw(quantizer_options(name))
    xs = data.draw(float_tensors(n=d, rows=n)).unbind(0)
    levels = [call_quantizer(name, x, s, opts) for x in xs]
    total = sum(q.to(torch.int64) for q in levels)
    if bits == 8:
        wire = torch.zeros(d, dtype=torch.int8)
        for q in levels:
            wire += q  # int8 arithmetic wraps like the int8 allreduce
        assert torch.equal(wire.to(torch.int64), total)
    else:
        wire = torch.zeros(packing.packed_size(d, bits), dtype=torch.uint8)
        for q in levels:
            wire += packing.pack_lanes(packing.offset_encode(q, s), bits)  # uint8 wraps like the allreduce
        decoded = packing.offset_decode(packing.unpack_lanes(wire, bits, d), n, s)
        assert torch.equal(decoded.to(torch.int64), total)


BAD_OPTIONS = [
    ("levels", {"levels": 0}),
    ("levels", {"levels": -3}),
    ("levels", {"levels": 1 << 30}),
    ("levels", {"levels": 2.5}),
    ("levels", {"levels": True}),
    ("clip_multiple", {"clip_multiple": 0}),
    ("clip_multiple", {"clip_multiple": -1.0}),
    ("clip_multiple", {"clip_multiple": NAN}),
    ("clip_multiple", {"clip_multiple": INF}),
    ("chunk_size", {"chunk_size": 0}),
    ("chunk_size", {"chunk_size": -4}),
    ("chunk_size", {"chunk_size": 2.5}),
    ("p", {"p": -1.0}),
    ("p", {"p": NAN}),
    ("norm", {"norm": "1"}),
    ("out", {"out": torch.empty(3, dtype=torch.int16)}),
]
ACCEPTS = {
    "levels": set(Q.QUANTIZERS),
    "clip_multiple": {"l1", "l0", "linf", "lp"},
    "chunk_size": set(Q.QUANTIZERS) - {"sign"},
    "p": {"lp"},
    "norm": {"qsgd"},
    "out": {"l1", "l0", "linf", "lp"},
}


@fuzz(60)
@given(st.sampled_from(BAD_OPTIONS), st.data())
def test_bad_options_raise_a_clear_error(bad: tuple[str, dict], data: st.DataObject) -> None:
    option, kw = bad
    name = data.draw(st.sampled_from(sorted(ACCEPTS[option])))
    x = data.draw(float_tensors(n=data.draw(st.sampled_from([1, 3, 9]))))
    kw = dict(kw)
    levels = kw.pop("levels", 7)
    with pytest.raises(ValueError, match=option):
        Q.quantize(name, x, levels, **kw)


@pytest.mark.parametrize("name", sorted(Q.QUANTIZERS))
def test_non_float_input_is_a_type_error(name: str) -> None:
    for x in (torch.arange(5), torch.zeros(3, dtype=torch.bool), torch.zeros(2, dtype=torch.complex64)):
        with pytest.raises(TypeError, match="floating-point"):
            Q.quantize(name, x, 3)
    with pytest.raises(ValueError, match="quantizer='l9'"):
        Q.quantize("l9", torch.zeros(2), 3)


# ------------------------------------------------------------------------------------------ packing

INTS = (torch.int8, torch.int16, torch.int32, torch.int64)
# NaN bit patterns (sign bit, exponent all ones, smallest/canonical/largest payload) of each float dtype.
NAN_BITS = {
    torch.bfloat16: (torch.int16, [0x7F81, 0x7FC0, 0x7FFF, -0x7F, -0x40, -0x1]),
    torch.float16: (torch.int16, [0x7C01, 0x7E00, 0x7FFF, -0x3FF, -0x200, -0x1]),
    torch.float32: (torch.int32, [0x7F800001, 0x7FC00000, 0x7FFFFFFF, -0x7FFFFF, -0x400000, -0x1]),
    torch.float64: (torch.int64, [0x7FF0000000000001, 0x7FF8000000000000, -0x1, -0x8000000000000]),
}


@st.composite
def vote_inputs(draw) -> torch.Tensor:
    """Real tensors for sign votes: any float dtype (with NaNs of every bit pattern) or signed int."""
    dtype = draw(st.sampled_from(FLOATS + INTS))
    n = draw(st.sampled_from(LENGTHS) | st.integers(0, 300))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        pool = draw(
            st.lists(st.sampled_from([0, -1, 1, info.min, info.max]) | st.integers(info.min, info.max))
        )
        values = rng.choice(np.array(pool or [0], dtype=np.int64), size=n)
        return torch.from_numpy(values).to(dtype)
    x = to_tensor(draw(float_arrays(n, dtype=dtype)), dtype)
    if n and draw(st.booleans()):  # NaNs of either sign bit and several payloads
        int_dtype, patterns = NAN_BITS[dtype]
        where = rng.integers(n, size=draw(st.integers(1, 4)))
        x.view(int_dtype)[torch.from_numpy(where)] = torch.tensor(
            rng.choice(patterns, size=where.size), dtype=int_dtype
        )
    return x


def votes_reference(x: torch.Tensor, pad_to: int = 8) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        bits = x.double().numpy() >= 0 if x.dtype.is_floating_point else x.numpy() >= 0
    pad = (-bits.size) % pad_to
    return np.concatenate([bits, np.ones(pad, dtype=bool)])


@fuzz(200)
@given(
    vote_inputs(),
    st.integers(1, 16),
    st.sampled_from(["numpy", "torch"]),
    st.sampled_from((*FLOATS, torch.int8)),
)
def test_sign_votes_pack_and_unpack_exactly(x: torch.Tensor, workers: int, kernel: str, dtype) -> None:
    want = votes_reference(x, 8 * workers)
    with mock.patch.object(packing, "_numpy_path", lambda t: kernel == "numpy"):
        packed = packing.pack_signs(x, pad_to=8 * workers)
        out = torch.full((want.size // 8,), 0xAA, dtype=torch.uint8)
        assert packing.pack_signs(x, pad_to=8 * workers, out=out).data_ptr() == out.data_ptr()
        assert packed.dtype == torch.uint8 and packed.numel() * 8 == want.size
        assert np.array_equal(packed.numpy(), np.packbits(want, bitorder="big")), "votes differ from x >= 0"
        assert torch.equal(out, packed)
        signs = packing.unpack_signs(packed, x.numel(), dtype)
    assert signs.dtype == dtype
    assert np.array_equal(signs.double().numpy(), np.where(want[: x.numel()], 1.0, -1.0))


@pytest.mark.parametrize("kernel", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_nan_votes_minus_on_every_kernel(kernel: str, dtype: torch.dtype) -> None:
    """bf16 on the numpy kernel compared raw bits, so a positive NaN voted "+" there only."""
    x = torch.tensor([NAN, -NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0], dtype=dtype)
    with mock.patch.object(packing, "_numpy_path", lambda t: kernel == "numpy"):
        assert packing.pack_signs(x).tolist() == [0b00101110]


@fuzz(100)
@given(st.sampled_from(packing.LANE_BITS), st.integers(0, 300), st.data())
def test_lanes_round_trip_and_map_exactly(bits: int, n: int, data: st.DataObject) -> None:
    """Lanes of any values, or of a few drawn ones (all 0, all at the top, ties), spread and mapped by a
    seeded generator: a few choices per example, not one per element and table entry."""
    top = (1 << bits) - 1
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    if data.draw(st.booleans()):
        values = rng.integers(0, top + 1, size=n).astype(np.uint8)
    else:
        pool = data.draw(st.lists(st.sampled_from([0, top]) | st.integers(0, top), min_size=1, max_size=4))
        values = np.array(pool, dtype=np.uint8)[rng.integers(len(pool), size=n)]
    lanes = torch.from_numpy(values)
    packed = packing.pack_lanes(lanes, bits)
    # reference packing: first element in the high lane of a byte
    per = 8 // bits
    padded = np.concatenate([values, np.zeros((-n) % per, np.uint8)]).reshape(-1, per).astype(np.int64)
    want = (padded << (8 - bits * np.arange(1, per + 1))).sum(axis=1)
    assert packed.dtype == torch.uint8 and np.array_equal(packed.numpy(), want)
    assert packed.numel() == packing.packed_size(n, bits)
    assert torch.equal(packing.unpack_lanes(packed, bits, n), lanes)
    if bits == 1:
        assert np.array_equal(packing.pack_bits(lanes.bool()).numpy(), np.packbits(values, bitorder="big"))
        assert torch.equal(packing.unpack_bits(packed, n), lanes.bool())

    # each table entry an edge value or (one choice in six) any int8
    choice, any_int8 = rng.integers(6, size=1 << bits), rng.integers(-128, 128, size=1 << bits)
    table = tuple(
        np.where(choice < 5, np.array([-128, -1, 0, 1, 127])[np.minimum(choice, 4)], any_int8).tolist()
    )
    mapped = packing.map_lanes(packed, bits, n, table)
    assert mapped.dtype == torch.int8 and mapped.tolist() == [table[v] for v in values.tolist()]
    wide = list(table)
    wide[data.draw(st.integers(0, len(wide) - 1))] = data.draw(st.sampled_from([128, 255, -129, 1000]))
    with pytest.raises(ValueError, match="values must be int8"):
        packing.map_lanes(packed, bits, n, tuple(wide))
    with pytest.raises(ValueError, match="do not fit"):
        packing.unpack_lanes(packed, bits, packed.numel() * per + 1)


@fuzz(100)
@given(st.sampled_from(packing.LANE_BITS), st.integers(1, 16), st.integers(1, 255), st.data())
def test_lane_sums_decode_exactly_when_allowed(bits: int, n: int, vmax: int, data: st.DataObject) -> None:
    vmax = min(vmax, (1 << bits) - 1)
    if not packing.lane_sum_fits(n, bits, vmax):
        with pytest.raises(ValueError, match=f"at most {packing.max_lane_workers(bits, vmax)} workers"):
            packing.require_lane_sum_fits(n, bits, vmax)
        return
    d = data.draw(st.integers(0, 70))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    pool = np.array([0, vmax, rng.integers(0, vmax + 1)])  # all at the maximum happens often
    rows = pool[rng.integers(0, 3, size=(n, d))] if data.draw(st.booleans()) else np.full((n, d), vmax)
    wire = torch.zeros(packing.packed_size(d, bits), dtype=torch.uint8)
    for row in rows:
        wire += packing.pack_lanes(torch.from_numpy(row.astype(np.uint8)), bits)  # wraps like the allreduce
    assert np.array_equal(packing.unpack_lanes(wire, bits, d).numpy().astype(np.int64), rows.sum(0))


@fuzz(100)
@given(st.integers(0, 127), st.integers(1, 16), st.data())
def test_offset_lanes_round_trip(s: int, n: int, data: st.DataObject) -> None:
    d = data.draw(st.integers(0, 40))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    levels = torch.from_numpy(np.array([-s, 0, s])[rng.integers(0, 3, size=(n, d))].astype(np.int8))
    if data.draw(st.booleans()):
        levels = torch.from_numpy(rng.integers(-s, s + 1, size=(n, d)).astype(np.int8))
    lanes = packing.offset_encode(levels, s)
    assert lanes.dtype == torch.uint8 and torch.equal(lanes.to(torch.int64), levels.to(torch.int64) + s)
    total = levels.to(torch.int64).sum(0)
    if n * 2 * s <= 255:  # the budget rule: then a real uint8 byte sum cannot wrap
        wire = torch.zeros(d, dtype=torch.uint8)
        for lane in lanes:
            wire += lane
        assert torch.equal(packing.offset_decode(wire, n, s).to(torch.int64), total)
    assert torch.equal(packing.offset_decode(lanes.to(torch.int64).sum(0), n, s).to(torch.int64), total)
    with pytest.raises(ValueError, match="max_level"):
        packing.offset_encode(levels[0], data.draw(st.sampled_from([-1, 128, 255])))


@fuzz(100)
@given(
    st.integers(1, 16) | st.sampled_from([255, 256, 300]),
    st.integers(0, 120),
    st.sampled_from(["numpy", "torch"]),
    st.data(),
)
def test_count_votes_and_majority(n: int, n_bits: int, kernel: str, data: st.DataObject) -> None:
    bias = data.draw(st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0, 1))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    bits = rng.random((n, n_bits)) < bias
    rows = torch.from_numpy(np.stack([np.packbits(b, bitorder="big") for b in bits]).reshape(n, -1))
    with mock.patch.object(packing, "_numpy_path", lambda t: kernel == "numpy"):
        counts = packing.count_votes(rows, n_bits)
        assert np.array_equal(counts.numpy().astype(np.int64), bits.sum(0))
        for tie_positive in (True, False):
            c = bits.sum(0)
            want = (2 * c > n) | ((2 * c == n) & tie_positive)
            assert np.array_equal(
                packing.pack_majority(counts, n, tie_positive).numpy(), np.packbits(want, bitorder="big")
            )


# ------------------------------------------------------------------------- votes on simulated ranks


def _sign0(c: np.ndarray) -> np.ndarray:
    return np.nan_to_num(np.sign(c))  # sign(NaN) = 0


def _as_value(v: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.asarray(v, dtype=np.float64)).to(dtype)


VOTE_KINDS = ("1bit", "lanes", "int8-sign", "average", "quantized", "server", "dense")


@st.composite
def vote_configs(draw, n: int) -> tuple[str, Any, dict[str, Any]]:
    kind = draw(st.sampled_from(VOTE_KINDS))
    if kind == "1bit":
        return kind, lambda c: OneBitVote(c), {}
    if kind == "lanes":
        bits = draw(st.sampled_from([2, 4, 8, "auto"]))
        return kind, lambda c: LaneVote(c, bits), {"bits": bits}
    if kind == "int8-sign":
        return kind, lambda c: SignSumVote(c), {}
    if kind == "average":
        return kind, lambda c: AverageVote(c), {}
    if kind == "server":
        agg = draw(st.sampled_from(["majority", "average"]))
        root = draw(st.integers(0, n - 1))
        return kind, lambda c: ServerVote(c, agg, root), {"aggregation": agg, "root": root}
    if kind == "dense":
        wire = draw(st.sampled_from([None, torch.float32, torch.bfloat16, torch.float16, torch.float64]))
        return kind, lambda c: DenseMean(c, wire), {"wire": wire}
    name = draw(st.sampled_from(sorted(Q.QUANTIZERS)))
    bits = draw(st.sampled_from([2, 4, 8, "auto"]))
    opts = draw(quantizer_options(name))
    chunk, clip = opts.pop("chunk_size", None), opts.pop("clip_multiple", 2.0)
    seed = draw(st.integers(0, 5))

    def make(c):
        return QuantizedVote(
            c, name, bits, clip_multiple=clip, chunk_size=chunk, options=dict(opts), seed=seed
        )

    cfg = {"name": name, "bits": bits, "opts": opts, "chunk": chunk, "clip": clip, "seed": seed}
    return kind, make, cfg


def expected_votes(
    kind: str, cfg: dict, algo, locals_: list[torch.Tensor], step: int, segments
) -> torch.Tensor:
    """The vote from first principles: per-worker votes/levels in numpy, their count/sum, the rule."""
    n, dtype = len(locals_), locals_[0].dtype
    c = np.stack([x.double().numpy() for x in locals_]) if locals_[0].numel() else np.zeros((n, 0))
    with np.errstate(invalid="ignore"):  # NaN votes "-"; an exact zero "+" where rank + step is even
        zero_plus = (np.arange(n) + step) % 2 == 0
        count = ((c > 0) | ((c == 0) & zero_plus[:, None])).sum(0)
    majority = np.sign(2 * count - n)
    if kind == "quantized":
        total = 0
        for r, x in enumerate(locals_):
            extra = {"chunk_size": cfg["chunk"]} if cfg["name"] != "sign" else {}
            if cfg["name"] in ("l1", "l0", "linf", "lp"):
                extra["clip_multiple"] = cfg["clip"]
            if cfg["name"] == "qsgd":
                extra["generator"] = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + r)
            pieces = x.split(list(segments)) if segments else [x]
            q = (
                torch.cat([Q.quantize(cfg["name"], p, algo.levels, **cfg["opts"], **extra) for p in pieces])
                if x.numel()
                else torch.zeros(0, dtype=torch.int8)
            )
            assert int(q.abs().max()) <= algo.levels if q.numel() else True
            total = total + q.to(torch.int64).numpy()
        return torch.from_numpy(np.sign(np.asarray(total, dtype=np.int64)).astype(np.int8)).reshape(-1)
    if n == 1:
        signs = _sign0(c[0])
        value = kind in ("average", "dense") or (kind == "server" and cfg["aggregation"] == "average")
        if kind == "dense":
            return locals_[0]
        return _as_value(signs, dtype) if value else torch.from_numpy(signs.astype(np.int8))
    if kind == "1bit":
        tie = 1 if step % 2 == 1 else -1
        return torch.from_numpy(np.where(majority == 0, tie, majority).astype(np.int8))
    if kind in ("lanes",) or (kind == "server" and cfg["aggregation"] == "majority"):
        return torch.from_numpy(majority.astype(np.int8))
    if kind == "server":
        return _as_value(2 * count - n, dtype) / n
    if kind == "int8-sign":
        return torch.from_numpy(np.sign(_sign0(c).sum(0)).astype(np.int8))
    if kind == "average":
        return _as_value(_sign0(c).sum(0), dtype) / n
    raise AssertionError(kind)


def _construct(make, n: int, kind: str, cfg: dict):
    """Build the algorithm for N ranks; a refusal must be a ValueError naming the lane width."""
    try:
        return make(SimComm(SimWorld(n), 0))
    except ValueError as err:
        msg = str(err)
        assert kind in ("lanes", "quantized"), msg
        assert ("bits" in msg or "-bit" in msg) and f"{n}" in msg and "at most" in msg, msg
        return None


@fuzz(250)
@given(st.integers(1, 16), st.data())
def test_votes_on_simulated_ranks_match_reference(n: int, data: st.DataObject) -> None:
    kind, make, cfg = data.draw(vote_configs(n))
    algo = _construct(make, n, kind, cfg)
    assume(algo is not None)
    dtype = data.draw(st.sampled_from(FLOATS))
    d = data.draw(st.sampled_from(LENGTHS[:-1]))
    finite = kind == "dense"  # the dense mean is checked on finite values below
    locals_ = list(data.draw(float_tensors(dtype, n=d, non_finite=not finite, rows=n)).unbind(0))
    if n % 2 == 0 and data.draw(st.booleans()):  # the second half mirrors the first: ties everywhere
        locals_[n // 2 :] = [-x for x in locals_[: n // 2]]
    step = data.draw(st.integers(1, 4))
    segments = None
    if kind == "quantized" and d and data.draw(st.booleans()):
        cuts = sorted(data.draw(st.sets(st.integers(1, d - 1), max_size=4))) if d > 1 else []
        segments = [b - a for a, b in itertools.pairwise([0, *cuts, d])]
    results = run_vote(make, [x.clone() for x in locals_], step, segments, first=cfg.get("root", 0))
    for r, res in enumerate(results):  # identical on every rank
        assert res.shape == (d,), f"rank {r}: shape {tuple(res.shape)}"
        torch.testing.assert_close(res, results[0], rtol=0, atol=0, equal_nan=True, msg=f"rank {r} != rank 0")
    got = results[0]
    if kind == "dense":
        check_dense_mean(locals_, got, cfg["wire"])
        return
    want = expected_votes(kind, cfg, algo, locals_, step, segments)
    if algo.result == "vote":
        assert got.dtype == torch.int8 and bool((got.abs() <= 1).all())
        if kind == "1bit" and n > 1:
            assert bool((got != 0).all()), "1-bit votes are never 0"
    else:
        assert got.dtype == dtype and bool((got.abs() <= 1).all()) and bool(torch.isfinite(got).all())
    assert torch.equal(got, want.to(got.dtype)), f"{kind} {cfg}: got {got.tolist()}, want {want.tolist()}"


def check_dense_mean(locals_: list[torch.Tensor], got: torch.Tensor, wire: torch.dtype | None) -> None:
    n, dtype = len(locals_), locals_[0].dtype
    wire = wire or dtype
    assert got.dtype == dtype
    if n == 1:
        assert torch.equal(got, locals_[0])
        return
    c = np.stack([x.double().numpy() for x in locals_])
    with np.errstate(over="ignore", invalid="ignore"):
        _check_dense_values(c, got, wire, dtype)


def _check_dense_values(c: np.ndarray, got: torch.Tensor, wire: torch.dtype, dtype: torch.dtype) -> None:
    n = c.shape[0]
    limit = min(torch.finfo(wire).max, torch.finfo(dtype).max) / 2
    inside = np.all(np.abs(c) <= limit, axis=0)  # values that fit the wire: a finite mean
    g = got.double().numpy()
    assert np.isfinite(g[inside]).all(), "finite values within the wire's range gave a non-finite mean"
    mean = c.mean(0)
    eps = max(torch.finfo(wire).eps, torch.finfo(dtype).eps)
    tiny = max(torch.finfo(wire).tiny, torch.finfo(dtype).tiny)
    tol = (n + 2) * eps * np.abs(c).max(0) + (n + 2) * tiny
    assert np.all(np.abs(g - mean)[inside] <= tol[inside])


# ------------------------------------------------------------------ the simulator against real gloo

GLOO_SPECS = [
    ("1bit", {}),
    ("lanes", {"bits": 2}),
    ("lanes", {"bits": "auto"}),
    ("int8-sign", {}),
    ("average", {}),
    ("server", {"aggregation": "majority", "root": 1}),
    ("server", {"aggregation": "average", "root": 0}),
    ("quantized", {"name": "l1", "bits": 8}),
    ("quantized", {"name": "l1", "bits": 4, "chunk": 7}),
    ("quantized", {"name": "qsgd", "bits": 8, "seed": 3}),
    ("quantized", {"name": "log", "bits": 4}),
    ("dense", {"wire": torch.bfloat16}),
]


def _build(kind: str, spec: dict, comm):
    if kind == "quantized":
        return QuantizedVote(
            comm, spec["name"], spec["bits"], chunk_size=spec.get("chunk"), seed=spec.get("seed", 0)
        )
    return {
        "1bit": lambda: OneBitVote(comm),
        "lanes": lambda: LaneVote(comm, spec.get("bits")),
        "int8-sign": lambda: SignSumVote(comm),
        "average": lambda: AverageVote(comm),
        "server": lambda: ServerVote(comm, spec.get("aggregation"), spec.get("root", 0)),
        "dense": lambda: DenseMean(comm, spec.get("wire")),
    }[kind]()


def _gloo_inputs(world: int) -> list[torch.Tensor]:
    """Per-rank vectors with ties across ranks, zeros, -0.0, extremes and (on rank 1) NaN/±Inf."""
    gen = torch.Generator().manual_seed(42)
    base = torch.randn(67, generator=gen) * 10.0 ** torch.randint(-40, 38, (67,), generator=gen)
    xs = []
    for r in range(world):
        x = base * torch.where(torch.rand(67, generator=gen) < 0.5, -1.0, 1.0)
        x[::9] = 0.0
        x[1::9] = -0.0
        x[2], x[3] = 3.4e38, -1e-45
        if r == 1:
            x[4], x[5], x[6] = NAN, INF, -INF
        xs.append(x)
    return xs


def _gloo_worker(rank: int, world: int) -> list[torch.Tensor]:
    from lioncub.collectives import Comm

    comm = Comm()
    x = _gloo_inputs(world)[rank]
    return [
        _build(kind, spec, comm).start(x.clone(), step=2, segments=None).wait() for kind, spec in GLOO_SPECS
    ]


@pytest.mark.slow
def test_simulated_ranks_equal_real_gloo_ranks() -> None:
    """The same votes on 3 gloo processes and on 3 simulated ranks agree bit for bit (NaN included):
    :class:`SimComm` is a faithful stand-in for the fuzzing above."""
    world = 3
    real = run_workers(_gloo_worker, world)
    xs = _gloo_inputs(world)
    for i, (kind, spec) in enumerate(GLOO_SPECS):
        sim = run_vote(
            lambda c, kind=kind, spec=spec: _build(kind, spec, c),
            [x.clone() for x in xs],
            2,
            first=spec.get("root", 0),
        )
        for rank in range(world):
            torch.testing.assert_close(
                real[rank][i], sim[rank], rtol=0, atol=0, equal_nan=True, msg=f"{kind} {spec} rank {rank}"
            )
