"""Deleting what lioncub wrote (:func:`remove_owned`): only recorded paths, nothing while anything else is
there, ``config.json`` last and the marker at the very end (an interrupted removal can be run again), never
through a link."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from lioncub.rundir.files import regular_file
from lioncub.rundir.marker import MARKER, OWN_FILES, Record, is_marked
from lioncub.rundir.record import write_record
from lioncub.rundir.survey import survey

__all__ = ["remove_owned"]


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
