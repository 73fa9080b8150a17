"""What can never be an output directory: :func:`check_out_path`, before lioncub writes anything."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_out_path"]


def _short(text: str) -> str:
    return text if len(text) <= 80 else text[:60] + "…" + text[-16:]


def check_out_path(path: Path | str, option: str = "--out", *, below: int = 0) -> Path:
    """``path`` as a :class:`Path` if it can be an output directory; else ``ValueError`` naming ``option``
    and why: empty, ``/``, the working directory, an existing file or a path under one, a dangling
    symbolic link, a name or a path too long for the file system (lioncub writes up to ``below`` bytes
    below it: a run directory's deepest path is :data:`lioncub.train.runfiles.DEEPEST`), or no write
    permission where it would be created."""
    text = str(path)
    if not text.strip():
        raise ValueError(f"{option} {text!r}: give a directory name (an empty path is the working directory)")
    p = Path(text).expanduser()
    path_max = os.pathconf("/", "PC_PATH_MAX")
    if len(os.fsencode(str(p))) + below >= path_max:
        raise ValueError(
            f"{option} {_short(text)}: the path has {len(os.fsencode(str(p)))} bytes and lioncub writes "
            f"paths up to {below} bytes longer below it, but this system's paths hold at most "
            f"{path_max - 1}: choose a shorter {option}"
        )
    existing = _deepest_existing(p, option, text)
    resolved = p.resolve()
    if resolved == Path(resolved.anchor):
        raise ValueError(f"{option} {text}: the file system root cannot be a run directory")
    if resolved == Path.cwd().resolve():
        raise ValueError(
            f"{option} {text}: the working directory itself cannot be a run directory; name a new one"
        )
    if p.exists() and not p.is_dir():
        raise ValueError(f"{option} {_short(text)}: exists and is not a directory")
    if not existing.is_dir():
        raise ValueError(f"{option} {_short(text)}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {_short(text)}: {existing} is not writable by this user")
    return p


def _deepest_existing(p: Path, option: str, text: str) -> Path:
    """The deepest existing directory on the way to ``p`` (``p`` itself if it exists), checking every
    name's length and refusing a symbolic link to nothing on the way."""
    here = Path(p.anchor) if p.is_absolute() else Path(".")
    name_max = os.pathconf(here, "PC_NAME_MAX")
    walking = True
    for part in p.parts[1:] if p.is_absolute() else p.parts:
        if len(os.fsencode(part)) > name_max:
            raise ValueError(
                f"{option} {_short(text)}: the name {_short(part)!r} has {len(os.fsencode(part))} bytes; "
                f"this file system allows at most {name_max} per name"
            )
        nxt = here / part
        if walking and os.path.lexists(nxt):
            if nxt.is_symlink() and not nxt.exists():
                raise ValueError(
                    f"{option} {_short(text)}: {nxt} is a symbolic link to {os.readlink(nxt)}, which does "
                    "not exist; give an existing directory or a new name"
                )
            here = nxt
            if not nxt.is_dir():
                walking = False
        else:
            walking = False
    return here
