"""Opening and writing the files of a run directory: never blocking, never through a symbolic link.

:func:`open_run_file` is how lioncub opens any file of a run, compare or plots directory (its record, its
locks, ``config.json``, ``log.jsonl``, a checkpoint's ``latest`` and ``meta.json`` ...): a FIFO, a socket
or a device there is refused with :class:`SpecialFileError` naming the path, checked before the open and
again on the open descriptor, and the open itself never waits (``O_NONBLOCK``), so a named pipe put where
lioncub reads cannot hang it. :func:`write_atomically` writes beside the name and renames into place (a
link at the name is replaced, never followed); :func:`open_append` appends with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from pathlib import Path

__all__ = [
    "SpecialFileError",
    "file_sha256",
    "fsync_dir",
    "open_append",
    "open_run_file",
    "read_run_file",
    "real_dir",
    "refuse_special",
    "regular_file",
    "write_atomically",
]

#: the entries lioncub never opens as a run file, by their ``stat`` type: opening a FIFO waits for its
#: other end, a socket cannot be opened, and opening a device acts on it
SPECIAL = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


class SpecialFileError(ValueError):
    """A run file that is a FIFO, a socket or a device (:data:`SPECIAL`): lioncub does not open it."""


def _refuse_special(path: Path | str, mode: int) -> None:
    what = SPECIAL.get(stat.S_IFMT(mode))
    if what is not None:
        raise SpecialFileError(
            f"{path} is {what}, not a regular file: lioncub opens no run file that could block it or act "
            "on a device; remove it (or choose another directory)"
        )


def refuse_special(path: Path | str, *, follow_symlinks: bool = False) -> None:
    """:class:`SpecialFileError` naming ``path`` if it is a FIFO, a socket or a device (nothing if it is
    missing or cannot be looked at): a check before work that ends in opening it."""
    with contextlib.suppress(OSError):
        _refuse_special(path, os.stat(path, follow_symlinks=follow_symlinks).st_mode)


def open_run_file(
    path: Path | str, flags: int = os.O_RDONLY, mode: int = 0o644, *, follow_symlinks: bool = False
) -> int:
    """A blocking descriptor of run file ``path``, opened with ``flags`` (and ``O_CLOEXEC``; ``O_NOFOLLOW``
    unless ``follow_symlinks``) without ever waiting in the open. :class:`SpecialFileError` naming the path
    if it is a FIFO, a socket or a device (nothing is then read or written); otherwise what ``os.open``
    raises (``FileNotFoundError``; ``OSError`` ``ELOOP`` for a symbolic link when not followed)."""
    with contextlib.suppress(FileNotFoundError):  # os.open says so, or creates it (O_CREAT)
        _refuse_special(path, os.stat(path, follow_symlinks=follow_symlinks).st_mode)
    nofollow = 0 if follow_symlinks else os.O_NOFOLLOW
    fd = os.open(path, flags | os.O_NONBLOCK | nofollow | os.O_CLOEXEC, mode)
    try:
        _refuse_special(path, os.fstat(fd).st_mode)  # it was replaced between the check and the open
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_run_file(path: Path | str, limit: int = -1, *, follow_symlinks: bool = False) -> bytes:
    """The bytes of run file ``path`` (at most ``limit``; -1: all) through :func:`open_run_file`."""
    with os.fdopen(open_run_file(path, follow_symlinks=follow_symlinks), "rb") as f:
        return f.read(limit)


def regular_file(path: Path) -> bool:
    """Whether ``path`` is a regular file itself (not a symbolic link to one)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def real_dir(path: Path) -> bool:
    """Whether ``path`` is a directory itself (not a symbolic link to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def file_sha256(path: Path) -> str | None:
    """The SHA-256 (hex) of regular file ``path`` (None if it cannot be opened without following a link)."""
    try:
        fd = open_run_file(path)
    except OSError:
        return None
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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


def open_append(path: Path) -> int:
    """A file descriptor appending to ``path`` (created if missing), never through a symbolic link
    (:func:`open_run_file`: a FIFO there is refused, not waited on)."""
    return open_run_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
