"""The runs of tests/test_fsdp_cli.py, one after another, started in the background when collection ends
(tests/background.py); root only (network namespaces):

    python tests/fsdp_runs.py OUT

GPT tiny on 2 nodes × 2 ranks behind 1 Gbit/s NICs: ``OUT/cmp``, ``lioncub compare`` of :data:`RUNS`
(:data:`STEPS` steps); ``OUT/resumed``: the
sharded local-steps run stopped with a checkpoint mid-window (``--checkpoint-every``, ``--stop-at``) and
resumed (``--resume``). ``OUT/runs.json`` holds each command's exit status, stdout and stderr; the exit
status is 1 if any failed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from processes import python

NODES = ["--nnodes", "2", "--nproc-per-node", "2", "--link", "1gbit"]
STEPS = 24
#: the compared runs: the nodes voting on their shards, every step and with local steps (each launch of 2
#: nodes costs ~15 s of the suite's CPU: the unsharded run's loss and the HSDP baseline are measured by hand,
#: BENCHMARKS.md; an unsharded rank's memory is a closed form, tests/test_train.py)
RUNS = ("1bit+fsdp", "1bit/h4+fsdp")
#: the run stopped mid-window (H = 4: windows end at 8 and 12) and resumed
RESUMED, STOP_AT = "1bit/h4+fsdp", 10
GPT = ["--workload", "gpt", "--size", "tiny", *NODES, "--no-progress"]


def commands(out: Path) -> list[list[str]]:
    """The CLI runs, in order."""
    resumed = ["--out", str(out / "resumed")]
    stop = ["--checkpoint-every", str(STOP_AT), "--stop-at", str(STOP_AT)]
    return [
        ["compare", "--variants", ",".join(RUNS), *GPT, "--steps", str(STEPS), "--out", str(out / "cmp")],
        [
            "train",
            "--variant",
            "1bit",
            "--local-steps",
            "4",
            "--fsdp",
            *GPT,
            "--steps",
            str(STEPS),
            *stop,
            *resumed,
        ],
        ["train", "--resume", "--no-progress", *resumed],
    ]


def main(out: Path) -> int:
    done = []
    for argv in commands(out):
        proc = python("-m", "lioncub.cli", *argv, timeout=300)
        done.append({"argv": argv, "returncode": proc.returncode, "out": proc.stdout, "err": proc.stderr})
        if proc.returncode:
            break
    (out / "runs.json").write_text(json.dumps(done))
    return 0 if all(d["returncode"] == 0 for d in done) else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
