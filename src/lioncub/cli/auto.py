"""``--variant auto`` (``lioncub train``) and the row ``auto`` (``lioncub compare``): a vote every step or
local steps, and H, chosen on the job itself.

1. **Pilot.** The per-step ``1bit`` vote of the run's own workload, ranks and links trains
   :func:`lioncub.train.budget.pilot_steps` steps (8) in a scratch directory, removed after.
2. **Measure.** ``c``, the median compute of its steps (forward and backward; the first step, which holds
   the one-time costs, left out), and ``m``, the median communication of one vote.
3. **Choose.** :func:`lioncub.planning.schedule.choose_schedule` picks the H with the shortest predicted
   time to a loss (``f(H) · (c + m/H)``, with the factors f(H) measured in ``docs/findings.md`` §9). The
   run then trains as ``1bit`` (H = 1) or ``1bit/hH`` with the outer rule's defaults
   (``docs/local-steps.md``), and its ``config.json`` records ``chosen_by: "auto"`` with ``c`` and ``m``
   (``auto_compute_s``, ``auto_vote_s``); reports name it ``auto (1bit/h16)``.

The preset is always ``1bit``, the vote the factors f(H) were measured with and the fewest bytes per
vote; which preset wins a vote every step on a given network is :func:`lioncub.planning.auto.auto_variant`'s
and ``lioncub cost``'s question.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

from lioncub.train.config import CHOSEN_BY

__all__ = ["AUTO", "PILOT_VARIANT", "candidates", "check_candidates", "choose_run", "measure", "resolve"]

#: the name that asks for the choice (``--variant auto``, the row ``auto``; what ``chosen_by`` records)
AUTO = CHOSEN_BY[0]
#: the run the pilot trains and the preset of every choice
PILOT_VARIANT = "1bit"


def measure(records: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """``(c, m)`` in seconds from a pilot's step records in order: the medians of ``compute_s`` and
    ``comm_s`` after the first step. ``ValueError`` if it logged fewer than 2 steps or no positive compute."""
    later = list(records[1:])
    if not later:
        raise ValueError(f"the pilot of auto logged {len(records)} step(s); it needs at least 2")
    c = statistics.median(float(r["compute_s"]) for r in later)
    m = statistics.median(float(r["comm_s"]) for r in later)
    if not c > 0:
        raise ValueError(f"the pilot of auto measured {c!r} s of compute per step; it needs > 0")
    return c, max(0.0, m)


def choose_run(compute_s: float, vote_s: float) -> tuple[str, str]:
    """The run name :func:`~lioncub.planning.schedule.choose_schedule` picks for a step's compute
    ``compute_s`` and one vote's communication ``vote_s`` (``1bit`` or ``1bit/hH``), and its reason."""
    from lioncub.planning.schedule import choose_schedule

    choice = choose_schedule(compute_s, vote_s)
    name = PILOT_VARIANT if choice.local_steps is None else f"{PILOT_VARIANT}/h{choice.local_steps}"
    return name, choice.reason


def candidates() -> list[str]:
    """The runs ``auto`` may choose, the vote every step first: ``1bit``, ``1bit/h4``, ``1bit/h16``
    (the H of :data:`~lioncub.planning.schedule.STEPS_FACTOR`)."""
    from lioncub.planning.schedule import STEPS_FACTOR

    return [PILOT_VARIANT if h == 1 else f"{PILOT_VARIANT}/h{h}" for h in sorted({1, *STEPS_FACTOR})]


def check_candidates(config_of: Callable[[str], Any]) -> Any:
    """Build the configuration of every run ``auto`` may choose (:func:`candidates`), so that a setting
    one of them refuses (``--steps`` not a multiple of 16, say) is refused before the pilot (``config_of``'s
    ``ValueError`` names the run); the pilot's configuration (``1bit``)."""
    configs = {name: config_of(name) for name in candidates()}
    return configs[PILOT_VARIANT]


def resolve(
    args: argparse.Namespace,
    config_of: Callable[[str], Any],
    label: str,
    command: str,
) -> Any:
    """The run ``auto`` becomes: a pilot of ``config_of("1bit")`` (with the launch options of ``args``),
    its measures, the choice, and ``config_of(choice)`` marked with them. Its exit status (an int) if the
    pilot failed."""
    from lioncub.cli.options import run_pilot
    from lioncub.train import budget

    pilot = budget.pilot_config(config_of(PILOT_VARIANT))
    records = run_pilot(args, pilot, f"{label} (the per-step {PILOT_VARIANT} vote)", command)
    if isinstance(records, int):
        return records
    c, m = measure(records)
    name, reason = choose_run(c, m)
    print(f"{label}: chose {name}: {reason}", file=sys.stderr, flush=True)
    return config_of(name).replace(chosen_by=AUTO, auto_compute_s=c, auto_vote_s=m)
