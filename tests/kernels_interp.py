"""Cases of tests/test_kernels.py and tests/test_launches.py that run lioncub.ops.kernels' Triton kernels
in Triton's interpreter.

Run as a script (``python tests/kernels_interp.py [--out FILE] [CASE ...]``): it sets
``TRITON_INTERPRET=1`` before anything imports triton, runs the cases (all by default) and prints one JSON
line per case: ``{"case": name, "ok": bool, "error": str, "seconds": float}``; case ``lioncub_steps``
saves rank 0's results in FILE. A separate process, so that the interpreter setting never reaches the
other test files: both test files take the records of one run of every case (:func:`job`, the
background job ``kernels_interp``; imported, this module sets nothing). The interpreter patches
``triton.language`` once per process, not at every launch and every call of a kernel's helpers
(``benchmarks/gpu_path.py``'s ``interpreter_patches_once``, as gpu_check's dry run: the same kernels and
programs; ~15 % less CPU than patching it at every launch), and looks up each dtype's numpy dtype once
(``interpreter_dtypes_once``: 5-10 % less).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import subprocess

    import background

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import torch

from lioncub.ops import abs_sums, kernels, packing, quantize, triton_launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the file case ``lioncub_steps`` saves rank 0's results in, in :func:`job`'s working directory
STEPS_FILE = "lioncub_steps.pt"
_STEPS_OUT: list[str] = []  # --out, if given
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
LENGTHS = (0, 1, 5, 7, 8, 13, 1031)


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit for bit (NaN payloads aside: both NaN counts as equal)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    )
    if a.dtype.is_floating_point:
        an, bn = a.isnan(), b.isnan()
        assert torch.equal(an, bn), f"{what}: NaN at different places"
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a[~an].view(ints), b[~bn].view(ints)
    diff = (a != b).nonzero().flatten()
    assert diff.numel() == 0, f"{what}: {diff.numel()} elements differ, first at {diff[:5].tolist()}"


def special(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random normals with signed zeros, denormals, huge values, ±Inf and NaN sprinkled in."""
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    if n >= 8:
        idx = torch.randperm(n, generator=gen)
        picks = [0.0, -0.0, 1e-40, -1e-42, 3e38, -3e38, 1e-30, 2.0**-126]
        for i, v in zip(idx[:8].tolist(), picks, strict=True):
            x[i] = v
    return x.to(dtype)


def with_nonfinite(x: torch.Tensor) -> torch.Tensor:
    if x.numel() >= 3:
        x = x.clone()
        x[1], x[-1] = float("nan"), float("inf")
    return x


