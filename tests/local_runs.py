"""The runs of tests/test_local_steps_cli.py's mid-window resume, one after the other in ONE interpreter
(one zygote for every run's ranks): tests/compare_runs.py's, between its two comparisons (the background
job ``compares``, started when collection ends: tests/background.py), or alone:

    python tests/local_runs.py OUT

``OUT/whole``: :data:`RUN` with a checkpoint after step :data:`STOP`; ``OUT/parts``: the same run stopped
after step :data:`STOP` (``--stop-at``), then resumed (``--resume --outer-lr 1``). What each printed is in
``OUT/<name>.out``; the exit status is the number of runs that failed.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from train_runs import train

H, STEPS, STOP = 2, 6, 3  # the stop after step 3 is in the middle of the second window
RUN = ["--variant", "1bit", "--nproc", "2", "--local-steps", str(H), "--steps", str(STEPS)]
#: batches of 4 windows a rank (the tiny GPT's is 16): the test compares the runs bit for bit and their bytes
#: (the parameters'), never a loss's value
RUN += ["--eval-every", str(H), "--set", "dropout=0.1", "--set", "batch_size=4"]
#: name -> (run directory, options): in this order
RUNS = {
    "whole": ("whole", [*RUN, "--checkpoint-every", str(STOP)]),
    "stopped": ("parts", [*RUN, "--stop-at", str(STOP)]),
    "resumed": ("parts", ["--resume", "--no-progress", "--outer-lr", "1"]),  # the vote's default: accepted
}


def main(out: Path) -> int:
    failed = 0
    for name, (run_dir, options) in RUNS.items():
        with (
            open(out / f"{name}.out", "w") as log,
            contextlib.redirect_stdout(log),
            contextlib.redirect_stderr(log),
        ):
            failed += train(out / run_dir, *options) != 0
    return failed


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
