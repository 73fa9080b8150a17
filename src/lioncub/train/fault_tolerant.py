"""The driver of a fault-tolerant run (``lioncub train --fault-tolerant``): every rank (with ``--nnodes``
every node of ``--nproc-per-node`` ranks) one replica group (:mod:`lioncub.train.replica_group`),
launched with the failure schedule by :func:`lioncub.launch.groups.launch_groups`; then the groups' logs
merged into the run's ``log.jsonl`` and its ``summary.json``.

The merged log has one ``step`` record per step of the run, that of the lowest-numbered group whose step
it was (``groups``: the groups that ran it), with ``loss`` the mean of their training losses,
``participants`` the quorum's size and ``committed`` whether it was applied (a step that was not is
skipped, never applied twice). An ``eval`` record is the lowest group's, with ``replicas_agree``: whether
every group that evaluated then scored the same. The summary adds ``fault_tolerance``: the steps run with
each number of participants, the steps skipped, every heal (when, which group, from whom, bytes,
seconds), the schedule, and whether the replicas of the groups that finished were bitwise equal at the
end (their parameters' digests, and in a group of several ranks whether its ranks held the same).
``memory`` (:mod:`lioncub.train.memory`) is the largest over the ranks of the groups that finished.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

from lioncub.launch.groups import launch_groups, parse_faults
from lioncub.launch.preload import MODULES
from lioncub.rundir import SpecialFileError, is_marked, read_run_file, record, write_owned
from lioncub.train.config import TrainConfig
from lioncub.train.driver import (
    RANK_MODULE,
    RunOutcome,
    check_launch_options,
    make_launch_config,
    preload_ranks,
)
from lioncub.train.fault_settings import cpu_note
from lioncub.train.loop import summarize
from lioncub.train.memory import largest_of
from lioncub.train.prepare import NEXT_CONFIG, finish_run
from lioncub.train.progress import Progress
from lioncub.train.replica_group import end_name, group_files, log_name
from lioncub.train.runlog import complete_records

__all__ = ["GroupLogs", "fault_tolerance_summary", "merge_group_logs", "run_fault_tolerant"]

#: what the groups of a fault-tolerant run start as
GROUP_MODULE = "lioncub.train.replica_group"


class GroupLogs:
    """The groups' logs as they grow: :meth:`progress` is the last step a group finished (its ``step`` or
    ``hold`` records), read incrementally; what the failure schedule waits on."""

    def __init__(self, run_dir: Path, groups: int) -> None:
        self.paths = [run_dir / log_name(g) for g in range(groups)]
        self.offsets = [0] * groups
        self.last = [0] * groups

    def progress(self, group: int) -> int:
        path = self.paths[group]
        try:
            with open(path, "rb") as f:
                f.seek(self.offsets[group])
                chunk = f.read()
        except FileNotFoundError:
            return self.last[group]
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offsets[group] += len(complete)
        for line in complete.splitlines():
            rec = json.loads(line)
            if rec.get("kind") in ("step", "hold"):
                self.last[group] = max(self.last[group], int(rec["step"]))
        return self.last[group]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(read_run_file(path, follow_symlinks=True))
    except (OSError, ValueError, SpecialFileError):
        return None


def merge_group_logs(run_dir: Path, groups: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The run's ``step`` and ``eval`` records from the groups' logs (module docstring), by step."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    evals: dict[int, list[dict[str, Any]]] = {}
    for g in range(groups):
        path = run_dir / log_name(g)
        if not path.exists():
            continue
        for _, rec in complete_records(path)[0]:
            if rec.get("kind") == "step" and rec.get("committed") is not None:
                by_step.setdefault(rec["step"], []).append(rec)
            elif rec.get("kind") == "eval":
                evals.setdefault(rec["step"], []).append(rec)
    steps = []
    for step in sorted(by_step):
        recs = by_step[step]
        done = [r for r in recs if r["committed"]] or recs  # a skipped step: every participant's put back
        chosen = min(done, key=lambda r: r["group"])
        merged = {k: v for k, v in chosen.items() if k != "group"}
        merged["loss"] = sum(r["loss"] for r in done) / len(done)
        merged["groups"] = sorted(r["group"] for r in done)
        steps.append(merged)
    merged_evals = []
    for step in sorted(evals):
        recs = evals[step]
        chosen = {k: v for k, v in min(recs, key=lambda r: r["group"]).items() if k != "group"}
        scores = {
            json.dumps({k: v for k, v in r.items() if k.startswith("val_")}, sort_keys=True) for r in recs
        }
        chosen["groups"] = sorted(r["group"] for r in recs)
        chosen["replicas_agree"] = len(scores) == 1
        merged_evals.append(chosen)
    return steps, merged_evals


def fault_tolerance_summary(
    config: TrainConfig, run_dir: Path, steps: list[dict[str, Any]], lighthouse: str | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The ``fault_tolerance`` entry of the summary (module docstring) and one finished group's end
    record (its parameter count and workload info), None if none finished."""
    cluster = config.cluster
    ends = [e for g in range(cluster.replica_groups) if (e := _read_json(run_dir / end_name(g))) is not None]
    finished = [e for e in ends if e.get("step") == config.run.steps]
    digests = {e["digest"] for e in finished}
    heals = []  # each group's log has its heals, also a group's that was killed later
    for g in range(cluster.replica_groups):
        if (run_dir / log_name(g)).exists():
            heals += [
                rec for _, rec in complete_records(run_dir / log_name(g))[0] if rec.get("kind") == "heal"
            ]
    heals = sorted(
        ({k: v for k, v in h.items() if k != "kind"} for h in heals), key=lambda h: (h["step"], h["group"])
    )
    committed = Counter(str(r["participants"]) for r in steps if r["committed"])
    entry = {
        "participants": dict(sorted(committed.items(), key=lambda kv: -int(kv[0]))),
        "skipped_steps": sum(1 for r in steps if not r["committed"]),
        "heals": heals,
        "kill": list(cluster.kill),
        "rejoin": list(cluster.rejoin),
        "momentum_on_heal": cluster.momentum_on_heal,
        "groups_finished": sorted(e["group"] for e in finished),
        "replicas_equal": bool(finished) and len(digests) == 1 and all(e["ranks_equal"] for e in finished),
        "digest": digests.pop() if len(digests) == 1 else None,  # SHA-256 of the final parameters
        "lighthouse": lighthouse,
    }
    first = finished or ends
    return entry, first[0] if first else None


