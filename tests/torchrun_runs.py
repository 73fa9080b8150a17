"""The suite's two torchrun jobs, one after the other in ONE interpreter (torchrun's agent imported once:
``torch.distributed.run.main``), started in the background when collection ends (tests/background.py):

    python tests/torchrun_runs.py OUT

1. ``kill``: tests/test_reliability.py's ``lioncub.cli train`` of :data:`TINY` on 2 ranks, ``--max-restarts
   1``, whose rank 1 SIGKILLs itself after the backward of step 5 in the first attempt (tests/kill_rank.py),
   into ``OUT/torchrun``;
2. ``forgot_init``: tests/test_topology.py's :data:`FORGOT_INIT` on 2 ranks (``OUT/forgot_init.py``), which
   builds LionCub without ``init_process_group`` (its ranks' files ``OUT/started.RANK``).

The workers are torchrun's own: fresh interpreters. ``OUT/runs.json`` holds each job's exit status (1 where
torchrun raised) and what it printed on file descriptors 1 and 2 (the agent's and its workers'); the exit
status is 0 once both have run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import processes

if TYPE_CHECKING:
    import background

HERE = Path(__file__).resolve().parent

#: the run of tests/test_reliability.py's restart tests: checkpoints at steps 3 and 6; a rank killed before
#: step 5's update (tests/kill_rank.py's ``1:5``) restarts from step 3, rewrites steps 4-5 and trains step 6
TINY = ["train", "--workload", "gpt", "--size", "tiny", "--no-progress", "--variant", "1bit", "--steps", "6",
        "--eval-every", "4", "--checkpoint-every", "3"]  # fmt: skip

#: a torchrun job that builds LionCub without init_process_group: each rank waits (files) until both
#: started, so that neither is stopped by torchrun before it builds the optimizer
FORGOT_INIT = """
import os, pathlib, sys, time
import torch
from lioncub import LionCub
here = pathlib.Path(sys.argv[1])
(here / f"started.{os.environ['RANK']}").touch()
deadline = time.monotonic() + 60
while len(list(here.glob("started.*"))) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
LionCub(torch.nn.Linear(3, 1).parameters(), lr=1e-3)
print("trained alone", flush=True)
"""


def job() -> background.Subprocess:
    """The background job ``torchruns`` (tests/test_reliability.py, tests/test_topology.py)."""
    import background  # the tests' modules: not needed where this file runs the jobs

    from processes import python_cmd

    return background.Subprocess(
        lambda workdir: python_cmd(__file__, str(workdir)), 300, {**os.environ, "OMP_NUM_THREADS": "1"}
    )


def torchruns(out: Path) -> dict[str, list[str]]:
    """Each job's ``torchrun`` arguments (``python -m torch.distributed.run ARGS``)."""
    standalone = ["--standalone", "--nproc-per-node", "2"]
    script = out / "forgot_init.py"
    script.write_text(FORGOT_INIT)
    kill = [*standalone, "--max-restarts", "1", str(HERE / "kill_rank.py"), "1:5", "lioncub.cli", *TINY]
    return {
        "kill": [*kill, "--out", str(out / "torchrun")],
        "forgot_init": [*standalone, "--monitor-interval", "0.5", str(script), str(out)],
    }


def _torchrun(argv: list[str]) -> dict[str, object]:
    """``torchrun ARGV`` in this process, file descriptors 1 and 2 on one temporary file: its exit status
    and that output."""
    from torch.distributed import run

    def attempt() -> int:
        try:
            run.main(argv)
            return 0
        except Exception as exc:  # torchrun's ChildFailedError (and anything it did not expect)
            print(f"torchrun raised {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1

    return processes.output_captured(attempt)


def main(out: Path) -> int:
    runs = {name: _torchrun(argv) for name, argv in torchruns(out).items()}
    (out / "runs.json").write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
