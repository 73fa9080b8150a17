"""One prepared check of the GPU path (run by ``benchmarks/gpu_check.sh``; finishes in a few minutes).

On a machine with NVIDIA GPUs, from the repository root, with a Python whose torch is a CUDA build and
which has triton (``gpu_check.sh`` picks it: docs/benchmarks/gpu-check.md); nothing is installed and no
network is used:

1. correctness: every kernel of :mod:`lioncub.ops.kernels` with ``backend="triton"`` against
   ``backend="torch"`` on fresh random data on the GPU, bit for bit (NaN-aware), with compiled ``fma``
   and with the exact emulation the interpreter uses — the per-bucket kernels (``lion_directions_``,
   ``apply_votes_multi_``) on a bucket of tensors of mixed sizes — and the float64 sums ``l1_abs_sums``
   against a float64 reference, with the quantizer's per-bucket pass 1 against its per-segment one;
2. bandwidth: bytes each kernel moves / its median time (CUDA events, warm-up, 25 runs) as a % of a
   device-to-device copy's bandwidth (target ≥ 60 %);
3. the whole vote path (``benchmarks/gpu_path.py``) on ``cuda:0`` over NCCL at world size 1 with the
   votes' collectives on (:func:`lioncub.collectives.exchange_when_alone`): every vote algorithm and every
   ``LionCub`` preset — step check, encode, exchange, decode, apply — local steps, ``consolidate_state_dict``
   and a checkpoint round trip through the CPU, each against the same ranks on the CPU over gloo, bit for
   bit; ``LionCub.overlap_with`` (the DDP hook and its vote thread) against the plain step; the host
   synchronizations of a step (host reads, ``synchronize`` calls and the profiler's CUDA syncs) and its
   Triton launches, for 8 and 64 tensors and for 1, 8 and 64 buckets; ``LionCub`` on FSDP2's shards
   over a mesh of one (``fully_shard``, 1 × 1) against the unsharded ``LionCub`` on the same gradients,
   bit for bit (docs/gpu.md). With several GPUs the same on N = #GPUs processes, one per GPU (the shards
   on N × 1 and 1 × N meshes);
4. a ``LionCub`` step on a 350M-parameter GPT-sized parameter set (24 layers, d = 1024), as one process
   (Lion's step) and with the votes exchanged over NCCL, against a plain ``lioncub.optim.Lion`` step:
   median step times and the overhead (target ≤ 25 %).

Every section (:data:`SECTIONS`) runs under a guard: an exception marks it FAIL in the table, its
traceback is printed and kept, and the next section runs. After each section the table so far is written
to ``--out`` (default ``gpu_check_<date>_<time>.txt`` under ``$OUT`` if set, else the working directory),
so a check stopped by a hang (``gpu_check.sh``'s ``timeout -s ABRT``: ``faulthandler`` dumps every
thread's stack) leaves what it measured; ``faulthandler`` also dumps the stacks of a section that runs
past its bound, without stopping it. ``--fail-section NAME`` (repeatable), the guard's test hook, makes
section NAME raise at its end, after its work.

``--dry-run`` runs the same code paths on the CPU at small sizes: the Triton kernels in Triton's
interpreter (``TRITON_INTERPRET=1``; section 3's CPU reference on the C kernels, as beside a GPU: the
two compared), gloo instead of NCCL, wall-clock timing (its numbers mean nothing);
``--ranks K`` adds section 3 on K CPU processes (with the CPU kernels: the interpreter ran it at N = 1),
forks of the check (no Python to start per rank; GPU ranks are ``python gpu_path.py`` processes), started
with the check and run beside its other sections (GPU ranks start after them: the same GPUs).
Without CUDA and without ``--dry-run`` it says so and exits 2. Exit 1 when a correctness check or a
section failed. The table printed last lists every measurement next to its target, and every section
with its time and verdict.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import faulthandler
import functools
import importlib
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import IO

DRY = "--dry-run" in sys.argv
if DRY:  # before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import gpu_path  # noqa: E402 (beside this file; imports torch only)

ROWS: list[tuple[str, str, str, str, str]] = []  # (section, item, measured, target, verdict)
FAILURES: list[str] = []  # correctness checks that failed
FAILED: list[str] = []  # sections that failed (raised, or a rank that exited or timed out)
TRACEBACKS: list[tuple[str, str]] = []  # (section, traceback) of each failed section
#: the sections of this check, in order (``--fail-section`` takes these names)
SECTIONS = (
    "kernels",
    "half-way rule",
    "bandwidth",
    "process group",
    *gpu_path.SECTIONS,
    "350M step",
    "several ranks",
)


def row(section: str, item: str, measured: str, target: str = "", ok: bool | None = None) -> None:
    verdict = "" if ok is None else ("ok" if ok else "MISS")
    ROWS.append((section, item, measured, target, verdict))
    print(f"[{section}] {item}: {measured} {('(target ' + target + ') ' + verdict) if target else verdict}")


def _verdict(ok: bool) -> bool | None:
    return None if DRY else ok  # a dry run's timings (interpreter, CPU) say nothing about the targets


def same(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of differing elements, bit for bit (both NaN counts as equal)."""
    a, b = a.reshape(-1), b.reshape(-1)
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel(), 1)
    if a.dtype.is_floating_point:
        an, bn = a.isnan(), b.isnan()
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        diff = (an != bn) | (~an & ~bn & (a.view(ints) != b.view(ints)))
        return int(diff.sum())
    return int((a != b).sum())


