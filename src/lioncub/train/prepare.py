"""A run directory made ready for a run under its writer's lock, and what the end of a run leaves.

:func:`prepare_run_dir` is what happens before any rank trains -- in the driver of ``lioncub train`` and
``lioncub compare``, and in rank 0 of a ``lioncub train`` that ``torchrun`` or ``lioncub launch`` started:
take the directory's writer lock (:func:`lioncub.rundir.lock_writer`), read what it holds (:func:`run_state`,
by lioncub's record: :mod:`lioncub.rundir`), check the new run or the resume against it, and only
then write ``config.json`` (a new run) or ``config.next.json`` (a resume; it becomes ``config.json`` once
the run succeeds, :func:`finish_run`). A refusal is a ``ValueError`` naming the option or the file, and
leaves the directory as it was.

Every state that lioncub can leave a run directory in can be resumed or run again:

* new, empty, or holding only a record whose ``config.json`` is gone: a new run starts; ``--resume`` is
  refused (no run);
* a run with a complete checkpoint (``checkpoints/latest`` missing or naming no complete one: the newest
  complete one, said so): ``--resume`` goes on from it; a new run is refused (``--resume``);
* a run that stopped before its first checkpoint (killed launcher, failed ranks) and has no summary: the
  same command starts it afresh (said so); ``--resume`` is refused, saying to do that; but a failed
  fault-tolerant run (its ``failure.json``) is kept whole: a new run there is refused;
* ``config.json`` changed since lioncub wrote it: refused, naming the file; files lioncub did not write:
  a new run is refused, naming them; a resume leaves them alone (and is refused if one is a symbolic link
  or replaced a file of the run).

A job's restart (``torchrun --max-restarts``, ``lioncub launch --restarts``) goes on with the run its
first attempt prepared: the record names the job (:func:`job_identity`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lioncub import env
from lioncub.rundir import (
    LOCK,
    MARKER,
    DirLock,
    Survey,
    check_out_path,
    claim,
    fsync_dir,
    lock_writer,
    read_record,
    read_run_file,
    record,
    remove_owned,
    survey,
    write_owned,
)
from lioncub.train import checkpoint
from lioncub.train.config import SETTINGS, TrainConfig
from lioncub.train.runfiles import DEEPEST, NEXT_CONFIG

#: what a failed fault-tolerant run writes beside the files it keeps (what failed, each group's exit code)
FAILURE_FILE = "failure.json"

__all__ = [
    "FAILURE_FILE",
    "FROZEN_ON_RESUME",
    "NEXT_CONFIG",
    "RunState",
    "check_resume",
    "finish_run",
    "finished_run",
    "job_identity",
    "load_saved_config",
    "prepare_run_dir",
    "run_state",
    "write_config",
]

#: what a resumed run keeps from the run it continues, besides what its checkpoint records and
#: :func:`lioncub.train.checkpoint.check_compatible` checks (workload, size, seed, variant, ranks)
FROZEN_ON_RESUME = (
    "data_mode", "overrides", "quantizer", "zero_vote", "local_steps", "outer", "outer_lr", "outer_betas",
    "inner_momentum",
)  # fmt: skip


def _stderr(text: str) -> None:
    print(f"lioncub: {text}", file=sys.stderr, flush=True)


@dataclass
class RunState:
    """What a run directory holds: the :class:`~lioncub.rundir.Survey`, its ``config.json`` when
    lioncub's (``saved``) or changed since (``edited``), its newest complete checkpoint (``meta``; or why
    none can be read: ``meta_error``) and whether lioncub wrote its ``summary.json`` (``finished``)."""

    survey: Survey
    saved: TrainConfig | None
    edited: bool
    meta: checkpoint.CheckpointMeta | None
    meta_error: str
    finished: bool


def _parse_config(path: Path) -> TrainConfig:
    """``config.json`` at ``path``; ``ValueError`` naming the file and what is wrong with it."""
    fix = "a resume reads the run's options from it; restore it, or start a new --out"
    data = read_run_file(path, follow_symlinks=True)  # a FIFO there: refused, naming it
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); {fix}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path} holds a JSON {type(doc).__name__}, not the object lioncub writes; {fix}")
    try:
        return TrainConfig.from_json(doc)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path} (not your command line): {exc}; {fix}") from None


def _edited(run_dir: Path) -> ValueError:
    return ValueError(
        f"{run_dir / 'config.json'} was changed since lioncub wrote it (its SHA-256 is not the one "
        f"{run_dir / MARKER} records): a run keeps the options it started with, and a resume reads them "
        "from that file; restore it, or start a new --out with the options you want"
    )


def run_state(run_dir: Path) -> RunState:
    """What ``run_dir`` holds (:class:`RunState`); ``ValueError`` if its ``config.json`` is lioncub's but
    cannot be read."""
    found = survey(run_dir, "run")
    saved = _parse_config(run_dir / "config.json") if "config.json" in found.owned else None
    meta, error = None, ""
    if saved is not None:
        try:
            meta = checkpoint.latest(run_dir)
        except ValueError as exc:
            error = str(exc)
    return RunState(found, saved, "config.json" in found.changed, meta, error, "summary.json" in found.owned)


def load_saved_config(run_dir: Path) -> TrainConfig | None:
    """The configuration lioncub wrote into ``run_dir`` (None if it holds none of lioncub's);
    ``ValueError`` naming the file if it was changed since or cannot be read."""
    found = survey(run_dir, "run")
    if "config.json" in found.changed:
        raise _edited(run_dir)
    return _parse_config(run_dir / "config.json") if "config.json" in found.owned else None


def write_config(run_dir: Path, name: str, config: TrainConfig) -> None:
    """Write ``config`` as ``run_dir/name`` (``config.json`` or :data:`NEXT_CONFIG`), recorded."""
    write_owned(run_dir, name, json.dumps(config.to_json(), indent=1) + "\n")


def job_identity() -> str | None:
    """The job this process is a rank of (None outside one): ``lioncub launch``'s launch id, or
    torchrun's run id with its agent (host and process), which every attempt of the job shares."""
    if launch := env.get("LIONCUB_LAUNCH_ID"):
        return f"lioncub launch {launch}"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return f"torchrun {os.environ['TORCHELASTIC_RUN_ID']} agent {socket.gethostname()}:{os.getppid()}"
    return None


def _restarted(state: RunState, job: str | None) -> bool:
    """Whether this is a restart of the job that prepared the run in the directory."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") or env.get("LIONCUB_RESTART_COUNT") or "0"
    rec = state.survey.record
    return job is not None and attempt != "0" and rec is not None and rec.job == job


def check_resume(saved: TrainConfig, config: TrainConfig, run_dir: Path) -> None:
    """``ValueError`` naming the option if ``config`` changes what a resumed run must keep
    (:data:`FROZEN_ON_RESUME`) from ``saved``, the configuration in ``run_dir``. An ``--outer-lr`` equal to
    the default of a run that has none is accepted, and ``config`` keeps the run's None."""
    if saved.optimizer.outer_lr is None and config.optimizer.outer_lr == _outer_lr(saved):
        config.optimizer.outer_lr = None  # the rule's default, given: the run keeps its own (and its name)
    saved_values, values = saved.flat(), config.flat()
    for name in FROZEN_ON_RESUME:
        old, new = saved_values[name], values[name]
        if old == new or (name == "zero_vote" and saved.optimizer.variant != config.optimizer.variant):
            continue  # another variant (which implies the zero rule) is refused by the checkpoint's check
        if name == "overrides":
            keys = sorted(k for k in {*old, *new} if old.get(k, "(default)") != new.get(k, "(default)"))
            asked = " ".join(f"{k}={new[k]!r}" if k in new else f"{k} (its default)" for k in keys)
            was = " ".join(f"{k}={old[k]!r}" if k in old else f"{k} at its default" for k in keys)
            raise ValueError(
                f"--resume: --set {asked}: the run in {run_dir} has {was}; a resumed run keeps its workload "
                "fields (start a new --out to change them)"
            )
        option = SETTINGS[name].flag
        raise ValueError(
            f"--resume: {option} {new!r}: the run in {run_dir} has {option} {old!r}; a resumed run keeps it "
            "(start a new --out to change it)"
        )


def _outer_lr(config: TrainConfig) -> float | None:
    """The outer lr a run with local steps trains with: ``outer_lr``, or its outer rule's default."""
    from lioncub.optim.local_steps import default_outer_lr

    opt = config.optimizer
    if opt.local_steps is None:
        return None
    return default_outer_lr(opt.outer, opt.local_steps) if opt.outer_lr is None else float(opt.outer_lr)


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (" …" if len(names) > 5 else "")


def _no_run(run_dir: Path) -> ValueError:
    """Why ``--resume`` finds no run, with what is wrong with a ``config.json`` that is there."""
    text = f"--resume: {run_dir} holds no lioncub run (no config.json written by lioncub)"
    path = run_dir / "config.json"
    if not path.is_file():
        return ValueError(text)
    try:
        _parse_config(path)
    except ValueError as exc:
        return ValueError(f"{text}: {exc}")
    if read_record(run_dir) is None:
        return ValueError(
            f"{text}: its config.json parses, but the directory has no lioncub record ({MARKER}). If an "
            "older lioncub wrote this run, before run directories were marked, adopt it with: "
            f"""echo '{{"kind": "run", "by": "lioncub"}}' > {run_dir / MARKER}"""
        )
    return ValueError(f"{text}: {MARKER} does not list that config.json")


def _foreign(run_dir: Path, names: list[str]) -> ValueError:
    return ValueError(
        f"--out {run_dir} holds files lioncub did not write ({_listed(names)}); give a new or empty directory"
    )


def prepare_run_dir(
    run_dir: Path,
    config: TrainConfig,
    *,
    resume: bool,
    replace: bool = False,
    job: str | None = None,
    note: Callable[[str], None] = _stderr,
) -> tuple[TrainConfig, DirLock]:
    """Take ``run_dir``'s writer lock and make it ready for ``config``: a new run (``replace``: after
    deleting a run lioncub wrote there, ``compare --overwrite``) or a ``resume``; see the module doc.
    Returns the configuration to train and the lock, which the caller holds until the ranks have exited
    and :func:`finish_run` is done. ``job``: rank 0 of a job (:func:`job_identity`). ``note`` is told
    what the user should know (a checkpoint found without ``latest``, a run started afresh)."""
    run_dir = check_out_path(run_dir, below=len(DEEPEST))
    if not resume and config.run.convert_momenta is not None:
        raise ValueError(
            f"--convert-momenta {config.run.convert_momenta}: applies only with --resume (a new run has no "
            "momenta to convert)"
        )
    if run_dir.is_dir() and read_record(run_dir) is None:  # not lioncub's: refuse before touching it
        entries = sorted(name for name in os.listdir(run_dir) if name != LOCK)
        if entries:
            raise _no_run(run_dir) if resume else _foreign(run_dir, entries)
    existed = run_dir.exists()
    lock = lock_writer(run_dir)
    try:
        state = run_state(run_dir)
        if resume:
            config = _resume(run_dir, config, state, job, note)
        else:
            _new(run_dir, config, state, job, replace, note)
    except BaseException:
        if lock.created and os.path.lexists(lock.path):
            os.unlink(lock.path)  # this call made it: leave the directory as it was
        lock.release()
        if not existed:
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise
    return config, lock


def _new(
    run_dir: Path, config: TrainConfig, state: RunState, job: str | None, replace: bool, note: Callable
) -> None:
    found = state.survey
    if state.saved is not None and _restarted(state, job):
        return  # the restarted ranks go on from the newest checkpoint
    if state.edited:
        raise ValueError(
            f"--out {run_dir} already holds a run (and {_edited(run_dir)}); choose another --out"
        )
    if state.saved is not None and replace:
        remove_owned(run_dir, keep_marker=True)  # names what lioncub did not write, and deletes nothing then
    elif state.saved is not None:
        if FAILURE_FILE in found.owned:  # a failed fault-tolerant run: kept whole, logs and results
            raise ValueError(
                f"--out {run_dir} holds a fault-tolerant run that failed ({FAILURE_FILE} says what failed; "
                "the groups' logs are in groups/); lioncub deletes none of it: choose another --out"
            )
        if state.meta is not None or state.meta_error or state.finished:
            raise ValueError(
                f"--out {run_dir} already holds a run; pass --resume to continue it, or choose another --out"
            )
        if found.foreign:
            raise _foreign(run_dir, found.foreign)
        note(
            f"{run_dir} holds a run that stopped before its first checkpoint (nothing to resume): "
            "starting it afresh"
        )
        remove_owned(run_dir, keep_marker=True)
    elif found.foreign and not (found.record is None and found.foreign == [LOCK]):
        raise _foreign(run_dir, found.foreign)
    claim(run_dir, "run", fresh=True, job=job)
    write_config(run_dir, "config.json", config)


def _resume(
    run_dir: Path, config: TrainConfig, state: RunState, job: str | None, note: Callable
) -> TrainConfig:
    found = state.survey
    if state.edited:
        raise ValueError(f"--resume: {_edited(run_dir)}")
    if state.saved is None:
        raise _no_run(run_dir)
    if not _restarted(state, job):
        _check_resume_state(run_dir, config, state, state.saved, note)
        if found.foreign:
            note(f"{run_dir}: leaving alone what lioncub did not write there: {_listed(found.foreign)}")
    claim(run_dir, "run", job=job)
    write_config(run_dir, NEXT_CONFIG, config)
    return config


def _check_resume_state(
    run_dir: Path, config: TrainConfig, state: RunState, saved: TrainConfig, note: Callable
) -> None:
    """``saved``: ``state.saved``, which a resume has."""
    found = state.survey
    bad = [p for p in found.foreign if p in found.changed or os.path.islink(run_dir / p)]
    if bad:
        raise ValueError(
            f"--resume: in {run_dir}, {_listed(bad)}: not as lioncub left it (a symbolic link, or changed "
            "since lioncub wrote it); lioncub neither writes through a link nor over a file it did not "
            "write: restore or move it"
        )
    if state.meta_error:
        raise ValueError(f"--resume: {state.meta_error}")
    if state.meta is None:
        if state.finished:
            raise ValueError(
                f"--resume: the run in {run_dir} has no checkpoint left to resume from (was checkpoints/ "
                "removed?); start a new --out"
            )
        raise ValueError(
            f"--resume: the run in {run_dir} stopped before its first checkpoint, so there is nothing to "
            "resume: run the same command without --resume to start it again"
        )
    meta = state.meta
    if meta.note:
        note(meta.note)
    check_resume(saved, config, run_dir)
    checkpoint.check_compatible(
        meta,
        variant=config.optimizer.variant,
        world_size=config.cluster.nproc,
        workload=config.run.workload,
        size=config.run.size,
        seed=config.run.seed,
        convert_momenta=config.run.convert_momenta,
        local_steps=config.optimizer.local_steps,
    )
    if config.run.stop_at is not None and config.run.stop_at <= meta.step:
        raise ValueError(f"--stop-at {config.run.stop_at}: the checkpoint is already at step {meta.step}")
    if meta.step >= config.run.steps:
        raise ValueError(f"--resume: the checkpoint is at step {meta.step}; pass --steps above it to go on")


def finish_run(run_dir: Path, ok: bool) -> None:
    """After the ranks of a run have exited (the caller holds the writer's lock): a resume's
    :data:`NEXT_CONFIG` becomes ``config.json`` if the run succeeded and is dropped if not (the run goes on
    from its previous configuration and checkpoints); a new run that failed before its first checkpoint is
    removed, so that the same command can run again (nothing is removed if anything of the user's is
    there). Nothing is done in a directory without lioncub's record."""
    if read_record(run_dir, "run") is None:
        return
    nxt = run_dir / NEXT_CONFIG
    if os.path.lexists(nxt):
        if ok:
            new = hashlib.sha256(read_run_file(nxt, follow_symlinks=True)).hexdigest()
            rec = read_record(run_dir, "run")
            before = rec.files.get("config.json", []) if rec is not None else []
            record(run_dir, files={"config.json": [*before, new]})  # either content is lioncub's meanwhile
            os.replace(nxt, run_dir / "config.json")
            fsync_dir(run_dir)
            record(run_dir, files={"config.json": [new]}, drop=[NEXT_CONFIG])
        else:
            os.unlink(nxt)
            record(run_dir, drop=[NEXT_CONFIG])
        return
    if ok:
        return
    try:
        started = checkpoint.latest(run_dir) is not None
    except ValueError:
        started = True
    if not started:
        with contextlib.suppress(ValueError):  # something of the user's appeared meanwhile: leave it all
            remove_owned(run_dir, keep_dir=True)


def finished_run(run_dir: Path) -> tuple[dict, dict] | None:
    """``(config.json, summary.json)`` of a finished run that lioncub wrote in ``run_dir`` and nobody
    changed since (None otherwise)."""
    found = survey(run_dir, "run")
    if found.changed or not {"config.json", "summary.json"} <= set(found.owned):
        return None
    try:
        saved = json.loads(read_run_file(run_dir / "config.json", follow_symlinks=True))
        summary = json.loads(read_run_file(run_dir / "summary.json", follow_symlinks=True))
    except (OSError, ValueError):
        return None
    if not (isinstance(saved, dict) and isinstance(summary, dict) and summary.get("steps_run", 0) > 0):
        return None
    return saved, summary
