"""The cost model's report: the prediction table, the winner, which variant wins by link rate and where
the winner crosses the others (:func:`report`), and the cost against the link rate and against N
(:func:`figure`, like Fig. 2 of the Lion Cub paper). ``lioncub cost`` prints and saves these.

Degenerate cases are worded as such: with N = 1 nothing is communicated, every variant costs only its
codec (the compute column), and one line says that there are no speedups, link-rate winners or crossovers
to show; variants that cost the same are named together ("equal"), never as "never faster".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lioncub.optim.config import PRESETS
from lioncub.planning import costmodel as cm
from lioncub.report.text import print_table, print_wrapped

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rich.console import Console

__all__ = [
    "figure",
    "format_bitrate",
    "format_bytes",
    "format_count",
    "format_seconds",
    "report",
    "report_cluster",
]

#: link rates of the plot's first panel and of the winner ranges, bits/s
SWEEP_BPS = (10e6, 400e9)
#: worker counts of the plot's second panel
SWEEP_N = (2, 128)


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


def _equal(a: float, b: float) -> bool:
    """Equal up to rounding (the model's sums of the same terms in another order)."""
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)


def _title(title: str, options: dict[str, Any]) -> str:
    """``title`` and the momentum sync or local steps of ``options``."""
    if options.get("sync_every"):
        title += f", momentum sync every {options['sync_every']} steps"
    if options.get("local_steps"):
        title += f", one vote every {options['local_steps']} local steps (per inner step)"
    return title


def _transport(variant: str, n: int) -> str:
    """The wire of a preset, e.g. ``"lanes 4-bit"``, ``"dense bf16"``."""
    config = PRESETS[variant]
    bits = config.lane_bits(n)
    transport = config.transport + (f" {bits}-bit" if bits else "")
    if config.transport == "dense":
        wire = config.wire_bits
        transport += f" fp{wire}" if wire == 32 else f" bf{wire}"
    return transport


def _prediction_rows(
    rows: Sequence[cm.Prediction], speed: dict[str, float]
) -> tuple[list[list[str]], list[str]]:
    """The table rows of :func:`report` (cells with rich markup) and a note for every variant that is not
    allowed."""
    cells, notes = [], []
    for p in rows:
        transport = _transport(p.variant, p.n_workers)
        if not p.allowed:
            cells.append([p.variant, transport, "", "", "", "[dim]not allowed[/dim]", "", ""])
            notes.append(f"{p.variant} is not allowed for N = {p.n_workers}: {p.reason}")
            continue
        cells.append(
            [
                p.variant,
                transport,
                format_seconds(p.latency_s),
                format_seconds(p.bandwidth_s),
                format_seconds(p.compute_s),
                f"[bold]{format_seconds(p.total_s)}[/bold]",
                format_bytes(p.bytes_sent),
                f"{speed[p.variant]:.2f}x" if p.variant in speed else "",
            ]
        )
    return cells, notes


