"""The PNG plots of a comparison (:class:`lioncub.report.runs.Report`): validation loss against steps,
time and bytes sent, the step time split, bytes per step and the vote diagnostics.
:class:`matplotlib.figure.Figure` directly (the Agg renderer, no pyplot state), so nothing leaks and the
importing program's backend is untouched."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from matplotlib.axis import Axis
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

__all__ = [
    "BAR_PARTS",
    "DIAG_PANELS",
    "FIGURES",
    "figure_bytes_per_step",
    "figure_diagnostics",
    "figure_step_time_split",
    "figure_val_loss_vs_bytes",
    "figure_val_loss_vs_step",
    "figure_val_loss_vs_time",
    "plot_series",
    "readable_log_axis",
]

BAR_PARTS = (
    ("compute", "compute_s"),
    ("communication (incl. quantize/pack)", "comm_s"),
    ("apply", "apply_s"),
    ("other", "other_s"),
)


def plot_series(report: Any) -> dict[str, dict[str, tuple[list[float], list[float]]]]:
    """The plotted lines: ``{"val_loss_vs_step" | "val_loss_vs_time" | "val_loss_vs_bytes": {variant:
    (x, val_loss)}}``.

    x is the optimizer step, the training wall time (s), or the MB (1e6 bytes) a rank sent up to and with
    the evaluated step. Runs without evals are left out; on the time plot, evals without a known time; on
    the bytes plot, runs whose steps record no bytes and evals before the first byte (a log axis).
    """
    by_step, by_time, by_bytes = {}, {}, {}
    for run in report.runs:
        if not run.evals:
            continue
        by_step[run.variant] = (
            [float(e["step"]) for e in run.evals],
            [float(e["val_loss"]) for e in run.evals],
        )
        timed = [(t, float(e["val_loss"])) for e in run.evals if (t := run.eval_time(e)) is not None]
        if timed:
            by_time[run.variant] = ([t for t, _ in timed], [v for _, v in timed])
        sent = _cumulative_mb(run.steps)
        spent = [(sent[e["step"]], float(e["val_loss"])) for e in run.evals if sent.get(e["step"], 0) > 0]
        if spent:
            by_bytes[run.variant] = ([b for b, _ in spent], [v for _, v in spent])
    return {"val_loss_vs_step": by_step, "val_loss_vs_time": by_time, "val_loss_vs_bytes": by_bytes}


def _cumulative_mb(steps: list[dict[str, Any]]) -> dict[int, float]:
    """Step -> MB sent by a rank in the steps up to and with it (steps whose record has ``bytes_sent``)."""
    total, out = 0.0, {}
    for rec in sorted((r for r in steps if isinstance(r.get("step"), int)), key=lambda r: r["step"]):
        value = rec.get("bytes_sent")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            total += float(value) / 1e6
            out[rec["step"]] = total
    return out


def readable_log_axis(axis: Axis, fmt: Callable[[float], str], low: float, high: float) -> None:
    """Label a log-scale ``axis`` with plain numbers, ``fmt(value)`` (``"0.5"``, ``"10 Mbit/s"``), not
    powers of ten: its ticks at 1, 2 and 5 per decade when the data (``low`` to ``high``, > 0) span at most
    three decades, else at every power of ten; no labels on the minor ticks."""
    decades = math.log10(high / low) if 0 < low <= high else math.inf
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 3 else (1.0,)))
    axis.set_major_formatter(FuncFormatter(lambda x, _pos: fmt(x)))
    axis.set_minor_formatter(NullFormatter())


def _line_figure(report: Any, name: str, xlabel: str, budgets: tuple[float, ...] = ()) -> Figure:
    """Validation loss against ``name``'s x, one line per run; the legend below the axes, where it hides
    no line."""
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.subplots()
    for variant, (x, y) in plot_series(report)[name].items():
        ax.plot(x, y, marker="o", markersize=3, label=variant)
    target = report.target_loss
    if target is not None and math.isfinite(target):
        ax.axhline(
            target, color="gray", linestyle="--", linewidth=1, gid="target", label=f"target {target:.4g}"
        )
    for budget in budgets:
        ax.axvline(
            budget, color="gray", linestyle=":", linewidth=1, gid="budget", label=f"budget {budget:g} s"
        )
    ax.set(xlabel=xlabel, ylabel="validation loss", title=report.title)
    ax.grid(alpha=0.3)
    handles = ax.get_legend_handles_labels()[0]
    if handles:
        fig.legend(loc="outside lower center", ncols=min(len(handles), 3), fontsize="small")
    return fig


def figure_val_loss_vs_step(report: Any) -> Figure:
    """Validation loss vs optimizer step, one line per variant (label = variant); dashed: target loss."""
    return _line_figure(report, "val_loss_vs_step", "optimizer step")


def figure_val_loss_vs_time(report: Any) -> Figure:
    """Validation loss vs training wall time (s, evaluation excluded), one line per variant; dotted: the
    runs' time budget (``lioncub compare --time-budget``)."""
    budgets = {row.budget.budget_s for row in report.rows if getattr(row, "budget", None) is not None}
    return _line_figure(report, "val_loss_vs_time", "training wall time (s)", tuple(sorted(budgets)))


