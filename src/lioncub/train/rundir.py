"""Run directories: which paths are lioncub's, how it writes them, and what it may delete.

lioncub writes into **run directories** (``lioncub train --out``, ``lioncub compare``'s ``OUT/<variant>``),
**compare directories** (``lioncub compare --out``) and **plots directories** (``lioncub report --out``).
Ownership is lioncub's own record, never a guess from names: the marker :data:`MARKER` names the kind and
lists every path lioncub wrote there (:class:`Record`), each file with the SHA-256 of its content where
lioncub writes it whole. A path enters the record *before* it is created (:func:`record`); a recorded path
that is now a link, another kind of entry or other content is the user's, as is everything unrecorded
(:func:`survey`), and a run's record counts for nothing once its ``config.json`` is gone (``rm -r RUN/*``
leaves the dotfiles). A marker of lioncub before the record (no list) is read as listing what that lioncub
always wrote, by exact name, and for a run only when ``config.json`` parses as lioncub's
(:func:`read_record`; docs/errors.md lists the names); :func:`claim` stores that list.

:func:`remove_owned` deletes only recorded paths, nothing while anything else is there, ``config.json`` last
and the marker at the very end (an interrupted removal can be run again), never through a link.
:func:`write_atomically` writes beside the name and renames into place (a link at the name is replaced,
never followed); :func:`open_append` opens with ``O_NOFOLLOW``. :func:`check_out_path`
(:mod:`lioncub.train.outpath`) refuses what can never be an output directory; one writer at a time:
:mod:`lioncub.train.runlock`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lioncub.train.outpath import DEEPEST, check_out_path

__all__ = [
    "COMPARE_FILES",
    "DEEPEST",
    "DIAG_PLOTS",
    "LOCK",
    "MARKER",
    "OWN_FILES",
    "RANKS_LOCK",
    "Record",
    "Survey",
    "check_out_path",
    "claim",
    "foreign_entries",
    "fsync_dir",
    "is_marked",
    "meta_files",
    "open_append",
    "read_record",
    "record",
    "regular_file",
    "remove_owned",
    "survey",
    "write_atomically",
    "write_owned",
]

#: the record: what lioncub wrote into a directory (JSON, see :class:`Record`)
MARKER = ".lioncub"
#: the writer's lock (:mod:`lioncub.train.runlock`); never written
LOCK = ".lioncub.lock"
#: the lock that rank 0 of a driven run holds while it lives (:mod:`lioncub.train.runlock`); never written
RANKS_LOCK = ".lioncub.ranks.lock"
#: the record's and the locks' own files, lioncub's in every directory it marked
OWN_FILES = (MARKER, MARKER + ".part", LOCK, RANKS_LOCK)
#: the plots ``lioncub report`` writes
DIAG_PLOTS = ("diag_rates.png", "diag_momentum_std.png", "diag_update_shape.png")
#: the files of ``lioncub compare``'s report
COMPARE_FILES = (
    "summary.md",
    "summary.json",
    "val_loss_vs_step.png",
    "val_loss_vs_time.png",
    "step_time_split.png",
    "bytes_per_step.png",
    "diagnostics_vs_step.png",
)
KINDS = ("run", "compare", "plots")

#: what a run directory of lioncub before the record always held (adopted by exact name, see module doc)
_V1_RUN_FILES = (
    "config.json",
    "config.json.part",
    "config.next.json",
    "config.next.json.part",
    "log.jsonl",
    "log.jsonl.part",
    "summary.json",
    *DIAG_PLOTS,
)
_STEP = re.compile(r"step_\d{8}")
_TMP_STEP = re.compile(r"\.tmp_step_\d{8}")
_CHECKPOINT_FILE = re.compile(r"(model|rank\d+)\.pt")
_TMP_FILE = re.compile(r"((model|rank\d+)\.pt(\.sha256)?|meta\.json)(\.part)?")


# ---------------------------------------------------------------------------------------- the record


@dataclass
class Record:
    """What the marker of a directory records: its ``kind`` (run, compare, plots), the ``files`` lioncub
    wrote (relative path -> the SHA-256 digests its content may have; ``[]``: not checked, e.g. a log it
    appends to), the ``dirs`` it created, and for a run prepared by rank 0 of a job the ``job`` that did
    (its restarts go on with the run). ``version`` 1: read from a marker without a list (adopted)."""

    kind: str
    files: dict[str, list[str]] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)
    job: str | None = None
    version: int = 2

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"kind": self.kind, "by": "lioncub", "version": 2}
        doc["files"] = {name: list(self.files[name]) for name in sorted(self.files)}
        doc["dirs"] = sorted(self.dirs)
        if self.job is not None:
            doc["job"] = self.job
        return doc


def _safe(rel: Any) -> bool:
    """A path relative to the directory, inside it: no ``..``, no absolute path, no empty part."""
    if not isinstance(rel, str) or not rel or "\0" in rel or rel.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in rel.split("/"))


def _read_marker(path: Path) -> dict[str, Any] | None:
    """The marker of ``path`` as a JSON object written by lioncub (None: none, or not lioncub's)."""
    try:
        fd = os.open(path / MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            doc = json.loads(f.read())
        except (OSError, ValueError):
            return None
    if not (isinstance(doc, dict) and doc.get("by") == "lioncub" and doc.get("kind") in KINDS):
        return None
    return doc


def read_record(path: Path, kind: str | None = None) -> Record | None:
    """The record of directory ``path`` (of ``kind``, if given); None if it has no lioncub marker (or a
    malformed one, which is then the user's file). A marker without a list is adopted (module doc)."""
    doc = _read_marker(Path(path))
    if doc is None or (kind is not None and doc["kind"] != kind):
        return None
    if doc.get("version") != 2:
        return _adopt_v1(Path(path), doc["kind"])
    files, dirs, job = doc.get("files"), doc.get("dirs"), doc.get("job")
    if not (isinstance(files, dict) and isinstance(dirs, list) and (job is None or isinstance(job, str))):
        return None
    ok = all(
        _safe(k) and isinstance(v, list) and all(isinstance(d, str) for d in v) for k, v in files.items()
    )
    if not (ok and all(_safe(d) for d in dirs)):
        return None
    return Record(doc["kind"], {k: list(v) for k, v in files.items()}, set(dirs), job)


def is_marked(path: Path, kind: str = "run") -> bool:
    """Whether ``path`` holds lioncub's marker for a ``kind`` directory ("run", "compare", "plots")."""
    doc = _read_marker(Path(path))
    return doc is not None and doc["kind"] == kind


def regular_file(path: Path) -> bool:
    """Whether ``path`` is a regular file itself (not a symbolic link to one)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _sha256(path: Path) -> str | None:
    """The SHA-256 of regular file ``path`` (None if it cannot be read without following a link)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _lioncub_config(path: Path) -> bool:
    """Whether ``path`` parses as a ``config.json`` lioncub writes."""
    from lioncub.train.config import TrainConfig

    try:
        doc = json.loads(path.read_bytes())
        TrainConfig.from_json(doc)
    except (OSError, ValueError, TypeError, AttributeError):
        return False
    return isinstance(doc, dict)


def _adopt_v1(path: Path, kind: str) -> Record:
    """The record of a marker without a list: what that lioncub always wrote, by exact name."""
    rec = Record(kind, version=1)
    if kind == "compare":
        rec.files = {name: [] for name in COMPARE_FILES if regular_file(path / name)}
        with contextlib.suppress(OSError):
            rec.dirs = {
                e.name for e in os.scandir(path) if _real_dir(Path(e.path)) and is_marked(Path(e.path))
            }
        return rec
    if kind != "run" or not regular_file(path / "config.json") or not _lioncub_config(path / "config.json"):
        return rec
    rec.files = {name: [] for name in _V1_RUN_FILES if regular_file(path / name)}
    rec.files["config.json"] = [str(_sha256(path / "config.json"))]
    root = path / "checkpoints"
    if not _real_dir(root):
        return rec
    rec.dirs.add("checkpoints")
    rec.files.update({f"checkpoints/{n}": [] for n in ("latest", "latest.part") if regular_file(root / n)})
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        sub = Path(entry.path)
        if _real_dir(sub) and _STEP.fullmatch(entry.name):
            names = ["meta.json", *(n for n in meta_files(sub) if _CHECKPOINT_FILE.fullmatch(n))]
        elif _real_dir(sub) and _TMP_STEP.fullmatch(entry.name):
            names = [e.name for e in os.scandir(sub) if _TMP_FILE.fullmatch(e.name)]
        else:
            continue
        rec.dirs.add(f"checkpoints/{entry.name}")
        rec.files.update({f"checkpoints/{entry.name}/{n}": [] for n in names if regular_file(sub / n)})
    return rec


def meta_files(step_dir: Path) -> list[str]:
    """The files a checkpoint's ``meta.json`` lists, in its directory ([] if it cannot be read)."""
    try:
        names = json.loads((step_dir / "meta.json").read_bytes()).get("sha256", {})
    except (OSError, ValueError, AttributeError):
        return []
    return [n for n in names if isinstance(n, str) and "/" not in n] if isinstance(names, dict) else []


def write_record(path: Path, rec: Record) -> None:
    """Write ``rec`` as the marker of ``path`` (atomically)."""
    write_atomically(path / MARKER, json.dumps(rec.to_json(), indent=1) + "\n")


def _addable(path: Path, rel: str, rec: Record, new_dirs: set[str], digests: list[str]) -> None:
    """``ValueError`` unless lioncub may create (or rewrite) ``rel`` under ``path``: every existing
    ancestor a directory it recorded, and the path itself absent or lioncub's as it left it."""
    if not _safe(rel):
        raise ValueError(f"{path}: {rel!r} is not a path inside the directory")
    parts = rel.split("/")
    for i in range(1, len(parts)):
        ancestor = "/".join(parts[:i])
        try:
            mode = os.lstat(path / ancestor).st_mode
        except FileNotFoundError:
            break
        if not stat.S_ISDIR(mode) or (ancestor not in rec.dirs and ancestor not in new_dirs):
            what = "a symbolic link" if stat.S_ISLNK(mode) else "not a directory lioncub made"
            raise ValueError(f"{path / ancestor} is {what}: lioncub writes nothing into it")
    try:
        mode = os.lstat(path / rel).st_mode
    except FileNotFoundError:
        return
    if rel in rec.dirs or rel in new_dirs:
        if stat.S_ISDIR(mode):
            return
    elif (
        rel in rec.files
        and stat.S_ISREG(mode)
        and (not rec.files[rel] or _sha256(path / rel) in [*rec.files[rel], *digests])
    ):
        return
    if stat.S_ISLNK(mode):
        raise ValueError(f"{path / rel} is a symbolic link: lioncub writes nothing through it or over it")
    raise ValueError(
        f"{path / rel} is not a file lioncub wrote (or it was changed since): lioncub writes nothing over "
        "it; move it away, or choose another output directory"
    )


def record(
    path: Path,
    *,
    files: Iterable[str] | Mapping[str, list[str]] = (),
    dirs: Iterable[str] = (),
    drop: Iterable[str] = (),
    job: str | None = None,
) -> Record:
    """Add ``files`` (a mapping: each with the SHA-256 digests its content may have) and ``dirs`` to the
    record of directory ``path``, before lioncub creates them, and remove ``drop`` (paths it deleted);
    write the marker and return the record. ``ValueError`` (nothing written) if an added path lies under
    a symbolic link or a directory lioncub did not make, or holds what lioncub did not write. The caller
    holds the directory's lock; the directory is marked (:func:`claim`)."""
    path = Path(path)
    rec = read_record(path)
    if rec is None:
        raise ValueError(f"{path} has no lioncub record ({MARKER}); lioncub writes nothing into it")
    added = dict(files) if isinstance(files, Mapping) else {name: [] for name in files}
    new_dirs = set(dirs)
    for rel in sorted(new_dirs, key=lambda r: r.count("/")):
        _addable(path, rel, rec, new_dirs, [])
    for rel, digests in added.items():
        _addable(path, rel, rec, new_dirs, digests)
    for rel in drop:
        rec.files.pop(rel, None)
        rec.dirs.discard(rel)
    rec.files.update({rel: list(d) for rel, d in added.items()})
    rec.dirs |= new_dirs
    if job is not None:
        rec.job = job
    write_record(path, rec)
    rec.version = 2
    return rec


def claim(path: Path, kind: str = "run", *, fresh: bool = False, job: str | None = None) -> None:
    """Create ``path`` (with its parents) if needed and mark it as lioncub's ``kind`` directory: an empty
    record if it has none (or ``fresh``: the caller found nothing recorded left), an adopted one stored
    as a record. The caller holds the lock and has checked that the directory is new, empty or lioncub's."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rec = None if fresh else read_record(path, kind)
    if rec is None:
        write_record(path, Record(kind, job=job))
    elif rec.version != 2 or (job is not None and rec.job != job):
        rec.job = job if job is not None else rec.job
        write_record(path, rec)


# --------------------------------------------------------------------------------------- ownership


@dataclass
class Survey:
    """What a directory holds, by lioncub's record: ``record`` (None: unmarked), ``owned`` (recorded
    paths as lioncub left them; directories end in ``/``), ``foreign`` (everything else, a directory
    named once), ``changed`` (the foreign paths that are recorded: replaced by a link, another entry or
    other content) and ``stale`` (a run's record whose ``config.json`` is gone: nothing recorded counts)."""

    record: Record | None
    owned: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    stale: bool = False


def survey(path: Path, kind: str = "run", *, subruns: bool = False) -> Survey:
    """Sort what ``path`` holds into lioncub's and the user's (:class:`Survey`); nothing for a missing
    directory. With ``subruns`` (a compare directory) a subdirectory that is a marked run directory (its
    own record says what it holds) or empty is lioncub's. ``path`` itself may be a link to a directory
    (the user named it); nothing below it is followed."""
    path = Path(path)
    if not path.is_dir():
        return Survey(None)
    rec = read_record(path, kind)
    out = Survey(rec)
    trusted = rec
    if (
        rec is not None
        and kind == "run"
        and "config.json" in rec.files
        and not os.path.lexists(path / "config.json")
    ):
        trusted, out.stale = Record(kind), True
    _walk(path, "", trusted, subruns, out)
    return out


def _walk(root: Path, rel_dir: str, rec: Record | None, subruns: bool, out: Survey) -> None:
    for entry in sorted(os.scandir(root / rel_dir), key=lambda e: e.name):
        rel = rel_dir + entry.name
        recorded = rec is not None and (rel in rec.files or rel in rec.dirs)
        if (
            not rel_dir
            and out.record is not None
            and entry.name in OWN_FILES
            and regular_file(Path(entry.path))
        ):
            continue
        if entry.is_symlink():
            out.foreign.append(rel)
            out.changed += [rel] if recorded else []
        elif entry.is_dir(follow_symlinks=False):
            if not rel_dir and subruns and is_marked(Path(entry.path)):
                out.owned.append(rel + "/")  # a compare's run directory: its own record says what it holds
            elif not rel_dir and subruns and not any(os.scandir(entry.path)):
                continue  # an empty directory where a run will go: neither lioncub's nor in the way
            elif rec is not None and rel in rec.dirs:
                out.owned.append(rel + "/")
                _walk(root, rel + "/", rec, subruns, out)
            else:
                out.foreign.append(rel)
                out.changed += [rel] if recorded else []
        elif recorded and entry.is_file(follow_symlinks=False) and rel in rec.files:  # type: ignore[union-attr]
            digests = rec.files[rel]  # type: ignore[union-attr]
            if not digests or _sha256(Path(entry.path)) in digests:
                out.owned.append(rel)
            else:
                out.foreign.append(rel)
                out.changed.append(rel)
        else:
            out.foreign.append(rel)
            out.changed += [rel] if recorded else []


def foreign_entries(path: Path, kind: str = "run", *, subruns: bool = False) -> list[str]:
    """The paths in ``path`` that lioncub did not write (:func:`survey`): ``[]`` for a missing or empty
    directory, everything in an unmarked one."""
    return survey(path, kind, subruns=subruns).foreign


def _in_the_way(path: Path, names: list[str]) -> ValueError:
    return ValueError(
        f"{path} holds files lioncub did not write: {', '.join(names[:8])}"
        + (" …" if len(names) > 8 else "")
        + "; lioncub deletes only its own files: move them, or choose another --out"
    )


def remove_owned(
    path: Path, kind: str = "run", *, subruns: bool = False, keep_dir: bool = False, keep_marker: bool = False
) -> None:
    """Delete what lioncub recorded in ``path`` (with ``subruns``, and its run subdirectories), then its
    marker and lock files unless ``keep_marker`` (the record is then emptied and the caller goes on
    writing), then ``path`` itself unless ``keep_dir`` or ``keep_marker``. Raises ``ValueError`` naming
    what lioncub did not write, and deletes nothing, if anything else is there. The caller holds the lock."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    found = survey(path, kind, subruns=subruns)
    runs = [r[:-1] for r in found.owned if subruns and r.count("/") == 1 and is_marked(path / r[:-1])]
    foreign = list(found.foreign)
    for run in runs:
        foreign += [f"{run}/{name}" for name in survey(path / run).foreign]
    if foreign:
        raise _in_the_way(path, foreign)
    for run in runs:
        remove_owned(path / run)
    owned = [rel for rel in found.owned if rel.rstrip("/") not in runs]
    files = sorted(
        (r for r in owned if not r.endswith("/")), key=lambda r: (r == "config.json", -r.count("/"), r)
    )
    for rel in files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path / rel)
    for rel in sorted((r for r in owned if r.endswith("/")), key=lambda r: -r.count("/")):
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(path / rel)
    if keep_marker and found.record is not None:
        write_record(path, Record(kind))
        return
    for name in (*OWN_FILES[1:], MARKER):
        if regular_file(path / name):
            os.unlink(path / name)
    if not keep_dir and not path.is_symlink():
        path.rmdir()


# ------------------------------------------------------------------------------------------ writing


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (a file created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes | str) -> str:
    """Write ``data`` (``str``: as UTF-8) to ``path`` so that a reader, even after a crash, finds the old
    file or the whole new one: a ``.part`` file beside it (created anew, never through a link), fsynced,
    renamed over ``path`` (a symbolic link there is replaced, not followed), the directory fsynced.
    Returns the SHA-256 (hex) of the bytes."""
    raw = data.encode() if isinstance(data, str) else data
    tmp = Path(path).with_name(Path(path).name + ".part")
    if regular_file(tmp):
        os.unlink(tmp)  # a leftover of an interrupted write
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(Path(path).parent)
    return hashlib.sha256(raw).hexdigest()


def write_owned(root: Path, rel: str, data: bytes | str) -> None:
    """Write file ``rel`` of lioncub's directory ``root`` (:func:`write_atomically`), recorded with the
    SHA-256 of ``data``: until the new file is in place the record accepts the old content too."""
    raw = data.encode() if isinstance(data, str) else data
    digest = hashlib.sha256(raw).hexdigest()
    rec = read_record(root)
    before = rec.files.get(rel, []) if rec is not None else []
    record(root, files={rel: [*before, digest], rel + ".part": []})
    write_atomically(Path(root) / rel, raw)
    record(root, files={rel: [digest]})


def open_append(path: Path) -> int:
    """A file descriptor appending to ``path`` (created if missing), never through a symbolic link."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
