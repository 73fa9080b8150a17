"""The end-to-end runs of tests/test_replica_groups_cli.py, one after the other in ONE process (one
import of torch, one preloaded interpreter for every group), started in the background when collection
ends (tests/background.py; :func:`run_job`, a fork of the worker pool's fork server), or by hand:

    python tests/ft_runs.py OUT [NODES]

Each run ``NAME`` of :data:`RUNS` trains into ``OUT/<slug>`` (:func:`slug`) with its stdout and stderr in
``OUT/<slug>.out``; the exit status is the number of runs that failed.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

#: the tiny GPT with 4 sequences a batch (16 by default) and 32 validation windows (128): the checks compare
#: runs of the same settings with each other, or count steps, groups, seconds waited and parameter bytes
TINY = ["--workload", "gpt", "--size", "tiny", "--set", "batch_size=4", "--set", "eval_windows=32"]
TINY += ["--no-progress"]
KILL_REJOIN = ["--kill", "1@4", "--rejoin", "1@9"]
THREE = ["--nproc", "3", "--steps", "24", "--eval-every", "8"]
#: torchft's DiLoCo and lioncub's outer="diloco" with the inner momenta kept, 2 groups, no weight decay
PEER = ["--nproc", "2", "--steps", "16", "--eval-every", "8", "--local-steps", "4", "--set", "weight_decay=0"]
#: name -> the options of ``lioncub train --fault-tolerant`` (besides the tiny GPT and --out)
RUNS = {
    "1bit": ["--variant", "1bit", *THREE, *KILL_REJOIN],
    "1bit/h4": ["--variant", "1bit", "--local-steps", "4", *THREE, *KILL_REJOIN],
    "1bit, again": ["--variant", "1bit", *THREE, *KILL_REJOIN],
    "1bit, no kill": ["--variant", "1bit", *THREE],
    "1bit/h4, no kill": ["--variant", "1bit", "--local-steps", "4", *THREE],
    "torchft-diloco": ["--variant", "torchft-diloco", *PEER],
    "diloco/keep": ["--variant", "32bit", "--outer", "diloco", "--inner-momentum", "keep", *PEER],
}
#: a straggler: group 1 SIGSTOPped after its step 10 until group 0 has finished (past --collective-timeout:
#: group 0 trains on alone and finishes); woken, group 1 is alone in its quorum after group 0 finished and
#: stops. The job exits 3 (a group failed, the survivor finished), keeping every file (:func:`stall`). The
#: timeout is waited out once, so it is short: 3 s, above the 2 s after which the launcher's lighthouse
#: drops a group without heartbeats (the quorum after the timed-out step leaves group 1 out)
STRAGGLER_TIMEOUT_S = 3
STRAGGLER = ["--variant", "1bit", "--nproc", "2", "--steps", "30"]
STRAGGLER += ["--collective-timeout", str(STRAGGLER_TIMEOUT_S)]
RUNS["straggler"] = STRAGGLER
#: checkpoints (docs/fault-tolerance.md, "Checkpoints, resume, restarts"): local steps H = 2, group 1 killed
#: after step 2 and started again at step 3 (it joins at the window after step 4), a checkpoint every 4 steps
CKPT = ["--variant", "1bit", "--nproc", "3", "--steps", "12", "--eval-every", "4", "--local-steps", "2"]
CKPT += ["--checkpoint-every", "4", "--kill", "1@2", "--rejoin", "1@3"]
RUNS["checkpoints"] = CKPT
RUNS["checkpoints, stopped"] = [*CKPT, "--stop-at", "6"]
#: resumed in the stopped run's directory (:data:`RESUMES`; what the stop left is copied to
#: ``<slug>.at_stop`` first) from the checkpoint of step 4, that of step 6 made incomplete (its meta.json
#: removed): group 1 has no part in it (it joined after step 4) and heals from the others; every group of the
#: resumed job is SIGKILLed once it finished step 9 (:func:`kill_all`), and --restarts 1 relaunches the job
#: from the checkpoint of step 8
RUNS["checkpoints, resumed"] = ["--resume", "--restarts", "1", "--no-progress"]
#: a run -> the earlier run whose directory it resumes
RESUMES = {"checkpoints, resumed": "checkpoints, stopped"}
#: the exit status each run ends with (0 if not named)
EXPECTED_RC = {"straggler": 3}
#: 2 emulated nodes of 2 ranks, each node a group (DDP inside), node 1 SIGKILLed after step 8 and started
#: again at step 16: root only (network namespaces), run when ``NODES`` is given
NODES = ["--variant", "1bit", "--nnodes", "2", "--nproc-per-node", "2", "--link", "1gbit", "--steps", "24"]
NODES += ["--eval-every", "12", "--kill", "1@8", "--rejoin", "1@16"]
#: the same with each node's ranks sharding the model (FSDP2), healing shard by shard, a checkpoint every 8
#: steps (each rank's part its shards), stopped after step 20 (node 1 back since step 17), then resumed
#: (:data:`RESUMES`) to step 24: the sharded run whose bits are held to those of ``nodes`` (root only too)
NODES_FSDP = [*NODES, "--fsdp", "--checkpoint-every", "8"]
NODES_RUNS = {
    "nodes": NODES,
    "nodes, fsdp, stopped": [*NODES_FSDP, "--stop-at", "20"],
    "nodes, fsdp, resumed": ["--resume", "--no-progress"],
}
RESUMES["nodes, fsdp, resumed"] = "nodes, fsdp, stopped"


def slug(name: str) -> str:
    """A run's directory name: ``1bit/h4, no kill`` -> ``1bit_h4_no_kill``."""
    return name.replace("/", "_").replace(", ", "_").replace(" ", "_")


