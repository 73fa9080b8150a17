"""The fused CPU kernels (lioncub.ops.native, ``backend="cpu"`` of lioncub.ops.kernels) bit for bit against
the torch backend and the torch step code they replace: every kernel on odd, empty and short lengths, NaN/Inf,
float32/float64/bfloat16 and hypothesis inputs; Lion's fused step; LionCub's presets on gloo ranks with the
fused path against the torch path (``LIONCUB_CPU_KERNELS=0``) and against the N-worker simulation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import background
import exec_program
from kernel_steps import counted_calls
from lioncub.collectives.formats import sign_int8
from lioncub.ops import kernels, native, packing
from lioncub.ops.update import apply_update_converting_, update_momentum_
from lioncub.optim import PRESETS, Lion, LionCub
from profiles import examples

from processes import run_workers

LENGTHS = [0, 1, 7, 8, 9, 15, 17, 63, 64, 65, 1000, 4097]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no fused CPU kernels: {native.reason()}")


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (so +0.0 ≠ −0.0), NaN-aware: a NaN matches a NaN of any sign or payload (which operand
    an x86 multiply-add propagates is the compiler's choice; NaN results are skipped steps anyway)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    view = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}[a.dtype]
    return torch.equal(nan_a, nan_b) and torch.equal(a.view(view)[~nan_a], b.view(view)[~nan_b])


def draw(n: int, dtype: torch.dtype, seed: int, specials: bool = True) -> torch.Tensor:
    """Normal values with exact zeros, −0.0, tiny and huge ones and (``specials``) NaN/±Inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x[::5] = 0.0
    x[1::7] = -0.0
    x[2::11] *= 1e-40
    x[3::13] *= 1e30
    if specials and n > 20:
        x[4], x[9], x[16] = float("nan"), float("inf"), float("-inf")
    return x.to(dtype)


# ------------------------------------------------------------------------------------------ the choice


def test_switched_off_by_the_environment(monkeypatch) -> None:
    x = torch.zeros(8)
    assert kernels.backend_for(x) in ("cpu", "triton")
    monkeypatch.setenv("LIONCUB_CPU_KERNELS", "0")
    assert not native.available() and "LIONCUB_CPU_KERNELS" in native.reason()
    assert kernels.backend_for(x) in ("torch", "triton") and kernels.step_backend_for(x) in (
        "torch",
        "triton",
    )
    with pytest.raises(RuntimeError, match="LIONCUB_CPU_KERNELS"):
        kernels.apply_votes_(x, torch.zeros(8, dtype=torch.int8), lr=1.0, backend="cpu")


