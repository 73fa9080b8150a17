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

Checkpoints (``--checkpoint-every``, ``--stop-at``) are written by the groups
(:mod:`lioncub.train.replica_group`); every path they may create is recorded before the launch. A launch
over a checkpoint -- ``--resume``, or a restart of a job that lost every group (``--restarts N``) --
first puts the groups' files back to the checkpoint's step (:func:`rewind`: their logs cut back to it, the
marks and end records of the earlier launch removed, a checkpoint left incomplete removed), then starts the
groups the schedule has alive at that step, each as its life then, and carries out the rest of the
schedule (:func:`lioncub.launch.groups.schedule_after`).

A failure deletes nothing (docs/fault-tolerance.md, "When something fails"): the merged log, the groups'
logs and, where groups finished, their summary and ``model.pt`` stay, with :data:`FAILURE_FILE` saying
what failed; the exit status is :func:`job_status`'s. The driver marks the end of each group's life
(:func:`lioncub.train.replica_group.ended_name`), which groups waiting for a rejoin read.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TextIO

from lioncub.launch.config import LaunchConfig
from lioncub.launch.groups import Fault, Resumed, launch_groups, parse_faults, schedule_after
from lioncub.launch.preload import MODULES
from lioncub.launch.result import LaunchResult
from lioncub.rundir import SpecialFileError, is_marked, read_run_file, record, write_atomically, write_owned
from lioncub.train import checkpoint
from lioncub.train.config import TrainConfig
from lioncub.train.driver import (
    RANK_MODULE,
    RunOutcome,
    check_launch_options,
    format_summary,
    make_launch_config,
    preload_ranks,
    progress_title,
)
from lioncub.train.fault_settings import cpu_note
from lioncub.train.loop import summarize
from lioncub.train.memory import largest_of
from lioncub.train.prepare import FAILURE_FILE, NEXT_CONFIG, finish_run
from lioncub.train.progress import Progress
from lioncub.train.replica_group import (
    MODEL_FILE,
    checkpoint_steps,
    cut_name,
    end_name,
    ended_name,
    group_files,
    log_name,
    ready_name,
)
from lioncub.train.runlog import complete_records

__all__ = [
    "FAILURE_FILE",
    "SURVIVORS_RC",
    "UNEQUAL_RC",
    "GroupLogs",
    "fault_tolerance_summary",
    "job_status",
    "merge_group_logs",
    "resume_refusal",
    "rewind",
    "run_fault_tolerant",
]

#: what the groups of a fault-tolerant run start as
GROUP_MODULE = "lioncub.train.replica_group"
#: the exit status of a job where a group failed on its own and the others finished with equal replicas
SURVIVORS_RC = 3
#: the exit status of a job whose finished groups do not hold bitwise equal replicas
UNEQUAL_RC = 4


