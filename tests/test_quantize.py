"""Quantizers against a float64 numpy oracle, plus hypothesis properties and the level budget."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lioncub.ops import quantize as Q
from profiles import examples

NORMALISED = ["l1", "l0", "linf", "lp", "log"]
ALL = [*NORMALISED, "sign", "qsgd"]


def oracle_normaliser(x: np.ndarray, p: float, eps: float | None = None) -> float:
    a = np.abs(x.astype(np.float64))
    if p == math.inf:
        return float(a.max())
    if p == 0:
        if eps is not None:
            return float(np.exp(np.mean(np.log(a + eps))))
        nz = a[a > 0]
        return float(np.exp(np.mean(np.log(nz)))) if nz.size else 0.0
    return float(np.mean(a**p) ** (1 / p))


def oracle_levels(x: np.ndarray, s: int, p: float, k: float, eps: float | None = None):
    """Returns (levels, ambiguous): ambiguous marks values within 1e-6 of a rounding half-way point."""
    m = oracle_normaliser(x, p, eps)
    if m == 0:
        return np.zeros(x.shape, np.int64), np.zeros(x.shape, bool)
    t = x.astype(np.float64) / m * (s / k)  # divide first, then scale (as the authors' code)
    frac = np.abs(t - np.floor(t) - 0.5)
    return np.clip(np.round(t), -s, s).astype(np.int64), (frac < 1e-6) & (np.abs(t) < s + 1)


def call(name: str, x: torch.Tensor, s: int, **kw) -> torch.Tensor:
    if name == "qsgd":
        kw.setdefault("generator", torch.Generator().manual_seed(0))
    if name == "lp":
        kw.setdefault("p", 1.5)
    return Q.quantize(name, x, s, **kw)


@pytest.mark.parametrize("p, name", [(1.0, "l1"), (0.0, "l0"), (math.inf, "linf"), (1.5, "lp"), (3.0, "lp")])
@pytest.mark.parametrize("k", [2.0, 1.0])
@pytest.mark.parametrize("s", [1, 7, 15, 63, 127])
def test_normalised_quantizers_match_float64_oracle(p: float, name: str, k: float, s: int) -> None:
    rng = np.random.default_rng(s)
    x = rng.laplace(size=4099) * 1e-3  # heavy-ish tails, as Lion's pre-sign updates
    x[::17] = 0.0
    kw = {"clip_multiple": k} | ({"p": p} if name == "lp" else {})
    got = Q.quantize(name, torch.from_numpy(x), s, **kw).numpy().astype(np.int64)
    want, ambiguous = oracle_levels(x, s, p, k)
    assert np.array_equal(got[~ambiguous], want[~ambiguous])
    assert np.all(np.abs(got[ambiguous] - want[ambiguous]) <= 1)


def test_l1_authors_and_paper_forms() -> None:
    x = torch.tensor([1.0, -1.0, 2.0, -4.0, 0.0])  # mean |x| = 1.6
    assert Q.quantize_l1(x, 10).tolist() == [3, -3, 6, -10, 0]  # x/1.6*5: 3.125, 6.25, -12.5 -> clip
    assert Q.quantize_l1(x, 10, clip_multiple=1.0).tolist() == [6, -6, 10, -10, 0]


def test_l0_eps_is_the_authors_normaliser() -> None:
    x = torch.tensor([1.0, 4.0, 0.0, -2.0], dtype=torch.float64)
    assert Q.lp_normalizer(x[None], 0).item() == pytest.approx(2.0)  # geometric mean of 1, 4, 2
    want = math.exp(np.mean(np.log(np.abs(x.numpy()) + 1e-12)))
    assert Q.lp_normalizer(x[None], 0, eps=1e-12).item() == pytest.approx(want)
    got = Q.quantize_l0(x, 15, eps=1e-12).numpy()
    assert np.array_equal(got, oracle_levels(x.numpy(), 15, 0.0, 2.0, eps=1e-12)[0])


def test_round_half_to_even() -> None:
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5])  # mean |x| = 1.5, so s=3, k=2 gives factor 1
    assert Q.quantize_l1(x, 3).tolist() == [0, 2, 2, 0, -2, -2]


@pytest.mark.parametrize("chunk", [1, 5, 64, 1000])
@pytest.mark.parametrize("name", ["l1", "l0", "linf", "log"])
def test_chunked_normalisation_equals_per_chunk_calls(chunk: int, name: str) -> None:
    """1003 elements: a last chunk of 3 (chunk 5 and 1000) or 43 (64). Chunks of 1 are all whole at any
    length and the reference makes one call per element: 101 elements there (x / M = ±1 in every chunk)."""
    x = torch.randn(1003 if chunk > 1 else 101, dtype=torch.float64)
    got = call(name, x, 15, chunk_size=chunk)
    want = torch.cat([call(name, piece, 15) for piece in x.split(chunk)])
    assert torch.equal(got, want)


def test_qsgd_matches_definition_and_is_unbiased() -> None:
    """4000 draws of x's levels from one call on 4000 copies of x: the copies have x's max |x| (the whole
    tensor's normaliser), and each element's rounding is its own uniform draw, so each copy's levels are
    one draw of x's (4000 calls of 5 elements took ~0.4 s of CPU)."""
    x = torch.tensor([0.5, -0.25, 0.1, 0.0, -1.0], dtype=torch.float64)
    s = 4
    copies = Q.quantize_qsgd(x.repeat(4000), s, generator=torch.Generator().manual_seed(0))
    draws = copies.view(4000, x.numel()).to(torch.float64)
    # levels are floor or ceil of s|x|/max|x|
    rel = (s * x.abs() / x.abs().max()).numpy()
    mags = draws.abs().numpy()
    assert np.all((mags == np.floor(rel)) | (mags == np.ceil(rel)))
    # unbiased: E[q] * max|x| / s == x (4000 draws: standard error <= 0.5/sqrt(4000) levels)
    assert torch.allclose(draws.mean(0) * x.abs().max() / s, x, atol=0.03)
    # 2-norm variant uses ||x||_2
    q2 = Q.quantize_qsgd(x, 1000, norm="2", generator=torch.Generator().manual_seed(0)).double()
    assert torch.allclose(q2 / 1000 * torch.linalg.vector_norm(x), x, atol=2e-3)
    # the same generator state gives the same levels
    a = Q.quantize_qsgd(x, s, generator=torch.Generator().manual_seed(7))
    b = Q.quantize_qsgd(x, s, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_log_levels_are_powers_of_two_of_s() -> None:
    x = torch.tensor([8.0, 4.0, -2.0, 1.0, 0.5, 0.25, 0.0, 3.1])
    # s = 8: levels 8, 4, 2, 1, then 0.5 rounds to 0 (half to even); 3.1 -> 2^-round(log2(8/3.1)=1.37)=1/2
    assert Q.quantize_log(x, 8).tolist() == [8, 4, -2, 1, 0, 0, 0, 4]


def test_level_budget() -> None:
    assert [Q.level_budget(n, 8) for n in (1, 2, 4, 8, 16, 127)] == [127, 63, 31, 15, 7, 1]
    assert Q.level_budget(3, 4, "offset") == 2  # 3 workers x (2*2) = 12 <= 15
    assert Q.level_budget(15, 4, "vote") == 1
    for n in range(1, 40):
        for bits in (2, 4, 8):
            for enc in ("signed", "offset", "vote"):
                try:
                    s = Q.level_budget(n, bits, enc)
                except ValueError as err:
                    assert "at most" in str(err) and f"n_workers={n}" in str(err)
                    continue
                span = {"signed": s, "offset": 2 * s, "vote": 1}[enc]
                top = (1 << (bits - 1)) - 1 if enc == "signed" else (1 << bits) - 1
                assert n * span <= top  # the sum fits ...
                if enc != "vote":
                    extra = {"signed": s + 1, "offset": 2 * (s + 1)}[enc]
                    assert n * extra > top  # ... and the budget is the largest that does
    with pytest.raises(ValueError, match="n_workers=128"):
        Q.level_budget(128, 8)
    with pytest.raises(ValueError, match="n_workers=16"):
        Q.level_budget(16, 4, "vote")
    with pytest.raises(ValueError, match="encoding"):
        Q.level_budget(2, 8, "twos")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------- properties

finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
vectors = st.lists(finite32, min_size=0, max_size=64)


@settings(max_examples=examples(150), deadline=None)
@given(st.sampled_from(ALL), vectors, st.integers(1, 127), st.sampled_from([None, 1, 3, 16]))
def test_levels_in_range_and_signs_agree(name: str, values: list[float], s: int, chunk) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    kw = {} if name == "sign" else {"chunk_size": chunk}
    q = call(name, x, s, **kw)
    assert q.shape == x.shape and q.dtype == torch.int8
    bound = 1 if name == "sign" else s
    assert (int(q.abs().amax()) if q.numel() else 0) <= bound
    nz = q != 0
    assert torch.equal(torch.sign(q[nz].float()), torch.sign(x[nz]))
    assert bool((q[x == 0] == 0).all())


@settings(max_examples=examples(150), deadline=None)
@given(
    st.sampled_from([*NORMALISED, "qsgd"]),
    st.lists(finite32, min_size=1, max_size=64),
    st.integers(1, 127),
    st.integers(-60, 60),
)
def test_scale_invariance_power_of_two(name: str, values: list[float], s: int, exponent: int) -> None:
    x = torch.tensor(values, dtype=torch.float64)
    a = 2.0**exponent
    assume(bool(torch.isfinite(x * a).all()))
    assume(float(x.abs().max()) * a > 1e-290 or float(x.abs().max()) == 0)  # stay out of denormals
    assert torch.equal(call(name, x, s), call(name, x * a, s))


@settings(max_examples=examples(100), deadline=None)
@given(
    st.sampled_from(["l1", "l0", "linf", "lp"]),
    st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=64),
    st.integers(1, 127),
    st.floats(1e-3, 1e3),
)
def test_scale_invariance_any_positive_scale(name: str, values: list[float], s: int, a: float) -> None:
    x = torch.tensor(values, dtype=torch.float64)
    diff = (call(name, x, s).to(torch.int64) - call(name, x * a, s).to(torch.int64)).abs()
    assert int(diff.max()) <= 1  # only half-way points may round the other way


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_edge_inputs(name: str, dtype: torch.dtype) -> None:
    for values in ([], [0.0], [0.0] * 9, [3.0], [-2.0], [1e30, -1e30, 5.0], [1e-30, -1e-30, 0.0]):
        x = torch.tensor(values, dtype=torch.float64).to(dtype)
        q = call(name, x, 15)
        assert q.shape == x.shape and q.dtype == torch.int8
        assert (int(q.abs().amax()) if q.numel() else 0) <= 15
        nz = q != 0
        assert torch.equal(torch.sign(q[nz].double()), torch.sign(x[nz].double()))
    # all zeros stay zeros, a lone value takes a full-sign level, huge and tiny are symmetric
    assert call(name, torch.zeros(7, dtype=dtype), 15).abs().sum() == 0
    assert call(name, torch.tensor([-3.0], dtype=dtype), 15).item() < 0
    if dtype in (torch.float32, torch.float64):
        big = call(name, torch.tensor([1e30, -1e30], dtype=dtype), 15).tolist()
        assert big[0] == -big[1] != 0


def test_huge_sums_do_not_overflow() -> None:
    x = torch.full((1000,), 3e38)
    x[::2] *= -1
    assert Q.quantize_l1(x, 7).abs().min().item() == 4  # mean |x| = 3e38; 1 * 7 / 2 = 3.5 -> 4
    tiny = torch.full((10,), 1e-45)  # denormals: the factor overflows float32
    assert Q.quantize_l1(tiny, 7).tolist() == [4] * 10


def test_large_levels_use_wider_dtype() -> None:
    assert Q.quantize_l1(torch.randn(10), 1000).dtype == torch.int16
    assert Q.level_dtype(127) == torch.int8 and Q.level_dtype(40000) == torch.int32


def test_bad_arguments() -> None:
    x = torch.randn(4)
    with pytest.raises(ValueError, match="levels=0"):
        Q.quantize_l1(x, 0)
    with pytest.raises(ValueError, match="clip_multiple"):
        Q.quantize_l1(x, 3, clip_multiple=0)
    with pytest.raises(ValueError, match="chunk_size"):
        Q.quantize_l1(x, 3, chunk_size=0)
    with pytest.raises(ValueError, match="p=-1"):
        Q.quantize_lp(x, 3, p=-1)
    with pytest.raises(ValueError, match="norm"):
        Q.quantize_qsgd(x, 3, norm="1")
    with pytest.raises(ValueError, match="quantizer='l2'"):
        Q.quantize("l2", x, 3)
    with pytest.raises(TypeError, match="floating"):
        Q.quantize_l1(torch.arange(4), 3)


@pytest.mark.parametrize("name", ["l1", "l0", "linf", "lp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("chunk", [None, 4, 7])
def test_out_equals_fresh_result(name: str, dtype: torch.dtype, chunk: int | None) -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 5, generator=gen) * 10.0 ** torch.randint(-3, 3, (6, 5), generator=gen)).to(dtype)
    x[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])  # non-finite inputs too
    for s in (3, 127, 1000):
        want = Q.quantize(name, x, s, chunk_size=chunk)
        out = torch.full(x.shape, 99, dtype=Q.level_dtype(s))
        got = Q.quantize(name, x, s, chunk_size=chunk, out=out)
        assert got is out and torch.equal(out, want)