def run_fault_tolerant(
    config: TrainConfig,
    run_dir: Path,
    *,
    timeout_s: float | None,
    progress: bool,
    label: str | None,
    collective_timeout_s: float,
    out: TextIO | None = None,
    err: TextIO | None = None,
    restarts: int = 0,
    env: dict[str, str] | None = None,
) -> RunOutcome:
    """What :func:`lioncub.train.driver.run_training` is for a ``--fault-tolerant`` run: launch the groups
    with the schedule, merge their logs, write ``log.jsonl`` and ``summary.json``, finish the run directory.
    The groups train on the CPU (``--device cuda`` was refused by the configuration's check); with
    ``--device auto`` on a machine with CUDA a line says so. Returns how it ended."""
    check_launch_options(restarts, collective_timeout_s, fault_tolerant=True)
    err = err or sys.stderr
    note = cpu_note(config)
    if note is not None:
        print(f"lioncub: {note}", file=err, flush=True)
    cluster, run = config.cluster, config.run
    faults = parse_faults(
        cluster.kill, cluster.rejoin, cluster.replica_groups, run.steps, config.optimizer.local_steps
    )
    if is_marked(run_dir):
        record(run_dir, dirs=["groups"], files=[*group_files(cluster.replica_groups, faults), "log.jsonl"])
    (run_dir / "groups").mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", GROUP_MODULE, str(run_dir)]
    if (run_dir / NEXT_CONFIG).exists():
        cmd.append(str(run_dir / NEXT_CONFIG))
    launch_config = make_launch_config(
        config, cmd, timeout_s, env={"LIONCUB_PG_TIMEOUT": f"{collective_timeout_s:g}", **(env or {})}
    )
    if preload_ranks(config, [sys.executable, "-m", RANK_MODULE]):  # the groups: forks of one interpreter
        launch_config.preload = (*MODULES, "lioncub.train.loop")  # as a plain run's: one zygote
    # the bar follows the group the schedule kills least (the lowest of them)
    kills = Counter(f.group for f in faults if f.kind == "kill")
    followed = min(range(cluster.replica_groups), key=lambda g: (kills[g], g))
    bar = None
    if progress:
        title = f"{label or config.optimizer.variant} (group {followed})"
        bar = Progress(run_dir / log_name(followed), title, 0, run.steps, err)
        bar.start()
    logs = GroupLogs(run_dir, cluster.replica_groups)
    try:
        result = launch_groups(
            launch_config, faults, logs.progress, lighthouse=cluster.lighthouse, out=out, err=err
        )
    finally:
        if bar is not None:
            bar.done.set()
            bar.join(timeout=5)
    steps, evals = merge_group_logs(run_dir, cluster.replica_groups)
    summary = None
    if steps:
        lighthouse = cluster.lighthouse or "started for the job"
        entry, end = fault_tolerance_summary(config, run_dir, steps, lighthouse)
        params, info = (end["params"], end["info"]) if end else (0, {})
        ends = [_read_json(run_dir / end_name(g)) or {} for g in range(cluster.replica_groups)]
        memory = largest_of(e["memory"] for e in ends if "memory" in e)  # the groups that finished
        summary = summarize(config, cluster.nproc, params, info, steps, evals, None, memory)
        summary["fault_tolerance"] = entry
        ordered = sorted([*steps, *evals], key=lambda r: (r["step"], r["kind"] == "eval"))
        log_text = "".join(json.dumps(r) + "\n" for r in ordered)
        summary_text = json.dumps(summary, indent=1) + "\n"
        if is_marked(run_dir):
            write_owned(run_dir, "log.jsonl", log_text)
            if result.ok:
                write_owned(run_dir, "summary.json", summary_text)
        else:
            (run_dir / "log.jsonl").write_text(log_text)
            if result.ok:
                (run_dir / "summary.json").write_text(summary_text)
    try:
        finish_run(run_dir, result.ok)
    except OSError as exc:
        print(f"lioncub: could not finish {run_dir} ({exc}); it stays as the groups left it", file=err)
    return RunOutcome(result.returncode, result.message, summary if result.ok else None)