def quantize_case(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    layouts = [([1031], None), ([5, 0, 7, 300, 719], None), ([5, 0, 7, 300, 719], 64), ([1031], 100)]
    layouts += [([1], None), ([3], 7), ([0], None), ([6, 2], 4)]
    for segments, chunk in layouts:
        n = sum(segments)
        x = special(n, dtype, gen) * torch.rand(n, generator=gen).to(dtype)
        if n > 900:
            x[100:200] = 0  # an all-zero chunk
            x[300:400] = (torch.randn(100, generator=gen) * 1e-41).to(dtype)  # denormal chunk (fp32)
            x[400:500] = 1e-45
            x[750], x[820] = float("nan"), float("-inf")
        for levels in (127, 63, 7, 1, 3000):
            for k in (2.0, 1.0):
                a = kernels.quantize_l1(
                    x, levels, clip_multiple=k, chunk_size=chunk, segments=segments, backend="torch"
                )
                b = kernels.quantize_l1(
                    x, levels, clip_multiple=k, chunk_size=chunk, segments=segments, backend="triton"
                )
                same(a, b, f"{dtype} segments={segments} chunk={chunk} levels={levels} k={k}")


def quantize_halfway_case() -> None:
    """Exact half-way levels (tests/halfway_cases.py): the Triton kernel and the torch backend both give the
    exact level ``round((x / M) · (s / k))``; plus 1-element segments and chunks (x / M = ±1), the minimal
    example (``MINIMAL``), and chunks whose M is just above float32's smallest normal with subnormal entries
    (an IEEE division keeps them; a flush-to-zero one would not)."""
    import numpy as np
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from halfway_cases import MINIMAL, halfway_cases

    for dtype in (F32, BF16, F16):
        x = torch.tensor(MINIMAL).to(dtype)
        for backend in ("torch", "triton"):
            got = kernels.quantize_l1(x, 63, segments=[1, 1], backend=backend)
            assert got.tolist() == [32, -32], f"minimal example {dtype} {backend}: {got.tolist()}"

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(halfway_cases("l1", (F32, BF16, F16)), st.booleans())
    def exact(case, chunked):
        segs = None if chunked else [case.chunk] * (case.x.numel() // case.chunk)
        chunk = case.chunk if chunked else None
        for backend in ("torch", "triton", "triton, pass 1 per bucket"):
            with _device_pass1() if backend.endswith("bucket") else contextlib.nullcontext():
                got = kernels.quantize_l1(
                    case.x, case.s, clip_multiple=case.k, chunk_size=chunk, segments=segs, backend=backend[:6]
                )
            bad = np.flatnonzero(got.to(torch.int64).numpy() != case.want)
            assert bad.size == 0, f"{backend} s={case.s} k={case.k} {case.x.dtype}: at {bad[:5].tolist()}"

    exact()
    gen = torch.Generator().manual_seed(5)
    for dtype in (F32, BF16, F16):
        x = (torch.randn(1031, generator=gen) * 10.0 ** torch.randint(-30, 30, (1031,), generator=gen)).to(
            dtype
        )
        x = torch.where((x == 0) | ~torch.isfinite(x), 1.0, x)  # float16: 0 and Inf outside its range
        for levels in (127, 63, 42, 31, 15, 7, 3, 1):
            for k in (2.0, 1.0):
                want = torch.from_numpy(np.sign(x.double().numpy()) * np.rint(levels / k)).to(torch.int8)
                for backend in ("torch", "triton"):
                    a = kernels.quantize_l1(x, levels, clip_multiple=k, chunk_size=1, backend=backend)
                    b = kernels.quantize_l1(
                        x[:67], levels, clip_multiple=k, segments=[1] * 67, backend=backend
                    )
                    same(a, want, f"chunk_size=1 {dtype} {backend} levels={levels} k={k}")
                    same(b, want[:67], f"segments of 1 {dtype} {backend} levels={levels} k={k}")
    tiny = torch.finfo(F32).tiny
    x = (torch.rand(256, generator=gen) * 2 - 1) * (0.99 * tiny)  # subnormal
    x[::16] = torch.tensor([20.0, -24.0, 28.0, 40.0] * 4) * tiny  # M of each chunk of 16: 1.5-3 · tiny
    _divisor, wide = quantize.l1_divisors(x, 127, chunk_size=16)
    assert not bool(wide), "these chunks must take the float32 path"
    for levels in (127, 63, 7):
        a = kernels.quantize_l1(x, levels, chunk_size=16, backend="torch")
        b = kernels.quantize_l1(x, levels, chunk_size=16, backend="triton")
        same(a, b, f"subnormal entries, M near float32's smallest normal, levels={levels}")
        assert int((a.view(16, 16)[:, 1:] != 0).sum()) > 100, "the subnormal entries rounded to 0"


def majority_case() -> None:
    """Random rows against the torch reference: word loads (rows of a multiple of 4 bytes, aligned) and byte
    loads (other lengths, or a misaligned start), several programs (2 KiB of each row per program), n_bits
    cut inside a byte, ties either way, more workers than rows, and counts needing up to 9 bit planes."""
    gen = torch.Generator().manual_seed(3)
    cases = [(n, b) for n in (1, 2, 3, 4, 5, 8, 16) for b in (0, 1, 3, 4, 129, 132)]
    cases += [(3, 4101), (4, 4104), (33, 132), (300, 8)]  # several programs (bytes, words); 6, 9 planes
    for i, (n_rows, row_bytes) in enumerate(cases):
        rows = torch.randint(0, 256, (n_rows, row_bytes), dtype=torch.uint8, generator=gen)
        cuts = [row_bytes * 8, max(0, row_bytes * 8 - 5), max(0, row_bytes * 8 - 13)]
        if n_rows >= 300:
            cuts = [row_bytes * 8 - 3]  # the long loop: fewer calls
        # a third of the 12 (tie, cut, workers) combinations per shape, the next third on the next shape:
        # every combination on each three shapes in a row, both ties and both worker counts on every shape
        combos = list(itertools.product((True, False), cuts, (n_rows, n_rows + 2)))
        if len(combos) > 4:
            combos = combos[i % 3 :: 3]
        elif n_rows >= 300:  # 300 rows per call (9 planes): both ties and both worker counts in 2 calls
            combos = combos[::3]
        for tie, n_bits, workers in combos:
            a = kernels.majority_pack(rows, tie, n_bits=n_bits, n_workers=workers, backend="torch")
            b = kernels.majority_pack(rows, tie, n_bits=n_bits, n_workers=workers, backend="triton")
            same(a, b, f"N={n_rows} workers={workers} B={row_bytes} tie+={tie} n_bits={n_bits}")
    backing = torch.randint(0, 256, (5 * 132 + 1,), dtype=torch.uint8, generator=gen)
    shifted = backing[1:].view(5, 132)  # rows of 4k bytes at an odd address: byte loads
    for tie in (True, False):
        a = kernels.majority_pack(shifted, tie, backend="torch")
        same(a, kernels.majority_pack(shifted, tie, backend="triton"), f"misaligned rows tie+={tie}")
    ties = torch.tensor([[0b10101010] * 8, [0b01010101] * 8], dtype=torch.uint8)  # every bit a 1-1 tie
    for tie in (True, False):
        want = [255 if tie else 0] * 8
        assert kernels.majority_pack(ties, tie, backend="triton").tolist() == want

    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=25, deadline=None, database=None)
    @given(
        st.integers(1, 12),
        st.integers(0, 40),
        st.integers(0, 7),
        st.integers(0, 3),
        st.booleans(),
        st.integers(0, 2**32 - 1),
    )
    def agree(n_rows, row_bytes, cut, extra, tie, seed):
        g = torch.Generator().manual_seed(seed)
        rows = torch.randint(0, 256, (n_rows, row_bytes), dtype=torch.uint8, generator=g)
        n_bits = max(0, row_bytes * 8 - cut)
        a = kernels.majority_pack(rows, tie, n_bits=n_bits, n_workers=n_rows + extra, backend="torch")
        b = kernels.majority_pack(rows, tie, n_bits=n_bits, n_workers=n_rows + extra, backend="triton")
        same(a, b, f"N={n_rows}+{extra} B={row_bytes} n_bits={n_bits} tie+={tie}")

    agree()


def apply_case(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    for n in LENGTHS:
        p = special(n, dtype, gen)
        m = special(n, dtype, gen)
        g = with_nonfinite(special(n, dtype, gen))
        packed = torch.randint(0, 256, ((n + 13 + 7) // 8,), dtype=torch.uint8, generator=gen)
        votes = torch.randint(-1, 2, (n,), dtype=torch.int8, generator=gen)
        for lr, wd in ((1e-3, 0.0), (3e-4, 0.1), (0.05, 1.0)):
            for offset in (0, 13):
                outs = []
                signs = packing.unpack_signs(packed, offset + n, torch.int8)[offset:]
                for backend in ("torch", "triton"):
                    ps, ms, pv = p.clone(), m.clone(), p.clone()
                    kernels.apply_votes_(
                        ps, signs, lr=lr, weight_decay=wd, exp_avg=ms, grad=g, beta2=0.99,
                        negate_grad=offset > 0, backend=backend,
                    )  # fmt: skip
                    kernels.apply_votes_(pv, votes, lr=lr, weight_decay=wd, backend=backend)
                    outs.append((ps, ms, pv))
                for name, a, b in zip(("signs", "momentum", "votes"), *outs, strict=True):
                    same(a, b, f"{name} {dtype} n={n} lr={lr} wd={wd} offset={offset}")


def hypothesis_case() -> None:
    """Property: both backends' L1 levels agree on arbitrary float32/bf16 inputs (incl. NaN/Inf/denormals)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    floats = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)

    @settings(max_examples=25, deadline=None, database=None)
    @given(
        st.lists(st.tuples(floats, floats), max_size=40),
        st.sampled_from([F32, BF16]),
        st.floats(0.0, 0.999),
        st.integers(1, 127),
        st.sampled_from([None, 3, 16]),
    )
    def agree(pairs, dtype, beta1, levels, chunk):
        x = torch.tensor([a * b for a, b in pairs], dtype=torch.float32).to(dtype)
        qa = kernels.quantize_l1(x, levels, chunk_size=chunk, backend="torch")
        qb = kernels.quantize_l1(x, levels, chunk_size=chunk, backend="triton")
        same(qa, qb, "levels")

    agree()


def _device_pass1() -> Any:
    """Pass 1 as off the CPU (``normalizers.on_host`` False): the reference sums of each tensor and the
    fused quantizer's per-bucket sums both run :func:`abs_sums.l1_abs_sums`' Triton kernels."""
    from lioncub.ops import normalizers

    @contextlib.contextmanager
    def patched() -> Iterator[None]:
        on_host = normalizers.on_host
        normalizers.on_host = lambda t: False
        try:
            yield
        finally:
            normalizers.on_host = on_host

    return patched()


def pass1_bucket_case() -> None:
    """The per-bucket pass 1 of a GPU (3 launches per bucket) against the reference run per tensor (off the
    CPU: the float64 sums of l1_abs_sums): divisors, work-dtype flags and levels bit for bit, for float32,
    bfloat16 and float16, per tensor and chunked, with all-zero, denormal (float64 work), NaN and Inf
    chunks and tensors; the sums are exact on exactly summable data and within float64 rounding of the
    exact sum (math.fsum) on other data."""
    import math

    gen = torch.Generator().manual_seed(6)
    with _device_pass1():
        layouts = [([1031], None), ([5, 0, 7, 300, 719], None), ([5, 0, 7, 300, 719], 64), ([9000], 4100)]
        layouts += [([1], None), ([3], 7), ([6, 2], 4), ([0, 4097, 0, 8193], None), ([10, 3], 1)]
        # chunks of 1: each element its own group (one program per group and stage in the interpreter);
        # 13 elements hold every kind special() sprinkles (8), each alone in its group, as 53 did
        for segments, chunk in layouts:
            n = sum(segments)
            base = special(n, F32, gen) * torch.rand(n, generator=gen)
            if n > 900:
                base[100:200] = 0  # an all-zero chunk
                base[300:400] = torch.randn(100, generator=gen) * 1e-41  # float32 denormals: float64 work
                base[750], base[820] = float("nan"), float("-inf")
            for dtype in (F32, BF16, F16):
                x = base.to(dtype)
                want = kernels._l1_divisors(x, 127, 2.0, chunk, segments)  # per bucket (3 launches)
                pos, divs, wide = 0, [], []
                for length in segments:
                    if length:
                        d, w = quantize.l1_divisors(x[pos : pos + length], 127, chunk_size=chunk)
                        divs.append(d)
                        wide.append(bool(w))
                    else:
                        wide.append(False)
                    pos += length
                same(want[0], torch.cat(divs), f"divisors {dtype} {segments} chunk={chunk}")
                assert [bool(v) for v in want[1]] == wide, f"wide {dtype} {segments} chunk={chunk}"
                for levels in (127, 7) if dtype == F32 else (127,):
                    a = kernels.quantize_l1(x, levels, chunk_size=chunk, segments=segments, backend="torch")
                    b = kernels.quantize_l1(x, levels, chunk_size=chunk, segments=segments, backend="triton")
                    same(a, b, f"levels {dtype} {segments} chunk={chunk} levels={levels}")
        grid = torch.randint(-255, 256, (3, 70_000), generator=gen).float() / 64  # sums exact in float32
        exact = grid.double().abs().sum(dim=1)
        same(abs_sums.l1_abs_sums(grid), exact, "exact sums")
        wild = torch.randn(2, 20_000, generator=gen) * 10.0 ** torch.randint(
            -20, 20, (2, 20_000), generator=gen
        )
        for row, got in zip(wild, abs_sums.l1_abs_sums(wild).tolist(), strict=True):
            want = math.fsum(abs(v) for v in row.double().tolist())
            assert abs(got - want) <= 1e-13 * want, (got, want)
        assert abs_sums.l1_abs_sums(torch.zeros(4, 0)).tolist() == [0.0] * 4


def multi_tensor_case() -> None:
    """lion_directions_ and apply_votes_multi_ (one launch for all tensors of a bucket) against the torch
    reference per tensor: float32, bfloat16 and float16 with signed zeros, denormals, huge values, NaN and
    Inf; missing gradients (zeros, never negated), maximize, weight decay, empty tensors, more tensors
    than blocks of a binary search, and tensors at an offset in the flat buffer (unused gaps)."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(37, 11), (5,), (0,), (1,), (3000,), (2,), (0,), (1024,), (1025,)] + [(k,) for k in range(1, 9)]
    for dtype in (F32, BF16, F16):
        ms = [special(int(torch.Size(s).numel()), dtype, gen).view(s) for s in shapes]
        gs = [with_nonfinite(special(m.numel(), dtype, gen)).view(m.shape) for m in ms]
        gs[1] = gs[5] = None
        starts, pos = [], 3
        for m in ms:
            starts.append(pos)
            pos += m.numel() + 2  # gaps: the kernels write only their tensors' ranges
        n = pos
        for negate in (False, True):
            outs = []
            for backend in ("torch", "triton"):
                out = torch.full((n,), 7.0, dtype=dtype)
                kernels.lion_directions_(out, starts, ms, gs, beta1=0.9, negate=negate, backend=backend)
                outs.append(out)
            same(*outs, f"lion_directions_ {dtype} negate={negate}")
        votes = torch.randint(-1, 2, (n,), dtype=torch.int8, generator=gen)
        for negate, wd in ((False, 0.0), (True, 0.1)):
            outs = []
            for backend in ("torch", "triton"):
                ps = [
                    special(m.numel(), dtype, torch.Generator().manual_seed(i)).view(m.shape)
                    for i, m in enumerate(ms)
                ]
                mm = [m.clone() for m in ms]
                kernels.apply_votes_multi_(
                    ps, votes, starts, lr=1e-2, weight_decay=wd, exp_avgs=mm, grads=gs, beta2=0.99,
                    negate_grad=negate, backend=backend,
                )  # fmt: skip
                outs.append([*ps, *mm])
            for i, (a, b) in enumerate(zip(*outs, strict=True)):
                same(a, b, f"apply_votes_multi_ {dtype} negate={negate} wd={wd} tensor {i}")
        ps_a = [special(m.numel(), dtype, gen) for m in ms]
        ps_b = [p.clone() for p in ps_a]
        kernels.apply_votes_multi_(ps_a, votes, starts, lr=3e-4, backend="torch")
        kernels.apply_votes_multi_(ps_b, votes, starts, lr=3e-4, backend="triton")
        for a, b in zip(ps_a, ps_b, strict=True):
            same(a, b, f"apply_votes_multi_ without momentum {dtype}")


class _Counts:
    """Counts, while active, the Triton launches (the kernels of lioncub.ops.triton_kernels wrapped) and the
    aten operations that would launch a GPU kernel (not views, not allocations; none issued by Triton's
    interpreter inside a launch)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        from lioncub.ops import triton_kernels

        self.module = triton_kernels
        self.triton = 0
        self.aten: dict[str, int] = {}
        self._inside = False
        counts = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                name = func.overloadpacket.__name__
                if not (counts._inside or func.is_view or name.startswith("empty")):
                    counts.aten[name] = counts.aten.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def wrap(self) -> dict[str, Any]:
        originals = {}
        for name in self.module.__all__:
            if not name.endswith("_kernel"):
                continue
            kernel = originals[name] = getattr(self.module, name)
            setattr(self.module, name, _Counted(kernel, self))
        return originals

    def total(self) -> int:
        return self.triton + sum(self.aten.values())


class _Counted:
    """A Triton kernel whose launches ``_Counts`` counts."""

    def __init__(self, kernel: Any, counts: _Counts) -> None:
        self.kernel, self.counts = kernel, counts

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.counts.triton += 1
            self.counts._inside = True
            try:
                return self.kernel[grid](*args, **kwargs)
            finally:
                self.counts._inside = False

        return launch


def _vote_step(tensors: int, counts: _Counts) -> tuple[dict[str, tuple[int, int]], int]:
    """Two QuantizedVote(l1, 8) steps (contribution, levels, apply) of one bucket of ``tensors`` float32
    tensors, 4096 elements in all, on the Triton path: (Triton launches, aten ops) of each phase of the
    second step, and the device tables it uploaded."""
    from lioncub.collectives import Comm, QuantizedVote
    from lioncub.collectives.protocol import Ballot, Hyper

    gen = torch.Generator().manual_seed(tensors)
    params = [torch.nn.Parameter(torch.randn(4096 // tensors, generator=gen)) for _ in range(tensors)]
    for i, p in enumerate(params):
        p.grad = None if i == 1 else torch.randn(p.shape, generator=gen)
    momenta = {id(p): torch.randn(p.shape, generator=gen) for p in params}
    hyper = Hyper(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, maximize=False)
    state = SimpleNamespace(momentum=lambda p: momenta[id(p)], hyper=lambda p: hyper)
    vote = QuantizedVote(Comm.single(), "l1", 8)
    local = torch.empty(4096)
    phases: dict[str, tuple[int, int]] = {}
    tables = triton_launch.TABLES
    uploads = 0
    for _ in range(2):
        uploads = tables.uploads
        ballot = Ballot(key="bucket", params=params, backend=kernels.STEP_BACKENDS["triton"], local=local)
        for phase in ("contribution", "levels", "apply"):
            counts.triton, counts.aten = 0, {}
            with counts.mode:
                if phase == "contribution":
                    vote.contribute(ballot, [p.grad for p in params], state, step=1)
                elif phase == "levels":
                    ballot.pending = vote.start(local, step=1, key="bucket", segments=ballot.segments)
                else:
                    vote.apply(ballot, state)
            phases[phase] = (counts.triton, sum(counts.aten.values()))
    return phases, tables.uploads - uploads


def launch_counts_case() -> dict:
    """The launches of a vote step's phases per bucket do not grow with the bucket's tensors (4 vs 16: a
    count per tensor would grow 4x; every tensor is a program of each per-bucket kernel in the
    interpreter), on the Triton path with pass 1 as off the CPU, and a second step uploads no device
    table."""
    counts = _Counts()
    originals = counts.wrap()
    try:
        with _device_pass1():
            got = {tensors: _vote_step(tensors, counts) for tensors in (4, 16)}
    finally:
        for name, kernel in originals.items():
            setattr(counts.module, name, kernel)
    assert got[4][0] == got[16][0], got
    assert got[4][1] == got[16][1] == 0, got
    return {str(k): v[0] for k, v in got.items()}


def lioncub_steps_case() -> None:
    """LionCub's steps with the kernels in them (tests/kernel_steps.py) on 2 gloo ranks of
    tests/processes.py's pool, in this interpreter's environment; rank 0 saves its results in ``--out``
    (tests/test_kernels.py compares them with the torch step's)."""
    from kernel_steps import STEP_PRESETS, worker_lioncub_kernels

    from processes import run_workers

    run_workers(worker_lioncub_kernels, 2, STEP_PRESETS, (_STEPS_OUT or [None])[0], timeout=200)


CASES = {
    "quantize_l1_float32": lambda: quantize_case(F32),
    "quantize_l1_bfloat16": lambda: quantize_case(BF16),
    "quantize_l1_halfway": quantize_halfway_case,
    "majority_pack": majority_case,
    "apply_float32": lambda: apply_case(F32),
    "apply_bfloat16": lambda: apply_case(BF16),
    "hypothesis_agreement": hypothesis_case,
    "pass1_bucket": pass1_bucket_case,
    "multi_tensor": multi_tensor_case,
    "launch_counts": launch_counts_case,
    "lioncub_steps": lioncub_steps_case,
}


def job() -> background.Subprocess | None:
    """A ``background.Subprocess`` of every case (tests/background.py's job ``kernels_interp``, shared by
    tests/test_kernels.py and tests/test_launches.py; ``STEPS_FILE`` in its working directory), or None
    without triton."""
    import importlib.util

    import background

    from processes import python_cmd

    if importlib.util.find_spec("triton") is None:
        return None
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
    return background.Subprocess(
        lambda workdir: python_cmd(os.path.abspath(__file__), "--out", str(workdir / STEPS_FILE)), 360, env
    )


def records(proc: subprocess.CompletedProcess[str]) -> dict[str, dict]:
    """The records of a run's cases (``proc``: its ``CompletedProcess``), by case; ``pytest.fail`` with its
    stderr if no case reported."""
    import pytest

    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            found[record["case"]] = record
    if not found:
        pytest.fail(f"the interpreter cases did not run (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return found


def main(argv: list[str]) -> int:
    names = list(argv)
    if names[:1] == ["--out"]:
        _STEPS_OUT.append(names[1])
        names = names[2:]
    warnings.simplefilter("ignore")  # numpy's "invalid value" warnings of NaN/Inf inputs in the interpreter
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_path  # benchmarks/gpu_path.py: interpreter_patches_once, interpreter_dtypes_once

    gpu_path.interpreter_patches_once()
    gpu_path.interpreter_dtypes_once()
    for name in names or list(CASES):
        t0 = time.perf_counter()
        info = None
        try:
            info = CASES[name]()
            ok, error = True, ""
        except Exception as err:  # reported to the test, which fails naming it
            ok, error = False, f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}"
        record = {"case": name, "ok": ok, "error": error, "seconds": time.perf_counter() - t0}
        print(json.dumps(record | ({"info": info} if info is not None else {})), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
