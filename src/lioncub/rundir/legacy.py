"""Markers written before the record (no list of paths): each kind's owner registers what such a directory
always held (:func:`register_legacy`), and :func:`adopt` reads an old marker as listing exactly that.

The package that writes a kind of directory registers it when it is imported: ``run`` by
:mod:`lioncub.train.runfiles` (imported by :mod:`lioncub.train`), ``compare`` and ``plots`` by
:mod:`lioncub.report.files` (imported by :mod:`lioncub.report`). In a process that imported neither, an old
marker of that kind adopts nothing: everything in the directory is then the user's (never deleted, never
written over), the safe side of a guess.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from lioncub.rundir.files import real_dir, regular_file
from lioncub.rundir.marker import KINDS, Record, is_marked

__all__ = ["Legacy", "adopt", "adopt_run_subdirs", "register_legacy"]


@dataclass(frozen=True)
class Legacy:
    """What a ``kind`` directory of lioncub before the record held: the regular ``files`` it always wrote
    (adopted by exact name), only if ``gate(path)`` holds (None: always); then ``extend(path, record)``
    adds what is not found by name (a run's checkpoints, a compare's run directories)."""

    files: tuple[str, ...] = ()
    gate: Callable[[Path], bool] | None = None
    extend: Callable[[Path, Record], None] | None = None


_REGISTERED: dict[str, Legacy] = {}


def register_legacy(
    kind: str,
    files: Iterable[str] = (),
    *,
    gate: Callable[[Path], bool] | None = None,
    extend: Callable[[Path, Record], None] | None = None,
) -> None:
    """Register how an old marker of ``kind`` (one of :data:`~lioncub.rundir.marker.KINDS`) is read
    (:class:`Legacy`); registering a kind again replaces it."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: allowed values are {list(KINDS)}")
    _REGISTERED[kind] = Legacy(tuple(files), gate, extend)


def adopt(path: Path, kind: str) -> Record:
    """The record of a marker without a list (``version`` 1): what that lioncub always wrote, by exact name
    (:func:`register_legacy`; nothing for a kind not registered in this process)."""
    legacy = _REGISTERED.get(kind)
    rec = Record(kind, version=1)
    if legacy is None or (legacy.gate is not None and not legacy.gate(path)):
        return rec  # nobody registered the kind in this process: nothing is lioncub's
    rec.files = {name: [] for name in legacy.files if regular_file(path / name)}
    if legacy.extend is not None:
        legacy.extend(path, rec)
    return rec


def adopt_run_subdirs(path: Path, rec: Record) -> None:
    """Add to ``rec`` the subdirectories of ``path`` that are marked run directories (a compare's runs)."""
    with contextlib.suppress(OSError):
        rec.dirs = {e.name for e in os.scandir(path) if real_dir(Path(e.path)) and is_marked(Path(e.path))}