def stall(run_dir: Path, group: int, after: int, until: int, deadline_s: float = 300.0) -> None:
    """SIGSTOP group ``group`` once its log has step ``after``, SIGCONT it once group ``until`` has
    finished (its end record), each within ``deadline_s`` (the group's pid: its ready mark)."""
    import json
    import os
    import signal
    import time

    log, end = run_dir / "groups" / f"g{group}.jsonl", run_dir / "groups" / f"g{until}.end.json"
    deadline = time.monotonic() + deadline_s

    def reached() -> bool:
        lines = log.read_text().splitlines() if log.exists() else []
        return any(json.loads(x).get("kind") == "step" and json.loads(x)["step"] >= after for x in lines[:-1])

    while not reached() and time.monotonic() < deadline:
        time.sleep(0.02)
    pid = int((run_dir / "groups" / f"g{group}.ready0").read_text())
    os.kill(pid, signal.SIGSTOP)
    try:
        while not end.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.kill(pid, signal.SIGCONT)


def kill_all(run_dir: Path, after: int, saved: int, deadline_s: float = 300.0) -> None:
    """SIGKILL every group of the job in ``run_dir`` (the pids of their ready marks) once group 0's log has
    a step record above ``after - 1`` and the checkpoint of step ``saved`` is complete, within
    ``deadline_s``."""
    import json
    import os
    import signal
    import time

    log, deadline = run_dir / "groups" / "g0.jsonl", time.monotonic() + deadline_s

    def reached() -> bool:
        lines = log.read_text().splitlines() if log.exists() else []
        return any(json.loads(x).get("kind") == "step" and json.loads(x)["step"] >= after for x in lines[:-1])

    meta = run_dir / "checkpoints" / f"step_{saved:08d}" / "meta.json"
    while not (reached() and meta.exists()) and time.monotonic() < deadline:
        time.sleep(0.01)
    for mark in (run_dir / "groups").glob("g*.ready*"):
        with contextlib.suppress(ValueError, ProcessLookupError):
            os.kill(int(mark.read_text()), signal.SIGKILL)


def main(out: Path, nodes: bool) -> int:
    import shutil
    import threading

    from lioncub import cli

    failed = 0
    for name, args in {**RUNS, **(NODES_RUNS if nodes else {})}.items():
        run_dir = out / slug(RESUMES.get(name, name))
        argv = ["train", *TINY, "--fault-tolerant", "--out", str(run_dir), *args]
        if name in RESUMES:
            argv = ["train", "--out", str(run_dir), *args]
        if name == "checkpoints, resumed":
            shutil.copytree(run_dir, out / f"{slug(RESUMES[name])}.at_stop")
            (run_dir / "checkpoints" / "step_00000006" / "meta.json").unlink()
            threading.Thread(target=kill_all, args=(run_dir, 9, 8), daemon=True).start()
        if name == "straggler":
            threading.Thread(target=stall, args=(out / slug(name), 1, 10, 0), daemon=True).start()
        with (
            open(out / f"{slug(name)}.out", "w") as log,
            contextlib.redirect_stdout(log),
            contextlib.redirect_stderr(log),
        ):
            rc = cli.main(argv)
        failed += rc != EXPECTED_RC.get(name, 0)
    return failed


def run_job(rank: int, world: int, workdir: Path, nodes: bool) -> None:
    """``background.Spawned``'s target: :func:`main` into ``workdir``, in this fork of the worker pool's
    fork server (torch already imported, where an interpreter of its own imported it again, ~1.5 CPU-s);
    the exit code is the number of runs that failed, and what the process prints besides the runs' own
    output (a traceback) is in ``workdir/job.out``."""
    import os
    import traceback

    with open(workdir / "job.out", "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    try:
        failed = main(workdir, nodes)
    except BaseException:
        traceback.print_exc()
        raise
    raise SystemExit(failed)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:] == ["NODES"]))