class GroupLogs:
    """The groups' logs as they grow: :meth:`progress` is the last step a group finished (its ``step`` or
    ``hold`` records), read incrementally; what the failure schedule waits on. A step of the group's
    ``kills`` counts once its ``hold`` record is there: the group writes that after its parts (every
    rank's) of a checkpoint of the step are on disk (a SIGKILL at the step record lost them, and the first
    participant then waited out --collective-timeout for a missing part)."""

    def __init__(self, run_dir: Path, groups: int, kills: Collection[tuple[int, int]] = ()) -> None:
        self.paths = [run_dir / log_name(g) for g in range(groups)]
        self.offsets = [0] * groups
        self.last = [0] * groups
        self.kills = set(kills)  # (group, step) of the kills still to come

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
            kind, step = rec.get("kind"), rec.get("step")
            if kind == "hold" or (kind == "step" and (group, step) not in self.kills):
                self.last[group] = max(self.last[group], int(step))
            elif kind == "step":  # a kill's step: finished once held
                self.last[group] = max(self.last[group], int(step) - 1)
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
        largest = max(r["participants"] for r in done)  # two quorums made it: the larger is the job
        done = [r for r in done if r["participants"] == largest]
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
    finished = [e for e in ends if e.get("step") == (config.run.stop_at or config.run.steps)]
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
    ``--device auto`` on a machine with CUDA a line says so. Returns how it ended: the exit status of
    :func:`job_status`, and the summary only with status 0 (with 3 or 4 it is written and printed on
    ``err``); a failed run is kept whole."""
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
        dirs, saved = checkpoint.paths(checkpoint_steps(config), cluster.nproc)
        files = [*group_files(cluster.replica_groups, faults), "log.jsonl", FAILURE_FILE, *saved]
        record(run_dir, dirs=["groups", *dirs], files=[*files, FAILURE_FILE + ".part"])
    (run_dir / "groups").mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", GROUP_MODULE, str(run_dir)]
    if (run_dir / NEXT_CONFIG).exists():
        cmd.append(str(run_dir / NEXT_CONFIG))
    launch_config = make_launch_config(
        config, cmd, timeout_s, env={"LIONCUB_PG_TIMEOUT": f"{collective_timeout_s:g}", **(env or {})}
    )
    if preload_ranks(config, [sys.executable, "-m", RANK_MODULE]):  # the groups: forks of one interpreter
        launch_config.preload = (*MODULES, "lioncub.train.loop")  # as a plain run's: one zygote
    refused = resume_refusal(config, faults, checkpoint.latest(run_dir))
    if refused is not None:  # nothing started: the run stays as it was
        print(f"lioncub train: error: {refused}", file=err, flush=True)
        finish_run(run_dir, False)
        return RunOutcome(2, refused, None)
    for attempt in range(restarts + 1):
        resumed, start = _rewind_to_latest(run_dir, config, faults, err, attempt, restarts)
        result = _attempt(launch_config, config, run_dir, resumed, start, progress, label, out, err)
        if attempt == restarts or not _lost_every_group(config, run_dir, result):
            break
        print(f"lioncub: every group was lost ({result.message})", file=err, flush=True)
    summary, entry = _merge(config, run_dir)
    code, message = job_status(result, entry)
    if summary is not None and code in (0, SURVIVORS_RC, UNEQUAL_RC):  # groups finished: their summary
        summary["fault_tolerance"]["status"] = {"exit_code": code, "message": message}
        _write(run_dir, "summary.json", json.dumps(summary, indent=1) + "\n")
    if code != 0:
        failure = {
            "exit_code": code, "message": message, "launcher": result.message,
            "group_exit_codes": result.rank_returncodes,
            "groups_finished": entry["groups_finished"] if entry else [],
            "kept": sorted(_kept(run_dir, cluster.replica_groups)),
        }  # fmt: skip
        _write(run_dir, FAILURE_FILE, json.dumps(failure, indent=1) + "\n")
        if summary is not None:  # groups finished: what they did, though the job failed
            print(format_summary(summary), file=err, flush=True)
        print(
            f"lioncub: {message}; nothing was deleted: {run_dir / FAILURE_FILE} says what failed, the "
            f"groups' logs are in {run_dir / 'groups'}",
            file=err,
            flush=True,
        )
    if code == 0 or (run_dir / NEXT_CONFIG).exists():  # a failed run is kept whole (finish_run would not)
        try:
            finish_run(run_dir, code == 0)
        except OSError as exc:
            print(f"lioncub: could not finish {run_dir} ({exc}); it stays as the groups left it", file=err)
    return RunOutcome(code, message, summary if code == 0 else None)


def _attempt(
    launch_config: LaunchConfig,
    config: TrainConfig,
    run_dir: Path,
    resumed: Resumed,
    start: int,
    progress: bool,
    label: str | None,
    out: TextIO | None,
    err: TextIO,
) -> LaunchResult:
    """One launch of the groups from step ``start`` (``resumed``: the schedule from there), with the
    progress bar, which follows the group the schedule kills least (the lowest of them)."""
    cluster = config.cluster
    kills = Counter(f.group for f in resumed.pending if f.kind == "kill")
    followed = min(range(cluster.replica_groups), key=lambda g: (kills[g], g))
    bar = None
    if progress:
        title = f"{progress_title(config, label)} (group {followed})"
        bar = Progress(run_dir / log_name(followed), title, start, config.run.steps, err)
        bar.start()
    kill_steps = {(f.group, f.step) for f in resumed.pending if f.kind == "kill"}
    logs = GroupLogs(run_dir, cluster.replica_groups, kill_steps)
    try:
        return _launch(
            launch_config,
            list(resumed.pending),
            logs.progress,
            lighthouse=cluster.lighthouse,
            out=out,
            err=err,
            ended=lambda g, life, code: _mark_end(run_dir, g, life, code),
            resumed=resumed,
        )
    finally:
        if bar is not None:
            bar.done.set()
            bar.join(timeout=5)


def _merge(config: TrainConfig, run_dir: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The groups' logs merged into ``log.jsonl`` (written), and the run's summary with its
    ``fault_tolerance`` entry (None, None: no step was logged)."""
    cluster = config.cluster
    steps, evals = merge_group_logs(run_dir, cluster.replica_groups)
    if not steps:
        return None, None
    lighthouse = cluster.lighthouse or "started for the job"
    entry, end = fault_tolerance_summary(config, run_dir, steps, lighthouse)
    params, info = (end["params"], end["info"]) if end else (0, {})
    ends = [_read_json(run_dir / end_name(g)) or {} for g in range(cluster.replica_groups)]
    memory = largest_of(e["memory"] for e in ends if "memory" in e)  # the groups that finished
    summary = summarize(config, cluster.nproc, params, info, steps, evals, None, memory)
    summary["fault_tolerance"] = entry
    ordered = sorted([*steps, *evals], key=lambda r: (r["step"], r["kind"] == "eval"))
    _write(run_dir, "log.jsonl", "".join(json.dumps(r) + "\n" for r in ordered))
    return summary, entry


