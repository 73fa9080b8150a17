"""Checkpoints of a data-parallel run whose ranks each keep their own optimizer state.

Layout under the run directory::

    checkpoints/step_00000200/meta.json     version, step, variant, world size, workload, seed
                             /model.pt      the model once (rank 0; replicas are identical)
                             /rank0.pt ...  per rank: optimizer state (own momentum, step counter and
                                            so the 1-bit tie-rule phase), RNG states, data position
                             /shards/       a sharded run (``--fsdp``): the model and optimizer state as
                                            torch.distributed.checkpoint writes them, each rank its shard
                                            (``__R_0.distcp``, ``.metadata``); ``rankN.pt`` then holds no
                                            optimizer state, ``model.pt`` the gathered whole model
    checkpoints/latest                      name of the newest complete checkpoint

A fault-tolerant run (``lioncub train --fault-tolerant``, :mod:`lioncub.train.replica_group`) writes the
same layout with ``rank{k}.pt`` for the job's rank k of every group in the committing quorum (a group
absent from it has no file; ``meta.json``'s ``fault_tolerant`` says which were there). Its groups have no
barrier between them: each writes its part (:func:`encode`, :func:`write_part`, from a background
thread), and the first participant of the quorum completes the checkpoint (:func:`complete_parts`) once
every participant's part is there (:func:`parts_written`); the driver records every path beforehand
(:func:`paths`).

A checkpoint is written into ``.tmp_step_...`` by all ranks (each file: temporary name, fsync, rename)
and renamed into place by rank 0 only when every rank's file is there; ``latest`` then moves to it (again
written, fsynced and renamed), and only after that are checkpoints older than the newest ``keep``
removed, so a crash at any point leaves the previous checkpoint intact and never one that looks complete.
In a run directory lioncub marked, rank 0 records every path in the directory's record before it is
created and deletes only recorded files (:mod:`lioncub.rundir`): a file of the user's in
``checkpoints/`` stays, and nothing is written through a symbolic link. :func:`latest` finds the newest
complete checkpoint even when ``latest`` is missing or names a broken one.
``meta.json`` records the format version and the SHA-256 of every file; loading verifies the hash before
it unpickles anything and loads with ``torch.load(weights_only=True)`` (tensors and plain containers only),
so a truncated or corrupted file raises :class:`CorruptCheckpointError` (naming the file and the
previous checkpoint) and never leaves a half-loaded state.

Resuming checks the variant and the world size. Another variant is always refused; another world size
is refused unless ``convert_momenta="average"``: every new rank then starts from the mean of the saved
ranks' momenta (for ``LionCub`` the momenta differ per rank; for the DDP baselines they are identical, so
the mean is exact; with local steps also the outer momenta, from a checkpoint at a window's end), and its
data order starts afresh at the saved step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lioncub.rundir import (
    Record,
    fsync_dir,
    is_marked,
    open_run_file,
    read_record,
    read_run_file,
    record,
    regular_file,
    write_atomically,
)
from lioncub.train.config import CONVERSIONS
from lioncub.train.runfiles import meta_files

__all__ = [
    "CONVERSIONS",
    "SHARDS",
    "VERSION",
    "CheckpointMeta",
    "CorruptCheckpointError",
    "check_compatible",
    "complete_parts",
    "drop_incomplete",
    "encode",
    "latest",
    "load_rank_state",
    "load_shards",
    "model_state",
    "part_state",
    "parts_written",
    "paths",
    "restore_rng",
    "save",
    "step_name",
    "write_part",
]

_STEP = re.compile(r"step_\d{8}")
#: the entries of ``meta.json`` that :class:`CheckpointMeta` has fields for
_META_KEYS = ("version", "step", "variant", "world_size", "workload", "size", "seed", "sha256")
#: the per-rank momenta a conversion averages: the (inner) momentum, and local steps' outer momenta (a
#: rank's own with the vote rule; the same on every rank with dsm and diloco, whose mean is exact)
MOMENTA = ("exp_avg", "outer_exp_avg", "outer_buf")
VERSION = 2  # 2: SHA-256 of every file in meta.json, numpy RNG state as tensors (weights_only loading)
#: the directory of a sharded run's checkpoint that torch.distributed.checkpoint writes
SHARDS = "shards"


class CorruptCheckpointError(ValueError):
    """A checkpoint file is missing, truncated or altered (its SHA-256 is not the one recorded)."""


@dataclass(frozen=True)
class CheckpointMeta:
    """What ``meta.json`` records about a checkpoint."""

    path: Path
    step: int
    variant: str
    world_size: int
    workload: str
    size: str
    seed: int
    sha256: dict[str, str] = field(default_factory=dict, repr=False)  # file name -> SHA-256 (hex)
    note: str = field(default="", compare=False)  # how it was found, when ``latest`` did not name it
    #: the rest of ``meta.json`` (a fault-tolerant run's ``fault_tolerant``: the groups it holds)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def _rng_state() -> dict[str, Any]:
    """The RNG states as tensors and plain values (loadable with ``weights_only=True``)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def step_name(step: int) -> str:
    """The directory of the checkpoint of ``step``: ``step_00000200``."""
    return f"step_{step:08d}"