def test_prefetch_is_chosen_by_vendor_or_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("LIONCUB_CPU_PREFETCH", raising=False)
    on, why = native.prefetch_choice()
    assert on == ("AMD" not in why) and why
    for value, want in (("0", False), ("off", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("LIONCUB_CPU_PREFETCH", value)
        assert native.prefetch_choice() == (want, f"LIONCUB_CPU_PREFETCH={value!r}")
    monkeypatch.setenv("LIONCUB_CPU_PREFETCH", "2")
    with pytest.raises(ValueError, match=r"LIONCUB_CPU_PREFETCH='2': must be 1 or 0"):
        native.prefetch_choice()


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefetch_changes_no_bit(dtype: torch.dtype) -> None:
    """Every streaming pass (direction: c, signs, 1-bit lanes, each with the next momentum; the apply with
    the momentum update) gives the same bits with and without the software prefetch, on a length past
    several prefetch distances."""
    n, was = 3 * 4096 + 13, native.prefetch()[0]
    m, g, p = draw(n, dtype, 1), draw(n, dtype, 2), draw(n, dtype, 3)
    results = []
    for on in (True, False):
        native.set_prefetch(on)
        c, signs = torch.zeros_like(m), torch.zeros(n, dtype=torch.int8)
        lanes = torch.zeros(n // 8 + 1, dtype=torch.uint8)
        nexts = [torch.zeros_like(m) for _ in range(3)]
        peaks = [
            native.direction(m, g, 0.9, out=c, next_momentum=nexts[0], beta2=0.99),
            native.direction_sign(m, g, 0.9, out=signs, next_momentum=nexts[1], beta2=0.99),
            native.direction_lanes(
                m, g, 0.9, out=lanes, position=3, bits=1, next_momentum=nexts[2], beta2=0.99
            ),
        ]
        q, mom = p.clone(), m.clone()
        momentum = native.Momentum(mom, g, 0.99)
        native.apply_int8(q, signs, sign_of=True, lr=0.01, weight_decay=0.1, momentum=momentum)
        results.append((peaks, [c, signs, lanes, *nexts, q, mom]))
    native.set_prefetch(was)
    (peaks_on, on), (peaks_off, off) = results
    assert str(peaks_on) == str(peaks_off)
    assert all(same(a, b) for a, b in zip(on, off, strict=True))


def test_step_backend_keeps_bfloat16_and_odd_layouts_on_torch() -> None:
    x = torch.zeros(8)
    assert kernels.step_backend_for(x, x, None) == "cpu"
    assert kernels.step_backend_for(x.double(), x.double()) == "cpu"
    assert kernels.step_backend_for(x.bfloat16()) == "torch"  # the step's bf16 ops are ATen's own
    assert kernels.step_backend_for(x, x.double()) == "torch"  # mixed dtypes
    assert kernels.step_backend_for(torch.zeros(4, 4).t()) == "torch"
    assert kernels.step_backend_for(torch.zeros(4).to_sparse()) == "torch"


#: the background job ``no_compiler``: Lion's step where ``$CC`` names no compiler, in a fork of the fork
#: server (torch imported; lioncub imported after the environment is set, its kernels never loaded before)
NO_COMPILER = """
import os
os.environ["CC"] = str(workdir / "no-such-cc")
os.environ["LIONCUB_KERNEL_CACHE"] = str(workdir / "cache")
os.environ.pop("LIONCUB_CPU_KERNELS", None)
import torch
from lioncub.ops import kernels, native
from lioncub.optim import Lion
p = torch.nn.Parameter(torch.ones(10)); p.grad = torch.ones(10)
Lion([p], lr=0.5).step()
chosen = f"{native.available()} {kernels.backend_for(p.detach())} {float(p[0])}"
(workdir / "out").write_text(f"{chosen}\\n{native.reason()}")
"""

#: tests/background.py's jobs of this module
BACKGROUND = {
    "no_compiler": lambda: background.Spawned(exec_program.in_job, 1, args=(NO_COMPILER,), timeout=120)
}


@pytest.mark.slow
@pytest.mark.background("no_compiler")
def test_no_compiler_falls_back_with_a_reason() -> None:
    """Run in the background job ``no_compiler`` (a process whose lioncub had never loaded its kernels)."""
    codes = background.result("no_compiler", BACKGROUND["no_compiler"])
    workdir = background.workdir("no_compiler")
    error = workdir / "error"
    assert codes == [0], error.read_text() if error.exists() else f"the job's process exited with {codes}"
    first, why = (workdir / "out").read_text().splitlines()[:2]
    assert first == "False torch 0.5"
    assert "no C compiler found" in why


# ------------------------------------------------------------------------------------------ kernels


def lerp(a: torch.Tensor, b: torch.Tensor, beta: float) -> torch.Tensor:
    """``a·β + (1−β)·b`` as torch's step rounds it: two float ops for float32/float64, each op in float32
    and rounded to the storage dtype ("opmath") for bfloat16."""
    if a.dtype in (torch.float32, torch.float64):
        return torch.mul(a, beta).add_(b, alpha=1.0 - beta)
    t = torch.mul(a.float(), beta).to(a.dtype).float()
    return t.add_(b.float(), alpha=1.0 - beta).to(a.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_direction_and_next_momentum_equal_torch(dtype: torch.dtype, n: int) -> None:
    """The contribution pass (c, its 1-bit votes with "+" padding, the next momentum, max |c|) against
    torch's direction, pack_signs and momentum update."""
    m, g = draw(n, dtype, n), draw(n, dtype, n + 1)
    for neg, pad_to in [(False, 8), (True, 24), (False, 64)]:
        gg = -g if neg else g
        c = lerp(m, gg, 0.9)
        nbytes = -(-n // pad_to) * pad_to // 8
        lanes, nxt, got_c = (
            torch.full((nbytes,), 0xA5, dtype=torch.uint8),
            torch.empty_like(m),
            torch.empty_like(m),
        )
        more = {"negate": neg, "next_momentum": nxt, "beta2": 0.99}
        peak = native.direction_lanes(m, g, 0.9, out=lanes, position=0, bits=1, **more)
        native.fill_lanes(lanes, n, nbytes * 8, 1, 1)
        assert torch.equal(lanes, packing.pack_signs(c, pad_to=pad_to))
        assert same(nxt, lerp(m, gg, 0.99))
        assert math.isfinite(peak) == bool(torch.isfinite(c).all()) == (n <= 20)
        native.direction(m, g, 0.9, out=got_c, negate=neg)
        assert same(got_c, c)


def test_direction_encodings_at_bucket_positions() -> None:
    """direction / direction_sign / direction_lanes of a bucket's parameters, one call each at its offset,
    equal the torch direction of the flat bucket encoded by pack_signs, pack_lanes and the int8 sign."""
    sizes = [13, 0, 1, 64, 37, 7, 100, 1537]  # the last: several blocks of the kernels
    d = sum(sizes)
    for dtype in (torch.float32, torch.float64):
        ms = [draw(k, dtype, 10 + i, specials=False) for i, k in enumerate(sizes)]
        gs = [draw(k, dtype, 20 + i) if i != 2 else None for i, k in enumerate(sizes)]
        c = torch.cat(
            [
                torch.mul(m, 0.9).add_(g if g is not None else torch.zeros_like(m), alpha=1 - 0.9)
                for m, g in zip(ms, gs, strict=True)
            ]
        )
        flat, signs = torch.empty(d, dtype=dtype), torch.empty(d, dtype=torch.int8)
        for bits in (1, 2, 4, 8):
            per = 8 // bits
            pad_to = 8 * 3 if bits == 1 else per
            lanes = torch.full((-(-d // pad_to) * pad_to * bits // 8,), 0xA5, dtype=torch.uint8)
            pos, peaks = 0, []
            for m, g, k in zip(ms, gs, sizes, strict=True):
                peaks.append(native.direction_lanes(m, g, 0.9, out=lanes, position=pos, bits=bits))
                if bits == 1:
                    native.direction(m, g, 0.9, out=flat[pos : pos + k])
                    native.direction_sign(m, g, 0.9, out=signs[pos : pos + k])
                pos += k
            native.fill_lanes(lanes, d, lanes.numel() * per, bits, 1 if bits == 1 else 0)
            if bits == 1:
                assert torch.equal(lanes, packing.pack_signs(c, pad_to=pad_to))
                assert same(flat, c) and torch.equal(signs, sign_int8(c))
            else:
                assert torch.equal(lanes, packing.pack_lanes(torch.ge(c, 0).view(torch.uint8), bits))
            finite = [p for p in peaks if p == p and p != float("inf")]
            assert len(finite) < len(peaks)  # the gradients hold NaN and Inf
        clean = [draw(k, dtype, 30 + i, specials=False) for i, k in enumerate(sizes)]
        for m, g in zip(ms, clean, strict=True):
            want = torch.mul(m, 0.9).add_(g, alpha=1 - 0.9).abs().max().item() if m.numel() else 0.0
            assert native.direction(m, g, 0.9, out=torch.empty_like(m)) == want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_quantize_l1_equals_torch(dtype: torch.dtype, n: int) -> None:
    x = draw(n, dtype, 3 * n, specials=n % 2 == 1)
    if n > 3:
        x[: n // 3] = 1e-41  # a denormal first chunk: pass 2 in float64 for that segment
    segments = [n // 2, 0, n - n // 2]
    for levels in (1, 7, 15, 63, 127, 1000, 70000):
        for chunk in (None, 16):
            want = kernels.quantize_l1(x, levels, chunk_size=chunk, segments=segments, backend="torch")
            got = kernels.quantize_l1(x, levels, chunk_size=chunk, segments=segments, backend="cpu")
            assert torch.equal(want, got), (levels, chunk)


def test_quantize_l1_halfway_values() -> None:
    """1-element tensors land exactly half-way between two levels (x / M = ±1, s / k = 31.5)."""
    x = torch.tensor([0.8797774, -0.3, 1.0, -1.0, 3.0])
    got = kernels.quantize_l1(x, 63, segments=[1] * 5, backend="cpu")
    assert got.tolist() == [32, -32, 32, -32, 32]
    assert torch.equal(got, kernels.quantize_l1(x, 63, segments=[1] * 5, backend="torch"))


@pytest.mark.parametrize("n_workers", [1, 2, 3, 4, 5, 8, 15, 16, 127, 255, 300])
def test_majority_pack_equals_torch(n_workers: int) -> None:
    gen = torch.Generator().manual_seed(n_workers)
    for row_bytes in (0, 1, 7, 8, 9, 100):
        rows = torch.randint(0, 256, (n_workers, row_bytes), dtype=torch.uint8, generator=gen)
        if row_bytes > 2:
            rows[:, 1] = 0xFF  # unanimous and ...
            rows[: n_workers // 2, 2] = 0xFF  # ... tied (even N) columns
            rows[n_workers // 2 :, 2] = 0
        for tie in (True, False):
            for n_bits in sorted({0, row_bytes * 8, max(0, row_bytes * 8 - 5)}):
                want = kernels.majority_pack(rows, tie, n_bits=n_bits, backend="torch")
                assert torch.equal(kernels.majority_pack(rows, tie, n_bits=n_bits, backend="cpu"), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_apply_equals_torch(dtype: torch.dtype, n: int) -> None:
    """The apply from packed bits at a bit offset (native.apply_bits) and from int8 votes (apply_votes_,
    backend "cpu") against the torch backend of apply_votes_ on the decoded votes."""
    p, m, g = draw(n, dtype, n), draw(n, dtype, n + 7, specials=False), draw(n, dtype, n + 9)
    gen = torch.Generator().manual_seed(n)
    packed = torch.randint(0, 256, ((n + 13) // 8 + 1,), dtype=torch.uint8, generator=gen)
    votes = torch.randint(-1, 2, (n,), dtype=torch.int8, generator=gen)
    cases = [(5e-3, 0.1, True, False, 0), (1e-3, 0.0, False, False, 5), (0.02, 0.5, True, True, 13)]
    for lr, wd, momentum, neg, offset in cases:
        bits = packing.unpack_signs(packed, offset + n, torch.int8)[offset:]
        results = {}
        for backend in ("torch", "cpu"):
            extra = {"exp_avg": m.clone(), "grad": g, "beta2": 0.99, "negate_grad": neg} if momentum else {}
            extra2 = {**extra, "exp_avg": m.clone()} if momentum else {}
            if backend == "cpu":
                a, mom = p.clone(), native.Momentum(extra["exp_avg"], g, 0.99, neg) if momentum else None
                native.apply_bits(a, packed, position=offset, lr=lr, weight_decay=wd, momentum=mom)
            else:
                a = kernels.apply_votes_(p.clone(), bits, lr=lr, weight_decay=wd, backend="torch", **extra)
            b = kernels.apply_votes_(p.clone(), votes, lr=lr, weight_decay=wd, backend=backend, **extra2)
            results[backend] = (a, b, extra.get("exp_avg"), extra2.get("exp_avg"))
        for want, got in zip(results["torch"], results["cpu"], strict=True):
            assert (want is None and got is None) or same(want, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_workers", [2, 3, 4, 7])
def test_apply_of_the_mean_of_signs_equals_the_torch_code(dtype: torch.dtype, n_workers: int) -> None:
    """dlion-avg: ``u = sum / N`` (AverageVote's ``out.copy_(sums).div_(N)``) applied in the same pass."""
    n = 2049
    sums = torch.randint(-n_workers, n_workers + 1, (n,), dtype=torch.int8)
    p, m, g = draw(n, dtype, 5), draw(n, dtype, 6, specials=False), draw(n, dtype, 7)
    pa, ma = p.clone(), m.clone()
    apply_update_converting_(
        pa, torch.empty(n, dtype=dtype).copy_(sums).div_(n_workers), lr=7e-3, weight_decay=0.3
    )
    update_momentum_(ma, g, 0.99)
    pb, mb = p.clone(), m.clone()
    momentum = native.Momentum(mb, g, 0.99)
    native.apply_mean(pb, sums, divisor=n_workers, lr=7e-3, weight_decay=0.3, momentum=momentum)
    assert same(pa, pb) and same(ma, mb)


@pytest.mark.parametrize(("dtype", "wire"), sorted(native.SCALE_DTYPES, key=str))
def test_dense_scale_equals_copy_and_div(dtype: torch.dtype, wire: torch.dtype) -> None:
    """The dense presets' contribution: ``send.copy_(−g or g).div_(N)`` (DenseMean.start) in one pass."""
    for n in (0, 1, 17, 4099):
        g = draw(n, dtype, n)
        if n > 20:
            g[:5] = torch.tensor([3.0, 1e-39, 7.0e38, -2.5, 1.0], dtype=dtype)  # halfway, subnormal, huge
        for workers, neg in ((2, False), (3, True), (7, False)):
            want = torch.empty(n, dtype=wire).copy_(-g if neg else g).div_(workers)
            got = torch.empty(n, dtype=wire)
            peak = native.scale(g, got, divisor=workers, negate=neg)
            assert same(want, got), (n, workers)
            finite = bool(torch.isfinite(g).all())
            assert (peak == float(g.abs().max()) if n else peak == 0.0) if finite else not math.isfinite(peak)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_apply_from_lanes_equals_map_lanes(bits: int) -> None:
    """native.apply_lanes from bits-bit lanes at any lane position, lane value v → table[v]: the decode of
    ``packing.map_lanes`` followed by the step's apply."""
    n, per = 1001, 8 // bits
    gen = torch.Generator().manual_seed(bits)
    lanes = torch.randint(0, 256, (n // per + 3,), dtype=torch.uint8, generator=gen)
    table = tuple(int(v) for v in torch.randint(-1, 2, (1 << bits,), generator=gen))
    p, m, g = draw(n, torch.float32, 1), draw(n, torch.float32, 2, specials=False), draw(n, torch.float32, 3)
    for pos in (0, 1, per - 1, per + 1):
        u = packing.map_lanes(lanes, bits, pos + n, table)[pos:]
        pa, ma = p.clone(), m.clone()
        apply_update_converting_(pa, u, lr=1e-2, weight_decay=0.1)
        update_momentum_(ma, g, 0.9)
        pb, mb = p.clone(), m.clone()
        native.apply_lanes(
            pb, lanes, position=pos, bits=bits, table=table, lr=1e-2, weight_decay=0.1,
            momentum=native.Momentum(mb, g, 0.9),
        )  # fmt: skip
        assert same(pa, pb) and same(ma, mb), pos
    with pytest.raises(ValueError, match="table"):
        native.apply_lanes(p, lanes, bits=bits, table=(1, -1), lr=1.0, weight_decay=0.0)


@pytest.mark.parametrize("n_workers", [2, 3, 4, 5, 8, 16])
def test_server_majority_equals_the_torch_count(n_workers: int) -> None:
    """The parameter server's count + sign + 2-bit lanes in one pass: ServerVote's torch code."""
    gen = torch.Generator().manual_seed(n_workers)
    for d in (0, 1, 7, 8, 9, 63, 1000):
        rows = torch.randint(0, 256, (n_workers, (d + 7) // 8), dtype=torch.uint8, generator=gen)
        if d > 16:
            rows[: n_workers // 2, 1] = 0xFF  # ties for even N
            rows[n_workers // 2 :, 1] = 0
        count = packing.count_votes(rows, d).to(torch.int16)
        want = packing.pack_lanes((torch.sign(2 * count - n_workers) + 1).to(torch.uint8), 2)
        got = torch.full((packing.packed_size(d, 2),), 0xEE, dtype=torch.uint8)
        native.server_majority(rows, got, n_bits=d)
        assert torch.equal(got, want), d


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_raw_apply_equals_the_step_code(dtype: torch.dtype) -> None:
    """native.apply_int8 from int8 sums (sign taken) and apply_values from values of the parameter's dtype:
    the step's torch
    code (``apply_update_converting_`` then ``update_momentum_``), with and without a gradient."""
    n = 3001
    p, m, g = draw(n, dtype, 1), draw(n, dtype, 2, specials=False), draw(n, dtype, 3)
    sums = torch.randint(-9, 10, (n,), dtype=torch.int8)
    values = draw(n, dtype, 4, specials=False)
    for grad in (g, None):
        for kind, source, u in (("int8", sums, torch.sign(sums)), ("values", values, values)):
            pa, ma = p.clone(), m.clone()
            apply_update_converting_(pa, u, lr=3e-3, weight_decay=0.2)
            update_momentum_(ma, -grad if grad is not None else torch.zeros_like(ma), 0.95)
            pb, mb = p.clone(), m.clone()
            hyper = {"lr": 3e-3, "weight_decay": 0.2, "momentum": native.Momentum(mb, grad, 0.95, True)}
            if kind == "int8":
                native.apply_int8(pb, source, sign_of=True, **hyper)
            else:
                native.apply_values(pb, source, **hyper)
            assert same(pa, pb) and same(ma, mb)


def test_threads_split_large_tensors_alike(monkeypatch) -> None:
    """The pieces of a tensor over several threads (aligned to the packed bytes) give the one-thread bits."""
    n, pos = 10_001, 5
    m, g, p = draw(n, torch.float32, 1), draw(n, torch.float32, 2), draw(n, torch.float32, 3)

    def run() -> list[torch.Tensor]:
        lanes = torch.zeros(n // 8 + 3, dtype=torch.uint8)
        peak = native.direction_lanes(m, g, 0.9, out=lanes, position=pos, bits=1)
        c = torch.empty_like(m)
        native.direction(m, g, 0.9, out=c)
        pp, mm = p.clone(), m.clone()
        native.lion(pp, g, mm, lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1)
        pq, mq = p.clone(), m.clone()
        native.apply_bits(
            pq, lanes, position=pos, lr=1e-2, weight_decay=0.1, momentum=native.Momentum(mq, g, 0.9)
        )
        return [lanes, c, pp, mm, pq, mq, torch.tensor(peak)]

    one = run()
    monkeypatch.setattr(native, "MIN_PER_THREAD", 997)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert len(native._parts(n, align=8, first=pos)) == 3
        three = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, three, strict=True):
        assert same(a, b)


finite32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(st.tuples(finite32, finite32, finite32), min_size=0, max_size=40),
    st.sampled_from([0.0, 0.5, 0.9, 0.99]),
    st.integers(0, 15),
    st.booleans(),
)
def test_hypothesis_kernels_equal_torch(rows, beta, offset, neg) -> None:
    m = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    g = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    p = torch.tensor([r[2] for r in rows], dtype=torch.float32)
    n = len(rows)
    c = lerp(m, -g if neg else g, beta)
    lanes = torch.empty(-(-n // 8), dtype=torch.uint8)
    peak = native.direction_lanes(m, g, beta, out=lanes, position=0, bits=1, negate=neg)
    native.fill_lanes(lanes, n, lanes.numel() * 8, 1, 1)
    assert torch.equal(lanes, packing.pack_signs(c)) and math.isfinite(peak) == bool(torch.isfinite(c).all())
    packed = torch.cat([torch.tensor([0x5A, 0xC3], dtype=torch.uint8), lanes])
    u = packing.unpack_signs(packed, offset + n, torch.int8)[offset:]
    pa, ma = p.clone(), m.clone()
    kernels.apply_votes_(
        pa, u, lr=0.01, weight_decay=0.1, exp_avg=ma, grad=g, beta2=beta, negate_grad=neg, backend="torch"
    )
    pb, mb = p.clone(), m.clone()
    momentum = native.Momentum(mb, g, beta, neg)
    native.apply_bits(pb, packed, position=offset, lr=0.01, weight_decay=0.1, momentum=momentum)
    assert same(pa, pb) and same(ma, mb)
    if rows:
        want = kernels.quantize_l1(p, 15, backend="torch")
        assert torch.equal(want, kernels.quantize_l1(p, 15, backend="cpu"))


# ------------------------------------------------------------------------------------------ Lion


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("maximize", [False, True])
def test_lion_fused_step_equals_the_torch_step(monkeypatch, dtype: torch.dtype, maximize: bool) -> None:
    shapes = [(37, 11), (1,), (0,), (4097,), (5, 3)]

    def run() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in shapes]
        opt = Lion(
            [
                {"params": params[:3], "weight_decay": 0.1},
                {"params": params[3:], "lr": 0.0, "betas": (0.5, 0.0)},
            ],
            lr=3e-3,
            maximize=maximize,
        )
        for step in range(5):
            for i, p in enumerate(params):
                p.grad = None if (i == 1 and step == 2) else torch.randn(p.shape, generator=gen, dtype=dtype)
                if p.grad is not None and p.numel() > 10 and step == 3:
                    p.grad.view(-1)[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
            opt.step()
        return [p.detach().clone() for p in params], [opt.state[p]["exp_avg"].clone() for p in params]

    fused = run()
    monkeypatch.setenv("LIONCUB_CPU_KERNELS", "0")
    plain = run()
    for a, b in zip(fused[0] + fused[1], plain[0] + plain[1], strict=True):
        assert same(a, b)


def test_lion_with_a_bfloat16_gradient_equals_the_widened_one() -> None:
    """The 16-bit dense preset's apply: the mean gradient read in bfloat16 = ``grad.float()`` first."""
    n = 5003
    p, m = draw(n, torch.float32, 1), draw(n, torch.float32, 2, specials=False)
    g = draw(n, torch.float32, 3).to(torch.bfloat16)
    hyper = {"lr": 3e-3, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1}
    pa, ma, pb, mb = p.clone(), m.clone(), p.clone(), m.clone()
    native.lion(pa, g.float(), ma, **hyper)
    native.lion(pb, g, mb, **hyper)
    assert same(pa, pb) and same(ma, mb)


def test_lion_takes_the_fused_kernel(monkeypatch) -> None:
    calls = []
    real = native.lion
    monkeypatch.setattr(native, "lion", lambda *a, **k: (calls.append(a[0].dtype), real(*a, **k))[1])
    ps = [torch.nn.Parameter(torch.ones(9, dtype=t)) for t in (torch.float32, torch.float64, torch.bfloat16)]
    for p in ps:
        p.grad = torch.ones_like(p)
    Lion(ps, lr=0.1).step()
    assert calls == [torch.float32, torch.float64]  # bfloat16: torch's own bf16 ops


# ------------------------------------------------------------------------------------------ LionCub


NATIVE_STEP_CALLS = (
    "direction",
    "direction_sign",
    "direction_lanes",
    "apply_bits",
    "apply_lanes",
    "apply_int8",
    "apply_mean",
    "lion",
    "majority",
    "quantize",
    "server_majority",
    "scale",
)


def worker_fused_presets(rank: int, world: int, presets: list[str], dtype: torch.dtype) -> dict:
    """6 steps of every preset (two param groups, maximize in one, a missing gradient, exact zeros, a NaN
    on one rank that skips step 4 on every rank);
    returns parameters and momenta per preset and which fused kernels the steps called."""
    with counted_calls(native, NATIVE_STEP_CALLS) as calls:
        out: dict = {}
        for preset in presets:
            gen = torch.Generator().manual_seed(7)
            params = [
                torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype))
                for s in ((61, 3), (5,), (130,))
            ]
            opt = LionCub(
                [
                    {"params": params[:2], "weight_decay": 0.1},
                    {"params": params[2:], "maximize": True, "lr": 0.02},
                ],
                lr=0.01,
                variant=preset,
                bucket_mb=0.0005,
            )
            momenta: list[torch.Tensor] = []
            for step in range(1, 7):
                g = torch.Generator().manual_seed(1000 * rank + step)
                for i, p in enumerate(params):
                    missing = i == 1 and step == 2
                    p.grad = None if missing else torch.randn(p.shape, generator=g, dtype=dtype)
                    if p.grad is not None and step == 1:
                        p.grad.view(-1)[:3] = 0.0
                    if step == 4 and rank == world - 1 and i == 2:
                        p.grad[7] = float("nan")  # step 4 is skipped on every rank
                opt.step()
                momenta = momenta or [opt.state[p]["exp_avg"] for p in params]
            # the momenta stay the optimizer's tensor objects (the fused apply swaps their storage)
            assert all(m is opt.state[p]["exp_avg"] for m, p in zip(momenta, params, strict=True))
            assert opt.comm_stats()["total"]["skipped_steps"] == 1
            moms = [opt.state[p]["exp_avg"].clone() for p in params]
            out[preset] = [p.detach().clone() for p in params] + moms
    out["calls"] = calls
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("world", "dtype"), [(2, torch.float32), (3, torch.float64)])
def test_lioncub_presets_fused_equal_the_torch_path(monkeypatch, world: int, dtype: torch.dtype) -> None:
    presets = sorted(PRESETS)
    fused = run_workers(worker_fused_presets, world, presets, dtype, timeout=240)
    monkeypatch.setenv("LIONCUB_CPU_KERNELS", "0")
    plain = run_workers(worker_fused_presets, world, presets, dtype, timeout=240)
    for rank in range(world):
        assert plain[rank]["calls"] == {}
        calls = fused[rank]["calls"]
        for name in NATIVE_STEP_CALLS:
            if name == "server_majority" and rank != 0:
                continue  # the parameter server's count runs on its root only
            assert calls.get(name, 0) > 0, f"the fused step never called native.{name}: {calls}"
        for preset in presets:
            for i, (a, b) in enumerate(zip(fused[rank][preset], plain[rank][preset], strict=True)):
                assert same(a, b), (
                    f"{preset}: rank {rank} tensor {i} differs between the fused and torch steps"
                )


@pytest.mark.slow
def test_torch_path_matches_the_simulation(monkeypatch) -> None:
    """The fallback (``LIONCUB_CPU_KERNELS=0``) still agrees with the N-worker simulation (the fused path
    is what tests/test_lioncub.py runs by default), over 4 steps as there: every event of the tests'
    problem happens by step 4 (exact zero directions with zero momenta, a missing gradient, odd and even
    steps twice each, a new lr each step)."""
    from oracles import ALL_PRESETS, simulate, worker_run_presets

    monkeypatch.setenv("LIONCUB_CPU_KERNELS", "0")
    steps = 4
    results = run_workers(
        worker_run_presets, 3, ALL_PRESETS, 0.0008, "auto", "flat", 1, False, steps, timeout=240
    )
    for preset in ALL_PRESETS:
        want = simulate(preset, 3, steps=steps)
        for rank in range(3):
            for i, (g, w) in enumerate(zip(results[rank][preset]["params"], want, strict=True)):
                assert torch.equal(g, w), f"{preset}: rank {rank} parameter {i} differs from simulation"
