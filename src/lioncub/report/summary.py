"""``lioncub report``'s summary of one run: what it trained, how fast, what it sent, where its loss went
and what its replica groups went through, from its ``log.jsonl`` (read as :func:`lioncub.report.runs.
load_run` reads it, the numbers as ``lioncub compare``'s table has them) and, once it finished, its
``summary.json`` (the memory, the fault-tolerance events). One short line per topic, for
:func:`lioncub.report.text.print_wrapped`. No torch is imported here.

Units: milliseconds per optimizer step (a run with local steps /hH: the median over its windows of H
steps of the window's mean per step, as in the comparison), MB = 1e6 bytes a rank sends, seconds of
training (``time_s``: evaluation excluded).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lioncub.report.runs import RunLog, RunSummary, load_run, summarize
from lioncub.rundir import read_run_file

__all__ = ["run_summary"]


def _finished(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``summary.json`` (written when it finished), or None (not finished, or unreadable)."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    try:
        doc = json.loads(read_run_file(path, follow_symlinks=True))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _mb(nbytes: float | None) -> str:
    return "—" if nbytes is None else f"{nbytes / 1e6:.3g} MB"


def _headline(run: RunLog, row: RunSummary, done: dict[str, Any] | None) -> str:
    cfg = run.config
    world = cfg.get("world_size", "?")
    where = f"{world} rank(s), link {cfg.get('link', '?')}"
    if cfg.get("nnodes"):
        where = f"{cfg['nnodes']} nodes, {world} ranks, NIC {cfg.get('link', '?')}"
    text = f"{cfg.get('workload', '?')}/{cfg.get('size', '?')} {run.variant} on {where}: {row.steps} steps"
    if row.stopped:
        return f"{text} (stopped over its time budget at step {row.steps} of {row.target_steps})"
    if done is None or row.partial:
        of = f" of {row.target_steps}" if row.target_steps is not None else ""
        return f"{text}{of} (not finished: no summary.json yet, or the run stopped)"
    return text


def _speed(run: RunLog, row: RunSummary) -> str:
    h = run.local_steps
    stat = "median" if h == 1 else f"median over windows of {h} steps"
    parts = (("compute", row.compute_s), ("communication", row.comm_s), ("apply", row.apply_s))
    split = ", ".join(f"{name} {_ms(value)}" for name, value in parts if value is not None)
    if row.other_s is not None and split:
        split += f", other {_ms(max(row.other_s, 0.0))}"
    text = f"speed: {_ms(row.step_s)} per step ({stat}{'; ' + split if split else ''})"
    times = [rec["time_s"] for rec in run.steps if isinstance(rec.get("time_s"), (int, float))]
    if times and times[-1] > 0:
        text += f"; {times[-1]:.1f} s of training, {len(run.steps) / times[-1]:.2f} steps/s"
    return text


def _bytes(run: RunLog, row: RunSummary) -> str:
    sent = [rec["bytes_sent"] for rec in run.steps if isinstance(rec.get("bytes_sent"), (int, float))]
    if not sent:
        return "bytes: none logged"
    total = f"{_mb(sum(sent))} in all ({len(sent)} steps)"
    if row.nic_bytes_per_step is not None:
        return (
            f"bytes: {_mb(row.nic_bytes_per_step)} per step through a node's NIC, "
            f"{_mb(row.intra_bytes_per_step)} per step by a rank inside its node; a rank sent {total}"
        )
    return f"bytes: a rank sent {_mb(row.bytes_sent_per_step)} per step, {total}"


def _loss(run: RunLog, row: RunSummary) -> str:
    losses = [(rec["step"], rec["loss"]) for rec in run.steps if isinstance(rec.get("loss"), (int, float))]
    text = "loss: "
    if losses:
        (s0, l0), (s1, l1) = losses[0], losses[-1]
        text += f"training {l0:.4f} at step {s0} → {l1:.4f} at step {s1}; "
    if row.final_val_loss is None:
        return text + "no evaluation logged"
    acc = f", val_acc {row.final_val_acc:.4f}" if row.final_val_acc is not None else ""
    best = min(run.evals, key=lambda e: float(e["val_loss"]))
    best_text = (
        f" (best {float(best['val_loss']):.4f} at step {best['step']})" if best is not run.evals[-1] else ""
    )
    return text + f"validation: val_loss {row.final_val_loss:.4f}{acc} at step {row.final_step}{best_text}"


def _fault_tolerance(run: RunLog, done: dict[str, Any] | None) -> list[str]:
    """The replica groups' events: from ``summary.json`` once finished, else the groups per step logged."""
    entry = (done or {}).get("fault_tolerance")
    if not entry:
        counts: dict[int, int] = {}
        for rec in run.steps:
            if isinstance(rec.get("participants"), int):
                counts[rec["participants"]] = counts.get(rec["participants"], 0) + 1
        if not counts:
            return []
        shown = ", ".join(f"{n} steps with {k} groups" for k, n in sorted(counts.items(), reverse=True))
        return [f"fault tolerance: {shown} (so far)"]
    counts_text = ", ".join(
        f"{n} step{'s' if n != 1 else ''} with {k} group{'s' if k != '1' else ''}"
        for k, n in entry.get("participants", {}).items()
    )
    lines = [f"fault tolerance: {counts_text}; {entry.get('skipped_steps', 0)} steps skipped (not committed)"]
    for fault in ("kill", "rejoin"):
        if entry.get(fault):
            lines[0] += f"; --{fault} {','.join(map(str, entry[fault]))}"
    for heal in entry.get("heals", []):
        lines.append(
            f"  heal: group {heal['group']} at step {heal['step']} from {heal['source']}, "
            f"{_mb(heal['nbytes'])} in {heal['seconds']:.2f} s"
        )
    groups = ", ".join(map(str, entry.get("groups_finished", [])))
    stop_at = run.config.get("stop_at")
    when = "the end" if stop_at is None else f"step {stop_at} (--stop-at)"
    lines.append(
        f"  the replicas of groups {groups} were bitwise equal at {when}"
        if entry.get("replicas_equal")
        else f"  the replicas were NOT equal at {when} (groups finished: {groups or 'none'})"
    )
    return lines


def _memory(done: dict[str, Any] | None) -> list[str]:
    memory = (done or {}).get("memory")
    if not isinstance(memory, dict):
        return []
    names = (("parameters", "parameters"), ("gradients", "gradients"), ("optimizer_state", "optimizer state"))
    parts = [
        f"{label} {_mb(memory[key])}" for key, label in names if isinstance(memory.get(key), (int, float))
    ]
    if isinstance(memory.get("peak_rss"), (int, float)):
        parts.append(f"peak RSS {_mb(memory['peak_rss'])}")
    return [f"memory per rank: {', '.join(parts)}"] if parts else []


def run_summary(run_dir: Path) -> list[str]:
    """The summary of the run in ``run_dir``, a line per topic (see the module docstring); ``ValueError``
    naming the directory if it has no ``config.json`` or no step in its log."""
    run = load_run(Path(run_dir))
    row, done = summarize(run), _finished(Path(run_dir))
    lines = [_headline(run, row, done), _speed(run, row), _bytes(run, row), _loss(run, row)]
    if row.budget is not None:
        b = row.budget
        lines.append(
            f"time budget: {b.budget_s:g} s, {b.planned_steps} steps planned; val loss at the budget "
            f"{b.cell()}"
        )
    return [*lines, *_fault_tolerance(run, done), *_memory(done)]
