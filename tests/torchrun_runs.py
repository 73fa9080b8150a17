"""The suite's two torchrun jobs, one after the other in ONE interpreter (torchrun's agent imported once:
``torch.distributed.run.main``), started in the background when collection ends (tests/background.py) as
:func:`main` in a fork of the tests' fork server (``background.Spawned``: torch already imported, the
agent's interpreter imports it no more); by hand:

    python tests/torchrun_runs.py OUT

1. ``kill``: tests/test_reliability.py's ``lioncub.cli train`` of :data:`TINY` on 2 ranks, ``--max-restarts
   1``, whose rank 1 SIGKILLs itself after the backward of step 5 in the first attempt (tests/kill_rank.py),
   into ``OUT/torchrun``;
2. ``forgot_init``: tests/test_topology.py's :data:`FORGOT_INIT` on 2 ranks, which builds LionCub without
   ``init_process_group`` (its ranks' files ``OUT/started.RANK``).

Each worker torchrun starts (``--no-python``) is lioncub's worker shim (:mod:`lioncub.launch.workers`), a
standard-library interpreter that torchrun watches, stops and restarts as its worker: it has its rank
forked, with the shim's environment (torchrun's), directory and output, from one interpreter that imported
torch and lioncub's training loop (:mod:`lioncub.launch.preload`), and exits as the rank did: the rank that
SIGKILLs itself (:data:`KILLED`, through tests/kill_rank.py) is a shim killed by SIGKILL, which is what
torchrun reports and tests/test_reliability.py checks. The restart resumes from the checkpoint whether its
ranks are forks or fresh interpreters: a fork has nothing of the first attempt. None of the 6 ranks imports
torch (~3.5 CPU-s each). ``OUT/runs.json`` holds each job's exit status (1 where torchrun
raised) and what it printed on file descriptors 1 and 2 (the agent's and its workers'); the exit status is
0 once both have run (:func:`runs` reads it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import processes

if TYPE_CHECKING:
    import background
    from lioncub.launch.workers import WorkerRelay


#: the run of tests/test_reliability.py's restart tests: checkpoints at steps 3 and 6; a rank killed before
#: step 5's update (tests/kill_rank.py's ``1:5``) restarts from step 3, rewrites steps 4-5 and trains step 6
TINY = ["train", "--workload", "gpt", "--size", "tiny", "--no-progress", "--variant", "1bit", "--steps", "6",
        "--eval-every", "4", "--checkpoint-every", "3"]  # fmt: skip

#: a torchrun job that builds LionCub without init_process_group: each rank waits (files) until both
#: started, so that neither is stopped by torchrun before it builds the optimizer
FORGOT_INIT = """
import os, pathlib, sys, time
# each line of the traceback in one write: both ranks print theirs at once on one file (with PYTHONUNBUFFERED
# set, a line went out in pieces, and the two ranks' pieces interleaved within a line)
sys.stderr.reconfigure(write_through=False, line_buffering=True)
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

#: which rank of the ``kill`` job kills itself, before which optimizer step (tests/kill_rank.py's spec)
KILLED = "1:5"


def job() -> background.Forked:
    """The background job ``torchruns`` (tests/test_reliability.py, tests/test_topology.py): :func:`main` in
    one fork of the fork server, with ``OMP_NUM_THREADS=1``; its tests read :func:`runs`."""
    import background  # the tests' modules: not needed where this file runs the jobs

    return background.Forked(main, 300, {"OMP_NUM_THREADS": "1"})


def runs(workdir: Path, proc: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    """``runs.json`` of the job that ended as ``proc`` in ``workdir``: each job's ``rc`` and ``output``; an
    AssertionError with the job's output where it wrote none."""
    path = workdir / "runs.json"
    assert path.exists(), (
        f"the torchruns job exited with {proc.returncode} and wrote no runs.json: {proc.stderr[-3000:]}"
    )
    return json.loads(path.read_text())


def torchruns(out: Path, relay: WorkerRelay) -> dict[str, list[str]]:
    """Each job's ``torchrun`` arguments (``python -m torch.distributed.run ARGS``), its workers ``relay``'s
    shims."""
    from processes import PY

    standalone = ["--standalone", "--nproc-per-node", "2"]
    train = ["lioncub.cli", *TINY, "--out", str(out / "torchrun")]
    kill = relay.command(0, [PY, "-m", "tests.kill_rank", KILLED, *train])
    forgot_init = relay.command(0, [PY, "-c", FORGOT_INIT, str(out)])
    return {
        "kill": [*standalone, "--max-restarts", "1", "--no-python", *kill],
        "forgot_init": [*standalone, "--monitor-interval", "0.5", "--no-python", *forgot_init],
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
    from lioncub.launch.preload import MODULES, lease, shared_env
    from lioncub.launch.workers import WorkerRelay

    os.chdir(Path(__file__).resolve().parents[1])  # the repository: the ranks run ``-m tests.kill_rank``
    zygote = lease(shared_env([dict(os.environ)]), os.getcwd(), (*MODULES, "lioncub.train.loop"))
    with zygote as forks, WorkerRelay(forks, str(out), [None]) as relay:
        done = {name: _torchrun(argv) for name, argv in torchruns(out, relay).items()}
    forks.close()  # now: a forked job (background.Forked) ends without running atexit, which closes it
    (out / "runs.json").write_text(json.dumps(done, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