def figure_val_loss_vs_bytes(report: Any) -> Figure:
    """Validation loss vs the MB a rank sent so far (log axis, labelled in MB), one line per variant: what
    a link's data cap buys (local steps send every H steps)."""
    fig = _line_figure(report, "val_loss_vs_bytes", "MB sent per rank so far (log scale)")
    sent = [v for x, _ in plot_series(report)["val_loss_vs_bytes"].values() for v in x]
    if sent:
        fig.axes[0].set_xscale("log")
        readable_log_axis(fig.axes[0].xaxis, lambda mb: f"{mb:g}", min(sent), max(sent))
    return fig


def figure_step_time_split(report: Any) -> Figure:
    """Stacked horizontal bars: median ms per step in compute, communication, apply and other."""
    fig = Figure(figsize=(6.4, 0.5 * len(report.rows) + 2.0), layout="constrained")
    ax = fig.subplots()
    names = [row.variant for row in report.rows]
    left = np.zeros(len(names))
    for label, attr in BAR_PARTS:
        ms = np.array([max(0.0, getattr(row, attr) or 0.0) * 1e3 for row in report.rows])
        ax.barh(range(len(names)), ms, left=left, label=label)
        left += ms
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set(xlabel="median time per step (ms)", title=report.title)
    fig.legend(loc="outside lower center", ncols=2, fontsize="small")
    return fig


def figure_bytes_per_step(report: Any) -> Figure:
    """Bars: median MB (1e6 bytes) sent per rank per step -- on emulated nodes, through a node's NIC per
    step; each bar labelled with its value. A linear axis however far apart the values are: a bar's
    length is its bytes (on a log axis it would be its ratio to the axis' arbitrary bottom), and a bar too
    short to see still shows its label."""
    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.subplots()
    nodes = any(row.nic_bytes_per_step is not None for row in report.rows)
    mb = [
        ((row.nic_bytes_per_step if nodes else row.bytes_sent_per_step) or 0.0) / 1e6 for row in report.rows
    ]
    ax.bar_label(ax.bar(range(len(mb)), mb, color="tab:blue"), fmt="%.3g")
    ax.set_xticks(range(len(mb)), [row.variant for row in report.rows], rotation=30, ha="right")
    ax.margins(y=0.1)
    ax.set(
        ylabel="MB through a node's NIC per step" if nodes else "MB sent per rank per step",
        title=report.title,
    )
    fig.tight_layout()
    return fig


DIAG_PANELS = (
    ("match", "match sign(Σc)"),
    ("flip", "flip"),
    ("tie", "tie rate of the sign vote"),
    ("momentum_max_std", "max std of m between workers"),
)


def figure_diagnostics(report: Any) -> Figure:
    """The overall vote diagnostics of every run that has them (``--diagnostics-every``), side by side:
    match / flip / tie rate and momentum spread against the step, one line per variant."""
    fig = Figure(figsize=(12.8, 7.0))
    axes = fig.subplots(2, 2).ravel()
    for ax, (key, label) in zip(axes, DIAG_PANELS, strict=True):
        for run in report.runs:
            points = [(d["step"], d["overall"][key]) for d in run.diags if d["overall"].get(key) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker=".", label=run.variant)
        ax.set(xlabel="optimizer step", ylabel=label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"vote diagnostics — {report.title}")
    fig.tight_layout()
    return fig


FIGURES = {
    "val_loss_vs_step": figure_val_loss_vs_step,
    "val_loss_vs_time": figure_val_loss_vs_time,
    "val_loss_vs_bytes": figure_val_loss_vs_bytes,
    "step_time_split": figure_step_time_split,
    "bytes_per_step": figure_bytes_per_step,
}