def _launch(
    config: LaunchConfig,
    faults: list[Fault],
    progress: Callable[[int], int],
    *,
    lighthouse: str | None,
    out: TextIO | None,
    err: TextIO,
    ended: Callable[[int, int, int], None],
    resumed: Resumed | None = None,
) -> LaunchResult:
    """:func:`lioncub.launch.groups.launch_groups`, its failures to start (the lighthouse, the emulated
    network) as a failed launch naming them, so that the run is kept and says what failed."""
    try:
        return launch_groups(
            config, faults, progress, lighthouse=lighthouse, out=out, err=err, ended=ended, resumed=resumed
        )
    except (RuntimeError, OSError) as exc:  # NetnsError, a lighthouse that did not start, no fork
        message = f"the launch failed: {exc}"
        print(f"lioncub: {message}", file=err, flush=True)
        return LaunchResult(1, [], None, message, 0.0, 0, False, None, "", None)


def resume_refusal(
    config: TrainConfig, faults: list[Fault], meta: checkpoint.CheckpointMeta | None
) -> str | None:
    """Why the job cannot go on from the checkpoint ``meta`` (None: it can, or there is none): one a run
    without ``--fault-tolerant`` wrote (its ranks' state, not each group's), or a schedule whose events up to
    its step differ from those the checkpoint's run carried out (the groups' lives there follow from them;
    later events may change)."""
    if meta is None:
        return None
    ft = meta.extra.get("fault_tolerant")
    if not isinstance(ft, dict):
        return (
            f"--resume --fault-tolerant: checkpoint {meta.path} was written by a run without "
            "--fault-tolerant (its ranks' state, not each replica group's): resume it without it"
        )
    cluster, run = config.cluster, config.run
    try:
        saved = parse_faults(ft.get("kill", []), ft.get("rejoin", []), cluster.replica_groups, run.steps,
                             config.optimizer.local_steps)  # fmt: skip
    except ValueError:
        saved = []
    before, now = ([f.spec for f in s if f.step <= meta.step] for s in (saved, faults))
    if before == now:
        return None
    return (
        f"--resume with {' '.join(now) or 'no --kill/--rejoin'}: the run of checkpoint {meta.path} carried "
        f"out {' '.join(before) or 'no --kill/--rejoin'} up to its step {meta.step}, and the groups' lives "
        "there follow from them: keep those events (the ones after it may change)"
    )


def _rewind_to_latest(
    run_dir: Path, config: TrainConfig, faults: list[Fault], err: TextIO, attempt: int, restarts: int
) -> tuple[Resumed, int]:
    """Before launch ``attempt`` (0: the first; then a restart of ``restarts``): the newest complete
    checkpoint's step (0: none), the groups' files rewound to it (:func:`rewind`), and the schedule seen
    from it. A restart says where it starts from, and so does a resume."""
    meta = checkpoint.latest(run_dir)
    step = meta.step if meta is not None else 0
    groups = config.cluster.replica_groups
    if attempt:
        where = f"its newest complete checkpoint, {meta.path}" if meta is not None else "step 0 (none)"
        text = f"restart {attempt} of {restarts} (--restarts): the job goes on from {where}"
        print(f"lioncub: {text}", file=err, flush=True)
    elif meta is not None:  # --resume (as a plain run says it; a checkpoint found past `latest` said so)
        print(f"lioncub: resumed from {meta.path} at step {step}", file=err, flush=True)
    rewind(run_dir, step, groups, config.cluster.nproc, lambda text: print(f"lioncub: {text}", file=err))
    return schedule_after(faults, groups, step), step