def test_bad_out_is_refused() -> None:
    x = torch.randn(8)
    for out in (
        torch.empty(8, dtype=torch.int16),
        torch.empty(9, dtype=torch.int8),
        torch.empty(16, dtype=torch.int8)[::2],
    ):
        with pytest.raises(ValueError, match=r"out must be a contiguous torch\.int8 tensor of shape"):
            Q.quantize_l1(x, 15, out=out)


def test_threaded_cpu_path_equals_single_thread() -> None:
    """5M elements on 1 and on 3 threads; the float64 reference in place on one copy of x (the same
    operations in the same order, a third of the passes over 40 MB)."""
    x = torch.randn(5 << 20, generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = Q.quantize_l1(x, 15)
        torch.set_num_threads(3)  # 5M elements: two threads (at least 2M elements each)
        many = Q.quantize_l1(x, 15)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)
    ref = x.double()
    ref.div_(ref.abs().mean()).mul_(15 / 2).round_().clamp_(-15, 15)
    off = ref.sub_(one).abs_()  # float32 scaling may land on the other side of a half-way point
    assert int(off.max()) <= 1 and int((off > 0).sum()) < 100


@pytest.mark.parametrize("chunk", [None, 64, 1000])
def test_torch_kernel_equals_numpy_kernel(chunk: int | None, monkeypatch) -> None:
    """The device-generic torch kernel (what CUDA runs) and the CPU numpy kernel give the same levels."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(300_001, generator=gen) * 10.0 ** torch.randint(-4, 4, (300_001,), generator=gen)
    x[:2] = torch.tensor([float("inf"), float("nan")])
    cases = [(x, s) for s in (1, 15, 127)] + [(x[2:], 15), (x[2:].double(), 127)]
    fast = [Q.quantize_l1(v, s, chunk_size=chunk) for v, s in cases]
    monkeypatch.setattr(Q, "_numpy_path", lambda t: False)
    for (v, s), want in zip(cases, fast, strict=True):
        assert torch.equal(Q.quantize_l1(v, s, chunk_size=chunk), want)


SPECIALS = [math.nan, math.inf, -math.inf, -0.0]


@settings(max_examples=examples(200))
@given(
    st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    st.integers(0, 300),
    st.lists(st.tuples(st.integers(0, 299), st.sampled_from(SPECIALS)), max_size=3),
    st.integers(0, 2**31 - 1),
)
def test_max_abs_is_numpy_max_of_abs(dtype: torch.dtype, n: int, specials: list, seed: int) -> None:
    """``max_abs`` (aminmax) against numpy's ``max(|x|)`` in float64: NaN/±Inf/−0 anywhere, in the vector
    body or the tail, every length from 0; and per row with ``dim=-1``."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    for i, v in specials:
        if i < n:
            x[i] = v
    x = x.to(dtype)
    ref = x.double().numpy()
    got = Q.max_abs(x)
    assert got.dtype == dtype and got.shape == ()
    np.testing.assert_array_equal(got.double().numpy(), np.max(np.abs(ref)) if n else 0.0)
    if n:
        rows = x.reshape(1, n).expand(3, n).contiguous()
        rows[1] = -rows[1]
        np.testing.assert_array_equal(Q.max_abs(rows, dim=-1).double().numpy(), np.max(np.abs(ref)).repeat(3))


