"""Software prefetch on or off in the fused CPU kernels, paired: each pass runs both ways in turns.

    python benchmarks/bench_prefetch.py --sizes 16M,64M --rounds 15

The streaming passes of :mod:`lioncub.ops.native` can prefetch their inputs a few KiB ahead in software
(``lioncub.ops.native.set_prefetch``); which is faster depends on the CPU's own prefetchers. The library
chooses by CPU vendor (:func:`lioncub.ops.native.prefetch_choice`); this measures both on this machine.
One thread, float32; medians over the rounds after one warm-up; ratio = off / on (< 1: off is faster).
The results are the same bits either way (tests/test_cpu_kernels.py).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from lioncub.ops import native

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import cpu_model, parse_size  # a sibling script, not a package


def passes(n: int) -> dict[str, Callable[[], object]]:
    """The streaming passes of a LionCub step on ``n`` float32 elements, and Lion's step."""
    gen = torch.Generator().manual_seed(1)
    m, g, p = (torch.randn(n, generator=gen) for _ in range(3))
    packed, nxt, c = torch.empty(n // 8, dtype=torch.uint8), torch.empty(n), torch.empty(n)
    sums = torch.randint(-4, 5, (n,), dtype=torch.int8, generator=gen)
    wd = {"lr": 1e-5, "weight_decay": 0.1}
    return {
        "lion step (p, g, m)": lambda: native.lion(p, g, m, beta1=0.9, beta2=0.99, **wd),
        "direction + 1-bit pack + next momentum": lambda: native.direction_lanes(
            m, g, 0.9, out=packed, position=0, bits=1, next_momentum=nxt, beta2=0.99
        ),
        "direction c": lambda: native.direction(m, g, 0.9, out=c),
        "apply from bits (p)": lambda: native.apply_bits(p, packed, **wd),
        "apply from bits + momentum": lambda: native.apply_bits(
            p, packed, momentum=native.Momentum(m, g, 0.99), **wd
        ),
        "apply from int8 + momentum": lambda: native.apply_int8(
            p, sums, sign_of=True, momentum=native.Momentum(m, g, 0.99), **wd
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="16M,64M", help="element counts (K/M = 2**10/2**20)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (after one warm-up)")
    args = parser.parse_args(argv)
    if not native.available():
        parser.error(f"the fused CPU kernels are unavailable: {native.reason()}")
    torch.set_num_threads(1)
    chosen = native.prefetch()
    print(f"{platform.node()}: {cpu_model()}, torch {torch.__version__}, 1 thread; "
          f"the library's choice here: prefetch {'on' if chosen[0] else 'off'} ({chosen[1]})")  # fmt: skip
    print("\n| size | pass | on ms | off ms | off / on |\n|---|---|---:|---:|---:|")
    for size in args.sizes.split(","):
        n = parse_size(size)
        ops = passes(n)
        times: dict[tuple[str, bool], list[float]] = {(k, on): [] for k in ops for on in (True, False)}
        for r in range(args.rounds + 1):
            for name, fn in ops.items():
                for on in (True, False) if r % 2 else (False, True):  # alternate which goes first
                    native.set_prefetch(on)
                    t0 = time.perf_counter()
                    fn()
                    if r:
                        times[(name, on)].append(time.perf_counter() - t0)
        for name in ops:
            on, off = (statistics.median(times[(name, s)]) * 1e3 for s in (True, False))
            print(f"| {size} | {name} | {on:.2f} | {off:.2f} | {off / on:.2f} |")
    native.set_prefetch(chosen[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
