"""Compare training runs of several optimizer variants: a summary table and PNG plots.

Input: run directories written by the training loop, one per variant, same workload, seed and link:

* ``config.json`` (nested or flat: :func:`lioncub.names.config_entries`) -- ``variant``, ``workload``,
  ``size``, ``world_size`` (or ``nproc``), ``link``, ``steps``, ``seed``;
* ``log.jsonl`` -- one JSON object a line: ``{"kind": "step", "step", "loss", "time_s", "step_s",
  "compute_s", "comm_s", "apply_s", "bytes_sent", ...}`` (seconds; bytes per rank for that step) and
  ``{"kind": "eval", "step", "val_loss", "time_s"[, "val_acc"]}``. ``time_s`` is cumulative training wall
  time without evaluation. Missing optional fields are treated as absent; a run without ``config.json``
  or without any step line raises :class:`ValueError` naming the directory. ``summary.json`` of a run is
  not read: everything comes from the log.

Output of :func:`make_report` (a :class:`Report`, one :class:`RunSummary` per run, in the given order),
written into ``out_dir``: ``summary.md`` (markdown table, the target-loss rule, the run dirs),
``summary.json`` (the rows), ``val_loss_vs_step.png``, ``val_loss_vs_time.png``, ``val_loss_vs_bytes.png``
(against the MB a rank sent so far), ``step_time_split.png`` (median compute / communication incl.
quantize+pack / apply / other per step, as Fig. 15 of the Lion Cub paper) and ``bytes_per_step.png``. Per-step
numbers are medians over all step records (a run with local steps: over its windows of H steps, of each
window's mean per step: :func:`per_step_median`). ``other`` is the rest of the step that no split covers
(:data:`TABLE_NOTE`, printed under the table, says what that is in a ``lioncub train`` log): the median
``step_s`` minus the median compute, comm and apply (a missing split counts 0), so that a row's parts add up
to its step time. When the step times vary it can come out slightly negative though no step's remainder is
(the medians of the parts need not add up to the median of the whole: with an even number of steps each
median is the mean of two other middle steps); the table and the bar plot then show 0 and a note under the
table says by how much the medians fell short (``summary.json`` keeps the value).

Compute floor (:func:`compute_floor`, printed and written under the table): the median over the runs of
their median ``compute_s``, the forward + backward time per step. It is the same model on every variant,
and communication cannot make a step shorter than it: with communication free, a run's step would take
the floor plus its own ``apply_s`` and ``other_s`` (the latter counted only when positive), so the
baseline's step over that is the most speedup the machine allows that variant. On a slower CPU the floor
is higher and the possible speedups lower, however slow the link.

Target loss (for "time to target"): ``target_loss`` if given, else 1.02 × the final val loss of the
``baseline`` run (default ``32bit``), else (no baseline run, or it has no eval) the worst final val loss
among the runs, so that every run with evals reaches it. Time to target = ``time_s`` of the first eval
with ``val_loss <= target``. "At equal steps" = the largest step evaluated by every run that has evals.

Runs of a time budget (``lioncub compare --time-budget``, :mod:`lioncub.report.budget`): the table shows
each run's steps and its validation loss at the budget (:data:`BUDGET_COLUMNS`) instead of the loss at
equal steps, the notes each run's pilot, plan and measured time, and the loss-vs-time plot the budget; a
run its budget's guard stopped is marked, not counted as partial.

The plots are drawn by :mod:`lioncub.report.figures`. On emulated nodes the table shows the bytes through a
node's NIC and a rank's bytes inside its node apart (:data:`NODE_COLUMNS`); a partial run (its log ends
before its configured last step: a stopped compare) is marked in the table and noted, and does not set
the default target loss. No torch is imported here.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape

from lioncub.names import config_entries, run_label
from lioncub.report import text
from lioncub.report.budget import Budget, budget_notes, budget_of
from lioncub.report.figures import (
    FIGURES,
    figure_bytes_per_step,
    figure_diagnostics,
    figure_step_time_split,
    figure_val_loss_vs_bytes,
    figure_val_loss_vs_step,
    figure_val_loss_vs_time,
    plot_series,
)
from lioncub.rundir import read_run_file

__all__ = [
    "BUDGET_COLUMNS",
    "COLUMNS",
    "NODE_COLUMNS",
    "TABLE_NOTE",
    "ComputeFloor",
    "Report",
    "RunLog",
    "RunSummary",
    "columns",
    "compute_floor",
    "figure_bytes_per_step",
    "figure_diagnostics",
    "figure_step_time_split",
    "figure_val_loss_vs_bytes",
    "figure_val_loss_vs_step",
    "figure_val_loss_vs_time",
    "load_run",
    "make_report",
    "per_step_median",
    "plot_series",
    "print_table",
    "summarize",
]

COLUMNS = (
    "variant",
    "step ms",
    "compute ms",
    "comm ms",
    "apply ms",
    "other ms",
    "speedup",
    "MB/step/rank",
    "val loss at equal steps (step)",
    "final val loss",
    "time to target s",
)
#: runs of a time budget (``lioncub compare --time-budget``, :mod:`lioncub.report.budget`): their steps and
#: loss at the budget instead of the loss at equal steps
BUDGET_COLUMNS = ("steps", "val loss at budget (s)")
#: on emulated nodes "MB/step/rank" mixes a node's NIC and the links inside it: the table shows these two
#: instead (``nic_bytes``, ``intra_bytes`` of the step records, :mod:`lioncub.train.nodebytes`)
NODE_COLUMNS = ("NIC MB/step/node", "in-node MB/step/rank")
SPLITS = ("compute_s", "comm_s", "apply_s")
#: what the "other ms" column is, printed under the table and written into summary.md
TABLE_NOTE = (
    "other ms = step − compute − comm − apply: the part of a step that no split covers (in lioncub train "
    "logs the optimizer step's own bookkeeping and zero_grad; data loading counts as compute, logging and "
    "evaluation are outside the step). Every column is a median over the steps (local steps /hH: over the "
    "windows of H steps, of the window's mean per step, the outer step included), so a row's parts add up "
    "to its step time."
)
TARGET_FACTOR = 1.02
DPI = 100


@dataclass
class RunLog:
    """One run directory read back: its config, step records and eval records (sorted by step)."""

    run_dir: Path
    config: dict[str, Any]
    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]]  # one per step (the last record wins), each with float "val_loss"
    diags: list[dict[str, Any]] = field(default_factory=list)  # "diag" records (--diagnostics-every), by step
    stops: list[dict[str, Any]] = field(default_factory=list)  # "stop" records (a time budget's guard)

    @property
    def variant(self) -> str:
        """The run's name in tables and legends, as ``lioncub compare --variants`` spells it
        (:func:`lioncub.names.run_label`: ``1bit@hierarchical``, ``8bit+overlap``, ``1bit/h16``)."""
        return run_label(self.config) if "variant" in self.config else self.run_dir.name

    @property
    def local_steps(self) -> int:
        """H of a run with local steps (1 without)."""
        h = self.config.get("local_steps")
        return h if isinstance(h, int) and not isinstance(h, bool) and h >= 1 else 1

    def eval_time(self, ev: dict[str, Any]) -> float | None:
        """Training wall time (s) of an eval record; falls back to ``time_s`` of the step with its number."""
        t = _num(ev, "time_s")
        if t is None:
            t = next((_num(s, "time_s") for s in self.steps if s.get("step") == ev["step"]), None)
        return t


@dataclass
class RunSummary:
    """One row of the comparison. Times in seconds (medians per step), bytes per rank per step."""

    variant: str
    steps: int
    step_s: float | None
    compute_s: float | None
    comm_s: float | None
    apply_s: float | None
    other_s: float | None  # step_s − compute_s − comm_s − apply_s (None parts count 0), not clipped
    speedup: float | None  # baseline median step_s / this median step_s
    bytes_sent_per_step: float | None
    final_step: int | None
    final_val_loss: float | None
    final_val_acc: float | None
    equal_step: int | None
    val_loss_equal_step: float | None
    time_to_target_s: float | None
    run_dir: Path
    target_steps: int | None = None  # the steps the run was to take (``stop_at`` or ``steps``), if known
    nic_bytes_per_step: float | None = None  # on emulated nodes: bytes a node sends through its NIC
    intra_bytes_per_step: float | None = None  # on emulated nodes: bytes a rank sends inside its node
    budget: Budget | None = None  # a run of a time budget: its plan and loss at the budget

    @property
    def stopped(self) -> bool:
        """The time budget's guard stopped the run (far over its budget)."""
        return self.budget is not None and self.budget.stopped_at is not None

    @property
    def partial(self) -> bool:
        """The run stopped before it finished: its log ends before its configured last step (not by the
        time budget's guard)."""
        return self.target_steps is not None and self.steps < self.target_steps and not self.stopped

    def label(self) -> str:
        """The variant, marked when the run is partial (``1bit (partial: step 33 of 60)``) or was stopped
        by its time budget's guard (``1bit (stopped over budget: step 33 of 60)``)."""
        if self.stopped:
            return f"{self.variant} (stopped over budget: step {self.steps} of {self.target_steps})"
        return (
            f"{self.variant} (partial: step {self.steps} of {self.target_steps})"
            if self.partial
            else self.variant
        )

    def to_json(self) -> dict[str, Any]:
        """The row as ``summary.json`` holds it (``budget`` only for a run of a time budget)."""
        data = {**dataclasses.asdict(self), "run_dir": str(self.run_dir)}
        if self.budget is None:
            del data["budget"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSummary:
        budget = Budget(**data["budget"]) if data.get("budget") else None
        return cls(**{**data, "run_dir": Path(data["run_dir"]), "budget": budget})


@dataclass
class Report:
    """The comparison: rows in run order, the markdown table, the PNG paths and the target loss used."""

    rows: list[RunSummary]
    table_markdown: str
    plots: dict[str, Path]
    target_loss: float | None
    target_rule: str
    baseline: str
    title: str
    notes: list[str] = field(default_factory=list)
    runs: list[RunLog] = field(default_factory=list, repr=False)


@dataclass
class ComputeFloor:
    """The compute floor of a comparison: the median forward + backward time per step of its runs, and for
    each run the speedup over the baseline it could reach if its communication took no time."""

    compute_s: float
    runs: int  # how many runs measured their compute
    baseline: str
    limits: dict[str, float]  # variant -> baseline step / (floor + its apply + its positive other)

    def line(self) -> str:
        """``compute floor: 512.3 ms per step (...); ... at most: 32bit 2.51x, 1bit 2.20x``."""
        text = (
            f"compute floor: {self.compute_s * 1e3:.1f} ms per step (the median forward+backward of the "
            f"{self.runs} run{'s' if self.runs != 1 else ''}, on the CPU they trained on; no step is shorter)"
        )
        if not self.limits:
            return text + f"; no {self.baseline} run to compare against"
        limits = ", ".join(f"{variant} {limit:.2f}x" for variant, limit in self.limits.items())
        return f"{text}; with communication free, the speedup over {self.baseline} is at most: {limits}"


def compute_floor(report: Report) -> ComputeFloor | None:
    """The :class:`ComputeFloor` of ``report``'s runs, from their logs (None: no run logged its compute)."""
    computes = [row.compute_s for row in report.rows if row.compute_s is not None]
    if not computes:
        return None
    floor = float(np.median(computes))
    base = next((r for r in report.rows if r.variant == report.baseline and r.step_s), None)
    limits = {}
    if base is not None and base.step_s:
        for row in report.rows:
            local = floor + (row.apply_s or 0.0) + max(row.other_s or 0.0, 0.0)
            limits[row.variant] = base.step_s / local
    return ComputeFloor(floor, len(computes), report.baseline, limits)


def _num(rec: dict[str, Any], key: str) -> float | None:
    value = rec.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):  # NaN and Inf stay
        return None
    return float(value)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.median(present)) if present else None


