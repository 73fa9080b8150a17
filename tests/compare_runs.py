"""The launched runs of several test modules, one after the other in ONE interpreter, their ranks forked
from one zygote, started in the background when collection ends (tests/background.py) as :func:`main` in
a fork of the tests' fork server (torch already imported: the job's interpreter imports it no more); by
hand:

    python tests/compare_runs.py OUT

1. ``compare``: the first of the two ``lioncub compare`` runs that the comparison tests of
   tests/test_train.py and tests/test_cli_output.py read;
2. ``OUT/local``: tests/test_local_steps_cli.py's three runs of a mid-window resume (tests/local_runs.py;
   their exit statuses in ``OUT/local/failed``);
3. ``OUT/launched``: tests/test_run_ownership.py's three launches and tests/test_rundir.py's two runs
   (tests/ownership_runs.py);
4. ``budget``: the second comparison (at equal time).

``OUT/<name>/cmp`` is a comparison's output directory and ``OUT/<name>.out`` what it printed (stdout) for
each ``name`` of :data:`RUNS`; the exit status is the number of comparisons and runs that failed. All print
for a terminal of :data:`COLUMNS` columns (``COLUMNS`` set: the tables in parts, the notes wrapped): the
runs' environment is the same, so every launch after the first forks its ranks from the first one's zygote
(an environment that differs in any variable starts another zygote: ~3 s of CPU importing torch; a job of
its own, another interpreter: ~2.5 s more).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import local_runs
import ownership_runs
from train_runs import TINY

if TYPE_CHECKING:
    import background

#: the tables, plots, diagnostics, momentum sync, an overlapped and a local-steps row (the votes only take
#: the diagnostics and the momentum sync); batches of 4 windows a rank (the tiny GPT's is 16): no test depends
#: on a loss's value (the overlapped row's are compared with 1bit's, the table's read back as printed)
COMPARE = ["compare", *TINY, "--variants", "32bit,1bit,1bit+overlap,1bit/h2", "--nproc", "2", "--steps", "4"]
COMPARE += ["--eval-every", "2", "--diagnostics-every", "2", "--momentum-sync", "io", "--sync-every", "2"]
COMPARE += ["--set", "batch_size=4"]
#: 1 s of training per run, on 2 ranks; every evaluation reaches the target loss 10 (above the initial loss)
BUDGET = ["compare", *TINY, "--variants", "32bit,1bit/h2,auto", "--nproc", "2", "--time-budget", "1"]
BUDGET += ["--target-loss", "10"]
RUNS = {"compare": COMPARE, "budget": BUDGET}
#: the width ``compare`` prints for (tests/test_report.py reads its table back)
COLUMNS = 80


def job() -> background.Forked:
    """The background job ``compares`` (tests/test_train.py, tests/test_cli_output.py,
    tests/test_local_steps_cli.py, tests/test_run_ownership.py, tests/test_rundir.py, tests/test_launch.py):
    :func:`main` in one fork of the fork server. The zygote its launches leased ends when that process does
    (its socket closed)."""
    import background  # the tests' modules: not needed where this file runs the comparisons

    return background.Forked(main, 300)


def _shorter_pilots() -> None:
    """``budget``: the pilot of 1bit/h2 (period 2) takes its step time 20× too short, so that its run goes
    far over the budget and the guard stops it."""
    from lioncub.train import budget

    measured = budget.pilot_step_time
    budget.pilot_step_time = lambda s, every: measured(s, every) / (20 if every == 2 else 1)


def main(out: Path) -> int:
    from lioncub import cli

    failed = 0
    os.environ["COLUMNS"] = str(COLUMNS)
    for name, argv in RUNS.items():
        if name == "budget":
            _shorter_pilots()
        printed = io.StringIO()
        with (
            contextlib.redirect_stdout(printed),
            open(out / f"{name}.log", "w") as err,
            contextlib.redirect_stderr(err),
        ):
            failed += cli.main([*argv, "--out", str(out / name / "cmp")]) != 0
        (out / f"{name}.out").write_text(printed.getvalue())
        if name == "compare":  # the other modules' launches: same environment, same zygote
            failed += _others(out)
    return failed


def _others(out: Path) -> int:
    """local_runs' runs into ``out/local`` and ownership_runs' into ``out/launched``: how many failed."""
    (out / "local").mkdir()
    local_failed = local_runs.main(out / "local")
    (out / "local" / "failed").write_text(str(local_failed))
    (out / "launched").mkdir()
    return local_failed + ownership_runs.main(out / "launched")


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
