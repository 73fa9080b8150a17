"""A vote every step or local steps, and H: the schedule with the shortest predicted time to a loss.

A vote every H steps makes each step cheaper and each step worth less. With ``c`` the compute of a step
(forward, backward, optimizer; seconds) and ``m`` the communication of one vote (seconds), a run with a
vote every H steps takes ``c + m/H`` per step (H = 1: the vote every step), and needs ``f(H)`` times the
steps of the per-step vote to reach the same validation loss at the same training time. Its time to a
target is then proportional to

    T(H) = f(H) · (c + m/H)                 (f(1) = 1)

and the schedule with the smallest T wins. H beats the vote every step where T(H) < T(1), i.e. where the
ratio of communication to compute

    m / c  >  (f(H) − 1) / (1 − f(H)/H)      (:func:`breakeven_ratio`; never where f(H) ≥ H)

The factors :data:`STEPS_FACTOR` are measured (``docs/findings.md`` §9: GPT small, 4 ranks, 1-bit votes,
equal training time, their time to 32bit's loss + 2 %); a model, a batch or a run length far from those
may need its own, passed as ``steps_factor``. Torch-free: a pure function of numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from lioncub._validate import is_int, is_number

__all__ = ["STEPS_FACTOR", "ScheduleChoice", "ScheduleRow", "breakeven_ratio", "choose_schedule"]

#: f(H): the steps a vote every H steps needs to reach a validation loss, relative to the vote every step,
#: at equal training time (1-bit votes with the default outer betas, GPT small on 4 ranks behind 2-100
#: Mbit/s: ``docs/findings.md`` §9 measured f(4) 0.85-1.07, mean 0.98, taken as 1; f(16) at outer lr 0.7
#: 0.86-1.56, mean 1.24)
STEPS_FACTOR: dict[int, float] = {1: 1.0, 4: 1.0, 16: 1.25}


@dataclass(frozen=True)
class ScheduleRow:
    """One candidate: ``local_steps`` H (``None``: a vote every step), its predicted seconds per step
    (``compute_s + vote_s / H``), its steps factor f(H) and ``relative_time`` = f(H) · step_s (seconds per
    step of the per-step vote's progress)."""

    local_steps: int | None
    step_s: float
    steps_factor: float

    @property
    def relative_time(self) -> float:
        return self.steps_factor * self.step_s

    @property
    def name(self) -> str:
        return "a vote every step" if self.local_steps is None else f"a vote every {self.local_steps} steps"


@dataclass(frozen=True)
class ScheduleChoice:
    """The chosen ``local_steps`` (``None``: a vote every step), why, and every candidate."""

    local_steps: int | None
    reason: str
    rows: tuple[ScheduleRow, ...]


def breakeven_ratio(h: int, steps_factor: float) -> float:
    """The ratio m/c of one vote's communication to a step's compute above which a vote every ``h`` steps
    reaches a loss sooner than a vote every step (module docstring); ``inf`` where it never does
    (``steps_factor >= h``)."""
    if not is_int(h, 1):
        raise ValueError(f"h={h!r} must be an int >= 1")
    if not is_number(steps_factor, gt=0):
        raise ValueError(f"steps_factor={steps_factor!r} must be a finite number > 0")
    if h == 1 or steps_factor >= h:
        return math.inf
    return max(0.0, (steps_factor - 1.0) / (1.0 - steps_factor / h))


def choose_schedule(
    compute_s: float,
    vote_s: float,
    steps_factor: Mapping[int, float] | None = None,
) -> ScheduleChoice:
    """The H with the smallest predicted time to a loss (module docstring), among the keys of
    ``steps_factor`` (default :data:`STEPS_FACTOR`; 1 is always a candidate: the vote every step).

    Args:
        compute_s: a step's compute c (seconds): forward, backward and the optimizer's own work.
        vote_s: one vote's communication m (seconds): measured by a pilot of the per-step vote, or
            predicted by the cost model (:func:`lioncub.planning.flat.predict`).
        steps_factor: f(H) by H (f(1) must be 1 where given).

    A tie goes to the smaller H (fewer inner steps between agreements)."""
    if not is_number(compute_s, gt=0):
        raise ValueError(f"compute_s={compute_s!r} must be a finite number of seconds > 0 (a step's compute)")
    if not is_number(vote_s, ge=0):
        raise ValueError(
            f"vote_s={vote_s!r} must be a finite number of seconds >= 0 (one vote's communication)"
        )
    factors = dict(STEPS_FACTOR if steps_factor is None else steps_factor)
    for h, f in factors.items():
        if not is_int(h, 1) or not is_number(f, gt=0):
            raise ValueError(
                f"steps_factor={dict(factors)!r}: give H (an int >= 1) -> f(H) (a number > 0), e.g. "
                f"{STEPS_FACTOR}"
            )
    if factors.setdefault(1, 1.0) != 1.0:
        raise ValueError(f"steps_factor={dict(factors)!r}: f(1) is the vote every step itself, 1.0")
    rows = tuple(
        ScheduleRow(None if h == 1 else h, compute_s + vote_s / h, factors[h]) for h in sorted(factors)
    )
    best = min(rows, key=lambda r: r.relative_time)  # min keeps the first: the smaller H on a tie
    ratio = vote_s / compute_s
    others = ", ".join(f"{r.name} {r.relative_time / best.relative_time:.2f}×" for r in rows if r is not best)
    reason = (
        f"{best.name} (one vote {vote_s * 1e3:.3g} ms against {compute_s * 1e3:.3g} ms of compute "
        f"per step, m/c = {ratio:.2f}; the others' predicted time to a loss: {others})"
    )
    return ScheduleChoice(best.local_steps, reason, rows)
