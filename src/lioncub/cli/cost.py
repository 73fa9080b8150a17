"""``lioncub cost``: predicted time per optimizer step of every variant (:mod:`lioncub.planning.costmodel`).

Prints a table (latency, bandwidth and compute parts, bytes per rank, speedup over ``32bit``), the winner,
which variant wins over the range of link rates and where the winner crosses the others; ``--plot``
saves the cost against the link rate and against N (like Fig. 2 of the Lion Cub paper). With ``--nnodes M
--nproc-per-node L`` it ranks every variant × topology (flat, hierarchical, node-majority) on M nodes of L
ranks: one NIC per node (``--bandwidth``, ``--latency``) and a link per rank inside the node
(``--intra-bandwidth``, ``--intra-latency``), or both levels as ``lioncub calibrate --nnodes`` measured
them (``--calibration``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from lioncub.cli.options import add_flag, real_number, whole_number
from lioncub.optim.config import PRESETS
from lioncub.planning import costmodel as cm
from lioncub.report import text
from lioncub.report.cost import figure, format_count, report, report_cluster
from lioncub.report.text import print_wrapped

EPILOG = """\
examples:
  lioncub cost --params 774M --workers 8 --bandwidth 1gbit --latency 50us
  lioncub cost --params 125M --workers 16 --bandwidth 10gbit --sync-every 10 --plot cost.png
  lioncub cost --params 25M --workers 4 --calibration calib.json    # constants from `lioncub calibrate`
  lioncub cost --params 774M --nnodes 2 --nproc-per-node 4 --bandwidth 10gbit --intra-bandwidth 400gbit
  lioncub cost --params 25M --nnodes 2 --nproc-per-node 2 --calibration nodes.json   # both levels measured

