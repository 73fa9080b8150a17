"""The launched runs of tests/test_run_ownership.py, one after the other in ONE interpreter (one zygote for
every launch's ranks), started in the background when collection ends (tests/background.py):

    python tests/ownership_runs.py OUT

1. ``OUT/finished``: the ranks of ``lioncub launch --nproc 2 --preload ... -- -m lioncub.cli train``
   (:data:`FINISHED`, no driver) prepare a run of the tiny GPT: 3 steps, checkpoints at 2 and 3;
2. ``OUT/again/run``: a copy of it, with the user's ``OUT/again/outside/thesis.tex``; the same launch again
   (which must be refused, writing nothing);
3. ``OUT/resumed/run``: another copy, with the user's files ``checkpoints/exported_best.pt`` and
   ``checkpoints/step_00000002/notes.txt`` and ``OUT/resumed/outside/thesis.tex``; the same launch with
   ``--resume --steps 5``.

Each launch's exit code and output (stdout and stderr together) are in ``OUT/launches.json``; the exit
status is 0 once all three have run.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

RUN = ["--workload", "gpt", "--size", "tiny", "--set", "batch_size=4", "--eval-every", "0", "--no-progress"]
FINISHED = [*RUN, "--steps", "3", "--checkpoint-every", "1", "--diagnostics-every", "1"]
#: the bytes of every file of the user's that the runs must leave alone
THESIS = b"irreplaceable\n"


def launch_argv(out: Path, *extra: str) -> list[str]:
    """``lioncub launch --nproc 2 --preload ... -- -m lioncub.cli train FINISHED --out OUT EXTRA``: the
    ranks (forks of one interpreter that imported torch and the training loop once) run ``lioncub train``."""
    from lioncub.launch.preload import MODULES

    preload = ",".join((*MODULES, "lioncub.train.loop"))
    return ["launch", "--nproc", "2", "--preload", preload, "--", "-m", "lioncub.cli", "train", *FINISHED,
            "--out", str(out), *extra]  # fmt: skip


def _launch(argv: list[str]) -> dict[str, object]:
    """``lioncub ARGV`` in this process, its file descriptors 1 and 2 (the launcher's and the ranks'
    output) on one temporary file: its exit code and that output."""
    from lioncub import cli

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 1)
        os.dup2(captured.fileno(), 2)
        try:
            rc = cli.main(argv)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
        captured.seek(0)
        return {"rc": rc, "output": captured.read().decode(errors="replace")}


def _copy_with_user_files(finished: Path, root: Path) -> Path:
    run = root / "run"
    shutil.copytree(finished, run, symlinks=True)
    (root / "outside").mkdir()
    (root / "outside" / "thesis.tex").write_bytes(THESIS)
    return run


def main(out: Path) -> int:
    launches = {"finished": _launch(launch_argv(out / "finished"))}
    if launches["finished"]["rc"] == 0:
        again = _copy_with_user_files(out / "finished", out / "again")
        launches["again"] = _launch(launch_argv(again))
        resumed = _copy_with_user_files(out / "finished", out / "resumed")
        (resumed / "checkpoints" / "exported_best.pt").write_bytes(THESIS)
        (resumed / "checkpoints" / "step_00000002" / "notes.txt").write_bytes(THESIS)
        launches["resumed"] = _launch(launch_argv(resumed, "--resume", "--steps", "5"))
    (out / "launches.json").write_text(json.dumps(launches, indent=1))
    return 0 if len(launches) == 3 else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
