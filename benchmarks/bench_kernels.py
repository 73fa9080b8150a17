"""Throughput of the quantize and 1-bit packing kernels against an fp32 copy of the same tensor (issue 2).

Usage::

    .venv/bin/python benchmarks/bench_kernels.py [--sizes 1M,16M,64M] [--repeats 7] [--threads 1]
                                                 [--json out.json]

For each size n (``K`` = 2**10, ``M`` = 2**20 elements; a plain integer also works) one float32 tensor
``x = torch.randn(n)`` (seed 0) is timed, in one run, under these ops:

* baseline ``copy``: ``dst.copy_(x)`` into a preallocated float32 tensor (the memory-bandwidth limit
  every ratio is taken against), and ``clone``: ``x.clone()`` (the same, plus a fresh allocation);
* ``quantize_l1(x, 15, out=levels)`` (8-bit L1 levels, 8-worker budget) and ``quantize_l1(x, 127,
  out=levels)`` into a reused int8 buffer (as the optimizer calls it), and ``quantize_l1(x, 15)``
  (row ``s=15 new``: a fresh output, whose first-touch page faults are included);
* ``pack_signs(x)`` (float → packed bytes), ``unpack_signs(packed, n, float32)`` and
  ``unpack_signs(packed, n, bfloat16)`` (packed → ±1);
* numpy references: ``np.packbits(x_np >= 0)`` (comparison included), ``np.packbits(bool_array)``,
  ``np.unpackbits(packed)`` (to uint8) and ``np.unpackbits(packed).astype(np.float32) * 2 - 1``.

Method: ``torch.set_num_threads(--threads)``; the ops of a size take turns (paired): one warm-up round,
then ``--repeats`` rounds of one call of each op, each timed with ``time.perf_counter``; the median and
the min are reported. Outputs are allocated by
the op itself (as a caller would get them), except for ``copy``, the quantize rows without ``new`` and
``unpack_signs``, which write into a buffer allocated once (as :class:`lioncub.LionCub` does).

GB/s = (bytes read + bytes written) / median time, 1 GB = 1e9 bytes, counting only the op's nominal
input and final output (temporaries are not counted):

* copy / clone: 4n read + 4n written;
* quantize_l1: 8n read (two passes over x: the L1 norm, then the scaling) + n written (int8 levels);
* pack_signs, np.packbits(x >= 0): 4n read + n/8 written;
* np.packbits(bool): n read + n/8 written;
* unpack_signs fp32: n/8 read + 4n written; bf16: n/8 read + 2n written;
* np.unpackbits: n/8 read + n written; np.unpackbits → ±1 float32: n/8 read + 4n written.

``ratio`` (column ``× copy``) is the op's median time over the median time of ``copy`` of the same
tensor, measured in the same run; ``× clone`` is the same against ``clone`` (a fairer reference for ops
that return a freshly allocated output, since first-touch page faults of a new buffer are included).
Targets (issue 2), judged on ``× copy``: pack_signs and unpack_signs (fp32, the parameter dtype here)
within 2× of the copy, quantize_l1 with s = 15 within 4×; the ``target`` column marks those rows ✓/✗.

Fused CPU passes (issue 20; :mod:`lioncub.ops.native`, float32, each against the torch code it replaces in
the step, which it equals bit for bit; ``--no-fused`` leaves them out), bytes as the fused pass moves them:

* ``lion fused`` (p, g, m → p, m: 12n read + 8n written) and ``lion torch`` (``lion_update_``'s foreach
  path, the ops one by one);
* ``dir+pack+m fused`` (m, g → packed votes, the next momentum, max-abs: 8n + 4n + n/8; what LionCub's
  1-bit contribution pass does) and ``dir+pack torch`` (``c = β1·m + (1−β1)·g`` into a buffer, its
  max-abs, ``pack_signs``); ``dir c fused`` (m, g → c: 8n + 4n);
* ``majority fused`` / ``majority torch``: 4 rows of n/32 packed bytes (one rank's slice of a 4-rank 1-bit
  vote of n elements) counted, tie rule, repacked (n/8 + n/32);
* ``apply bits fused`` (packed bits, p → p: n/8 + 4n + 4n; the momentum was written by the contribution
  pass) and ``apply bits torch`` (unpack to int8, ``apply_update_converting_``, ``update_momentum_``); ``apply
  bits+m fused`` (bits, p, m, g → p, m: n/8 + 12n + 8n; the apply where no next momentum was made);
  ``apply int8 fused`` / ``apply int8 torch`` (the int8 sums of an 8-bit vote, their sign taken, with the
  momentum update: n + 12n + 8n);
* ``dense scale fused`` (g → g / N into the send buffer of the dense presets, max-abs: 4n + 4n) and
  ``dense scale torch`` (the copy into the flat buffer, its max-abs, ``send.copy_(local).div_(N)``);
* ``quantize pass2 fused`` (c → int8 levels with the divisor known: 4n + n) and ``quantize_l1 cpu``
  (``kernels.quantize_l1(backend="cpu")``: torch's pass 1, then the C pass 2: 8n + n);
* ``1bit local fused``: dir+pack+m + majority + apply bits, LionCub's local work of a 1-bit step on one
  rank, whose ratio to ``lion fused`` is printed as "local beyond Lion".

The ``target`` column marks the fused rows against ≤ 1.5× copy (issue 20).

Correctness is checked once per size before timing (pack_signs against numpy.packbits of ``x >= 0``
padded with ones to a multiple of 8; unpack round trip against ``where(x >= 0, 1, -1)``); a mismatch
aborts with a non-zero exit status.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from lioncub.ops import packing
from lioncub.ops.packing import pack_signs, unpack_signs
from lioncub.ops.quantize import quantize_l1

TARGETS = {"pack_signs": 2.0, "unpack_signs fp32": 2.0, "quantize_l1 s=15": 4.0}
FUSED_TARGET = 1.5  # issue 20: each fused pass within 1.5x of one fp32 copy of the same tensor


@dataclass
class Row:
    size: str
    n: int
    op: str
    bytes_moved: int
    median_s: float
    min_s: float
    gbps: float
    ratio: float
    ratio_clone: float
    target: float | None
    met: bool | None


def parse_size(text: str) -> int:
    text = text.strip()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1].upper() in units:
        return int(float(text[:-1]) * units[text[-1].upper()])
    return int(text)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(threads: int) -> dict[str, object]:
    return {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "threads": threads,
        "torch_num_threads": torch.get_num_threads(),
    }


def time_paired(ops: list[tuple[str, Callable[[], object], int]], repeats: int) -> list[tuple[float, float]]:
    """(median, min) seconds of every op, the ops taking turns: one warm-up round, then ``repeats`` rounds
    of one call each (the drifts of a shared machine hit every op alike)."""
    for _, fn, _ in ops:
        fn()
    times: list[list[float]] = [[] for _ in ops]
    for _ in range(repeats):
        for i, (_, fn, _) in enumerate(ops):
            t0 = time.perf_counter()
            out = fn()
            times[i].append(time.perf_counter() - t0)
            del out
    return [(statistics.median(t), min(t)) for t in times]


def verify(x: torch.Tensor, x_np: np.ndarray) -> None:
    n = x.numel()
    packed = pack_signs(x)
    pad = (-n) % 8
    ref = np.packbits(np.concatenate([x_np >= 0, np.ones(pad, dtype=bool)]))
    if not np.array_equal(packed.numpy(), ref):
        sys.exit(f"FAILED: pack_signs != np.packbits(x >= 0) padded with ones (n={n})")
    want = torch.where(x >= 0, 1.0, -1.0)
    for dtype in (torch.float32, torch.bfloat16):
        got = unpack_signs(packed, n, dtype)
        if got.dtype != dtype or not torch.equal(got.float(), want):
            sys.exit(f"FAILED: unpack_signs(pack_signs(x), n, {dtype}) != where(x >= 0, 1, -1) (n={n})")


def fused_ops(x: torch.Tensor) -> list[tuple[str, Callable[[], object], int]]:
    """The fused CPU passes and the torch code each replaces (float32, n elements)."""
    from lioncub.ops import kernels, native, quantize
    from lioncub.ops.update import apply_update_converting_
    from lioncub.optim import LionCub
    from lioncub.optim.lion import _lion_update_foreach_, update_momentum_

    n = x.numel()
    gen = torch.Generator().manual_seed(1)
    m, g, p = torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    c, packed = torch.empty(n), torch.empty(n // 8 + 1, dtype=torch.uint8)
    lanes4 = torch.empty(n // 2 + 1, dtype=torch.uint8)
    rows = torch.randint(0, 256, (4, n // 32), dtype=torch.uint8, generator=gen)
    mine = torch.empty(n // 32, dtype=torch.uint8)
    sums = torch.randint(-4, 5, (n,), dtype=torch.int8, generator=gen)
    levels = torch.empty(n, dtype=torch.int8)
    hyper = {"lr": 1e-5, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1}

    def dir_pack_torch() -> None:
        torch.mul(m, 0.9, out=c).add_(g, alpha=0.1)
        torch.linalg.vector_norm(c, float("inf"))
        pack_signs(c, out=packed[: n // 8] if n % 8 == 0 else None)

    def apply_bits_torch() -> None:
        u = unpack_signs(packed, n, torch.int8)
        apply_update_converting_(p, u, lr=1e-5, weight_decay=0.1)
        update_momentum_(m, g, 0.99)

    def apply_int8_torch() -> None:
        apply_update_converting_(p, torch.sign(sums), lr=1e-5, weight_decay=0.1)
        update_momentum_(m, g, 0.99)

    def majority_fused() -> None:
        kernels.majority_pack(rows, True, n_workers=4, out=mine, backend="cpu")

    def dir_pack() -> None:
        native.direction_lanes(m, g, 0.9, out=packed, position=0, next_momentum=m_next, beta2=0.99)

    def dir_lanes4() -> None:  # the 4bit preset's contribution: votes in 4-bit lanes
        native.direction_lanes(m, g, 0.9, out=lanes4, position=0, bits=4, next_momentum=m_next, beta2=0.99)

    def apply_bits() -> None:
        native.apply_bits(p, packed, lr=1e-5, weight_decay=0.1)

    def apply_bits_m() -> None:
        native.apply_bits(p, packed, lr=1e-5, weight_decay=0.1, momentum=native.Momentum(m, g, 0.99))

    def local_1bit() -> None:
        dir_pack()
        majority_fused()
        apply_bits()

    m_next = torch.empty(n)
    divisor, _ = quantize.l1_divisors(x, 15)

    def dense_torch() -> None:  # LionCub's dense contribution: the copy, its max-abs, the send buffer
        torch.linalg.vector_norm(c.copy_(g), float("inf"))
        packed_c.copy_(c).div_(4)

    packed_c = torch.empty(n)
    param = torch.nn.Parameter(p.clone())
    param.grad = g
    one_process = LionCub([param], lr=1e-5, weight_decay=0.1, betas=(0.9, 0.99), variant="1bit")

    def pass2() -> None:
        native.quantize(x, divisor, chunk=None, wide=False, scale=7.5, levels=15, out=levels)

    return [
        ("lion fused", lambda: native.lion(p, g, m, **hyper), 20 * n),
        ("lion torch", lambda: _lion_update_foreach_([p], [g], [m], maximize=False, **hyper), 20 * n),
        ("dir+pack+m fused", dir_pack, 12 * n + n // 8),
        ("dir+pack torch", dir_pack_torch, 8 * n + n // 8),
        ("dir c fused", lambda: native.direction(m, g, 0.9, out=c), 12 * n),
        ("dir+4bit lanes+m fused", dir_lanes4, 12 * n + n // 2),
        ("majority fused", majority_fused, n // 8 + n // 32),
        (
            "majority torch",
            lambda: packing.pack_majority(packing.count_votes(rows, rows.shape[1] * 8), 4, True),
            n // 8 + n // 32,
        ),
        ("apply bits fused", apply_bits, 8 * n + n // 8),
        ("apply bits+m fused", apply_bits_m, 20 * n + n // 8),
        ("apply bits torch", apply_bits_torch, 20 * n + n // 8),
        (
            "apply int8 fused",
            lambda: native.apply_int8(
                p, sums, sign_of=True, lr=1e-5, weight_decay=0.1, momentum=native.Momentum(m, g, 0.99)
            ),
            21 * n,
        ),
        ("apply int8 torch", apply_int8_torch, 21 * n),
        ("dense scale fused", lambda: native.scale(g, c, divisor=4), 8 * n),
        ("dense scale torch", dense_torch, 8 * n),
        ("quantize pass2 fused", pass2, 5 * n),
        ("quantize_l1 cpu", lambda: kernels.quantize_l1(x, 15, out=levels, backend="cpu"), 9 * n),
        ("1bit local fused", local_1bit, 20 * n + n // 4),
        ("max-abs aminmax", lambda: quantize.max_abs(g), 4 * n),
        ("max-abs vector_norm", lambda: torch.linalg.vector_norm(g, float("inf")), 4 * n),
        ("LionCub N=1 step", one_process.step, 24 * n),  # its max-abs check, then the Lion step
    ]


FUSED_ROWS = ("lion fused", "dir+pack+m fused", "dir c fused", "majority fused", "apply bits fused")
FUSED_ROWS += ("apply bits+m fused", "apply int8 fused", "dense scale fused", "quantize pass2 fused")
FUSED_ROWS += ("quantize_l1 cpu",)


def bench_size(label: str, n: int, repeats: int, fused: bool = True) -> list[Row]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen, dtype=torch.float32)
    x_np = x.numpy()
    verify(x, x_np)
    dst = torch.empty_like(x)
    packed = pack_signs(x)
    packed_np = packed.numpy()
    bools_np = x_np >= 0
    nb = packed.numel()  # n/8 rounded up

    levels8 = torch.empty(n, dtype=torch.int8)
    out32 = torch.empty(n, dtype=torch.float32)
    out16 = torch.empty(n, dtype=torch.bfloat16)
    ops: list[tuple[str, Callable[[], object], int]] = [
        ("copy", lambda: dst.copy_(x), 8 * n),
        ("clone", lambda: x.clone(), 8 * n),
        # into a reused result buffer, as the optimizer does (a fresh one page-faults on every call)
        ("quantize_l1 s=15", lambda: quantize_l1(x, 15, out=levels8), 9 * n),
        ("quantize_l1 s=127", lambda: quantize_l1(x, 127, out=levels8), 9 * n),
        ("quantize_l1 s=15 new", lambda: quantize_l1(x, 15), 9 * n),
        ("pack_signs", lambda: pack_signs(x), 4 * n + nb),
        ("unpack_signs fp32", lambda: unpack_signs(packed, n, torch.float32, out=out32), nb + 4 * n),
        ("unpack_signs bf16", lambda: unpack_signs(packed, n, torch.bfloat16, out=out16), nb + 2 * n),
        ("np.packbits(x>=0)", lambda: np.packbits(x_np >= 0), 4 * n + nb),
        ("np.packbits(bool)", lambda: np.packbits(bools_np), n + nb),
        ("np.unpackbits u8", lambda: np.unpackbits(packed_np), nb + n),
        ("np.unpackbits ±1 fp32", lambda: np.unpackbits(packed_np).astype(np.float32) * 2 - 1, nb + 4 * n),
    ]
    if fused:
        ops += fused_ops(x)
    timed = [
        (name, *stats, nbytes)
        for (name, _, nbytes), stats in zip(ops, time_paired(ops, repeats), strict=True)
    ]
    copy_median, clone_median = timed[0][1], timed[1][1]
    rows = []
    for name, med, mn, nbytes in timed:
        ratio = med / copy_median
        target = FUSED_TARGET if name in FUSED_ROWS else TARGETS.get(name)
        met = None if target is None else ratio <= target
        rows.append(
            Row(label, n, name, nbytes, med, mn, nbytes / med / 1e9, ratio, med / clone_median, target, met)
        )
    return rows


def target_cell(row: Row) -> str:
    if row.target is None:
        return ""
    return f"{'✓' if row.met else '✗'} (≤{row.target:g}×)"


def markdown_table(rows: list[Row]) -> str:
    lines = [
        "| size | op | median ms | min ms | GB/s | × copy | × clone | target |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.size} | {r.op} | {r.median_s * 1e3:.3f} | {r.min_s * 1e3:.3f} | {r.gbps:.2f} "
            f"| {r.ratio:.2f} | {r.ratio_clone:.2f} | {target_cell(r)} |"
        )
    return "\n".join(lines)


def rich_table(rows: list[Row], threads: int) -> Table:
    table = Table(title=f"quantize / 1-bit packing kernels vs fp32 copy ({threads} thread(s))")
    for col, justify in [
        ("size", "left"),
        ("op", "left"),
        ("median ms", "right"),
        ("min ms", "right"),
        ("GB/s", "right"),
        ("× copy", "right"),
        ("× clone", "right"),
        ("target", "left"),
    ]:
        table.add_column(col, justify=justify)
    last = None
    for r in rows:
        if last is not None and r.size != last:
            table.add_section()
        last = r.size
        style = None if r.met is None else ("green" if r.met else "red")
        table.add_row(
            r.size,
            r.op,
            f"{r.median_s * 1e3:.3f}",
            f"{r.min_s * 1e3:.3f}",
            f"{r.gbps:.2f}",
            f"{r.ratio:.2f}",
            f"{r.ratio_clone:.2f}",
            target_cell(r),
            style=style,
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument(
        "--sizes", default="1M,16M,64M", help="comma-separated element counts (K/M = 2**10/2**20)"
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per op (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--json", metavar="PATH", help="also write machine info and rows as JSON")
    parser.add_argument("--no-fused", action="store_true", help="leave out the fused CPU passes")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be >= 1")
    sizes = [(s.strip(), parse_size(s)) for s in args.sizes.split(",") if s.strip()]
    if not sizes or any(n < 1 for _, n in sizes):
        parser.error(f"--sizes={args.sizes!r} must list positive sizes")

    torch.set_num_threads(args.threads)
    info = machine_info(args.threads)
    console = Console()
    console.print(
        f"date: {info['date']}\ncpu: {info['cpu']} (nproc {info['nproc']})\n"
        f"python {info['python']}, torch {info['torch']}, numpy {info['numpy']}, "
        f"torch threads {info['torch_num_threads']}\n"
        f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}\nrepeats: {args.repeats}"
    )
    rows: list[Row] = []
    for label, n in sizes:
        console.print(f"[dim]size {label} (n={n}): verifying and timing...[/dim]")
        rows.extend(bench_size(label, n, args.repeats, fused=not args.no_fused))
    console.print(rich_table(rows, args.threads))
    print("\nMarkdown:\n")
    print(markdown_table(rows))
    for size in dict.fromkeys(r.size for r in rows):
        by = {r.op: r for r in rows if r.size == size}
        if "1bit local fused" in by:
            local, lion = by["1bit local fused"].median_s, by["lion fused"].median_s
            print(f"{size}: 1bit local work beyond the Lion step: {100 * (local - lion) / lion:+.0f}% of it")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {"machine": info, "repeats": args.repeats, "rows": [asdict(r) for r in rows]}, f, indent=2
            )
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