Rates are bits/s (100mbit, 2.5gbit, 1Gbps); latencies take s, ms, us, ns; counts take K, M, B (SI).
Compute is charged on the critical path (not overlapped with communication). With --workers 1 nothing is
communicated: each variant costs only its codec, and there are no speedups or crossovers to show.
--workers N gives every worker its own link; --nnodes M --nproc-per-node L puts L workers behind each
node's NIC (ranks numbered node by node, as torchrun numbers them).
"""

#: defaults of the link inside a node (NVLink-class) when --nnodes is given
DEFAULT_INTRA_BANDWIDTH = cm.DEFAULT_INTRA_BANDWIDTH
DEFAULT_INTRA_LATENCY = cm.DEFAULT_INTRA_LATENCY


def _arg(parse: Any, option: str) -> Any:
    def convert(text: str) -> Any:
        try:
            return parse(text, option)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{option}: ")) from None

    convert.__name__ = option  # argparse names the type in some messages
    return convert


def _variants(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [v for v in names if v not in PRESETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown variants {unknown}; choose from {', '.join(PRESETS)}")
    twice = sorted({v for v in names if names.count(v) > 1}, key=names.index)
    if twice:
        raise argparse.ArgumentTypeError(
            f"{text!r} names {', '.join(twice)} more than once; give distinct names from {', '.join(PRESETS)}"
        )
    return names


def _topologies(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [t for t in names if t not in cm.TOPOLOGIES]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give distinct names; allowed values are {', '.join(cm.TOPOLOGIES)}"
        )
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--params",
        required=True,
        type=_arg(cm.parse_count, "--params"),
        metavar="COUNT",
        help="e.g. 774M, 1.5B",
    )
    parser.add_argument(
        "--workers", type=whole_number(1), metavar="N", help="data-parallel workers, each with its own link"
    )
    add_flag(parser, "nnodes", "cost")
    add_flag(parser, "nproc_per_node", "cost")
    parser.add_argument(
        "--intra-bandwidth",
        type=_arg(cm.parse_bandwidth, "--intra-bandwidth"),
        metavar="RATE",
        help=f"with --nnodes: each worker's link inside its node (default {DEFAULT_INTRA_BANDWIDTH}, or a "
        "two-level calibration's)",
    )
    parser.add_argument(
        "--intra-latency",
        type=_arg(cm.parse_duration, "--intra-latency"),
        metavar="TIME",
        help=f"with --nnodes: α inside a node (default {DEFAULT_INTRA_LATENCY}, or a two-level "
        "calibration's)",
    )
    parser.add_argument(
        "--topologies",
        type=_topologies,
        metavar="LIST",
        help=f"with --nnodes: comma-separated, from {', '.join(cm.TOPOLOGIES)} (default all)",
    )
    parser.add_argument(
        "--bandwidth",
        type=_arg(cm.parse_bandwidth, "--bandwidth"),
        metavar="RATE",
        help="each worker's link rate (with --nnodes: each node's NIC), e.g. 1gbit (default 1gbit, or the "
        "calibration's)",
    )
    parser.add_argument(
        "--latency",
        type=_arg(cm.parse_duration, "--latency"),
        metavar="TIME",
        help="α per message, e.g. 50us (default 50us, or the calibration's)",
    )
    parser.add_argument(
        "--efficiency",
        type=real_number("a number in (0, 1]", 0, 1, low_open=True),
        metavar="FRACTION",
        help=f"payload share of the link rate (default {cm.TCP_EFFICIENCY:.3f}: TCP at MTU 1500; "
        "ignored with --calibration)",
    )
    parser.add_argument(
        "--calibration", metavar="FILE.json", help="constants measured by `lioncub calibrate`"
    )
    parser.add_argument(
        "--compute",
        choices=("cpu", "none"),
        default="cpu",
        help="local compute costs without --calibration: typical CPU values (default) or none",
    )
    parser.add_argument(
        "--bucket-mb",
        type=real_number("a number >= 0", 0, low_open=False),
        default=25.0,
        metavar="MB",
        help="LionCub's bucket size in MiB of fp32 parameters; each bucket pays its latency (default 25; "
        "0: one bucket)",
    )
    parser.add_argument(
        "--sync-every",
        type=whole_number(1),
        metavar="K",
        help="synchronise the momentum (fp32) every K steps",
    )
    parser.add_argument(
        "--sync-params",
        type=_arg(cm.parse_count, "--sync-params"),
        metavar="COUNT",
        help="parameters synchronised (default: all; e.g. embedding + head)",
    )
    add_flag(parser, "local_steps", "cost")
    add_flag(parser, "inner_momentum", "cost")
    parser.add_argument(
        "--step-compute",
        type=_arg(cm.parse_duration, "--step-compute"),
        metavar="TIME",
        help="a step's compute on each worker (forward, backward, optimizer; e.g. 190ms, as `lioncub train` "
        "logs it): also say whether the winner should vote every step or every H local steps "
        "(docs/local-steps.md, 'Choosing H')",
    )
    parser.add_argument(
        "--variants", type=_variants, metavar="LIST", help="comma-separated presets (default all)"
    )
    parser.add_argument("--plot", metavar="FILE.png", help="save cost vs link rate and vs N (Fig. 2 style)")


# ---------------------------------------------------------------------------------------------- run


def _setup(args: argparse.Namespace) -> tuple[cm.Network, cm.Network | None, cm.Compute, str]:
    """The network (a node's NIC with --nnodes), the link inside a node where a two-level calibration
    measured it, the compute to use, and a line saying where they come from."""
    if args.calibration:
        try:
            calib = cm.load_calibration(args.calibration)
        except ValueError as exc:
            raise ValueError(
                f"--calibration {args.calibration}: {exc} (expected a `lioncub calibrate` JSON file)"
            ) from None
        network, intra, compute = calib.network, calib.intra, calib.compute
        if calib.nnodes is not None and args.nnodes is None:
            raise ValueError(
                f"--calibration {args.calibration}: measured on {calib.nnodes} nodes × "
                f"{calib.nproc_per_node} ranks (a node's NIC and the links inside a node); predict with "
                "--nnodes M --nproc-per-node L, or calibrate with --nproc N for --workers N"
            )
        layout = (
            f"{calib.nnodes} nodes × {calib.nproc_per_node} ranks, both levels"
            if calib.nnodes is not None
            else f"N = {calib.world_size}"
        )
        source = f"calibration {args.calibration} ({layout})"
        if args.bandwidth is not None:
            network = network.with_bandwidth(args.bandwidth)
        if args.latency is not None:
            network = network.with_latency(args.latency)
        return network, intra, compute, source
    network = cm.Network(
        50e-6 if args.latency is None else args.latency,
        1e9 / 8 if args.bandwidth is None else args.bandwidth,
        cm.TCP_EFFICIENCY if args.efficiency is None else args.efficiency,
    )
    compute = cm.DEFAULT_CPU_COMPUTE if args.compute == "cpu" else cm.Compute()
    return (
        network,
        None,
        compute,
        "typical CPU compute costs" if args.compute == "cpu" else "no compute costs",
    )


def _check_layout(args: argparse.Namespace) -> int:
    """Refuse option combinations naming the options; return N, the number of workers."""
    nodes = args.nnodes is not None
    if args.nproc_per_node is not None and not nodes:
        raise ValueError("--nproc-per-node: applies only with --nnodes M (M nodes of L workers)")
    if nodes and args.nproc_per_node is None:
        raise ValueError(f"--nnodes {args.nnodes}: needs --nproc-per-node L, the workers on each node")
    if nodes == (args.workers is not None):
        raise ValueError(
            "give either --workers N (one link per worker) or --nnodes M --nproc-per-node L (M nodes of L "
            "workers behind one NIC each), not both"
            if nodes
            else "give either --workers N (one link per worker) or --nnodes M --nproc-per-node L (M nodes of "
            "L workers behind one NIC each)"
        )
    if not nodes:
        given = [
            option
            for option, value in (
                ("--intra-bandwidth", args.intra_bandwidth),
                ("--intra-latency", args.intra_latency),
                ("--topologies", args.topologies),
            )
            if value is not None
        ]
        if given:
            raise ValueError(f"{', '.join(given)}: applies only with --nnodes M --nproc-per-node L")
        return int(args.workers)
    if args.plot:
        raise ValueError("--plot: applies only with --workers N (the plot sweeps the link rate and N)")
    return int(args.nnodes * args.nproc_per_node)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    bucket = int(args.bucket_mb * 2**20 / 4) if args.bucket_mb > 0 else None
    if bucket is not None and bucket < 1:
        raise ValueError(
            f"--bucket-mb {args.bucket_mb:g} holds no fp32 parameter; give at least {4 / 2**20:.2g} "
            "(MiB) or 0 for one bucket"
        )
    if args.sync_params is not None:
        if args.sync_every is None:
            raise ValueError(
                "--sync-params: applies only with --sync-every K (how often they are synchronised)"
            )
        if args.sync_params > args.params:
            raise ValueError(
                f"--sync-params {format_count(args.sync_params)} exceeds --params "
                f"{format_count(args.params)}; give at most the model's parameter count"
            )
    names = list(args.variants or PRESETS)
    n = args.workers if args.workers is not None else args.nnodes * args.nproc_per_node
    where = (
        f"--workers {n}"
        if args.workers is not None
        else f"{n} workers ({args.nnodes} × {args.nproc_per_node})"
    )
    checks = {v: cm.allowed(v, n) for v in names}
    if not any(ok for ok, _ in checks.values()):
        fits = [v for v in PRESETS if cm.allowed(v, n)[0]]
        why = "; ".join(f"{v}: {reason}" for v, (_, reason) in checks.items())
        raise ValueError(
            f"--variants {','.join(names)}: none is allowed for {where} ({why}); "
            f"presets that allow {n} workers: {', '.join(fits)}"
        )
    options = {"sync_every": args.sync_every, "sync_params": args.sync_params, "bucket_numel": bucket}
    if args.local_steps is not None and args.sync_every is not None:
        raise ValueError(
            f"--sync-every {args.sync_every} with --local-steps {args.local_steps}: local steps do not sync "
            "momenta every K steps; --inner-momentum average prices the inner momenta averaged at each outer "
            "step"
        )
    if args.step_compute is not None and args.local_steps is not None:
        raise ValueError(
            f"--step-compute with --local-steps {args.local_steps}: --step-compute chooses H itself (a vote "
            "every step or every H steps); give one of them"
        )
    if args.step_compute is not None and not args.step_compute > 0:
        raise ValueError(
            f"--step-compute {args.step_compute:g} s: give a step's compute time > 0, e.g. 190ms"
        )
    if args.inner_momentum == "average":
        if args.local_steps is None:
            raise ValueError("--inner-momentum average: applies only with --local-steps H")
        options["sync_every"] = args.local_steps  # an fp32 allreduce of every momentum per window
    return {**options, "local_steps": args.local_steps}


def _check_plot(path: str | None) -> None:
    """Refuse a --plot path that cannot be written before anything is computed."""
    if path is None:
        return
    from pathlib import Path

    from matplotlib.backend_bases import FigureCanvasBase

    target = Path(path)
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = target.suffix.lstrip(".").lower()
    if suffix not in formats:
        raise ValueError(f"--plot {path}: unknown image format {suffix!r}; use one of {', '.join(formats)}")
    parent = target.parent
    if target.is_dir():
        raise ValueError(f"--plot {path}: is a directory; give a file name such as cost.png")
    if not parent.is_dir():
        raise ValueError(f"--plot {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--plot {path}: the directory {parent} is not writable")


def _print_schedule(console: Any, vote: Any, compute_s: float) -> None:
    """The schedule for ``vote`` (the winner's prediction) with a step's compute ``compute_s``."""
    from lioncub.planning.schedule import choose_schedule

    choice = choose_schedule(compute_s, vote.total_s)
    where = f" {vote.topology}" if getattr(vote, "topology", None) else ""
    print_wrapped(console, f"schedule for {vote.variant}{where}: {choice.reason}")


def run(args: argparse.Namespace) -> int:
    console = text.console()
    try:
        _check_layout(args)
        network, measured_intra, compute, source = _setup(args)
        options = _options(args)
        _check_plot(args.plot)
        if args.nnodes is not None:
            if measured_intra is not None:
                intra = measured_intra
                if args.intra_bandwidth is not None:
                    intra = intra.with_bandwidth(args.intra_bandwidth)
                if args.intra_latency is not None:
                    intra = intra.with_latency(args.intra_latency)
            else:
                intra = cm.Network(
                    cm.parse_duration(DEFAULT_INTRA_LATENCY)
                    if args.intra_latency is None
                    else args.intra_latency,
                    cm.parse_bandwidth(DEFAULT_INTRA_BANDWIDTH)
                    if args.intra_bandwidth is None
                    else args.intra_bandwidth,
                    cm.TCP_EFFICIENCY if args.efficiency is None else args.efficiency,
                )
            cluster = cm.Cluster(args.nnodes, args.nproc_per_node, network, intra)
            topologies = args.topologies or list(cm.TOPOLOGIES)
            report_cluster(
                console, args.params, cluster, compute, args.variants, topologies, source, **options
            )
            if args.step_compute is not None:
                rows = cm.cluster_table(args.params, cluster, compute, args.variants, topologies, **options)
                exact = [p for p in rows if p.allowed and p.topology != "node-majority"]
                _print_schedule(console, min(exact, key=lambda p: p.total_s), args.step_compute)
            return 0
        report(console, args.params, args.workers, network, compute, args.variants, source, **options)
        if args.step_compute is not None and args.workers > 1:
            best = cm.winner(args.params, args.workers, network, compute, args.variants, **options)
            _print_schedule(console, best, args.step_compute)
        if args.plot:
            fig = figure(args.params, args.workers, network, compute, args.variants, **options)
            fig.savefig(args.plot, dpi=120)
            console.print(f"saved {args.plot}")
    except (ValueError, OSError) as exc:
        print(f"lioncub cost: error: {exc}", file=sys.stderr)
        return 2
    return 0
