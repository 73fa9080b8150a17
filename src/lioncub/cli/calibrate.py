"""``lioncub calibrate --out calib.json``: measure α, β and the compute costs for ``lioncub cost``.

Run it on every rank of a job (``lioncub launch --nproc 4 --link 1gbit -- python -m
lioncub.cli.calibrate --out calib.json``), or let it start the job itself with ``--nproc``
(``lioncub calibrate --nproc 4 --link 1gbit --out calib.json``). Rank 0 writes the JSON.

On nodes of several ranks (``--nnodes M --nproc-per-node L``, or a torchrun job of M ≥ 2 nodes whose
``$LOCAL_WORLD_SIZE`` is L ≥ 2) both levels are measured: each node's NIC (the ranks of one local rank
across the nodes, all L groups at once) and a rank's link inside its node; ``lioncub cost --nnodes M
--nproc-per-node L --calibration calib.json`` then predicts every topology from them. ``--flat``
measures one level over the whole job instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lioncub import env
from lioncub._validate import is_number
from lioncub.cli.options import add_flag, whole_number
from lioncub.planning.costmodel import OPS, parse_count

#: what a rank imports, preloaded once for the ranks forked under --nproc (no optimizer: no torch._dynamo)
RANK_MODULES = ("torch", "torch.distributed", "lioncub.planning.measure", "lioncub.optim.topology")

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lioncub.planning.calibration import Calibration

EPILOG = """\
examples:
  lioncub calibrate --nproc 4 --link 1gbit --out calib.json     # starts 4 ranks behind 1 Gbit/s links (root)
  lioncub calibrate --nnodes 2 --nproc-per-node 2 --link 1gbit --out nodes.json  # both levels
  lioncub cost --params 774M --nnodes 2 --nproc-per-node 4 --calibration nodes.json
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
    add_flag(parser, "timeout", "calibrate")  # the job's, as launch's: the process group's is the next
    add_flag(parser, "collective_timeout", "calibrate")
    # outside a job: the ranks `lioncub launch` starts (with --nnodes M >= 2, both levels are measured)
    add_flag(parser, "nproc", "calibrate", given_only=True)
    add_flag(parser, "link", "calibrate", given_only=True)
    add_flag(parser, "nnodes", "calibrate")
    add_flag(parser, "nproc_per_node", "calibrate")
    add_flag(parser, "intra_link", "calibrate")
    parser.add_argument(
        "--flat",
        action="store_true",
        help="inside a job of nodes of several ranks: measure one level over the whole job (as if every "
        "rank had its own link) instead of the NIC and the node separately",
    )


def _launch_self(args: argparse.Namespace) -> int:
    from lioncub.launch import LaunchConfig, launch, parse_rate
    from lioncub.launch.preload import gpu_refusal

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
        "--collective-timeout",
        str(args.collective_timeout),
    ]
    if args.sizes is not None:
        argv += ["--sizes", ",".join(str(s) for s in args.sizes)]
    if args.flat:
        argv.append("--flat")
    try:
        nodes = args.nnodes is not None
        # the ranks are forks of one interpreter that imported torch and the measurements once (under
        # --nnodes torchrun's agents and the ranks they start), unless they may use a GPU
        fork = gpu_refusal() is None and env.text("LIONCUB_PRELOAD") != "0"
        config = LaunchConfig(
            argv,
            nproc=1 if nodes else args.nproc,
            link_rate_bps=parse_rate(args.link) if args.link else None,
            timeout_s=args.timeout or None,
            nnodes=args.nnodes,
            nproc_per_node=args.nproc_per_node,
            intra_link_rate_bps=parse_rate(args.intra_link, "--intra-link") if args.intra_link else None,
            preload=RANK_MODULES if fork else (),
        )
        result = launch(config)
    except (ValueError, RuntimeError) as exc:
        return _fail(str(exc))
    if not result.ok:  # the launcher has named the failed rank or the signal already
        print(f"lioncub calibrate: no calibration written (exit code {result.returncode})", file=sys.stderr)
    return result.returncode


def _check_layout(args: argparse.Namespace) -> str:
    """Why the layout options outside a job do not fit together ('' if they do)."""
    if args.nnodes is None:
        for option, value in (("--nproc-per-node", args.nproc_per_node), ("--intra-link", args.intra_link)):
            if value is not None:
                return f"{option}: applies only with --nnodes M (M nodes of L ranks)"
        return ""
    if args.nproc is not None:
        return (
            f"--nproc {args.nproc} with --nnodes {args.nnodes}: give either --nproc N (N ranks, each its own "
            "link) or --nnodes M --nproc-per-node L (M nodes of L ranks)"
        )
    if args.nnodes < 2:
        return (
            f"--nnodes {args.nnodes}: the link between nodes needs M >= 2 nodes to measure; for one node "
            "give --nproc N"
        )
    if args.nproc_per_node is None:
        return f"--nnodes {args.nnodes}: needs --nproc-per-node L (L >= 2), the ranks on each node"
    if args.nproc_per_node < 2:
        return (
            f"--nproc-per-node {args.nproc_per_node}: a node of one rank has no link inside it to measure; "
            "give L >= 2, or --nproc N for one level"
        )
    if not args.link:
        return f"--nnodes {args.nnodes}: needs --link RATE, the rate of each node's NIC (root)"
    if args.flat:
        return "--flat with --nnodes: emulated nodes are calibrated per level; use --nproc N for one level"
    return ""