# ----------------------------------------------------------------------------- off the CPU: no host reads


def _host_reads() -> type:
    """``benchmarks/gpu_path.py``'s ``HostReads`` (what makes a GPU's host wait), loaded read-only."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_path.py"
    spec = importlib.util.spec_from_file_location("gpu_path", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HostReads


HostReads = _host_reads()
widths = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@settings(max_examples=examples(300), deadline=None)
@given(
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    st.lists(widths, min_size=1, max_size=40),
    st.integers(-140, 120),
    st.sampled_from([1, 2, 3, 7, 42, 63, 127, 3000, 40_000, 2**25]),
    st.sampled_from([2.0, 1.0, 0.7, 3.0]),
    st.sampled_from([None, 1, 3, 16]),
    st.sampled_from([1.0, 0.0, math.inf]),
)
def test_the_device_scaling_reads_nothing_and_gives_the_host_levels(
    dtype: torch.dtype, values: list[float], exponent: int, s: int, k: float, chunk: int | None, p: float
) -> None:
    """Off the CPU the scaling reads neither whether a tensor is finite nor its work dtype on the host (each
    was a GPU synchronization per tensor): it works in float64, rounding to float32 where the tensor does
    not work wide — bit for bit the host's levels, at half-way points, subnormal and huge normalisers
    (float64 work) and non-finite values included."""
    x = (torch.tensor(values, dtype=torch.float64) * 2.0**exponent).to(dtype)
    rows, _n = Q._as_rows(x, chunk)
    norm = Q.lp_normalizer(rows, p)
    want = Q._scale_round_clip(rows, norm, s, k)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Q, "_reads_free", lambda t: False)
        with HostReads() as reads:
            got = Q._scale_round_clip(rows, norm, s, k)
    assert reads.count == 0, reads.names
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_quantizers_off_the_cpu_read_nothing_on_the_host(dtype: torch.dtype, monkeypatch) -> None:
    """The torch quantizers as a GPU runs them (the normalisers and the scaling off the CPU) read no value
    on the host — they read 2 per tensor (finite? float64 work?), float64 input 1 more (overflow?)."""
    from lioncub.ops import normalizers

    x = torch.randn(1000, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[7] = float("nan")
    monkeypatch.setattr(normalizers, "on_host", lambda t: False)
    monkeypatch.setattr(Q, "_reads_free", lambda t: False)
    for chunk in (None, 64):
        with HostReads() as reads:
            for name in ("l1", "l0", "linf", "lp"):
                Q.quantize(name, x, 63, chunk_size=chunk)
                Q.quantize(name, x[:999], 63, chunk_size=chunk, out=torch.empty(999, dtype=torch.int8))
        assert reads.count == 0, reads.names


def test_the_float64_sums_off_the_cpu_copy_pieces_not_the_input(monkeypatch) -> None:
    """Off the CPU without Triton the L1 sums cast pieces of at most ``DEVICE_PIECE`` elements to float64,
    not the whole input (``vector_norm(dtype=float64)`` casts its input first); the sums are the exact
    ones on data whose sums are exact in any order. The casts, nested ones too, are seen by the autograd
    profiler without Kineto: the same events, without Kineto's start-up (~1.5 s of CPU, once a process)."""
    from torch.autograd.profiler import profile

    from lioncub.ops import normalizers

    monkeypatch.setattr(normalizers, "on_host", lambda t: False)
    monkeypatch.setattr(normalizers, "DEVICE_PIECE", 1000)
    gen = torch.Generator().manual_seed(4)
    for shape in ((1, 10_000), (40, 250), (3, 2_500)):
        x = torch.randint(-255, 256, shape, generator=gen).float() / 64
        with profile(use_kineto=False, record_shapes=True) as prof:
            sums = normalizers._abs_sums(x)
        casts = [e for e in prof.function_events if e.name == "aten::_to_copy"]
        assert casts and max(math.prod(e.input_shapes[0]) for e in casts) <= 1000
        assert torch.equal(sums, x.double().abs().sum(dim=1))