def check(section: str, item: str, differing: int) -> None:
    ok = differing == 0
    row(section, item, "equal" if ok else f"{differing} differ", "bit-exact", ok)
    if not ok:
        FAILURES.append(f"{section}: {item}")


def section_failed(section: str, what: str, tb: str) -> None:
    """Section ``section`` raised (or a rank of it ended badly): a FAIL row; the traceback printed, kept."""
    print(f"[{section}] FAIL: {what}\n{tb}", flush=True)
    ROWS.append((section, "section failed", what, "runs to its end", "FAIL"))
    FAILED.append(section)
    TRACEBACKS.append((section, tb))


def section_skipped(section: str, why: str) -> None:
    print(f"[{section}] SKIP: {why}", flush=True)
    ROWS.append((section, "section skipped", why, "runs", "SKIP"))


def table(sections: gpu_path.Sections, final: bool, tracebacks: bool = True) -> str:
    """The table of every row so far, then each section's time and verdict, then (``tracebacks``) the
    tracebacks kept; before the end (not ``final``) a last line says the check is still running."""
    rows = [
        *ROWS,
        *(("sections", name, f"{secs:.1f} s", "", status) for name, secs, status in sections.results),
    ]
    header = ("section", "item", "measured", "target", "")
    width = [max(len(r[i]) for r in [header, *rows]) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)).rstrip() for r in [header, *rows]]
    for section, tb in TRACEBACKS if tracebacks else ():
        lines += ["", f"--- traceback of section {section}:", tb.rstrip()]
    if not final:
        now = f"in section {sections.current!r}" if sections.current else "between sections"
        lines += ["", f"gpu_check: still running, {now} (if this is the end, the check was stopped there)"]
    return "\n".join(lines) + "\n"


def write_table(path: str, sections: gpu_path.Sections, final: bool = False) -> None:
    """:func:`table` in ``path``, replaced whole."""
    with open(path + ".tmp", "w") as f:
        f.write(table(sections, final))
    os.replace(path + ".tmp", path)


# ------------------------------------------------------------------------------------ 1. correctness


