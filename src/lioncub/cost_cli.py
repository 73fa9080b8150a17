"""``lioncub cost``: predicted time per optimizer step of every variant (:mod:`lioncub.costmodel`).

Prints a table (latency, bandwidth and compute parts, bytes per rank, speedup over ``32bit``), the winner,
which variant wins over the range of link rates and where the winner crosses the others; ``--plot``
saves the cost against the link rate and against N (like Fig. 2 of the Lion Cub paper).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lioncub import costmodel as cm

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rich.console import Console

EPILOG = """\
examples:
  lioncub cost --params 774M --workers 8 --bandwidth 1gbit --latency 50us
  lioncub cost --params 125M --workers 16 --bandwidth 10gbit --sync-every 10 --plot cost.png
  lioncub cost --params 25M --workers 4 --calibration calib.json    # constants from `lioncub calibrate`

Rates are bits/s (100mbit, 2.5gbit, 1Gbps); latencies take s, ms, us, ns; counts take K, M, B (SI).
Compute is charged on the critical path (not overlapped with communication).
"""

#: link rates of the plot's first panel and of the winner ranges, bits/s
SWEEP_BPS = (10e6, 400e9)
#: worker counts of the plot's second panel
SWEEP_N = (2, 128)


def _arg(parse: Any, option: str) -> Any:
    def convert(text: str) -> Any:
        try:
            return parse(text, option)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{option}: ")) from None

    convert.__name__ = option  # argparse names the type in some messages
    return convert


def _workers(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of workers, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _variants(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [v for v in names if v not in cm.PRESET_SCHEMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown variants {unknown}; choose from {', '.join(cm.PRESET_SCHEMES)}"
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
    parser.add_argument("--workers", required=True, type=_workers, metavar="N", help="data-parallel workers")
    parser.add_argument(
        "--bandwidth",
        type=_arg(cm.parse_bandwidth, "--bandwidth"),
        metavar="RATE",
        help="each worker's link rate, e.g. 1gbit (default 1gbit, or the calibration's)",
    )
    parser.add_argument(
        "--latency",
        type=_arg(cm.parse_duration, "--latency"),
        metavar="TIME",
        help="α per message, e.g. 50us (default 50us, or the calibration's)",
    )
    parser.add_argument(
        "--efficiency",
        type=_fraction,
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
        type=_non_negative,
        default=25.0,
        metavar="MB",
        help="LionCub's bucket size in MiB of fp32 parameters; each bucket pays its latency (default 25; "
        "0: one bucket)",
    )
    parser.add_argument(
        "--sync-every", type=_workers, metavar="K", help="synchronise the momentum (fp32) every K steps"
    )
    parser.add_argument(
        "--sync-params",
        type=_arg(cm.parse_count, "--sync-params"),
        metavar="COUNT",
        help="parameters synchronised (default: all; e.g. embedding + head)",
    )
    parser.add_argument(
        "--variants", type=_variants, metavar="LIST", help="comma-separated presets (default all)"
    )
    parser.add_argument("--plot", metavar="FILE.png", help="save cost vs link rate and vs N (Fig. 2 style)")


# --------------------------------------------------------------------------------------- formatting


def format_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "—"
    if s == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def format_bytes(b: float) -> str:
    if not math.isfinite(b):
        return "—"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def format_bitrate(bytes_per_s: float) -> str:
    bps = bytes_per_s * 8
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"


def format_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n:.0f}"


# ---------------------------------------------------------------------------------------------- run


def _setup(args: argparse.Namespace) -> tuple[cm.Network, cm.Compute, str]:
    """The network and compute to use, and a line saying where they come from."""
    if args.calibration:
        try:
            calib = cm.load_calibration(args.calibration)
        except ValueError as exc:
            raise ValueError(
                f"--calibration {args.calibration}: {exc} (expected a `lioncub calibrate` JSON file)"
            ) from None
        network, compute = calib.network, calib.compute
        source = f"calibration {args.calibration} (N = {calib.world_size})"
        if args.bandwidth is not None:
            network = network.with_bandwidth(args.bandwidth)
        if args.latency is not None:
            network = network.with_latency(args.latency)
        return network, compute, source
    network = cm.Network(
        50e-6 if args.latency is None else args.latency,
        1e9 / 8 if args.bandwidth is None else args.bandwidth,
        cm.TCP_EFFICIENCY if args.efficiency is None else args.efficiency,
    )
    compute = cm.DEFAULT_CPU_COMPUTE if args.compute == "cpu" else cm.Compute()
    return network, compute, "typical CPU compute costs" if args.compute == "cpu" else "no compute costs"


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
    names = list(args.variants or cm.PRESET_SCHEMES)
    checks = {v: cm.allowed(v, args.workers) for v in names}
    if not any(ok for ok, _ in checks.values()):
        fits = [v for v in cm.PRESET_SCHEMES if cm.allowed(v, args.workers)[0]]
        why = "; ".join(f"{v}: {reason}" for v, (_, reason) in checks.items())
        raise ValueError(
            f"--variants {','.join(names)}: none is allowed for --workers {args.workers} ({why}); "
            f"presets that allow {args.workers} workers: {', '.join(fits)}"
        )
    return {"sync_every": args.sync_every, "sync_params": args.sync_params, "bucket_numel": bucket}


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


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 132))
    try:
        network, compute, source = _setup(args)
        options = _options(args)
        _check_plot(args.plot)
        report(console, args.params, args.workers, network, compute, args.variants, source, **options)
        if args.plot:
            fig = figure(args.params, args.workers, network, compute, args.variants, **options)
            fig.savefig(args.plot, dpi=120)
            console.print(f"saved {args.plot}")
    except (ValueError, OSError) as exc:
        print(f"lioncub cost: error: {exc}", file=sys.stderr)
        return 2
    return 0


def report(
    console: Console,
    d: int,
    n: int,
    network: cm.Network,
    compute: cm.Compute,
    variants: Sequence[str] | None = None,
    source: str = "",
    **options: Any,
) -> None:
    """Print the prediction table, the winner, the winner by link rate and the crossovers."""
    from rich.table import Table

    rows = cm.table(d, n, network, compute, variants, **options)
    speed = cm.speedups(rows)
    buckets = options.get("bucket_numel")
    nbuckets = 1 if buckets is None else math.ceil(d / buckets)
    title = (
        f"d = {format_count(d)} parameters, N = {n} workers, {format_bitrate(network.bandwidth_Bps)} links "
        f"(payload {network.efficiency:.1%}), α = {format_seconds(network.latency_s)}, {nbuckets} bucket(s)"
    )
    if options.get("sync_every"):
        title += f", momentum sync every {options['sync_every']} steps"
    table = Table(title=title, title_justify="left")
    for col in ("variant", "transport", "latency", "bandwidth", "compute", "time / step", "sent / rank"):
        table.add_column(col, justify="left" if col in ("variant", "transport") else "right")
    table.add_column("vs 32bit", justify="right")
    notes = []
    for p in rows:
        scheme = cm.PRESET_SCHEMES[p.variant]
        transport = scheme.transport + (f" {scheme.bits}-bit" if scheme.bits else "")
        if scheme.transport == "dense":
            transport += f" fp{scheme.wire_bits}" if scheme.wire_bits == 32 else f" bf{scheme.wire_bits}"
        if not p.allowed:
            table.add_row(p.variant, transport, "", "", "", "[dim]not allowed[/dim]", "", "")
            notes.append(f"{p.variant} is not allowed for N = {n}: {p.reason}")
            continue
        table.add_row(
            p.variant,
            transport,
            format_seconds(p.latency_s),
            format_seconds(p.bandwidth_s),
            format_seconds(p.compute_s),
            f"[bold]{format_seconds(p.total_s)}[/bold]",
            format_bytes(p.bytes_sent),
            f"{speed[p.variant]:.2f}x" if p.variant in speed else "",
        )
    console.print(table)
    for note in notes:
        console.print(note)
    if source:
        console.print(f"constants: {source}")
    best = cm.winner(d, n, network, compute, variants, **options)
    vs = f", {speed[best.variant]:.1f}x faster than 32bit" if best.variant in speed else ""
    console.print(f"winner: [bold]{best.variant}[/bold] ({format_seconds(best.total_s)} per step{vs})")
    lo, hi = SWEEP_BPS[0] / 8, SWEEP_BPS[1] / 8
    spans = cm.regimes(d, n, network, compute, variants, lo, hi, **options)
    console.print(
        "fastest by link rate: "
        + "; ".join(f"{format_bitrate(a)}–{format_bitrate(b)}: {v}" for a, b, v in spans)
    )
    lines = []
    for p in rows:
        if not p.allowed or p.variant == best.variant:
            continue
        rate = cm.crossover_bandwidth(best.variant, p.variant, d, n, network, compute, **options)
        if rate is None:
            faster = best.total_s < p.total_s
            lines.append(f"  {best.variant} vs {p.variant}: {'always' if faster else 'never'} faster")
            continue
        at = network.with_bandwidth(rate * 2)
        above = cm.predict(best.variant, d, n, at, compute, **options).total_s
        below_side = above > cm.predict(p.variant, d, n, at, compute, **options).total_s
        lines.append(
            f"  {best.variant} vs {p.variant}: equal at {format_bitrate(rate)}, "
            f"{best.variant} faster {'below' if below_side else 'above'}"
        )
    if lines:
        console.print("crossovers with the winner:\n" + "\n".join(lines))


def figure(
    d: int,
    n: int,
    network: cm.Network,
    compute: cm.Compute,
    variants: Sequence[str] | None = None,
    **options: Any,
) -> Figure:
    """Two panels: time per step vs link rate (log, 10 Mbit/s–400 Gbit/s) and vs N (2–128)."""
    import numpy as np
    from matplotlib.figure import Figure

    names = list(variants or cm.PRESET_SCHEMES)
    fig = Figure(figsize=(12, 4.8), layout="constrained")  # no pyplot: no global backend state
    ax_bw, ax_n = fig.subplots(1, 2)
    rates = np.geomspace(SWEEP_BPS[0] / 8, SWEEP_BPS[1] / 8, 160)
    ns = np.arange(SWEEP_N[0], SWEEP_N[1] + 1)
    for name in names:
        t_bw = [cm.predict(name, d, n, network.with_bandwidth(r), compute, **options).total_s for r in rates]
        t_n = [cm.predict(name, d, int(k), network, compute, **options).total_s for k in ns]
        (line,) = ax_bw.plot(rates * 8, t_bw, label=name)
        ax_n.plot(ns, t_n, label=name, color=line.get_color())
    ax_bw.axvline(network.bandwidth_Bps * 8, color="grey", linestyle=":", linewidth=1)
    ax_n.axvline(n, color="grey", linestyle=":", linewidth=1)
    ax_bw.set(
        xscale="log",
        yscale="log",
        xlabel="link rate (bit/s)",
        ylabel="predicted time per step (s)",
        title=f"d = {format_count(d)}, N = {n}, α = {format_seconds(network.latency_s)}",
    )
    ax_n.set(
        yscale="log",
        xlabel="workers N",
        ylabel="predicted time per step (s)",
        title=f"d = {format_count(d)}, {format_bitrate(network.bandwidth_Bps)}",
    )
    ax_n.set_xscale("log", base=2)
    for ax in (ax_bw, ax_n):
        ax.grid(True, which="both", alpha=0.3)
    ax_bw.legend(fontsize="small")
    fig.suptitle("Communication + compute cost per optimizer step (α–β–γ model)")
    return fig
