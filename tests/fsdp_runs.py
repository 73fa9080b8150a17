"""The runs of tests/test_fsdp_cli.py, one after another, started in the background when collection ends
(tests/background.py); root only (network namespaces):

    python tests/fsdp_runs.py OUT

GPT tiny on 2 nodes × 2 ranks behind 1 Gbit/s NICs: ``OUT/run``, the sharded run :data:`RUN`
(:data:`STEPS` steps, a checkpoint every :data:`EVERY`); ``OUT/resumed``: its copy resumed (``--resume``)
from the checkpoint at step :data:`CHECKPOINT_AT`, mid-window. ``OUT/runs.json`` holds each command's
exit status, stdout and stderr; the exit status is 1 if any failed.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
from pathlib import Path

NODES = ["--nnodes", "2", "--nproc-per-node", "2", "--link", "1gbit"]
#: local steps: windows of H
H = 2
#: two windows of H = 2: the resume from step 3 (mid-window, after the first window's outer step) trains
#: step 4, an inner step and the outer step, from what the checkpoint of the shards restored; each step of
#: the 4 ranks costs ~0.2 s of CPU
STEPS = 4
#: the one sharded run (each launch of 2 nodes costs ~15 s of the suite's CPU): local steps, H = 2, with a
#: checkpoint every 3 steps (kept: 3, mid-window, and the last, 4); the per-step vote on shards is bit for bit
#: the unsharded vote in tests/test_shards.py, the unsharded run's loss (within 1 %) and the HSDP baseline
#: are measured by hand (BENCHMARKS.md), an unsharded rank's memory is a closed form (tests/test_train.py)
RUN, EVERY, CHECKPOINT_AT = f"1bit/h{H}+fsdp", 3, 3
GPT = ["--workload", "gpt", "--size", "tiny", *NODES, "--no-progress"]


def commands(out: Path) -> list[list[str]]:
    """The CLI runs, in order: the run, then its copy resumed from the checkpoint at :data:`CHECKPOINT_AT`
    (the later ones removed, as a crash after it would leave the run)."""
    every = ["--checkpoint-every", str(EVERY)]
    return [
        [
            "train",
            "--variant",
            "1bit",
            "--local-steps",
            str(H),
            "--fsdp",
            *GPT,
            "--steps",
            str(STEPS),
            *every,
            "--out",
            str(out / "run"),
        ],
        ["train", "--resume", "--no-progress", "--out", str(out / "resumed")],
    ]


def _copy_to_resume(out: Path) -> None:
    """``out/run`` copied to ``out/resumed`` without its checkpoints after :data:`CHECKPOINT_AT`."""
    shutil.copytree(out / "run", out / "resumed", symlinks=True)
    checkpoints = out / "resumed" / "checkpoints"
    for path in checkpoints.iterdir():
        if path.name.startswith("step_") and int(path.name.removeprefix("step_")) > CHECKPOINT_AT:
            shutil.rmtree(path)
        elif path.name == "latest":
            path.unlink()


def main(out: Path) -> int:
    """The runs in this interpreter (``lioncub.cli.main``, as ``lioncub`` runs them): no interpreter of the
    CLI's own per run, and the second launch forks its ranks from the first one's zygote where it can."""
    from lioncub import cli

    done = []
    for i, argv in enumerate(commands(out)):
        if i == 1:
            _copy_to_resume(out)
        printed, errors = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
            code = cli.main(argv)
        done.append({"argv": argv, "returncode": code, "out": printed.getvalue(), "err": errors.getvalue()})
        if code:
            break
    (out / "runs.json").write_text(json.dumps(done))
    return 0 if all(d["returncode"] == 0 for d in done) else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
