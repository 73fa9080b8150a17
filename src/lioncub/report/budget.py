"""The report of runs compared at equal training time (``lioncub compare --time-budget``, planned by
:mod:`lioncub.train.budget`): each run's budget, plan and measured time, and its validation loss at the
budget. No torch is imported here.

A run of a budget records it in ``config.json`` (``time_budget_s``, with ``steps`` as planned and the
pilot's ``pilot_steps`` and ``pilot_step_s``); a run the guard stopped logs a ``stop`` record.

**Loss at the budget**: the validation loss of the run's last evaluation whose training time (``time_s``)
is within the budget, allowing :data:`BUDGET_SLACK` of it past (what a pilot's estimate of the step time
may be off by on a quiet machine), so that a run that ends a little late is not judged by its
second-to-last evaluation. Its time is shown with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["BUDGET_SLACK", "Budget", "budget_notes", "budget_of"]

#: the fraction of its budget a run's evaluation may come after it and still be its loss at the budget
BUDGET_SLACK = 0.05


@dataclass
class Budget:
    """One run's time budget: seconds of training (``time_s``), steps, and the loss at the budget."""

    budget_s: float
    planned_steps: int | None  # the steps the pilot planned (config ``steps``)
    pilot_steps: int | None
    pilot_step_s: float | None  # the pilot's mean step time, s
    wall_s: float | None  # the training time of the last step logged, s
    loss: float | None  # validation loss at the budget (module doc)
    loss_step: int | None
    loss_time_s: float | None
    stopped_at: int | None = None  # the step the guard stopped the run at (far over its budget)

    def cell(self) -> str:
        """The table's "val loss at budget (s)" cell: ``2.0130 (29.6 s)``."""
        if self.loss is None or self.loss_time_s is None:
            return "—"
        return f"{self.loss:.4f} ({self.loss_time_s:.1f} s)"


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def budget_of(
    config: dict[str, Any],
    steps: list[dict[str, Any]],
    evals: list[tuple[int, float, float | None]],
    stops: list[dict[str, Any]],
) -> Budget | None:
    """The :class:`Budget` of a run from its ``config.json``, step records (in order), evaluations
    ``(step, val_loss, time_s)`` (in order) and ``stop`` records; None for a run without a budget."""
    budget = _number(config.get("time_budget_s"))
    if budget is None or budget <= 0:
        return None
    within = [e for e in evals if e[2] is not None and e[2] <= budget * (1 + BUDGET_SLACK)]
    last = within[-1] if within else None
    planned, pilot = config.get("steps"), config.get("pilot_steps")
    return Budget(
        budget_s=budget,
        planned_steps=planned if isinstance(planned, int) else None,
        pilot_steps=pilot if isinstance(pilot, int) else None,
        pilot_step_s=_number(config.get("pilot_step_s")),
        wall_s=_number(steps[-1].get("time_s")) if steps else None,
        loss=last[1] if last else None,
        loss_step=last[0] if last else None,
        loss_time_s=last[2] if last else None,
        stopped_at=next((s["step"] for s in stops if s.get("reason") == "time budget"), None),
    )


def budget_notes(rows: list[Any]) -> list[str]:
    """What the report says under the table about the rows' budgets (rows with a ``budget`` and a
    ``variant``; none without budgets): the rule, then each run's pilot, plan and measured time."""
    runs = [row for row in rows if row.budget is not None]
    if not runs:
        return []
    values = sorted({row.budget.budget_s for row in runs})
    notes = [
        f"time budget: {', '.join(f'{v:g}' for v in values)} s of training per run (time_s: the steps' own "
        "time; evaluation, checkpoints and start-up excluded). Each run trained the steps its pilot's step "
        "time fits, rounded down to a multiple of its H; its lr schedule spans them. val loss at budget: the "
        f"last evaluation within the budget (+{BUDGET_SLACK:.0%} for the pilot's error), at the time shown"
    ]
    for row in runs:
        b = row.budget
        pilot = (
            f"pilot {b.pilot_steps} steps at {b.pilot_step_s * 1e3:.1f} ms"
            if b.pilot_steps and b.pilot_step_s
            else "no pilot recorded"
        )
        wall = "—" if b.wall_s is None else f"{b.wall_s:.1f} s ({b.wall_s / b.budget_s:.0%} of the budget)"
        notes.append(
            f"- {row.variant}: {pilot} → {b.planned_steps} steps planned; {row.steps} trained in {wall}"
        )
        if b.stopped_at is not None:
            notes.append(
                f"warning: {row.variant} ran far over its budget and was stopped after step {b.stopped_at} "
                f"of {b.planned_steps}: its pilot's step time was too short (a busy machine?)"
            )
    return notes
