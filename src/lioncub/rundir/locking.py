"""One writer per directory: advisory locks (``fcntl.flock``) on lioncub's lock files.

A process that writes a run, compare or plots directory -- the driver of ``lioncub train`` and ``lioncub
compare``, ``lioncub report``, rank 0 of a ``lioncub train`` that ``torchrun`` or ``lioncub launch``
started -- holds an exclusive lock on ``DIR/.lioncub.lock`` for as long as it writes
(:func:`lock_writer`); another one is refused with a ``ValueError`` naming the process that holds it. The
ranks a driver starts write too, so their rank 0 holds a shared lock on ``DIR/.lioncub.ranks.lock`` for
its whole life (:func:`hold_ranks`) and :func:`lock_writer` refuses while any does: ranks left running by
a launcher that was killed keep the directory until they have stopped. The kernel releases a lock when
its process ends, however it ends; the lock files are never written. A lock file lioncub created is
removed with the directory's other files (:func:`lioncub.rundir.remove_owned`), after which a process that
opened it before retries on the new one (the inode is checked after locking). A lock file that is a FIFO,
a socket or a device is refused (:func:`lioncub.rundir.files.open_run_file`), as is a symbolic link.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path

from lioncub.rundir.files import open_run_file
from lioncub.rundir.marker import LOCK, RANKS_LOCK

__all__ = ["DirLock", "hold_ranks", "holder", "lock_writer"]


@dataclass
class DirLock:
    """A lock held on ``path`` (a lock file) through ``fd``; ``created``: this process made the file."""

    path: Path
    fd: int
    created: bool

    def release(self) -> None:
        """Let go of the lock (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _open(path: Path, create: bool) -> tuple[int, bool]:
    """A descriptor of lock file ``path`` (created if ``create``) and whether this call created it; never
    through a symbolic link, nor a FIFO, socket or device (``ValueError``). ``FileNotFoundError`` if it is
    missing and not ``create``."""
    flags = os.O_RDWR
    try:
        try:
            return open_run_file(path, flags | os.O_CREAT | os.O_EXCL) if create else open_run_file(
                path, flags
            ), create
        except FileExistsError:
            return open_run_file(path, flags), False
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise ValueError(
            f"{path} is a symbolic link, which lioncub's lock file never is: remove it"
        ) from None


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def holder(path: Path, fd: int | None = None) -> str:
    """Who holds a lock on ``path`` (from ``/proc/locks``): ``process 123 (lioncub train --out x)``, or
    ``another process`` where the system does not say (another host, a file system without it)."""
    try:
        inode = os.fstat(fd).st_ino if fd is not None else os.stat(path).st_ino
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return "another process"
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
            pid = fields[4]
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except (OSError, UnicodeDecodeError):
                command = ""
            if len(command) > 160:
                command = command[:157] + "…"
            return f"process {pid}" + (f" ({command})" if command else "")
    return "another process"


def lock_writer(directory: Path, option: str = "--out") -> DirLock:
    """The writer's lock of ``directory`` (created, with its parents, if missing), held until released or
    the process ends. ``ValueError`` naming ``option`` and the process in the way if another writer holds
    it, or if the ranks of an earlier run still write there."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK
    for _ in range(10):
        fd, created = _open(path, create=True)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = holder(path, fd)
            os.close(fd)
            raise ValueError(
                f"{option} {directory} is in use by {who}: one process writes a run directory at a time; "
                f"wait until it has finished (or stop it), or choose another {option}"
            ) from None
        if _same_file(path, fd):
            break
        os.close(fd)  # the holder before removed the file after this process opened it: take the new one
    else:
        raise ValueError(f"{option} {directory}: its lock file keeps being replaced; try again")
    lock = DirLock(path, fd, created)
    try:
        _refuse_running_ranks(directory, option)
    except BaseException:
        if created:
            os.unlink(path)  # leave the directory as it was
        lock.release()
        raise
    return lock


def _refuse_running_ranks(directory: Path, option: str) -> None:
    """``ValueError`` if rank 0 of an earlier run still holds ``directory``'s ranks lock."""
    try:
        fd, _ = _open(directory / RANKS_LOCK, create=False)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = holder(directory / RANKS_LOCK, fd)
        raise ValueError(
            f"{option} {directory}: the ranks of an earlier run still write there ({who}); "
            "they stop by themselves once their launcher is gone: try again in a moment"
        ) from None
    finally:
        os.close(fd)


def hold_ranks(directory: Path, timeout_s: float = 30.0) -> DirLock:
    """Rank 0 of a driven run: a shared lock on ``directory``'s ranks lock for the life of the process
    (waits up to ``timeout_s`` while a writer briefly checks it)."""
    path = Path(directory) / RANKS_LOCK
    deadline = time.monotonic() + timeout_s
    while True:
        fd, created = _open(path, create=True)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{path}: held exclusively by {holder(path)} for {timeout_s:g} s"
                ) from None
            time.sleep(0.05)
            continue
        if _same_file(path, fd):
            return DirLock(path, fd, created)
        with contextlib.suppress(OSError):
            os.close(fd)