#: the columns of :func:`report`'s table
COLUMNS = (
    "variant", "transport", "latency", "bandwidth", "compute", "time / step", "sent / rank", "vs 32bit",
)  # fmt: skip
#: the columns of :func:`report_cluster`'s table
CLUSTER_COLUMNS = (
    "#", "variant", "topology", "latency", "bandwidth", "compute", "time / step", "NIC / node",
    "intra / rank", "vs 32bit",
)  # fmt: skip


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
    rows = cm.table(d, n, network, compute, variants, **options)
    base = next((p for p in rows if p.variant == "32bit" and p.allowed), None)
    # with N = 1 (or a 32bit that costs nothing) a ratio to 32bit's time says nothing
    speed = cm.speedups(rows) if n > 1 and base is not None and base.total_s > 0 else {}
    buckets = options.get("bucket_numel")
    nbuckets = 1 if buckets is None else math.ceil(d / buckets)
    title = (
        f"d = {format_count(d)} parameters, N = {n} workers, {format_bitrate(network.bandwidth_Bps)} links "
        f"(payload {network.efficiency:.1%}), α = {format_seconds(network.latency_s)}, {nbuckets} bucket(s)"
    )
    cells, notes = _prediction_rows(rows, speed)
    print_table(console, _title(title, options), COLUMNS, cells, left=(0, 1))
    for note in notes:
        print_wrapped(console, note)
    if source:
        print_wrapped(console, f"constants: {source}")
    if n == 1:
        print_wrapped(
            console,
            "N = 1: nothing is communicated, so every variant costs only its codec (the compute column): "
            "no speedups, link-rate winners or crossovers to show",
        )
        return
    best = cm.winner(d, n, network, compute, variants, **options)
    allowed = [p for p in rows if p.allowed]
    tied = [p.variant for p in allowed if _equal(p.total_s, best.total_s)]
    names = ", ".join(tied)
    equal = "equal, " if len(tied) > 1 else ""
    per_step = f"{format_seconds(best.total_s)} per step{_vs(speed, best)}"
    print_wrapped(console, f"winner: {names} ({equal}{per_step})")
    print_wrapped(
        console, "fastest by link rate: " + "; ".join(_regimes(allowed, network, compute, variants, options))
    )
    lines = _crossovers(best, allowed, network, compute, options)
    if lines:
        console.print("crossovers with the winner:")
        for line in lines:
            print_wrapped(console, f"  {line}")


def _regimes(
    allowed: Sequence[cm.Prediction],
    network: cm.Network,
    compute: cm.Compute,
    variants: Sequence[str] | None,
    options: dict[str, Any],
) -> list[str]:
    """``"rate–rate: winner[ = equal ones]"`` over the link rates of :data:`SWEEP_BPS`."""
    d, n = allowed[0].d, allowed[0].n_workers
    lo, hi = SWEEP_BPS[0] / 8, SWEEP_BPS[1] / 8
    labels = []
    for a, b, v in cm.regimes(d, n, network, compute, variants, lo, hi, **options):
        at = network.with_bandwidth(math.sqrt(a * b))
        t = cm.predict(v, d, n, at, compute, **options).total_s
        same = [p.variant for p in allowed if p.variant != v]
        same = [w for w in same if _equal(cm.predict(w, d, n, at, compute, **options).total_s, t)]
        labels.append(f"{format_bitrate(a)}–{format_bitrate(b)}: {' = '.join([v, *same])}")
    return labels


def _crossovers(
    best: cm.Prediction,
    allowed: Sequence[cm.Prediction],
    network: cm.Network,
    compute: cm.Compute,
    options: dict[str, Any],
) -> list[str]:
    """A line per other allowed variant: where it and the winner cost the same, or which is always faster."""
    d, n = best.d, best.n_workers
    lines = []
    for p in allowed:
        if p.variant == best.variant:
            continue
        rate = cm.crossover_bandwidth(best.variant, p.variant, d, n, network, compute, **options)
        if rate is None:  # no crossing at a positive rate: the same order at every rate
            if _equal(best.total_s, p.total_s):
                lines.append(f"{best.variant} vs {p.variant}: equal at every link rate")
            else:
                faster = best.total_s < p.total_s
                lines.append(f"{best.variant} vs {p.variant}: {'always' if faster else 'never'} faster")
            continue
        at = network.with_bandwidth(rate * 2)
        above = cm.predict(best.variant, d, n, at, compute, **options).total_s
        below_side = above > cm.predict(p.variant, d, n, at, compute, **options).total_s
        lines.append(
            f"{best.variant} vs {p.variant}: equal at {format_bitrate(rate)}, "
            f"{best.variant} faster {'below' if below_side else 'above'}"
        )
    return lines


