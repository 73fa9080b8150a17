"""One prepared check of the GPU path (run by ``benchmarks/gpu_check.sh``; finishes in a few minutes).

On a machine with NVIDIA GPUs, from the repository root, with the project's venv — which must hold a
CUDA build of torch (the CPU wheel of constraints.txt has no CUDA) and triton (``pip install -e .[dev]``
brings the pinned one); nothing is installed and no network is used:

1. correctness: every kernel of :mod:`lioncub.ops.kernels` with ``backend="triton"`` against
   ``backend="torch"`` on fresh random data on the GPU, bit for bit (NaN-aware), with compiled ``fma``
   and with the exact emulation the interpreter uses;
2. bandwidth: bytes each kernel moves / its median time (CUDA events, warm-up, 25 runs) as a % of a
   device-to-device copy's bandwidth (target ≥ 60 %);
3. the whole vote path (``benchmarks/gpu_path.py``) on ``cuda:0`` over NCCL at world size 1 with the
   votes' collectives on (:func:`lioncub.collectives.exchange_when_alone`): every vote algorithm and every
   ``LionCub`` preset — step check, encode, exchange, decode, apply — local steps, ``consolidate_state_dict``
   and a checkpoint round trip through the CPU, each against the same ranks on the CPU over gloo, bit for
   bit; ``LionCub.overlap_with`` (the DDP hook and its vote thread) against the plain step; the host
   synchronizations of a step (host reads, and the profiler's CUDA syncs), for 8 and 64 tensors. With
   several GPUs the same on N = #GPUs processes, one per GPU;
4. a ``LionCub`` step on a 350M-parameter GPT-sized parameter set (24 layers, d = 1024), as one process
   (Lion's step) and with the votes exchanged over NCCL, against a plain ``lioncub.optim.Lion`` step:
   median step times and the overhead (target ≤ 25 %).

``--dry-run`` runs the same code paths on the CPU at small sizes: the Triton kernels in Triton's
interpreter (``TRITON_INTERPRET=1``), gloo instead of NCCL, wall-clock timing (its numbers mean nothing);
``--ranks K`` adds section 3 on K CPU processes (with the CPU kernels: the interpreter ran it at N = 1).
Without CUDA and without ``--dry-run`` it says so and exits 2. Exit 1 when a correctness check fails. The
table printed last lists every measurement next to its target.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

DRY = "--dry-run" in sys.argv
if DRY:  # before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lioncub.collectives import exchange_when_alone  # noqa: E402

ROWS: list[tuple[str, str, str, str, str]] = []  # (section, item, measured, target, verdict)
FAILURES: list[str] = []


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
    halfway(device)


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
    grid = torch.randint(-255, 256, (1 << 14,), generator=gen) / 64.0  # sums exact in float32
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
    from lioncub.ops import kernels

    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    warmup = 1 if DRY else 3  # a dry run's timings mean nothing: each kernel runs twice, not 3 + runs times
    copy_bw = 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), device, runs, warmup)
    row("bandwidth", "device-to-device copy (fp32)", f"{copy_bw / 1e9:.0f} GB/s")
    m, g, p = torch.randn(n, device=device), torch.randn(n, device=device), torch.randn(n, device=device)
    levels = torch.empty(n, dtype=torch.int8, device=device)
    votes = torch.randint(-1, 2, (n,), dtype=torch.int8, device=device)
    rows8 = torch.randint(0, 256, (8, n // 8), dtype=torch.uint8, device=device)
    maj = torch.empty(n // 8, dtype=torch.uint8, device=device)
    f4 = 4 * n
    cases = [
        ("quantize_l1 pass 2 (fp32 -> int8)", lambda: kernels.quantize_l1(m, 127, out=levels), f4 + n),
        ("majority_pack N=8", lambda: kernels.majority_pack(rows8, True, out=maj), 9 * n / 8),
        ("apply_votes_ (p, int8)", lambda: kernels.apply_votes_(p, votes, lr=1e-9), 2 * f4 + n),
        (
            "apply_votes_ + momentum",
            lambda: kernels.apply_votes_(p, votes, lr=1e-9, exp_avg=m, grad=g, beta2=0.99),
            4 * f4 + n,
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
    t_total = timed(lambda: kernels.quantize_l1(m, 127, out=levels), device, runs, warmup)
    row("bandwidth", "quantize_l1 both passes (per-tensor mean |c| in torch)", f"{t_total * 1e3:.3f} ms")


# ------------------------------------------------------------------------------------ 3. the vote path


def vote_path_on_ranks(world: int, n: int, timeout_s: float) -> None:
    """:func:`gpu_path.vote_path` on ``world`` processes, one per GPU (``cuda:rank``, NCCL; in a dry run
    CPU processes over gloo), each against its CPU over gloo; their rows are added here."""
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_path.py")
        common = ["--world", str(world), "--n", str(n), "--store", f"{tmp}/store"] + (["--dry-run"] * DRY)
        # a dry run's ranks take the CPU kernels: the Triton interpreter (slow) ran the same code at N = 1
        child_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        procs = [
            subprocess.Popen(
                [sys.executable, script, "--rank", str(r), "--out", f"{tmp}/rows{r}.json", *common],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=child_env,
            )
            for r in range(world)
        ]
        outputs = []
        for r, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                out = f"rank {r} of the {world}-rank vote path timed out after {timeout_s:.0f} s"
            outputs.append(out)
        for r, proc in enumerate(procs):
            path = f"{tmp}/rows{r}.json"
            if proc.returncode != 0 or not os.path.exists(path):
                print(outputs[r][-3000:])
                check(f"vote path N={world}", f"rank {r} exited {proc.returncode}", 1)
                continue
            with open(path) as f:
                rows = json.load(f)
            for kind, section, item, *rest in rows:
                label = f"rank {r}/{world}: {item}"
                if kind == "check":
                    check(f"{section} N={world}", label, rest[0])
                else:
                    row(f"{section} N={world}", label, *rest)


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
        for _ in range(1 if DRY else 2):  # warm-up (the first step builds buffers)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU: Triton interpreter, gloo, small sizes")
    parser.add_argument("--skip-350m", action="store_true", help="leave out section 4")
    parser.add_argument(
        "--ranks", type=int, default=0, help="dry run: also the vote path on this many CPU processes (>= 2)"
    )
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    if args.dry_run:
        device = torch.device("cpu")
        backend = "gloo"
        sizes = dict(n=3000, bw_n=1 << 14, runs=1, layers=1, d=16, vocab=32, ctx=8, step_runs=1)
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            print(
                f"gpu_check: torch {torch.__version__} sees no CUDA GPU. Run it on a machine with an NVIDIA "
                "GPU, in a venv with a CUDA build of torch and triton; or use --dry-run for the CPU mode."
            )
            return 2
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
    t0 = time.perf_counter()
    correctness(device, sizes["n"])
    bandwidth(device, sizes["bw_n"], sizes["runs"])
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            backend,
            init_method=f"file://{tmp}/store",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=120),
        )
        try:
            import gpu_path

            gpu_path.vote_path(device, sizes["n"], check, row, _verdict)
            if not args.skip_350m:
                step_overhead(
                    device, sizes["layers"], sizes["d"], sizes["vocab"], sizes["ctx"], sizes["step_runs"]
                )
        finally:
            dist.destroy_process_group()
    ranks = args.ranks if DRY else torch.cuda.device_count()
    if ranks >= 2:
        vote_path_on_ranks(ranks, sizes["n"], timeout_s=240)
    row("device", "wall time", f"{time.perf_counter() - t0:.0f} s")
    width = [max(len(r[i]) for r in ROWS) for i in range(5)]
    print(
        "\n"
        + "  ".join(
            h.ljust(w) for h, w in zip(("section", "item", "measured", "target", ""), width, strict=True)
        )
    )
    for r in ROWS:
        print("  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)).rstrip())
    if FAILURES:
        print(f"\ngpu_check: {len(FAILURES)} correctness check(s) failed: {'; '.join(FAILURES)}")
        return 1
    print(
        "\ngpu_check: all correctness checks passed"
        + (" (dry run: timings are meaningless)" if args.dry_run else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
