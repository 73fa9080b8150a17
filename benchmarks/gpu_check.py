"""One prepared check of the GPU path (run by ``benchmarks/gpu_check.sh``; finishes in a few minutes).

On a machine with NVIDIA GPUs, from the repository root, with a Python whose torch is a CUDA build and
which has triton (``gpu_check.sh`` picks it: docs/benchmarks/gpu-check.md); nothing is installed and no
network is used:

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
   synchronizations of a step (host reads, ``synchronize`` calls and the profiler's CUDA syncs), for 8 and
   64 tensors and for 1, 8 and 64 buckets. With several GPUs the same on N = #GPUs processes, one per GPU;
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
interpreter (``TRITON_INTERPRET=1``), gloo instead of NCCL, wall-clock timing (its numbers mean nothing);
``--ranks K`` adds section 3 on K CPU processes (with the CPU kernels: the interpreter ran it at N = 1).
Without CUDA and without ``--dry-run`` it says so and exits 2. Exit 1 when a correctness check or a
section failed. The table printed last lists every measurement next to its target, and every section
with its time and verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import json
import os
import signal
import statistics
import subprocess
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


def vote_path_on_ranks(world: int, n: int, timeout_s: float, inject: list[str]) -> None:
    """:func:`gpu_path.vote_path` on ``world`` processes, one per GPU (``cuda:rank``, NCCL; in a dry run
    CPU processes over gloo), each against its CPU over gloo; their rows are added here, a rank's failed
    sections as FAIL rows with its traceback. Past ``timeout_s`` each rank still running gets SIGABRT (its
    ``faulthandler`` dumps its stacks into its log, kept as its traceback), then SIGKILL."""
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_path.py")
        common = ["--world", str(world), "--n", str(n), "--store", f"{tmp}/store"] + (["--dry-run"] * DRY)
        common += [f"--fail-section={name}" for name in inject if name in gpu_path.SECTIONS]
        # a dry run's ranks take the CPU kernels: the Triton interpreter (slow) ran the same code at N = 1
        child_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        logs = [open(f"{tmp}/rank{r}.log", "w") for r in range(world)]  # noqa: SIM115 (closed below)
        procs = [
            subprocess.Popen(
                [sys.executable, script, "--rank", str(r), "--out", f"{tmp}/rows{r}.json", *common],
                stdout=logs[r],
                stderr=subprocess.STDOUT,
                text=True,
                env=child_env,
            )
            for r in range(world)
        ]
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
    out = args.out or default_out()
    warnings.simplefilter("ignore")
    faulthandler.enable(all_threads=True)  # SIGABRT (gpu_check.sh's time-out), SIGSEGV: every stack
    if args.dry_run:
        device = torch.device("cpu")
        backend = "gloo"
        sizes = dict(n=3000, bw_n=1 << 14, runs=1, layers=1, d=16, vocab=32, ctx=8, step_runs=1)
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            print(
                f"gpu_check: torch {torch.__version__} sees no CUDA GPU. Run it on a machine with an NVIDIA "
                "GPU, with a CUDA build of torch and triton; or use --dry-run for the CPU mode."
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
    ranks = args.ranks if DRY else torch.cuda.device_count()
    ranks_timeout_s = 240
    sections = gpu_path.Sections(
        section_failed, section_skipped, args.fail_section, after=lambda: write_table(out, sections)
    )
    print(f"gpu_check: the table goes to {out} (rewritten after every section)")
    t0 = time.perf_counter()
    with sections.run("kernels"):
        correctness(device, sizes["n"])
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
            vote_path_on_ranks(ranks, sizes["n"], ranks_timeout_s, args.fail_section)
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
