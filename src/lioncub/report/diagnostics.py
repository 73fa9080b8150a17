"""Plots and a table of a run's vote diagnostics (the ``diag`` records of ``log.jsonl``, written by
``lioncub train --diagnostics-every K``; see :mod:`lioncub.optim.diagnostics` for the definitions).

Written into the output directory (default: the run directory):

* ``diag_rates.png`` — overall match / flip / tie rate against the step (the paper's Fig. 4, Table 3);
* ``diag_momentum_std.png`` — per parameter tensor, the largest standard deviation of the momenta
  between the workers at the last diagnosed step (Fig. 6);
* ``diag_update_shape.png`` — per tensor, max|c| / mean|c| and the kurtosis of the pre-sign update (Fig. 3).

No torch is imported here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from rich.console import Console
from rich.markup import escape

from lioncub.names import config_entries
from lioncub.report import text
from lioncub.report.figures import readable_log_axis
from lioncub.rundir import read_run_file

__all__ = ["load_diagnostics", "print_table", "write_plots"]

LAYER_KEYS = ("match", "flip", "tie", "momentum_max_std", "max_over_mean", "kurtosis")


def load_diagnostics(run_dir: Path, required: bool = True) -> list[dict[str, Any]]:
    """The ``diag`` records of ``run_dir/log.jsonl`` in step order; ``ValueError`` if there are none and
    they are ``required`` (else an empty list)."""
    path = Path(run_dir) / "log.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no log.jsonl (is it a `lioncub train --out` directory?)")
    text = read_run_file(path, follow_symlinks=True).decode()  # a FIFO: refused, never waited on
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    diags = sorted((r for r in records if r.get("kind") == "diag"), key=lambda r: r["step"])
    if not diags and required:
        raise ValueError(f"{run_dir}: log.jsonl has no diagnostics; train with --diagnostics-every K")
    return diags


def _rates_figure(diags: list[dict[str, Any]], title: str) -> Figure:
    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    steps = [d["step"] for d in diags]
    for key, label in (("match", "match sign(Σc)"), ("flip", "flip"), ("tie", "tie (sign vote = 0)")):
        ax.plot(steps, [d["overall"][key] for d in diags], marker=".", label=label)
    ax.set(xlabel="optimizer step", ylabel="fraction of elements", ylim=(0, 1), title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def _layer_figure(last: dict[str, Any], keys: tuple[str, ...], labels: tuple[str, ...], title: str) -> Figure:
    names = list(last["layers"])
    fig = Figure(figsize=(6.4 * len(keys), 0.28 * len(names) + 1.5))
    for i, (key, label) in enumerate(zip(keys, labels, strict=True)):
        ax = fig.add_subplot(1, len(keys), i + 1)
        values = [last["layers"][n][key] for n in names]
        ax.barh(range(len(names)), values)
        ax.set_yticks(range(len(names)), names if i == 0 else [""] * len(names), fontsize=7)
        ax.invert_yaxis()
        positive = [v for v in values if v and v > 0]
        if positive and max(positive) > 10 * min(positive):
            ax.set_xscale("log")
            readable_log_axis(ax.xaxis, lambda x: f"{x:g}", min(positive), max(positive))
        ax.set(xlabel=label, title=f"{title}, step {last['step']}" if i == 0 else "")
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


def write_plots(run_dir: Path, out_dir: Path | None = None) -> dict[str, Path]:
    """Write the three PNGs (see the module docstring); returns ``{name: path}``."""
    run_dir = Path(run_dir)
    out_dir = Path(out_dir or run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    diags = load_diagnostics(run_dir)
    config_path = run_dir / "config.json"
    config = json.loads(read_run_file(config_path, follow_symlinks=True)) if config_path.exists() else {}
    config = config_entries(config) if isinstance(config, dict) else {}
    title = f"{config.get('variant', '?')}, N = {config.get('nproc', '?')}"
    figures = {
        "diag_rates": _rates_figure(diags, title),
        "diag_momentum_std": _layer_figure(
            diags[-1], ("momentum_max_std",), ("max std of m between workers",), title
        ),
        "diag_update_shape": _layer_figure(
            diags[-1], ("max_over_mean", "kurtosis"), ("max|c| / mean|c|", "kurtosis of c"), title
        ),
    }
    paths = {}
    for name, fig in figures.items():
        paths[name] = out_dir / f"{name}.png"
        fig.savefig(paths[name], dpi=100)
        fig.clear()
    return paths


def print_table(run_dir: Path, console: Console | None = None) -> None:
    """The last diagnosed step, per tensor and overall, as a table within the console's width
    (:func:`lioncub.report.text.print_table`: the tensor's name in every part, no number split)."""
    last = load_diagnostics(run_dir)[-1]
    rows = {**last["layers"], "overall": last["overall"]}
    cells = [
        [escape(name), *("—" if values.get(k) is None else f"{values[k]:.4g}" for k in LAYER_KEYS)]
        for name, values in rows.items()
    ]
    out = console if console is not None else text.console()
    text.print_table(out, f"diagnostics at step {last['step']} ({run_dir})", ("tensor", *LAYER_KEYS), cells)
