"""How long a short ``lioncub train`` takes from the command to its summary, with the ranks forked from a
preloaded interpreter (``lioncub.launch.preload``, the default on loopback) and as fresh interpreters
(``LIONCUB_PRELOAD=0``), in one process, the two taking turns.

    ./run bench bench_launch [--rounds 5] [--nproc 2] [--steps 7] [--link RATE]

The first preloaded run also starts the zygote (reported apart); the medians are over the later rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

from lioncub import cli


def one_run(out: Path, nproc: int, steps: int, preload: bool, link: str) -> float:
    """Seconds of one ``lioncub train`` of the tiny GPT into ``out`` (``link``: ``loopback`` or a rate)."""
    os.environ["LIONCUB_PRELOAD"] = "1" if preload else "0"
    argv = ["train", "--workload", "gpt", "--size", "tiny", "--no-progress", "--out", str(out),
            "--link", link, "--variant", "1bit", "--nproc", str(nproc), "--steps", str(steps),
            "--eval-every", "0"]  # fmt: skip
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = cli.main(argv)
    if rc != 0:
        raise SystemExit(f"lioncub train exited with {rc}")
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument(
        "--link", default="loopback", help="loopback, or a rate: each rank behind a link (root)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        first = one_run(Path(tmp) / "first", args.nproc, args.steps, True, args.link)
        times: dict[bool, list[float]] = {True: [], False: []}
        for k in range(args.rounds):
            for preload in (False, True) if k % 2 else (True, False):
                times[preload].append(
                    one_run(Path(tmp) / f"{k}-{preload}", args.nproc, args.steps, preload, args.link)
                )
    fresh, forked = (statistics.median(times[p]) for p in (False, True))
    where = f"{args.nproc} ranks ({args.link}), {args.steps} steps, {os.cpu_count()} CPUs"
    print(f"lioncub train, gpt/tiny 1bit, {where}")
    print(f"  first preloaded run (starts the zygote): {first:.2f} s")
    for name, median, preload in (("fresh interpreters", fresh, False), ("forked", forked, True)):
        print(f"  {name}, median of {args.rounds}: {median:.2f} s  {[round(t, 2) for t in times[preload]]}")
    print(f"  ratio fresh / forked: {fresh / forked:.2f}x")


if __name__ == "__main__":
    main()