def encode(obj: Any) -> tuple[bytes, str]:
    """``torch.save`` of ``obj`` into memory: the bytes and their SHA-256 (hex)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def part_state(optimizer: dict[str, Any] | None, data_state: dict[str, Any], rank: int) -> dict[str, Any]:
    """What ``rank{rank}.pt`` holds: the optimizer's state dict (``optimizer``), this process's RNG states
    now, the data position (``data_state``) and the rank."""
    return {"optimizer": optimizer, "rng": _rng_state(), "data": data_state, "rank": rank}


def _write_part(tmp: Path, name: str, data: bytes, digest: str) -> None:
    """``name`` into ``tmp`` (written, fsynced, renamed), then its ``.sha256`` side file."""
    write_atomically(tmp / name, data)
    write_atomically(tmp / f"{name}.sha256", digest.encode())


def _atomic_torch_save(obj: Any, path: Path) -> str:
    """``torch.save`` ``obj`` atomically to ``path``; returns the SHA-256 (hex) of the bytes written."""
    data, digest = encode(obj)
    write_atomically(path, data)
    return digest


def _verified_load(meta: CheckpointMeta, name: str) -> Any:
    """``torch.load(weights_only=True)`` of ``meta.path / name`` to the CPU after checking its SHA-256."""
    path = meta.path / name
    try:
        data = read_run_file(path, follow_symlinks=True)
    except OSError as err:
        raise CorruptCheckpointError(
            f"checkpoint {meta.path}: cannot read {name} ({err}){_previous(meta)}"
        ) from None
    want = meta.sha256.get(name)
    got = hashlib.sha256(data).hexdigest()
    if want is None or got != want:
        raise CorruptCheckpointError(
            f"checkpoint {meta.path}: {name} is truncated or corrupted ({len(data)} bytes, SHA-256 "
            f"{got[:12]}… but meta.json records {str(want)[:12]}…); nothing was loaded{_previous(meta)}"
        )
    # to the CPU whatever device it was saved from (cuda:K of a rank that may not exist here); the caller
    # moves it: load_state_dict copies into the parameters, the optimizer casts to each parameter's device
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _previous(meta: CheckpointMeta) -> str:
    older = sorted(p.name for p in meta.path.parent.glob("step_*") if p.is_dir() and p.name < meta.path.name)
    if not older:
        return ""
    return (
        f". The previous checkpoint {older[-1]} is intact if its files verify: write its name into "
        f"{meta.path.parent / 'latest'} to resume from it"
    )


def _shard_names(world_size: int) -> list[str]:
    """The files torch.distributed.checkpoint writes for ``world_size`` ranks (one file per rank, one
    writer thread), under :data:`SHARDS`."""
    return [f"{SHARDS}/.metadata", *(f"{SHARDS}/__{r}_0.distcp" for r in range(world_size))]


def _tmp_names(world_size: int, sharded: bool = False) -> list[str]:
    """Every file a save of ``world_size`` ranks may create in its ``.tmp_step_*`` directory."""
    names = [
        n + side
        for n in ("model.pt", *(f"rank{r}.pt" for r in range(world_size)))
        for side in ("", ".sha256")
    ]
    shards = [*_shard_names(world_size), f"{SHARDS}/.metadata.tmp"] if sharded else []
    return [n + part for n in (*names, "meta.json") for part in ("", ".part")] + shards


def _final_names(world_size: int, sharded: bool = False) -> list[str]:
    """The files of a complete checkpoint of ``world_size`` ranks."""
    shards = _shard_names(world_size) if sharded else []
    return ["meta.json", "model.pt", *(f"rank{r}.pt" for r in range(world_size)), *shards]


def paths(steps: list[int], world_size: int) -> tuple[list[str], list[str]]:
    """Every directory and file (relative to the run directory) that the checkpoints of ``steps`` of a run
    of ``world_size`` ranks may create, temporary ones included: what a run records before its processes,
    which have no barrier between them, write (a fault-tolerant run)."""
    dirs, files = ["checkpoints"], ["checkpoints/latest", "checkpoints/latest.part"]
    for step in sorted(set(steps)):
        name = step_name(step)
        dirs += [f"checkpoints/.tmp_{name}", f"checkpoints/{name}"]
        files += [f"checkpoints/.tmp_{name}/{n}" for n in _tmp_names(world_size)]
        files += [f"checkpoints/{name}/{n}" for n in _final_names(world_size)]
    return dirs, files


def _empty_out(path: Path, names: list[str]) -> None:
    """Delete the files ``names`` of lioncub's directory ``path`` (a leftover of an earlier save) and the
    directory; ``ValueError`` naming what else is there (nothing of it is touched)."""
    if not os.path.lexists(path):
        return
    for name in names:
        if regular_file(path / name):
            os.unlink(path / name)
    shards = path / SHARDS
    if shards.is_dir() and not shards.is_symlink() and not os.listdir(shards):
        shards.rmdir()
    rest = sorted(os.listdir(path)) if path.is_dir() and not path.is_symlink() else [path.name]
    if rest:
        raise ValueError(f"{path} holds files lioncub did not write ({', '.join(rest[:5])}): move them away")
    path.rmdir()


def _drop_old(run_dir: Path, keep: int, marked: bool) -> list[str]:
    """Delete all but the newest ``keep`` checkpoints: only the files lioncub recorded in them (or, in a
    directory without its record, those their ``meta.json`` lists), each directory once it is empty.
    Returns the paths deleted (relative to ``run_dir``)."""
    root = run_dir / "checkpoints"
    rec = read_record(run_dir, "run") if marked else None
    steps = _steps(root, rec)
    gone: list[str] = []
    for name in sorted(steps)[:-keep]:
        rel = f"checkpoints/{name}"
        if rec is not None:
            files = [f.removeprefix(rel + "/") for f in rec.files if f.startswith(rel + "/")]
        else:
            files = ["meta.json", *meta_files(root / name)]
        for file in files:
            if regular_file(root / name / file):
                os.unlink(root / name / file)
            gone.append(f"{rel}/{file}")
        try:
            if os.path.isdir(root / name / SHARDS) and not os.listdir(root / name / SHARDS):
                (root / name / SHARDS).rmdir()
                gone.append(f"{rel}/{SHARDS}")
        except OSError:
            pass
        try:
            (root / name).rmdir()
            gone.append(rel)
        except OSError:  # files of the user's are in it: they and the directory stay
            pass
    return gone


def save(
    run_dir: Path,
    *,
    step: int,
    rank: int,
    world_size: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data_state: dict[str, Any],
    meta: dict[str, Any],
    barrier: Callable[[], None],
    keep: int = 2,
    model_state: dict[str, Any] | None = None,
    shards: dict[str, Any] | None = None,
) -> Path:
    """Write this rank's part of the checkpoint of ``step`` (collective: every rank calls it).

    ``meta`` must hold ``variant``, ``workload``, ``size`` and ``seed``; ``barrier`` synchronises the
    ranks (e.g. ``torch.distributed.barrier``); ``model_state``: what rank 0 writes as ``model.pt`` (default:
    the model's ``state_dict()``; a sharded model's gathered whole state); ``shards``: a sharded run's
    model and optimizer state (``get_state_dict``'s, as :func:`load_shards` reads it), which
    torch.distributed.checkpoint writes into :data:`SHARDS`, each rank its own file; the rank files then
    hold no optimizer state. Returns the final checkpoint directory. In a run directory
    lioncub marked, rank 0 records every path before it is created and deletes only recorded ones
    (:mod:`lioncub.rundir`).
    """
    root = run_dir / "checkpoints"
    name = step_name(step)
    tmp, final = root / f".tmp_{name}", root / name
    marked = rank == 0 and is_marked(run_dir)
    sharded = shards is not None
    tmp_names = _tmp_names(world_size, sharded)
    dirs = [f"checkpoints/.tmp_{name}", *([f"checkpoints/.tmp_{name}/{SHARDS}"] if sharded else [])]
    if rank == 0:
        if marked:
            tmp_files = [f"checkpoints/.tmp_{name}/{n}" for n in tmp_names]
            record(run_dir, dirs=["checkpoints", *dirs], files=tmp_files)
        _empty_out(tmp, tmp_names)  # a leftover of an interrupted save
        tmp.mkdir(parents=True)
        if sharded:
            (tmp / SHARDS).mkdir()
    barrier()
    if shards is not None:
        _save_shards(shards, tmp / SHARDS)
    own = None if sharded else optimizer.state_dict()
    _write_part(tmp, f"rank{rank}.pt", *encode(part_state(own, data_state, rank)))
    if rank == 0:
        whole = getattr(model, "module", model).state_dict() if model_state is None else model_state
        _write_part(tmp, "model.pt", *encode(whole))
    barrier()
    if rank == 0:
        _complete_save(run_dir, name, step, world_size, meta, marked, sharded)
        gone = _drop_old(run_dir, keep, marked)
        if marked:
            tmp_files = [f"checkpoints/.tmp_{name}/{n}" for n in tmp_names]
            record(run_dir, drop=[*tmp_files, *reversed(dirs), *gone])
    barrier()
    return final


def write_part(run_dir: Path, step: int, name: str, data: bytes, digest: str) -> None:
    """One process's part of the checkpoint of ``step`` (``rank{k}.pt`` or ``model.pt``: ``data`` and its
    SHA-256 from :func:`encode`) into its temporary directory, which is made if missing (the paths are
    recorded beforehand: :func:`paths`): the file, then its ``.sha256`` side file, each atomically."""
    tmp = run_dir / "checkpoints" / f".tmp_{step_name(step)}"
    tmp.mkdir(parents=True, exist_ok=True)
    _write_part(tmp, name, data, digest)


def drop_incomplete(run_dir: Path, world_size: int) -> None:
    """Remove the checkpoints left incomplete in ``run_dir`` (``checkpoints/.tmp_step_*``, the files a save
    of ``world_size`` ranks writes there): before a launch over the newest complete one, when no process
    of the run writes any more. ``ValueError`` naming a directory that holds files lioncub did not write
    (they and it stay)."""
    root = run_dir / "checkpoints"
    if not root.is_dir() or root.is_symlink():
        return
    for entry in sorted(root.glob(".tmp_step_*")):
        if _STEP.fullmatch(entry.name.removeprefix(".tmp_")) and entry.is_dir() and not entry.is_symlink():
            _empty_out(entry, _tmp_names(world_size))


def parts_written(run_dir: Path, step: int) -> list[int]:
    """The ranks whose part of the checkpoint of ``step`` is whole in its temporary directory."""
    tmp = run_dir / "checkpoints" / f".tmp_{step_name(step)}"
    found = tmp.glob("rank*.pt.sha256") if tmp.is_dir() else []
    return sorted(int(p.name[4:].removesuffix(".pt.sha256")) for p in found)


def complete_parts(
    run_dir: Path, step: int, world_size: int, ranks: list[int], meta: dict[str, Any], keep: int = 2
) -> Path:
    """Complete the checkpoint of ``step`` whose parts (:func:`write_part`: ``model.pt`` and ``rank{k}.pt``
    of every rank in ``ranks``) are in its temporary directory: ``meta.json`` with their SHA-256 (``meta``
    as :func:`save`'s, with more entries if wanted), the rename into place, ``latest``; then the
    checkpoints older than the newest ``keep`` are removed (in a marked run directory only the files its
    record holds: :func:`paths` recorded them). The final directory; ``RuntimeError`` if a part is
    missing (nothing is renamed)."""
    name = step_name(step)
    if not (run_dir / "checkpoints" / f".tmp_{name}" / "model.pt.sha256").exists():
        raise RuntimeError(f"checkpoint {run_dir / 'checkpoints' / name}: no model.pt was written")
    _complete_save(run_dir, name, step, world_size, meta, marked=False, ranks=ranks)
    _drop_old(run_dir, keep, is_marked(run_dir))
    return run_dir / "checkpoints" / name


def _save_shards(shards: dict[str, Any], path: Path) -> None:
    """``dcp.save`` of ``shards`` into ``path``: each rank one file (one writer thread), fsynced.
    Collective."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True, thread_count=1)
    dcp.save(shards, storage_writer=writer)


def _complete_save(
    run_dir: Path,
    name: str,
    step: int,
    world_size: int,
    meta: dict,
    marked: bool,
    sharded: bool = False,
    ranks: list[int] | None = None,
) -> None:
    """Rank 0, once every rank's file is in ``.tmp_<name>``: ``meta.json`` (with the SHA-256 of the
    files torch.distributed.checkpoint wrote, ``sharded``), the rename into place, then ``latest`` (each
    written, fsynced and renamed). ``ranks``: the ranks whose files it holds (default: all)."""
    root = run_dir / "checkpoints"
    tmp, final = root / f".tmp_{name}", root / name
    expected = range(world_size) if ranks is None else ranks
    missing = [r for r in expected if not (tmp / f"rank{r}.pt.sha256").exists()]
    if missing:
        raise RuntimeError(f"checkpoint {tmp}: ranks {missing} wrote no state")
    hashes = {}
    for side in sorted(tmp.glob("*.sha256")):
        hashes[side.name.removesuffix(".sha256")] = read_run_file(side, follow_symlinks=True).decode().strip()
        side.unlink()
    for shard in _shard_names(world_size) if sharded else []:
        if not regular_file(tmp / shard):
            raise RuntimeError(f"checkpoint {tmp}: torch.distributed.checkpoint wrote no {shard}")
        hashes[shard] = hashlib.sha256(read_run_file(tmp / shard, follow_symlinks=True)).hexdigest()
    doc = {"version": VERSION, "step": step, "world_size": world_size, **meta, "sha256": hashes}
    write_atomically(tmp / "meta.json", (json.dumps(doc, indent=1) + "\n").encode())
    final_names = _final_names(world_size, sharded)
    if marked:
        files: dict[str, list[str]] = {f"checkpoints/{name}/{n}": [] for n in final_names}
        record(
            run_dir,
            dirs=[f"checkpoints/{name}", *([f"checkpoints/{name}/{SHARDS}"] if sharded else [])],
            files={**files, "checkpoints/latest": [], "checkpoints/latest.part": []},
        )
    _empty_out(final, final_names)  # this step saved before (a restarted run)
    os.replace(tmp, final)
    fsync_dir(root)
    write_atomically(root / "latest", (name + "\n").encode())


def _steps(root: Path, rec: Record | None) -> list[str]:
    """The checkpoint directories ``step_NNNNNNNN`` of ``root`` (the recorded ones, in a marked run)."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    return [
        e.name
        for e in entries
        if _STEP.fullmatch(e.name)
        and e.is_dir(follow_symlinks=False)
        and (rec is None or f"checkpoints/{e.name}" in rec.dirs)
    ]


def _complete(path: Path) -> tuple[CheckpointMeta | None, str]:
    """The checkpoint in ``path`` if it is complete (its ``meta.json`` readable, of this version, and every
    file it lists there); else None and why not."""
    try:
        fd = open_run_file(path / "meta.json")  # a FIFO there: refused, never waited on
        with os.fdopen(fd, "rb") as f:
            doc = json.loads(f.read())
    except (OSError, ValueError) as err:
        return None, f"checkpoint {path} is unreadable ({err})"
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        version = doc.get("version") if isinstance(doc, dict) else None
        return None, f"checkpoint {path} has version {version}, this lioncub reads {VERSION}"
    try:
        meta = CheckpointMeta(
            path,
            int(doc["step"]),
            doc["variant"],
            int(doc["world_size"]),
            doc["workload"],
            doc["size"],
            doc["seed"],
            dict(doc["sha256"]),
            extra={k: v for k, v in doc.items() if k not in _META_KEYS},
        )
    except (KeyError, TypeError, ValueError) as err:
        return None, f"checkpoint {path}: meta.json lacks or garbles {err}"
    missing = [n for n in meta.sha256 if not regular_file(path / n)]
    if missing:
        return None, f"checkpoint {path} lacks {', '.join(missing)}"
    return meta, ""


def latest(run_dir: Path) -> CheckpointMeta | None:
    """The newest complete checkpoint of ``run_dir`` (None if there is none): the one
    ``checkpoints/latest`` names; if that file is missing or names no complete checkpoint, the newest
    complete one there is, whose :attr:`CheckpointMeta.note` says so. In a marked run directory only the
    checkpoints lioncub recorded count. ``ValueError`` if ``checkpoints`` is a link or a file, or if
    ``latest`` names a checkpoint and none is complete."""
    root = run_dir / "checkpoints"
    if not os.path.lexists(root):
        return None
    if root.is_symlink() or not root.is_dir():
        raise ValueError(
            f"{root} is not a directory lioncub made (a symbolic link or a file): lioncub reads and writes "
            "no checkpoint through it"
        )
    steps = sorted(_steps(root, read_record(run_dir, "run")), reverse=True)
    pointer = root / "latest"
    named, why = None, f"{pointer} is missing"
    if os.path.lexists(pointer):
        try:
            fd = open_run_file(pointer)  # a FIFO there: refused (ValueError), never waited on
            with os.fdopen(fd, "rb") as f:
                named = f.read(256).decode().strip()
        except (OSError, UnicodeDecodeError) as err:
            why = f"{pointer} cannot be read ({err})"
        else:
            why = f"{pointer} names {named!r}, which is no checkpoint lioncub wrote here"
            if named in steps:
                meta, why = _complete(root / named)
                if meta is not None:
                    return meta
    for name in steps:
        meta, _ = _complete(root / name)
        if meta is not None and name != named:
            return dataclasses.replace(
                meta, note=f"{why}; resuming from {name}, the newest complete checkpoint"
            )
    if named is not None:
        raise ValueError(
            f"{why}, and no other checkpoint in {root} is complete: there is nothing to resume from"
        )
    return None


def check_compatible(
    meta: CheckpointMeta,
    *,
    variant: str,
    world_size: int,
    workload: str,
    size: str,
    seed: int,
    convert_momenta: str | None,
    local_steps: int | None = None,
) -> None:
    """Raise ``ValueError`` (naming the option to change) unless the run can resume from ``meta``
    (``local_steps``: the run's H; a conversion to another world size needs a checkpoint at a window's end,
    where the replicas agree)."""
    if convert_momenta is not None and convert_momenta not in CONVERSIONS:
        raise ValueError(f"--convert-momenta {convert_momenta!r}: allowed values are {list(CONVERSIONS)}")
    if (workload, size, seed) != (meta.workload, meta.size, meta.seed):
        raise ValueError(
            f"checkpoint {meta.path} is of --workload {meta.workload} --size {meta.size} --seed {meta.seed}; "
            f"this run is --workload {workload} --size {size} --seed {seed}"
        )
    if variant != meta.variant:
        raise ValueError(
            f"checkpoint {meta.path} was written by --variant {meta.variant}; this run is "
            f"--variant {variant}. Momenta of one variant do not carry over to another: resume with "
            "the same variant"
        )
    if world_size != meta.world_size and convert_momenta is None:
        raise ValueError(
            f"checkpoint {meta.path} was written by {meta.world_size} ranks; this run has {world_size}. "
            "Every rank's momentum is its own: resume with --nproc "
            f"{meta.world_size}, or pass --convert-momenta average to start every rank from their mean"
        )
    if world_size != meta.world_size and local_steps and meta.step % local_steps:
        raise ValueError(
            f"--convert-momenta {convert_momenta}: checkpoint {meta.path} is at step {meta.step}, in the "
            f"middle of a window of --local-steps {local_steps}, where each rank holds its own replica; "
            f"convert from a checkpoint at a multiple of {local_steps}"
        )


def load_rank_state(meta: CheckpointMeta, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's saved state; with another world size, the mean of all saved momenta (see module doc)."""
    if world_size == meta.world_size:
        return _verified_load(meta, f"rank{rank}.pt")
    states = [_verified_load(meta, f"rank{r}.pt") for r in range(meta.world_size)]
    base = states[0]
    for index, param_state in base["optimizer"]["state"].items():
        for key in MOMENTA:
            if key in param_state:
                stacked = torch.stack([s["optimizer"]["state"][index][key] for s in states])
                param_state[key] = stacked.mean(dim=0, dtype=torch.float64).to(param_state[key].dtype)
    base["converted_from"] = meta.world_size
    return base


def load_shards(meta: CheckpointMeta, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a sharded run's model and optimizer state (:data:`SHARDS`) into ``model`` (sharded as it was)
    and ``optimizer`` (built over it), after checking every file's SHA-256. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    for name in sorted(n for n in meta.sha256 if n.startswith(f"{SHARDS}/")):
        data = read_run_file(meta.path / name, follow_symlinks=True)
        if hashlib.sha256(data).hexdigest() != meta.sha256[name]:
            raise CorruptCheckpointError(
                f"checkpoint {meta.path}: {name} is truncated or corrupted ({len(data)} bytes); nothing was "
                f"loaded{_previous(meta)}"
            )
    model_sd, optim_sd = get_state_dict(model, optimizer)  # what dcp.load fills in place
    dcp.load(
        {"model": model_sd, "optim": optim_sd}, storage_reader=dcp.FileSystemReader(str(meta.path / SHARDS))
    )
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def model_state(meta: CheckpointMeta) -> dict[str, torch.Tensor]:
    """The saved model weights."""
    return _verified_load(meta, "model.pt")


def restore_rng(state: dict[str, Any]) -> None:
    """Restore the RNG states saved with this rank's state."""
    _set_rng_state(state["rng"])
