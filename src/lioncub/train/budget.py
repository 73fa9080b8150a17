"""Comparisons at equal training time (``lioncub compare --time-budget SECONDS``): how many steps of a run
fit the budget, from a short pilot of the same run, and the guard that stops a run that overruns it badly.
Torch-free.

Time here is the log's training time, ``time_s``: the sum of the steps' own ``step_s`` (forward, backward,
communication and optimizer step); evaluation, checkpoints and the launch are not counted, as on the
report's loss-vs-time axis and in its time to target.

1. **Pilot.** The row's own configuration (variant, ranks, links, local steps, momentum sync) trains
   :func:`pilot_steps` steps in a scratch directory: at least :data:`PILOT_STEPS`, and at least
   :data:`PILOT_PERIODS` periods (:func:`period`: H with local steps, so that outer steps are in it, times
   the momentum sync's interval), rounded up to a whole period. Its step time (:func:`pilot_step_time`) is
   the mean ``step_s`` of the steps after its first period, which holds the one-time costs (allocations,
   the first collectives' set-up) that a long run spreads thin.
2. **Plan.** ``steps = ⌊budget / step time⌋``, rounded down to a multiple of H (:func:`planned_steps`):
   the run ends where the replicas agree, and its lr schedule (warm-up, cosine) spans these steps. Without
   ``--eval-every`` it evaluates every :func:`eval_interval` steps (a multiple of H, about
   :data:`EVALS_PER_RUN` times a run, so every row is evaluated at about the same times), and, as every
   run, at its last step: the last evaluation is at the end of the budget.
3. **Guard.** A run whose ``time_s`` passes :data:`GUARD_FACTOR` × the budget at a window's end (every
   step without local steps) stops there, evaluated and checkpointed, with a ``stop`` record in its log
   (:func:`lioncub.train.loop.train`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lioncub.train.config import TrainConfig

__all__ = [
    "EVALS_PER_RUN",
    "GUARD_FACTOR",
    "PILOT_PERIODS",
    "PILOT_STEPS",
    "budget_summary",
    "eval_interval",
    "over_budget",
    "period",
    "pilot_config",
    "pilot_step_time",
    "pilot_steps",
    "planned_config",
    "planned_steps",
]

#: the fewest steps a pilot trains
PILOT_STEPS = 8
#: the fewest periods (windows of H steps) a pilot trains; the first is left out of its mean
PILOT_PERIODS = 3
#: a run stops once its training time passes this many times its budget
GUARD_FACTOR = 1.25
#: about how many evaluations a run of the budget gets without ``--eval-every`` (and one at its end)
EVALS_PER_RUN = 10


def period(config: TrainConfig) -> int:
    """Steps after which the run's work repeats: H with local steps (one outer step per window), times the
    momentum sync's interval where the momenta are synced (its lcm with H)."""
    opt = config.optimizer
    sync = opt.sync_every if opt.momentum_sync not in ("none", None) else 1
    return math.lcm(opt.local_steps or 1, sync)


def pilot_steps(every: int) -> int:
    """The steps of a pilot of a run of period ``every``: at least :data:`PILOT_STEPS` and
    :data:`PILOT_PERIODS` periods, a whole number of periods."""
    return every * max(PILOT_PERIODS, math.ceil(PILOT_STEPS / every))


def pilot_config(config: TrainConfig) -> TrainConfig:
    """The pilot of the run ``config``: the same run for :func:`pilot_steps` steps, evaluated and
    checkpointed only at its end, with its own warm-up (the step time does not depend on the lr)."""
    return config.replace(
        **dict.fromkeys(("time_budget_s", "pilot_steps", "pilot_step_s", "warmup_steps")),
        steps=pilot_steps(period(config)),
        eval_every=0,
        checkpoint_every=0,
    )


def pilot_step_time(step_s: Sequence[float], every: int) -> float:
    """The pilot's step time (s): the mean of ``step_s`` (the pilot's steps in order) after its first
    period of ``every`` steps; ``ValueError`` if it has no step after it or a time that is not > 0."""
    measured = list(step_s[every:])
    if not measured or not all(math.isfinite(t) and t > 0 for t in measured):
        raise ValueError(
            f"the pilot logged {len(step_s)} step times {list(step_s)[:5]}…; it needs more than {every} "
            "steps, each of a positive time"
        )
    return math.fsum(measured) / len(measured)


def planned_steps(budget_s: float, step_s: float, h: int) -> int:
    """The steps of ``step_s`` seconds that fit ``budget_s`` seconds, rounded down to a multiple of ``h``
    (``ValueError`` naming ``--time-budget`` if not one window fits)."""
    steps = math.floor(budget_s / step_s) // h * h
    if steps < h:
        window = f"a window of {h} steps" if h > 1 else "one step"
        raise ValueError(
            f"--time-budget {budget_s:g}: the pilot measured {step_s * 1e3:.1f} ms per step, so not even "
            f"{window} fits; give at least {h * step_s:.3g} seconds"
        )
    return steps


def eval_interval(steps: int, h: int) -> int:
    """Evaluate every this many steps: the multiple of ``h`` nearest ``steps`` / :data:`EVALS_PER_RUN`
    (at least ``h``)."""
    return h * max(1, round(steps / (EVALS_PER_RUN * h)))


def planned_config(
    config: TrainConfig, budget_s: float, step_times: Sequence[float], *, eval_given: bool
) -> TrainConfig:
    """The run ``config`` planned for ``budget_s`` seconds from its pilot's step times (in order): its
    steps (:func:`planned_steps`), its evaluations (:func:`eval_interval`, unless ``eval_given``: the
    ``--eval-every`` of ``config``) and the budget and pilot recorded."""
    every, h = period(config), config.optimizer.local_steps or 1
    step_s = pilot_step_time(step_times, every)
    steps = planned_steps(budget_s, step_s, h)
    planned = {
        "steps": steps,
        "time_budget_s": budget_s,
        "pilot_steps": len(step_times),
        "pilot_step_s": step_s,
    }
    if not eval_given:
        planned["eval_every"] = eval_interval(steps, h)
    return config.replace(**planned)


def over_budget(config: TrainConfig, step: int, time_s: float) -> bool:
    """Whether the run stops after ``step`` at ``time_s`` training seconds: it has a budget, ``step`` ends a
    window and is not its last, and ``time_s`` is past :data:`GUARD_FACTOR` × the budget."""
    budget, h = config.run.time_budget_s, config.optimizer.local_steps or 1
    if budget is None or step % h or step >= config.run.steps:
        return False
    return time_s > GUARD_FACTOR * budget


def budget_summary(config: TrainConfig, records: Sequence[dict[str, Any]], stopped_at: int | None) -> dict:
    """The ``time_budget`` entry of a run's ``summary.json``: the budget and the pilot (s), the planned
    steps, the steps trained, the measured training time (``time_s`` of the last step, s) and the step the
    guard stopped the run at (None: it was not stopped)."""
    run = config.run
    return {
        "budget_s": run.time_budget_s,
        "planned_steps": run.steps,
        "pilot_steps": run.pilot_steps,
        "pilot_step_s": run.pilot_step_s,
        "steps_run": records[-1]["step"] if records else None,
        "wall_s": records[-1]["time_s"] if records else None,
        "stopped_at": stopped_at,
    }