def _node_mesh() -> DeviceMesh | None:
    """The job's ``("node", "local")`` mesh when it has M >= 2 nodes of L >= 2 ranks (collective), else
    None: from ``$LIONCUB_NNODES`` (``lioncub launch``) or torchrun's ``$LOCAL_WORLD_SIZE``."""
    import torch.distributed as dist

    from lioncub.optim.topology import mesh_from_environment

    world = dist.get_world_size()
    nodes = env.get("LIONCUB_NNODES") or ""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    ell = (
        world // int(nodes)
        if nodes.isdigit() and int(nodes) >= 1
        else int(local)
        if local.isdigit()
        else world
    )
    if 2 <= ell < world and world % ell == 0:
        return mesh_from_environment("hierarchical")
    return None


#: the option that gives the rate of each level a calibration fits (by the label of its lines)
RATE_OPTIONS = {"[node] ": "--intra-link RATE", "[NIC] ": "--link RATE", "[all ranks, NIC] ": "--link RATE"}


def name_the_rate_option(message: str) -> str:
    """A calibration's error with "(or give the link's rate)" naming the option that gives that level's
    rate: ``--intra-link`` for the link inside a node, ``--link`` for a NIC or a flat job's link."""
    vague = "(or give the link's rate)"
    if vague not in message:
        return message
    option = next((o for label, o in RATE_OPTIONS.items() if message.startswith(label)), "--link RATE")
    where = "inside a node" if option.startswith("--intra") else "of the link"
    return message.replace(vague, f"(or give the rate {where}: lioncub calibrate … {option})")


def _fail(message: str) -> int:
    """Print ``message`` as the command's error; the exit code 2."""
    print(f"lioncub calibrate: error: {message}", file=sys.stderr)
    return 2


def _start_job(args: argparse.Namespace) -> int:
    """Outside a job: check the layout options and launch the ranks (or the emulated nodes)."""
    layout = _check_layout(args)
    if layout:
        return _fail(layout)
    if args.nnodes is not None:
        return _launch_self(args)
    if args.nproc is not None and args.nproc < 1:
        return _fail(f"--nproc {args.nproc} must be an integer >= 1")
    if args.nproc is not None and args.nproc < 2:
        return _fail(f"--nproc {args.nproc}: calibrating the network needs at least 2 ranks")
    if args.nproc is None:
        return _fail(
            "no process group: pass --nproc N (N >= 2), or run it on every rank of a job: lioncub launch "
            "--nproc 4 [--link 1gbit] -- -m lioncub.cli.calibrate --out calib.json"
        )
    return _launch_self(args)


def _said(result: Calibration) -> str:
    """What was measured, a level per clause: α, link rate and efficiency of the fp32 allreduce."""
    levels = [("NIC" if result.intra is not None else "link", result.network)]
    if result.intra is not None:
        levels.append(("inside a node", result.intra))
    if result.flat is not None:
        levels.append(("NIC under all ranks' collectives", result.flat))
    return "; ".join(
        f"{name}: α {net.latency_s * 1e6:.1f} us, {net.bandwidth_Bps * 8 / 1e6:.1f} Mbit/s x "
        f"efficiency {net.efficiency:.3f}"
        for name, net in levels
    )


def _in_job(args: argparse.Namespace) -> int:
    """On every rank of a job: measure; rank 0 writes the JSON."""
    given = [
        option
        for option, value in (
            ("--link", args.link),
            ("--nproc", args.nproc),
            ("--nnodes", args.nnodes),
            ("--nproc-per-node", args.nproc_per_node),
            ("--intra-link", args.intra_link),
        )
        if value is not None
    ]
    if given:
        return _fail(
            f"{', '.join(given)}: start a job from outside one; inside a job the launcher has set the ranks "
            "and links"
        )
    import torch
    import torch.distributed as dist

    from lioncub.planning.measure import calibrate, init_from_env

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    try:
        created = init_from_env(args.collective_timeout)
    except RuntimeError as exc:
        return _fail(str(exc))
    try:
        rank = dist.get_rank()
        log = print if rank == 0 else None
        if log is not None:
            log(f"calibrating on {dist.get_world_size()} ranks, {args.repeats} repeats per size")
        mesh = None if args.flat else _node_mesh()
        result = calibrate(
            args.sizes,
            args.repeats,
            args.warmup,
            ops=args.ops,
            compute_numel=args.compute_numel,
            nodes=mesh,
            log=log,
        )
        if rank == 0:
            result.save(args.out)
            print(f"wrote {args.out}: {_said(result)} (fp32 allreduce)")
    except ValueError as exc:
        return _fail(name_the_rate_option(str(exc)))
    finally:
        if created:
            dist.destroy_process_group()
    return 0


def run(args: argparse.Namespace) -> int:
    in_job = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        check_out(args.out)
        if not is_number(args.collective_timeout, gt=0):
            raise ValueError(
                f"--collective-timeout {args.collective_timeout!r} must be a finite number of seconds > 0"
            )
        if not in_job and not args.link and "allreduce_f32" not in args.ops:
            raise ValueError(
                f"--ops {','.join(args.ops)}: without --link the link rate is unknown, so the ops must "
                "include allreduce_f32 (the reference)"
            )
    except ValueError as exc:
        return _fail(str(exc))
    return _in_job(args) if in_job else _start_job(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lioncub.cli.calibrate", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