def report_cluster(
    console: Console,
    d: int,
    cluster: cm.Cluster,
    compute: cm.Compute,
    variants: Sequence[str] | None = None,
    topologies: Sequence[str] = cm.TOPOLOGIES,
    source: str = "",
    **options: Any,
) -> None:
    """Print every variant × topology on M nodes of L ranks, fastest first, then the fastest exact one
    (the flat vote's result) and the fastest overall (node-majority is another estimator)."""
    rows = cm.cluster_table(d, cluster, compute, variants, topologies, **options)
    ok = sorted((p for p in rows if p.allowed), key=lambda p: p.total_s)
    base = next((p for p in rows if p.variant == "32bit" and p.topology == "flat" and p.allowed), None)
    m, ell = cluster.nnodes, cluster.nproc_per_node
    title = (
        f"d = {format_count(d)} parameters, {m} nodes × {ell} ranks (N = {m * ell}); per node a "
        f"{format_bitrate(cluster.inter.bandwidth_Bps)} NIC (payload {cluster.inter.efficiency:.1%}, "
        f"α = {format_seconds(cluster.inter.latency_s)}), per rank a "
        f"{format_bitrate(cluster.intra.bandwidth_Bps)} link inside the node "
        f"(α = {format_seconds(cluster.intra.latency_s)})"
    )
    cells = []
    for i, p in enumerate(ok, 1):
        speed = f"{base.total_s / p.total_s:.2f}x" if base is not None and p.total_s > 0 else ""
        cells.append(
            [
                str(i),
                p.variant,
                p.topology + ("" if p.exact else " *"),
                format_seconds(p.latency_s),
                format_seconds(p.bandwidth_s),
                format_seconds(p.compute_s),
                f"[bold]{format_seconds(p.total_s)}[/bold]",
                format_bytes(p.nic_sent),
                format_bytes(p.intra_sent),
                speed,
            ]
        )
    print_table(console, _title(title, options), CLUSTER_COLUMNS, cells, keys=3, left=(1, 2))
    print_wrapped(
        console,
        "NIC / node: bytes each node's NIC sends per step; intra / rank: bytes a rank sends inside its "
        "node. * node-majority is a different estimator (a majority of node majorities), not the flat "
        "vote's result.",
    )
    refused: dict[tuple[str, str], list[str]] = {}
    for p in rows:
        if not p.allowed:
            refused.setdefault((p.topology, p.reason), []).append(p.variant)
    for (topology, reason), names in refused.items():
        print_wrapped(console, f"not allowed as {topology}: {', '.join(names)} ({reason})")
    if source:
        print_wrapped(console, f"constants: {source}")
    exact = [p for p in ok if p.exact]
    for label, best in (
        ("fastest exact", exact[0] if exact else None),
        ("fastest overall", ok[0] if ok else None),
    ):
        if best is not None:
            print_wrapped(
                console,
                f"{label}: {best.variant} {best.topology} "
                f"({format_seconds(best.total_s)} per step, {format_bytes(best.nic_sent)} through each NIC)",
            )


def _vs(speed: dict[str, float], best: cm.Prediction) -> str:
    if best.variant == "32bit" or best.variant not in speed:
        return ""
    return f", {speed[best.variant]:.1f}x faster than 32bit"


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
    from matplotlib.ticker import FuncFormatter

    from lioncub.report.figures import readable_log_axis

    names = list(variants or PRESETS)
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
        xlabel="link rate",
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
    # plain labels (10 Mbit/s, 100 ms, 16), not powers of ten
    readable_log_axis(ax_bw.xaxis, lambda bps: format_bitrate(bps / 8), SWEEP_BPS[0], SWEEP_BPS[1])
    ax_n.xaxis.set_major_formatter(FuncFormatter(lambda k, _pos: f"{k:g}"))
    for ax in (ax_bw, ax_n):
        times = [t for line in ax.get_lines() for t in line.get_ydata() if 0 < t < math.inf]
        if times:
            readable_log_axis(ax.yaxis, format_seconds, min(times), max(times))
        ax.grid(True, which="both", alpha=0.3)
    ax_bw.legend(fontsize="small")
    fig.suptitle("Communication + compute cost per optimizer step (α–β–γ model)")
    return fig
