"""Reading and growing a directory's record: :func:`read_record` (an old marker adopted,
:mod:`lioncub.rundir.legacy`), :func:`record` (a path enters the record *before* it is created),
:func:`claim` (a directory marked as lioncub's) and :func:`write_owned` (a file written and recorded)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

from lioncub.rundir.files import file_sha256, write_atomically
from lioncub.rundir.legacy import adopt
from lioncub.rundir.marker import MARKER, Record, read_marker, safe_path

__all__ = ["claim", "read_record", "record", "write_owned", "write_record"]


def read_record(path: Path, kind: str | None = None) -> Record | None:
    """The record of directory ``path`` (of ``kind``, if given); None if it has no lioncub marker (or a
    malformed one, which is then the user's file). A marker without a list is adopted
    (:func:`lioncub.rundir.legacy.adopt`)."""
    doc = read_marker(Path(path))
    if doc is None or (kind is not None and doc["kind"] != kind):
        return None
    if doc.get("version") != 2:
        return adopt(Path(path), doc["kind"])
    files, dirs, job = doc.get("files"), doc.get("dirs"), doc.get("job")
    if not (isinstance(files, dict) and isinstance(dirs, list) and (job is None or isinstance(job, str))):
        return None
    ok = all(
        safe_path(k) and isinstance(v, list) and all(isinstance(d, str) for d in v) for k, v in files.items()
    )
    if not (ok and all(safe_path(d) for d in dirs)):
        return None
    return Record(doc["kind"], {k: list(v) for k, v in files.items()}, set(dirs), job)


def write_record(path: Path, rec: Record) -> None:
    """Write ``rec`` as the marker of ``path`` (atomically)."""
    write_atomically(path / MARKER, json.dumps(rec.to_json(), indent=1) + "\n")


def _addable(path: Path, rel: str, rec: Record, new_dirs: set[str], digests: list[str]) -> None:
    """``ValueError`` unless lioncub may create (or rewrite) ``rel`` under ``path``: every existing
    ancestor a directory it recorded, and the path itself absent or lioncub's as it left it."""
    if not safe_path(rel):
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
        and (not rec.files[rel] or file_sha256(path / rel) in [*rec.files[rel], *digests])
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