def correctness(device: torch.device, n: int) -> None:
    from lioncub.ops import kernels

    gen = torch.Generator(device="cpu").manual_seed(0)

    def rnd(k: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(k, generator=gen) * scale
        if k > 16:
            x[3], x[5], x[7], x[9] = 0.0, -0.0, 1e-40, 3e38
        return x.to(dtype).to(device)

    for dtype in (torch.float32, torch.bfloat16):
        for emulate in (True,) if DRY else (False, True):  # the interpreter's tl.fma is not fused
            tag = f"{str(dtype)[6:]}{' emulated fma' if emulate else ''}"
            for k in (n, n + 13, 5):
                p, mo, g = rnd(k, dtype), rnd(k, dtype), rnd(k, dtype, 3.0)
                signs = torch.randint(0, 2, (k,), dtype=torch.int8, generator=gen).mul_(2).sub_(1).to(device)
                votes = torch.randint(-1, 2, (k,), dtype=torch.int8, generator=gen).to(device)
                outs = []
                for backend in ("torch", "triton"):
                    ps, ms, pv = p.clone(), mo.clone(), p.clone()
                    emu = emulate if backend == "triton" else None
                    kernels.apply_votes_(
                        ps, signs, lr=3e-4, weight_decay=0.1, exp_avg=ms, grad=g, beta2=0.99,
                        backend=backend, emulate_fma=emu,
                    )  # fmt: skip
                    kernels.apply_votes_(
                        pv, votes, lr=3e-4, weight_decay=0.1, backend=backend, emulate_fma=emu
                    )
                    outs.append((ps, ms, pv))
                diff = sum(same(x, y) for x, y in zip(*outs, strict=True))
                check("correctness", f"apply_votes_ {tag} n={k}", diff)
        c = rnd(n, dtype)
        c[n // 2] = float("nan")
        segments = [n // 3, 1, n - n // 3 - 1]
        for chunk in (None, 4096):
            a = kernels.quantize_l1(c, 127, segments=segments, chunk_size=chunk, backend="torch")
            b = kernels.quantize_l1(c, 127, segments=segments, chunk_size=chunk, backend="triton")
            check("correctness", f"quantize_l1 {str(dtype)[6:]} chunk={chunk}", same(a, b))
    for n_rows in (2, 3, 8):
        rows = torch.randint(0, 256, (n_rows, n // 64 + 3), dtype=torch.uint8, generator=gen).to(device)
        diff = 0
        for tie in (True, False):
            diff += same(
                kernels.majority_pack(rows, tie, backend="torch"),
                kernels.majority_pack(rows, tie, backend="triton"),
            )
        check("correctness", f"majority_pack N={n_rows}", diff)


@contextlib.contextmanager
def device_pass1():  # type: ignore[no-untyped-def]
    """Pass 1 of the L1 quantizer as a CUDA tensor takes it. In a dry run (CPU tensors) the normalisers'
    ``on_host`` test says False for the block, so the fused quantizer's per-bucket pass 1 and the
    per-segment reference both sum with ``l1_abs_sums`` (in Triton's interpreter); on a GPU they already
    do and nothing is patched."""
    if not DRY:
        yield
        return
    from lioncub.ops import normalizers

    saved = normalizers.on_host
    normalizers.on_host = lambda t: False
    try:
        yield
    finally:
        normalizers.on_host = saved


def check_close(section: str, item: str, rel: float, bound: float) -> None:
    """A float64 result within ``bound`` (relative) of its reference; a miss is a failed correctness check."""
    ok = rel <= bound
    row(section, item, f"max rel. diff {rel:.2g}", f"rel <= {bound:g}", ok)
    if not ok:
        FAILURES.append(f"{section}: {item}")


def bucket_shapes(n: int) -> list[tuple[int, ...]]:
    """A bucket's tensors of mixed sizes: tiny ones, an empty one, block edges (1023 / 1024 / 1025
    elements: a program per 1024), a matrix and one of ``n + 13`` elements (> 1M on a GPU)."""
    return [(1,), (2,), (5,), (0,), (1023,), (1024,), (37, 11), (n + 13,), (3,), (1025,), (7,)]


def multi_tensor(device: torch.device, n: int) -> None:
    """The per-bucket kernels (one pointer-table launch for all tensors of a bucket) against the torch
    reference (per tensor), bit for bit and NaN-aware (CUDA's bfloat16 NaN is ``0x7FFF``, the reference's
    ``0x7FC0``): ``lion_directions_`` with and without ``negate`` (a missing gradient: zeros) and
    ``apply_votes_multi_`` without momentum (with and without weight decay) and with it (with and without
    ``negate_grad``), float32 and bfloat16, the tensors at offsets of the flat buffer with gaps."""
    from lioncub.ops import kernels

    gen = torch.Generator(device="cpu").manual_seed(3)
    shapes = bucket_shapes(n)

    def rnd(shape: tuple[int, ...], dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(shape, generator=gen) * scale
        flat = x.view(-1)
        if flat.numel() > 16:
            flat[3], flat[5], flat[7], flat[9], flat[11] = 0.0, -0.0, 1e-40, 3e38, float("nan")
        return x.to(dtype).to(device)

    starts, pos = [], 3  # unused gaps before and between the tensors
    for shape in shapes:
        starts.append(pos)
        pos += torch.Size(shape).numel() + 2
    total = pos
    cases = ((0.0, False, False), (0.1, False, False), (0.1, True, False), (0.0, True, True))
    for dtype in (torch.float32, torch.bfloat16):
        ms = [rnd(s, dtype) for s in shapes]
        gs: list[torch.Tensor | None] = [rnd(s, dtype, 3.0) for s in shapes]
        gs[2] = None
        ps = [rnd(s, dtype) for s in shapes]
        votes = torch.randint(-1, 2, (total,), dtype=torch.int8, generator=gen).to(device)
        for emulate in (True,) if DRY else (False, True):  # the interpreter's tl.fma is not fused
            tag = f"{str(dtype)[6:]}{' emulated fma' if emulate else ''}, {len(shapes)} tensors"
            for negate in (False, True):
                outs = []
                for backend in ("torch", "triton"):
                    out = torch.full((total,), 7.0, dtype=dtype, device=device)
                    emu = emulate if backend == "triton" else None
                    kernels.lion_directions_(
                        out, starts, ms, gs, beta1=0.9, negate=negate, backend=backend, emulate_fma=emu
                    )
                    outs.append(out)
                check("correctness", f"lion_directions_ {tag}{', negate' if negate else ''}", same(*outs))
            for wd, momentum, negate in cases:
                outs = []
                for backend in ("torch", "triton"):
                    p2 = [p.clone() for p in ps]
                    m2 = [m.clone() for m in ms] if momentum else None
                    kernels.apply_votes_multi_(
                        p2, votes, starts, lr=3e-4, weight_decay=wd, exp_avgs=m2,
                        grads=gs if momentum else None, beta2=0.99 if momentum else None,
                        negate_grad=negate, backend=backend,
                        emulate_fma=emulate if backend == "triton" else None,
                    )  # fmt: skip
                    outs.append(p2 + (m2 or []))
                diff = sum(same(a, b) for a, b in zip(*outs, strict=True))
                what = f"wd={wd}{', momentum' if momentum else ''}{', negate_grad' if negate else ''}"
                check("correctness", f"apply_votes_multi_ {tag}, {what}", diff)


def pass1_segments(n: int) -> list[int]:
    """Many segments for the quantizer's per-bucket pass 1: tiny and empty ones, a tile (4096) plus one,
    and one of ``n + 13`` elements: 397 on a GPU, 12 in a dry run (the interpreter's launches are slow).
    :func:`l1_sums` makes segments 3 and 5 all-zero and denormal, and puts a NaN in 8 and an Inf in 10."""
    base = [1, 0, 5, 300, 2, 300, 0, 7, 4097, 64, 4097]
    return base * (1 if DRY else 36) + [n + 13]


def l1_sums(device: torch.device, n: int) -> None:
    """``l1_abs_sums`` (float64 Σ|x| per row, 2 launches) against ``x.double().abs().sum(-1)``: bit for bit
    (NaN-aware) on data whose sums are exact in float64 in any order (multiples of 2^-6 below 4, exact in
    bfloat16 too; an all-zero row, rows holding NaN and -Inf), and on other data within float64 rounding
    (rel. 1e-15) of the exact sum (``math.fsum``), as tests/test_devices.py. Then the quantizer's
    per-bucket pass 1 (3 launches for all segments) over many segments against the reference run per
    segment: divisors and work-dtype flags bit for bit (an all-zero, a denormal: float64 work, a NaN and an
    Inf segment), and the levels of both backends."""
    import math

    from lioncub.ops import abs_sums, kernels, quantize

    gen = torch.Generator(device="cpu").manual_seed(4)
    rows, width = 4, max(n // 4, 4099)  # on a GPU rows of 256K elements; in a dry run 2 tiles of 4096
    grid = torch.randint(-255, 256, (rows, width), generator=gen) / 64.0
    grid[1] = 0.0
    grid[2, 17], grid[3, 5] = float("nan"), float("-inf")
    wild = torch.randn(2, 2 * width + 5, generator=gen) * 1e3
    segments = pass1_segments(n)
    starts = [sum(segments[:i]) for i in range(len(segments))]
    base = torch.randn(sum(segments), generator=gen) * torch.rand(sum(segments), generator=gen)
    base[starts[3] : starts[3] + 300] = 0.0  # an all-zero segment
    base[starts[5] : starts[5] + 300] = torch.randn(300, generator=gen) * 1e-39  # denormals: float64 work
    base[starts[8] + 100], base[starts[10] + 4000] = float("nan"), float("inf")
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype)[6:]
        x = grid.to(dtype).to(device)  # exact in bfloat16 too
        got = abs_sums.l1_abs_sums(x)
        exact = same(got, x.double().abs().sum(-1))
        check("correctness", f"l1_abs_sums {name} {rows}x{width}, exactly summable", exact)
        y = wild.to(dtype)
        rel = 0.0
        for value, r in zip(abs_sums.l1_abs_sums(y.to(device)).tolist(), y.double().tolist(), strict=True):
            want = math.fsum(abs(v) for v in r)
            rel = max(rel, abs(value - want) / want)
        check_close("correctness", f"l1_abs_sums {name} 2x{y.shape[1]} vs the exact sum", rel, 1e-15)
        x = base.to(dtype).to(device)
        with device_pass1():
            chunks = (None, 64) if not DRY else (None, 1000) if dtype == torch.float32 else (None,)
            for chunk in chunks:  # a dry run: fewer (every tile or chunk is a program in the interpreter)
                bucket = kernels._l1_divisors(x, 127, 2.0, chunk, segments)  # 3 launches for the bucket
                divisors, wide = [], []
                for start, length in zip(starts, segments, strict=True):
                    if length:
                        d, w = quantize.l1_divisors(x[start : start + length], 127, chunk_size=chunk)
                        divisors.append(d)
                        wide.append(bool(w))
                    else:
                        wide.append(False)
                diff = same(bucket[0], torch.cat(divisors))
                diff += sum(bool(a) != b for a, b in zip(bucket[1].tolist(), wide, strict=True))
                label = f"quantize_l1 pass 1 per bucket {name}, {len(segments)} segments, chunk={chunk}"
                check("correctness", f"{label}: divisors, work dtypes = per segment", diff)
                if DRY and chunk is None and dtype == torch.float32:
                    continue  # the levels (per segment in the reference) of a dry run: chunked float32 only
                a = kernels.quantize_l1(x, 127, segments=segments, chunk_size=chunk, backend="torch")
                b = kernels.quantize_l1(x, 127, segments=segments, chunk_size=chunk, backend="triton")
                check("correctness", f"{label}: levels", same(a, b))


def halfway(device: torch.device) -> None:
    """Levels ``round((x / M) · (s / k))`` (issue 20) on the device against the CPU path: 1-element chunks
    (x / M = ±1: half-way for odd s; also against the exact level), float32 chunks whose M is just above
    float32's smallest normal with subnormal entries (an IEEE division keeps them) and one whose M is
    below it (the float64 path), and float32 data on a grid, whose sums (M) are exact in any order (the
    CPU and the GPU reduce in different orders, and a bfloat16 sum is rounded to bfloat16 on the way, so
    their normalisers of other data may differ)."""
    from lioncub.ops import kernels, quantize

    gen = torch.Generator(device="cpu").manual_seed(1)
    tiny = torch.finfo(torch.float32).tiny
    scalars = torch.randn(4099, generator=gen) * 10.0 ** torch.randint(-30, 30, (4099,), generator=gen)
    scalars = torch.where(scalars == 0, 1.0, scalars)
    sub = (torch.rand(4096, generator=gen) * 2 - 1) * (0.99 * tiny)
    sub[::16] = torch.tensor([20.0, -24.0, 28.0, 40.0]).repeat(64) * tiny
    sub[0] = 1e-39  # the first chunk is all subnormal: M < tiny, the float64 path
    # sums exact in float32; a dry run takes 4 programs of the interpreter per launch, not 16
    grid = torch.randint(-255, 256, (1 << 12 if DRY else 1 << 14,), generator=gen) / 64.0
    cases = [
        (torch.float32, "1-element chunks", scalars, 1),
        (torch.bfloat16, "1-element chunks", scalars, 1),
        (torch.float32, "subnormal entries", sub, 16),
        (torch.float32, "grid data, chunks of 1000", grid, 1000),
        (torch.float32, "grid data, per tensor", grid, None),
    ]
    for dtype, kind, data, chunk in cases:
        c = data.to(dtype)
        diff = 0
        for levels in (127, 63, 42, 31, 15, 7):
            for k in (2.0, 1.0):
                cpu = quantize.quantize_l1(c, levels, clip_multiple=k, chunk_size=chunk)
                if chunk == 1:
                    exact = torch.sign(c.double()) * round(levels / k)  # Python's round: half to even
                    diff += same(cpu, exact.to(cpu.dtype))
                for backend in ("torch", "triton"):
                    got = kernels.quantize_l1(
                        c.to(device), levels, clip_multiple=k, chunk_size=chunk, backend=backend
                    )
                    diff += same(got.cpu(), cpu)
        check("correctness", f"quantize_l1 half-way rule {str(dtype)[6:]}, {kind}: device = CPU", diff)


# ------------------------------------------------------------------------------------ 2. bandwidth


def timed(fn, device: torch.device, runs: int = 25, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bandwidth(device: torch.device, n: int, runs: int) -> None:
    from lioncub.ops import abs_sums, kernels

    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    warmup = 0 if DRY else 3  # a dry run's timings mean nothing: each kernel runs once, not 3 + runs times
    copy_bw = 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), device, runs, warmup)
    row("bandwidth", "device-to-device copy (fp32)", f"{copy_bw / 1e9:.0f} GB/s")
    m, g, p = torch.randn(n, device=device), torch.randn(n, device=device), torch.randn(n, device=device)
    levels = torch.empty(n, dtype=torch.int8, device=device)
    votes = torch.randint(-1, 2, (n,), dtype=torch.int8, device=device)
    rows8 = torch.randint(0, 256, (8, n // 8), dtype=torch.uint8, device=device)
    maj = torch.empty(n // 8, dtype=torch.uint8, device=device)
    # a bucket of 16 tensors (views of the same size, each its own address in the kernels' pointer table)
    parts = 16
    starts = [i * (n // parts) for i in range(parts)]
    ms, gs, ps = m.view(parts, -1).unbind(), g.view(parts, -1).unbind(), p.view(parts, -1).unbind()
    direction = torch.empty(n, device=device)
    f4 = 4 * n
    cases = [
        ("quantize_l1 pass 2 (fp32 -> int8)", lambda: kernels.quantize_l1(m, 127, out=levels), f4 + n),
        ("majority_pack N=8", lambda: kernels.majority_pack(rows8, True, out=maj), 9 * n / 8),
        ("apply_votes_ (p, int8)", lambda: kernels.apply_votes_(p, votes, lr=1e-9), 2 * f4 + n),
        (
            "apply_votes_ + momentum",
            lambda: kernels.apply_votes_(p, votes, lr=1e-9, exp_avg=m, grad=g, beta2=0.99),
            5 * f4 + n,  # p and m read and written, g and the votes read
        ),
        (
            f"lion_directions_ ({parts} tensors: m, g -> out)",
            lambda: kernels.lion_directions_(direction, starts, ms, gs, beta1=0.9),
            3 * f4,
        ),
        (
            f"apply_votes_multi_ ({parts} tensors, int8)",
            lambda: kernels.apply_votes_multi_(ps, votes, starts, lr=1e-9, weight_decay=0.1),
            2 * f4 + n,
        ),
        (
            f"apply_votes_multi_ + momentum ({parts} tensors)",
            lambda: kernels.apply_votes_multi_(ps, votes, starts, lr=1e-9, exp_avgs=ms, grads=gs, beta2=0.99),
            5 * f4 + n,
        ),
        (
            f"l1_abs_sums (fp32 [{parts}, {n // parts}] -> fp64)",
            lambda: abs_sums.l1_abs_sums(m.view(parts, -1)),
            f4,
        ),
    ]
    for name, fn, nbytes in cases:
        t = timed(fn, device, runs, warmup)
        pct = 100 * nbytes / t / copy_bw
        row(
            "bandwidth",
            name,
            f"{nbytes / t / 1e9:.0f} GB/s = {pct:.0f} % of copy",
            ">= 60 %",
            _verdict(pct >= 60),
        )
    with device_pass1():  # in a dry run too: pass 1 as a CUDA tensor takes it
        t_total = timed(lambda: kernels.quantize_l1(m, 127, out=levels), device, runs, warmup)
    row(
        "bandwidth",
        "quantize_l1 both passes (pass 1: float64 sums of |c| per group, 3 launches per bucket)",
        f"{t_total * 1e3:.3f} ms",
    )


# ------------------------------------------------------------------------------------ 3. the vote path


class _ForkedRank:
    """A dry run's CPU rank: a fork of this process (torch and ``torch._dynamo`` imported: no interpreter
    to start, nothing to import again) running ``gpu_path.py``'s entry point (:func:`gpu_path.rank_main`)
    with the arguments a GPU rank's command gets, its output into its log, without ``TRITON_INTERPRET``
    (the CPU kernels); waited for and signalled as the ``subprocess.Popen`` of a GPU rank. Forked before
    this process made a process group, before any section ran."""

    def __init__(self, argv: list[str], log: IO[str]) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        ctx = multiprocessing.get_context("fork")
        self.proc = ctx.Process(target=_forked_rank, args=(argv, log.fileno()), daemon=True)
        self.proc.start()

    @property
    def returncode(self) -> int | None:
        """The exit code (``-N``: killed by signal N), None while it runs."""
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank {self.proc.name}", timeout or 0.0)
        return self.proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self.proc.exitcode is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _forked_rank(argv: list[str], log_fd: int) -> None:
    """:class:`_ForkedRank`'s process: ``python gpu_path.py ARGV`` without starting Python again."""
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.environ.pop("TRITON_INTERPRET", None)  # the CPU kernels (read at each call, not at import)
    sys.argv = [gpu_path.__file__, *argv]
    sys.exit(gpu_path.rank_main())


def start_ranks(world: int, n: int, timeout_s: float, inject: list[str]) -> Callable[[], None]:
    """Start :func:`gpu_path.vote_path` on ``world`` processes, one per GPU (``cuda:rank``, NCCL; in a dry
    run CPU processes over gloo, forks of this one: :class:`_ForkedRank`), each against its CPU over gloo;
    returns ``collect()``, which waits for them and adds their rows here, a rank's failed sections as FAIL
    rows with its traceback. Past ``timeout_s`` (from ``collect()``'s call) each rank still running gets
    SIGABRT (its ``faulthandler`` dumps its stacks into its log, kept as its traceback), then SIGKILL;
    ranks still running when this process exits are killed."""
    tmp = tempfile.TemporaryDirectory()
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_path.py")
    common = ["--world", str(world), "--n", str(n), "--store", f"{tmp.name}/store"] + (["--dry-run"] * DRY)
    common += [f"--fail-section={name}" for name in inject if name in gpu_path.SECTIONS]
    # a dry run's ranks take the CPU kernels: the Triton interpreter (slow) ran the same code at N = 1
    child_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    logs = [open(f"{tmp.name}/rank{r}.log", "w") for r in range(world)]  # noqa: SIM115 (closed below)
    argv = [["--rank", str(r), "--out", f"{tmp.name}/rows{r}.json", *common] for r in range(world)]
    procs: list[subprocess.Popen[str] | _ForkedRank] = [
        _ForkedRank(argv[r], logs[r])
        if DRY
        else subprocess.Popen(
            [sys.executable, script, *argv[r]],
            stdout=logs[r],
            stderr=subprocess.STDOUT,
            text=True,
            env=child_env,
        )
        for r in range(world)
    ]

    def kill_left() -> None:  # a check ending before collect() leaves no rank behind
        for proc in procs:
            if proc.poll() is None:
                proc.kill()

    atexit.register(kill_left)

    def collect() -> None:
        try:
            _collect_ranks(procs, logs, tmp.name, timeout_s)
        finally:
            tmp.cleanup()

    return collect


def _reraise(err: Exception) -> None:
    """``collect()`` of ranks that did not start: ``err``, raised in section 'several ranks'."""
    raise err


def _collect_ranks(
    procs: list[subprocess.Popen[str] | _ForkedRank], logs: list[IO[str]], tmp: str, timeout_s: float
) -> None:
    """:func:`start_ranks`' ``collect()``: the ranks ``procs`` writing into ``tmp``."""
    world = len(procs)
    deadline = time.monotonic() + timeout_s
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGABRT)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for log in logs:
        log.close()
    section = f"vote path N={world}"
    for r, proc in enumerate(procs):
        path = f"{tmp}/rows{r}.json"
        rows = []
        if os.path.exists(path):
            with open(path) as f:
                rows = json.load(f)
        for kind, name, item, *rest in rows:
            label = f"rank {r}/{world}: {item}"
            if kind == "check":
                check(f"{name} N={world}", label, rest[0])
            elif kind == "fail":
                section_failed(f"{name} N={world}", label, rest[0])
            elif kind == "skip":
                section_skipped(f"{name} N={world}", label)
            else:
                row(f"{name} N={world}", label, *rest)
        if proc.returncode != 0:
            with open(f"{tmp}/rank{r}.log", errors="replace") as f:
                tail = f.read()[-6000:]
            why = (
                f"timed out after {timeout_s:.0f} s, stopped (SIGABRT: stacks in its log)"
                if timed_out
                else ""
            )
            section_failed(section, f"rank {r}/{world} exited {proc.returncode} {why}".rstrip(), tail)


# ------------------------------------------------------------------------------------ 4. 350M step


def gpt_shapes(layers: int, d: int, vocab: int, ctx: int) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [
            (d,),
            (d,),
            (3 * d, d),
            (3 * d,),
            (d, d),
            (d,),
            (d,),
            (d,),
            (4 * d, d),
            (4 * d,),
            (d, 4 * d),
            (d,),
        ]
    return [*shapes, (d,), (d,)]


def step_overhead(device: torch.device, layers: int, d: int, vocab: int, ctx: int, runs: int) -> None:
    from lioncub.collectives import exchange_when_alone
    from lioncub.optim import Lion, LionCub

    shapes = gpt_shapes(layers, d, vocab, ctx)
    total = sum(torch.Size(s).numel() for s in shapes)
    row("350M step", "parameters", f"{total / 1e6:.1f} M in {len(shapes)} tensors ({layers} layers, d={d})")

    def make():
        gen = torch.Generator(device=device).manual_seed(7)
        params = [torch.nn.Parameter(torch.randn(s, device=device, generator=gen) * 0.02) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, device=device, generator=gen)
        return params

    def sync_time(fn) -> float:
        # warm-up (the first step builds buffers); a dry run's timings mean nothing: none (steps after
        # the first are walked by sections 'presets' and 'host syncs')
        for _ in range(0 if DRY else 2):
            fn()
        times = []
        for _ in range(runs):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    params = make()
    lion = Lion(params, lr=1e-4, weight_decay=0.1)
    t_lion = sync_time(lion.step)
    row("350M step", "plain Lion (foreach) step", f"{t_lion * 1e3:.2f} ms")
    del lion, params
    for preset in ("1bit", "8bit", "4bit", "8bit-sign"):
        for voting in (False, True):  # one process: Lion's step; voting: the whole vote path at N = 1
            params = make()
            with exchange_when_alone() if voting else contextlib.nullcontext():
                opt = LionCub(params, lr=1e-4, weight_decay=0.1, variant=preset)
            t = sync_time(opt.step)
            over = 100 * (t / t_lion - 1)
            row(
                "350M step",
                f"LionCub {preset} step (N=1{', votes exchanged' if voting else ''})",
                f"{t * 1e3:.2f} ms, {over:+.0f} % over Lion",
                "<= 25 %",
                _verdict(over <= 25),
            )
            del opt, params


# ------------------------------------------------------------------------------------ main


def default_out() -> str:
    """``gpu_check_<date>_<time>.txt`` under ``$OUT`` if set, else in the working directory."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    return os.path.join(os.environ.get("OUT") or ".", f"gpu_check_{stamp}.txt")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU: Triton interpreter, gloo, small sizes")
    parser.add_argument("--skip-350m", action="store_true", help="leave out section 4")
    parser.add_argument(
        "--ranks", type=int, default=0, help="dry run: also the vote path on this many CPU processes (>= 2)"
    )
    parser.add_argument("--out", default=None, help="the table's file (default: gpu_check_<date>_<time>.txt)")
    parser.add_argument(
        "--fail-section",
        action="append",
        default=[],
        choices=SECTIONS,
        metavar="NAME",
        help=f"test hook: section NAME raises at its end (repeatable; one of {', '.join(SECTIONS)})",
    )
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():  # before anything changes the process's state
        print(
            f"gpu_check: torch {torch.__version__} sees no CUDA GPU. Run it on a machine with an NVIDIA "
            "GPU, with a CUDA build of torch and triton; or use --dry-run for the CPU mode."
        )
        return 2
    out = args.out or default_out()
    warnings.simplefilter("ignore")
    faulthandler.enable(all_threads=True)  # SIGABRT (gpu_check.sh's time-out), SIGSEGV: every stack
    if args.dry_run:
        gpu_path.interpreter_patches_once()  # the language patched once per process, not per launch
        gpu_path.interpreter_dtypes_once()  # each dtype's numpy dtype looked up once (5-10 %)
        device = torch.device("cpu")
        backend = "gloo"
        sizes = dict(n=3000, bw_n=1 << 14, runs=1, layers=1, d=16, vocab=32, ctx=8, step_runs=1)
        torch.set_num_threads(1)
        # what LionCub's first parameter group imports (~1.3 s of CPU), once, before the --ranks fork
        importlib.import_module("torch._dynamo")
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        backend = "nccl"
        sizes = dict(n=1 << 20, bw_n=1 << 28, runs=25, layers=24, d=1024, vocab=50304, ctx=1024, step_runs=10)
        row("device", "GPU", torch.cuda.get_device_name(device))
    from lioncub.ops import kernels

    row(
        "device",
        "torch / triton",
        f"{torch.__version__} / {kernels.triton.__version__ if kernels.HAVE_TRITON else 'missing'}",
    )
    if not kernels.HAVE_TRITON:
        print(f"gpu_check: triton is not importable ({kernels.TRITON_ERROR})")
        return 2
    ranks = args.ranks if DRY else torch.cuda.device_count()
    ranks_timeout_s = 240
    sections = gpu_path.Sections(
        section_failed, section_skipped, args.fail_section, after=lambda: write_table(out, sections)
    )
    print(f"gpu_check: the table goes to {out} (rewritten after every section)")
    t0 = time.perf_counter()
    early_ranks: Callable[[], None] | None = None
    if DRY and ranks >= 2:  # CPU ranks run beside the sections below (GPU ranks after them: the same GPUs)
        try:
            early_ranks = start_ranks(ranks, sizes["n"], ranks_timeout_s, args.fail_section)
        except Exception as err:  # raised in section 'several ranks', as where they start on GPUs
            early_ranks = functools.partial(_reraise, err)
    with sections.run("kernels"):
        correctness(device, sizes["n"])
        multi_tensor(device, sizes["n"])
        l1_sums(device, sizes["n"])
    with sections.run("half-way rule"):
        halfway(device)
    with sections.run("bandwidth"):
        bandwidth(device, sizes["bw_n"], sizes["runs"])
    with tempfile.TemporaryDirectory() as tmp:
        with sections.run("process group"):
            dist.init_process_group(
                backend,
                init_method=f"file://{tmp}/store",
                rank=0,
                world_size=1,
                timeout=datetime.timedelta(seconds=120),
            )
        if dist.is_initialized():
            gpu_path.vote_path(device, sizes["n"], check, row, _verdict, sections)
        else:
            for name in gpu_path.SECTIONS:
                sections.skip(name, "no process group (section 'process group' failed)")
        if not args.skip_350m:
            with sections.run("350M step"):
                step_overhead(
                    device, sizes["layers"], sizes["d"], sizes["vocab"], sizes["ctx"], sizes["step_runs"]
                )
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as err:
                print(f"gpu_check: destroy_process_group: {gpu_path.summary(err)}")
    if ranks >= 2:
        with sections.run("several ranks", bound_s=ranks_timeout_s + 60):
            (early_ranks or start_ranks(ranks, sizes["n"], ranks_timeout_s, args.fail_section))()
    row("device", "wall time", f"{time.perf_counter() - t0:.0f} s")
    write_table(out, sections, final=True)
    print("\n" + table(sections, final=True, tracebacks=False), end="")
    failed = sorted(set(FAILED), key=FAILED.index)
    if FAILURES:
        print(f"\ngpu_check: {len(FAILURES)} correctness check(s) failed: {'; '.join(FAILURES)}")
    else:
        print("\ngpu_check: all correctness checks passed" + (" (dry run: timings are meaningless)" * DRY))
    if failed:
        print(
            f"gpu_check: {len(failed)} section(s) failed: {'; '.join(failed)} (tracebacks above and in {out})"
        )
    else:
        print("gpu_check: every section ran to its end")
    print(f"gpu_check: the table is in {out}")
    return 1 if FAILURES or failed else 0


if __name__ == "__main__":
    sys.exit(main())