def load_run(run_dir: Path) -> RunLog:
    """Read ``config.json`` and ``log.jsonl`` of a run; :class:`ValueError` naming the dir if unusable."""
    run_dir = Path(run_dir)
    config_path, log_path = run_dir / "config.json", run_dir / "log.jsonl"
    if not config_path.is_file():
        raise ValueError(f"run dir {run_dir}: missing config.json")
    try:
        config = json.loads(read_run_file(config_path, follow_symlinks=True))
    except json.JSONDecodeError:
        config = None
    if not isinstance(config, dict):
        raise ValueError(f"run dir {run_dir}: config.json is not a JSON object")
    config = config_entries(config)  # nested or flat: the settings by name
    if "world_size" not in config and "nproc" in config:  # lioncub train records the ranks as nproc
        config["world_size"] = config["nproc"]
    if not log_path.is_file():
        raise ValueError(f"run dir {run_dir}: missing log.jsonl")
    text = read_run_file(log_path, follow_symlinks=True).decode()
    lines = [line for line in text.splitlines() if line.strip()]
    steps, evals, diags, stops = [], {}, {}, []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a run killed mid-write leaves a partial last line
                break
            raise ValueError(f"run dir {run_dir}: log.jsonl line {i + 1} is not valid JSON") from None
        kind = rec.get("kind") if isinstance(rec, dict) else None
        if kind == "step":
            steps.append(rec)
        elif kind == "eval" and isinstance(rec.get("step"), int) and _num(rec, "val_loss") is not None:
            evals[rec["step"]] = rec  # one record per step: the last one wins
        elif kind == "diag" and isinstance(rec.get("step"), int) and isinstance(rec.get("overall"), dict):
            diags[rec["step"]] = rec
        elif kind == "stop" and isinstance(rec.get("step"), int):
            stops.append(rec)
    if not steps:
        raise ValueError(f"run dir {run_dir}: log.jsonl has no step records")
    return RunLog(
        run_dir, config, steps, [evals[s] for s in sorted(evals)], [diags[s] for s in sorted(diags)], stops
    )


