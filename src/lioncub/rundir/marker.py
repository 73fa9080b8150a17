"""The record's format: the marker file :data:`MARKER` (JSON) and what it holds (:class:`Record`), the lock
files beside it, and reading the marker (:func:`read_marker`, :func:`is_marked`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lioncub.rundir.files import open_run_file

__all__ = [
    "KINDS",
    "LOCK",
    "MARKER",
    "OWN_FILES",
    "RANKS_LOCK",
    "Record",
    "is_marked",
    "read_marker",
    "safe_path",
]

#: the record: what lioncub wrote into a directory (JSON, see :class:`Record`)
MARKER = ".lioncub"
#: the writer's lock (:mod:`lioncub.rundir.locking`); never written
LOCK = ".lioncub.lock"
#: the lock that rank 0 of a driven run holds while it lives (:mod:`lioncub.rundir.locking`); never written
RANKS_LOCK = ".lioncub.ranks.lock"
#: the record's and the locks' own files, lioncub's in every directory it marked
OWN_FILES = (MARKER, MARKER + ".part", LOCK, RANKS_LOCK)
#: the kinds of directory lioncub marks: a training run, ``lioncub compare``'s, ``lioncub report``'s plots
KINDS = ("run", "compare", "plots")


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


def safe_path(rel: Any) -> bool:
    """A path relative to the directory, inside it: no ``..``, no absolute path, no empty part."""
    if not isinstance(rel, str) or not rel or "\0" in rel or rel.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in rel.split("/"))


def read_marker(path: Path) -> dict[str, Any] | None:
    """The marker of ``path`` as a JSON object written by lioncub (None: none, or not lioncub's);
    :class:`~lioncub.rundir.files.SpecialFileError` if the marker is a FIFO, a socket or a device."""
    try:
        fd = open_run_file(Path(path) / MARKER)
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


def is_marked(path: Path, kind: str = "run") -> bool:
    """Whether ``path`` holds lioncub's marker for a ``kind`` directory ("run", "compare", "plots")."""
    doc = read_marker(Path(path))
    return doc is not None and doc["kind"] == kind