def rewind(run_dir: Path, step: int, groups: int, world_size: int, log: Callable[[str], None]) -> None:
    """Put the groups' files of ``run_dir`` back to the checkpoint of ``step`` for a launch over it: each
    group's log keeps its records up to ``step`` (a heal's, before it: a heal logged at ``step`` came at
    the quorum after it), the records after it are appended to ``groups/gG.cut.jsonl`` (kept, not
    deleted); the marks and end records of the launch before (:func:`ready_name`, :func:`ended_name`,
    :func:`end_name`) are removed, and so is a checkpoint that was left incomplete (``.tmp_step_*``)."""
    for g in range(groups):
        path = run_dir / log_name(g)
        if os.path.lexists(path):
            records, cut = complete_records(path)
            if cut is not None:
                log(f"{path}: line {cut} is not a whole record (cut when the group died); it is dropped")
            kept: list[bytes] = []
            dropped: list[bytes] = []
            for line, rec in records:
                limit = step - 1 if rec.get("kind") == "heal" else step
                (kept if isinstance(rec.get("step"), int) and rec["step"] <= limit else dropped).append(line)
            if dropped:
                with open(run_dir / cut_name(g), "ab") as f:
                    f.write(b"".join(line + b"\n" for line in dropped))
            write_atomically(path, b"".join(line + b"\n" for line in kept))
        marks = [n for life in range(_lives(run_dir, g)) for n in (ready_name(g, life), ended_name(g, life))]
        for name in [*marks, end_name(g)]:
            if os.path.isfile(run_dir / name) and not os.path.islink(run_dir / name):
                os.unlink(run_dir / name)
    try:
        checkpoint.drop_incomplete(run_dir, world_size)
    except ValueError as exc:  # files of the user's in it: they stay, and so does the directory
        log(str(exc))


def _lives(run_dir: Path, group: int) -> int:
    """One more than the highest life of ``group`` whose marks are in ``run_dir`` (0: none)."""
    lives = [
        int(p.name.rsplit(kind, 1)[1])
        for kind in ("ready", "ended")
        for p in (run_dir / "groups").glob(f"g{group}.{kind}*")
        if p.name.rsplit(kind, 1)[1].isdigit()
    ]
    return max(lives, default=-1) + 1


def _lost_every_group(config: TrainConfig, run_dir: Path, result: LaunchResult) -> bool:
    """Whether the launch ended with every group lost: it failed (not by a timeout or a signal to the
    launcher) and no group finished (``--stop-at`` included), so that ``--restarts`` relaunches it."""
    if result.ok or result.timed_out or result.interrupted_by:
        return False
    end = config.run.stop_at or config.run.steps
    ends = [_read_json(run_dir / end_name(g)) for g in range(config.cluster.replica_groups)]
    return not any(e is not None and e.get("step") == end for e in ends)


def _mark_end(run_dir: Path, group: int, life: int, code: int) -> None:
    """Life ``life`` of group ``group`` ended with ``code``: its mark (:func:`ended_name`), which the groups
    waiting for it to start again read."""
    write_atomically(run_dir / ended_name(group, life), f"{code}\n")


def _write(run_dir: Path, name: str, text: str) -> None:
    """Write ``name`` into the run directory (recorded where the directory is lioncub's)."""
    if is_marked(run_dir):
        write_owned(run_dir, name, text)
    else:
        (run_dir / name).write_text(text)


def _kept(run_dir: Path, groups: int) -> list[str]:
    """What a failed run holds for its reader (a failure deletes nothing): the merged log, the model, the
    summary, the groups' logs and end records, those that exist."""
    names = ["log.jsonl", MODEL_FILE, "summary.json"]
    names += [n for g in range(groups) for n in (log_name(g), end_name(g))]
    return [n for n in names if (run_dir / n).is_file()]


def job_status(result: LaunchResult, entry: dict[str, Any] | None) -> tuple[int, str]:
    """The exit status of a fault-tolerant job and what it says (docs/fault-tolerance.md, "Exit status"):
    0 when every group ended as the schedule said and the groups that finished hold bitwise equal replicas;
    :data:`SURVIVORS_RC` when a group failed on its own (not by the schedule) but the others finished with
    equal replicas (their results are kept); :data:`UNEQUAL_RC` when the groups that finished do not hold
    equal replicas; otherwise the launcher's code (a timeout, a signal; 1 if it said 0 and no group
    finished)."""
    done = list(entry["groups_finished"]) if entry else []
    groups = ", ".join(map(str, done))
    if done and not (entry and entry["replicas_equal"]):
        return UNEQUAL_RC, f"the replicas of the groups that finished ({groups}) are NOT bitwise equal"
    if result.ok and done:
        return 0, result.message
    if done and result.failed_rank is not None and not result.timed_out and not result.interrupted_by:
        survivors = (
            f"group {groups} finished" if len(done) == 1 else f"groups {groups} finished with equal replicas"
        )
        return SURVIVORS_RC, f"{result.message}; {survivors}"
    if result.ok:
        return 1, "no group finished the run"
    return result.returncode, result.message
