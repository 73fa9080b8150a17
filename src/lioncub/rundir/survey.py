"""What a directory holds, sorted by lioncub's record into lioncub's and the user's (:func:`survey`): a
recorded path that is now a link, another kind of entry or other content is the user's, as is everything
unrecorded, and a run's record counts for nothing once its ``config.json`` is gone (``rm -r RUN/*``
leaves the dotfiles)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from lioncub.rundir.files import file_sha256, regular_file
from lioncub.rundir.marker import OWN_FILES, Record, is_marked
from lioncub.rundir.record import read_record

__all__ = ["Survey", "foreign_entries", "survey"]


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
        digests = rec.files.get(rel) if rec is not None else None  # None: not a recorded file
        recorded = digests is not None or (rec is not None and rel in rec.dirs)
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
        elif digests is not None and entry.is_file(follow_symlinks=False):
            if not digests or file_sha256(Path(entry.path)) in digests:
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