def per_step_median(run: RunLog, key: str) -> float | None:
    """The median per step of ``key`` in the run's step records; with local steps (H > 1) the median over
    the complete windows of H steps of the window's mean, so that the outer step's time and bytes count
    (a median over steps would drop them: most steps send nothing)."""
    h = run.local_steps
    if h == 1:
        return _median([_num(rec, key) for rec in run.steps])
    windows: dict[int, list[float]] = {}
    for rec in run.steps:
        value, step = _num(rec, key), rec.get("step")
        if value is not None and isinstance(step, int):
            windows.setdefault((step - 1) // h, []).append(value)
    return _median([sum(v) / h for v in windows.values() if len(v) == h])


def summarize(run: RunLog) -> RunSummary:
    """The table row of ``run`` (:class:`RunSummary`); no speedup, equal-step loss or time to target (they
    compare it with other runs: :func:`make_report` sets them)."""
    numbers = [s for s in (rec.get("step") for rec in run.steps) if isinstance(s, int)]
    target = run.config.get("stop_at") or run.config.get("steps")
    last = run.evals[-1] if run.evals else None
    step_s = per_step_median(run, "step_s")
    splits = {key: per_step_median(run, key) for key in SPLITS}
    other = None
    if step_s is not None:
        other = step_s - sum(v or 0.0 for v in splits.values())
        if abs(other) <= 1e-9 * abs(step_s):  # rounding, not a time: no "-0.0" in the table
            other = 0.0
    return RunSummary(
        variant=run.variant,
        steps=max(numbers) if numbers else len(run.steps),
        step_s=step_s,
        compute_s=splits["compute_s"],
        comm_s=splits["comm_s"],
        apply_s=splits["apply_s"],
        other_s=other,
        speedup=None,
        bytes_sent_per_step=per_step_median(run, "bytes_sent"),
        final_step=last["step"] if last else None,
        final_val_loss=_num(last, "val_loss") if last else None,
        final_val_acc=_num(last, "val_acc") if last else None,
        equal_step=None,
        val_loss_equal_step=None,
        time_to_target_s=None,
        run_dir=run.run_dir,
        target_steps=target if isinstance(target, int) and not isinstance(target, bool) else None,
        nic_bytes_per_step=per_step_median(run, "nic_bytes"),
        intra_bytes_per_step=per_step_median(run, "intra_bytes"),
        budget=budget_of(
            run.config,
            run.steps,
            [(e["step"], float(e["val_loss"]), run.eval_time(e)) for e in run.evals],
            run.stops,
        ),
    )


def _default_target(rows: list[RunSummary], baseline: str) -> tuple[float | None, str]:
    """The target loss and its rule, from the finished runs only (a partial run's last loss is not final)."""
    rows = [r for r in rows if not r.partial]
    base = next((r for r in rows if r.variant == baseline and r.final_val_loss is not None), None)
    base_loss = None if base is None else base.final_val_loss
    if base_loss is not None and math.isfinite(base_loss):
        target = base_loss * TARGET_FACTOR
        return target, f"{TARGET_FACTOR} × final val loss of the {baseline} run = {target:.4g}"
    finals = [r.final_val_loss for r in rows if r.final_val_loss is not None]
    worst = max((v for v in finals if math.isfinite(v)), default=None)
    if worst is None:
        return None, "none: no finished run has a finite validation loss"
    return worst, f"worst final val loss among the finished runs (no {baseline} run with evals) = {worst:.4g}"


def _fmt(value: float | None, scale: float = 1.0, spec: str = ".3g", suffix: str = "") -> str:
    return "—" if value is None else f"{value * scale:{spec}}{suffix}"


def columns(rows: Sequence[RunSummary]) -> tuple[str, ...]:
    """The table's columns: :data:`COLUMNS`, with :data:`NODE_COLUMNS` for "MB/step/rank" when a run was on
    emulated nodes, and :data:`BUDGET_COLUMNS` for the loss at equal steps when a run had a time budget."""
    names: tuple[str, ...] = COLUMNS
    if any(row.nic_bytes_per_step is not None for row in rows):
        i = names.index("MB/step/rank")
        names = (*names[:i], *NODE_COLUMNS, *names[i + 1 :])
    if any(row.budget is not None for row in rows):
        i = names.index("val loss at equal steps (step)")
        names = (*names[:i], *BUDGET_COLUMNS, *names[i + 1 :])
    return names


def _cells(row: RunSummary) -> dict[str, str]:
    """Every column's cell of ``row`` (:data:`COLUMNS`, :data:`NODE_COLUMNS`, :data:`BUDGET_COLUMNS`)."""
    final = _fmt(row.final_val_loss, spec=".4f")
    if row.final_val_acc is not None:
        final += f" (acc {row.final_val_acc:.3f})"
    equal = _fmt(row.val_loss_equal_step, spec=".4f")
    if row.val_loss_equal_step is not None:
        equal += f" ({row.equal_step})"
    cells = [
        row.label(),
        _fmt(row.step_s, 1e3, ".1f"),
        _fmt(row.compute_s, 1e3, ".1f"),
        _fmt(row.comm_s, 1e3, ".1f"),
        _fmt(row.apply_s, 1e3, ".1f"),
        _fmt(None if row.other_s is None else max(row.other_s, 0.0), 1e3, ".1f"),
        _fmt(row.speedup, spec=".2f", suffix="x"),
        _fmt(row.bytes_sent_per_step, 1e-6, ".3g"),
        equal,
        final,
        _fmt(row.time_to_target_s, spec=".1f"),
    ]
    by_name = dict(zip(COLUMNS, cells, strict=True))
    nic, intra = row.nic_bytes_per_step, row.intra_bytes_per_step
    by_name |= dict(zip(NODE_COLUMNS, (_fmt(nic, 1e-6, ".3g"), _fmt(intra, 1e-6, ".3g")), strict=True))
    budget = row.budget.cell() if row.budget is not None else "—"
    by_name |= dict(zip(BUDGET_COLUMNS, (str(row.steps), budget), strict=True))
    return by_name


def _clamped_notes(rows: Sequence[RunSummary]) -> list[str]:
    """A note for each row whose "other ms" the table shows as 0 though the medians leave less (see
    :data:`TABLE_NOTE`)."""
    return [
        f"other ms of {row.variant}: shown as 0.0; the medians leave {row.other_s * 1e3:.1f} ms (the median "
        "of a sum is not the sum of the medians: each column's median comes from other steps), so its parts "
        f"add up to {-row.other_s * 1e3:.1f} ms more than its step time"
        for row in rows
        if row.other_s is not None and round(row.other_s * 1e3, 1) < 0
    ]


def _markdown(rows: list[RunSummary]) -> str:
    names = columns(rows)
    lines = ["| " + " | ".join(names) + " |", "|" + "|".join(["---"] + ["---:"] * (len(names) - 1)) + "|"]
    lines += ["| " + " | ".join(_cells(row)[name] for name in names) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def make_report(
    run_dirs: Sequence[Path],
    out_dir: Path,
    *,
    target_loss: float | None = None,
    baseline: str = "32bit",
    write: Callable[[str, bytes], None] | None = None,
    plots: bool = True,
) -> Report:
    """Summarize the runs (in the given order), write summary.md/json and (``plots``) the PNGs into
    ``out_dir`` (``write(name, data)`` writes one file there; default: replace the file, never writing
    through a symbolic link; drawing the PNGs takes most of the time). A partial run (its log ends before
    its last step) is marked in the table and noted, and does not set the default target loss."""
    if not run_dirs:
        raise ValueError("make_report: no run directories given")
    runs = [load_run(Path(d)) for d in run_dirs]
    rows = [summarize(run) for run in runs]
    base = next((r for r in rows if r.variant == baseline and r.step_s), None)
    base_s = None if base is None else base.step_s
    for row in rows:
        if base_s is not None and row.step_s:
            row.speedup = base_s / row.step_s
    evaluated = [run for run in runs if run.evals]
    common = set.intersection(*({e["step"] for e in run.evals} for run in evaluated)) if evaluated else set()
    if target_loss is None:
        target_loss, rule = _default_target(rows, baseline)
    else:
        rule = f"given: {target_loss:.4g}"
    for run, row in zip(runs, rows, strict=True):
        if common and run.evals:
            row.equal_step = max(common)
            row.val_loss_equal_step = {e["step"]: float(e["val_loss"]) for e in run.evals}[row.equal_step]
        if target_loss is not None:
            hit = next((e for e in run.evals if float(e["val_loss"]) <= target_loss), None)
            row.time_to_target_s = run.eval_time(hit) if hit is not None else None
    config = runs[0].config
    where = f"N = {config.get('world_size', '?')}, link {config.get('link', '?')}"
    if config.get("nnodes") and isinstance(config.get("world_size"), int):
        nodes, world = config["nnodes"], config["world_size"]
        where = f"N = {world} ({nodes} nodes × {world // nodes}), NIC {config.get('link')}"
    title = (
        f"{config.get('workload', '?')} {config.get('size', '?')}, {where}, seed {config.get('seed', '?')}"
    )
    notes = []
    for key in ("workload", "size", "world_size", "nnodes", "link", "seed", "time_budget_s"):
        values = {json.dumps(run.config.get(key)) for run in runs}
        if len(values) > 1:
            notes.append(f"warning: the runs differ in {key}: {', '.join(sorted(values))}")
    notes += [
        f"warning: {row.variant} is partial: its log ends at step {row.steps} of {row.target_steps} (the run "
        "was stopped before it finished); its final numbers are not comparable with finished runs'"
        for row in rows
        if row.partial
    ]
    notes += budget_notes(rows)
    report = Report(rows, _markdown(rows), {}, target_loss, rule, baseline, title, notes, runs)
    _write(report, Path(out_dir), write or _writer(Path(out_dir)), plots)
    return report


def _writer(out_dir: Path) -> Callable[[str, bytes], None]:
    """Write a file into ``out_dir`` (created if missing), replacing a symbolic link, never following it."""

    def write(name: str, data: bytes) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / name
        if path.is_symlink():
            path.unlink()
        path.write_bytes(data)

    return write


def _write(report: Report, out_dir: Path, write: Callable[[str, bytes], None], plots: bool) -> None:
    text = [
        f"# {report.title}",
        "",
        report.table_markdown,
        TABLE_NOTE,
        "",
        *(f"{line}\n" for line in _clamped_notes(report.rows)),
        *([floor.line(), ""] if (floor := compute_floor(report)) is not None else []),
        f"Target loss: {report.target_rule}.",
        "",
    ]
    text += [*report.notes, "", "Run directories:", ""]
    text += [f"- {row.variant}: `{row.run_dir}`" for row in report.rows]
    write("summary.md", ("\n".join(text) + "\n").encode())
    data = {
        "title": report.title,
        "baseline": report.baseline,
        "target_loss": report.target_loss,
        "target_rule": report.target_rule,
        "rows": [row.to_json() for row in report.rows],
    }
    write("summary.json", (json.dumps(data, indent=2) + "\n").encode())
    figures = dict(FIGURES) if plots else {}
    if plots and any(run.diags for run in report.runs):
        figures["diagnostics_vs_step"] = figure_diagnostics
    for name, make in figures.items():
        fig = make(report)
        png = io.BytesIO()
        fig.savefig(png, dpi=DPI, format="png")
        fig.clear()
        write(f"{name}.png", png.getvalue())
        report.plots[name] = out_dir / f"{name}.png"


def print_table(report: Report, console: Console | None = None) -> None:
    """Print the comparison table (and the notes, the compute floor and the target-loss rule) within the
    console's width (:func:`lioncub.report.text.print_table`: cells whole, the variant in every part)."""
    out = console if console is not None else text.console()
    names = columns(report.rows)
    cells = [[_cells(row)[name] for name in names] for row in report.rows]
    text.print_table(out, report.title, names, [[escape(c) for c in row] for row in cells])
    floor = compute_floor(report)
    lines = [TABLE_NOTE, *_clamped_notes(report.rows), *([floor.line()] if floor is not None else [])]
    for line in [*lines, f"target loss: {report.target_rule}", *report.notes]:
        text.print_wrapped(out, line)
