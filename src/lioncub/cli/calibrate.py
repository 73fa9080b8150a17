"""``lioncub calibrate --out calib.json``: measure α, β and the compute costs for ``lioncub cost``.

Run it on every rank of a job (``lioncub launch --nproc 4 --link 1gbit -- python -m
lioncub.cli.calibrate --out calib.json``), or let it start the job itself with ``--nproc``
(``lioncub calibrate --nproc 4 --link 1gbit --out calib.json``). Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from lioncub.cli.options import real_number, whole_number
from lioncub.planning.costmodel import OPS, parse_count

EPILOG = """\
examples:
  lioncub calibrate --nproc 4 --link 1gbit --out calib.json     # starts 4 ranks behind 1 Gbit/s links (root)
  lioncub launch --nproc 4 -- -m lioncub.cli.calibrate --out calib.json   # inside a job (loopback)
  lioncub cost --params 774M --workers 4 --calibration calib.json

Sizes take b, kb, mb (1 kb = 1024 bytes).
"""


def _sizes(text: str) -> list[int]:
    from lioncub.units import parse_size

    try:
        sizes = [parse_size(s.strip(), "--sizes") for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--sizes: ")) from None
    if len(set(sizes)) < 2:
        raise argparse.ArgumentTypeError(f"need at least two distinct sizes, got {text!r}")
    return sizes


def _count(text: str) -> int:
    if text.strip() == "0":
        return 0
    try:
        return parse_count(text, "--compute-numel")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--compute-numel: ")) from None


def _ops(text: str) -> list[str]:
    ops = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        raise argparse.ArgumentTypeError(f"unknown collectives {unknown}; choose from {', '.join(OPS)}")
    return ops


def check_out(path: str) -> None:
    """Refuse an --out that rank 0 could not write, before anything is measured."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"--out {path}: is a directory; give a file name such as calib.json")
    parent = target.parent
    if not parent.is_dir():
        raise ValueError(f"--out {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"--out {path}: not writable")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--out", required=True, metavar="FILE.json", help="where rank 0 writes the result")
    parser.add_argument(
        "--sizes",
        type=_sizes,
        metavar="LIST",
        help="payload sizes per collective (default 1mb,4mb,16mb under a shaped link, whose tbf "
        "burst (2 ms of the rate) distorts smaller ones; 64kb,256kb,1mb,4mb,16mb otherwise); two sizes "
        "fit the line but leave no residual to judge it by (a warning says so): give three or more",
    )
    parser.add_argument("--repeats", type=whole_number(1), default=5, help="timed runs per size (default 5)")
    parser.add_argument(
        "--warmup", type=whole_number(0), default=1, help="untimed runs per size first (default 1)"
    )
    parser.add_argument(
        "--ops",
        type=_ops,
        default=list(OPS),
        metavar="LIST",
        help=f"collectives to time (default {','.join(OPS)})",
    )
    parser.add_argument(
        "--compute-numel",
        type=_count,
        default=1 << 22,
        metavar="COUNT",
        help="elements of the compute benchmarks, e.g. 4M (0: skip them; default 4194304)",
    )
    parser.add_argument(
        "--timeout",
        type=real_number("a finite number of seconds > 0", 0, low_open=True),
        default=300.0,
        metavar="SECONDS",
        help="process group timeout (default 300)",
    )
    parser.add_argument(
        "--nproc",
        type=whole_number(1),
        metavar="N",
        help="start N ranks with `lioncub launch` (unless inside a job)",
    )
    parser.add_argument("--link", metavar="RATE", help="with --nproc: shape each rank's link (needs root)")


def _launch_self(args: argparse.Namespace) -> int:
    from lioncub.launch import LaunchConfig, launch, parse_rate

    argv = [
        "-m",
        "lioncub.cli.calibrate",
        "--out",
        str(Path(args.out).resolve()),
        "--repeats",
        str(args.repeats),
        "--warmup",
        str(args.warmup),
        "--ops",
        ",".join(args.ops),
        "--compute-numel",
        str(args.compute_numel),
        "--timeout",
        str(args.timeout),
    ]
    if args.sizes is not None:
        argv += ["--sizes", ",".join(str(s) for s in args.sizes)]
    try:
        config = LaunchConfig(
            argv,
            nproc=args.nproc,
            link_rate_bps=parse_rate(args.link) if args.link else None,
            timeout_s=args.timeout + 60,
        )
        result = launch(config)
    except (ValueError, RuntimeError) as exc:
        print(f"lioncub calibrate: error: {exc}", file=sys.stderr)
        return 2
    if not result.ok:  # the launcher has named the failed rank or the signal already
        print(f"lioncub calibrate: no calibration written (exit code {result.returncode})", file=sys.stderr)
    return result.returncode


def run(args: argparse.Namespace) -> int:
    in_job = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        check_out(args.out)
        if not in_job and not args.link and "allreduce_f32" not in args.ops:
            raise ValueError(
                f"--ops {','.join(args.ops)}: without --link the link rate is unknown, so the ops must "
                "include allreduce_f32 (the reference)"
            )
    except ValueError as exc:
        print(f"lioncub calibrate: error: {exc}", file=sys.stderr)
        return 2
    if not in_job:
        if args.nproc is not None and args.nproc < 2:
            print(
                f"lioncub calibrate: error: --nproc {args.nproc}: calibrating the network needs at least "
                "2 ranks",
                file=sys.stderr,
            )
            return 2
        if args.nproc is None:
            print(
                "lioncub calibrate: error: no process group: pass --nproc N (N >= 2), or run it on every "
                "rank of a job: lioncub launch --nproc 4 [--link 1gbit] -- -m lioncub.cli.calibrate "
                "--out calib.json",
                file=sys.stderr,
            )
            return 2
        return _launch_self(args)
    if args.link:
        print("lioncub calibrate: error: --link only applies with --nproc outside a job", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist

    from lioncub.planning.calibrate import calibrate, init_from_env

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    try:
        created = init_from_env(args.timeout)
    except RuntimeError as exc:
        print(f"lioncub calibrate: error: {exc}", file=sys.stderr)
        return 2
    try:
        rank = dist.get_rank()
        log = print if rank == 0 else None
        if log is not None:
            log(f"calibrating on {dist.get_world_size()} ranks, {args.repeats} repeats per size")
        result = calibrate(
            args.sizes,
            args.repeats,
            args.warmup,
            ops=args.ops,
            compute_numel=args.compute_numel,
            log=log,
        )
        if rank == 0:
            result.save(args.out)
            net = result.network
            print(
                f"wrote {args.out}: α {net.latency_s * 1e6:.1f} us, link "
                f"{net.bandwidth_Bps * 8 / 1e6:.1f} Mbit/s x efficiency {net.efficiency:.3f} (fp32 allreduce)"
            )
    except ValueError as exc:
        print(f"lioncub calibrate: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if created:
            dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lioncub.cli.calibrate", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
