"""The zygote's side of :mod:`lioncub.launch.preload`: ``python -m lioncub.launch.zygote FD MODULE ...``
imports the modules, then forks a rank per request of the launcher on socket ``FD``; each rank becomes
``python -m MODULE ARGS`` as a fresh interpreter would be.

Run as its own ``__main__``, never imported by :mod:`lioncub.launch` (``python -m`` of a module that its
package had already imported warns, and under ``PYTHONWARNINGS=error`` fails).

Before each fork the zygote makes sure a fork is safe: no thread besides its own (counted in
``/proc/self/task``, native threads included; a library's pool that stops at a fork, such as OpenBLAS's,
is stopped by a probe fork first) and no CUDA initialized by torch. Each rank then draws its random state
as a fresh interpreter does (:func:`reseed`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from lioncub.launch.preload import end_rank, receive, send
from lioncub.launch.supervisor import pdeathsig_setup

__all__ = ["enter_netns", "fork_hazard", "reseed", "run_rank", "serve"]

#: seconds a probe fork may take to exit (it only runs the at-fork handlers)
PROBE_TIMEOUT_S = 5.0


def serve(sock: socket.socket, modules: Sequence[str]) -> dict[str, Any] | None:
    """The zygote: import ``modules``, then fork a rank per request until the launcher closes ``sock``.
    Returns ``None`` in the zygote, and the request in a forked rank (which then runs it)."""
    try:
        for name in modules:
            importlib.import_module(name)
        hazard = fork_hazard(modules)
    except BaseException as exc:
        hazard = f"{type(exc).__name__}: {exc}"
    if hazard is not None:
        send(sock, {"error": hazard})
        return None
    # the imports' objects are kept as they are: the ranks' collections (and the full one at their exit,
    # about 1 s of a core each with torch imported) skip them, and their pages stay shared after the fork
    gc.collect()
    gc.freeze()
    send(sock, {"ready": True})
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    deathsig = pdeathsig_setup()  # a rank gets SIGTERM when this zygote dies
    watched: list[socket.socket | int] = [sock, wake_r]
    while True:
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select(watched, [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        _report_exits(sock)
        if sock not in ready:
            continue
        message, fds = receive(sock)
        if message is None:
            return None
        if (hazard := fork_hazard(modules)) is not None:
            send(sock, {"error": hazard})
            for fd in fds:
                os.close(fd)
            continue
        if _fork(sock, fds, deathsig, (wake_r, wake_w)):
            return message


def _fork(
    sock: socket.socket, fds: list[int], deathsig: Callable[[], None] | None, own: tuple[int, int]
) -> bool:
    """Fork a rank with stdout and stderr on ``fds`` and tell the launcher its pid once it leads its own
    session; ``True`` in the rank (set up: the zygote's descriptors ``own`` and ``sock`` closed)."""
    set_up_r, set_up_w = os.pipe()  # closed by the rank once it leads its own session
    try:
        pid = os.fork()
    except OSError as exc:
        send(sock, {"error": str(exc)})
        pid = -1
    if pid == 0:  # the rank
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (*own, set_up_r):
            os.close(fd)
        sock.close()
        os.setsid()
        if deathsig is not None:
            deathsig()
        devnull = os.open(os.devnull, os.O_RDONLY)
        for target, fd in ((0, devnull), (1, fds[0]), (2, fds[1])):
            os.dup2(fd, target)
        for fd in (devnull, set_up_w, *fds):
            os.close(fd)
        return True
    for fd in (set_up_w, *fds):
        os.close(fd)
    if pid > 0:  # the launcher may signal the rank's process group once it has the pid: wait for it
        os.read(set_up_r, 1)
        send(sock, {"pid": pid})
    os.close(set_up_r)
    return False


def _report_exits(sock: socket.socket) -> None:
    """Reap every rank that exited and tell the launcher its exit status."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _threads() -> int:
    """This process's threads, native ones included."""
    return len(os.listdir("/proc/self/task"))


def _probe_fork() -> None:
    """Fork a child that exits at once: the libraries' at-fork handlers run, and those that stop their
    thread pools for a fork (OpenBLAS: started again when next needed) stop them here too."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.001)


def fork_hazard(modules: Sequence[str]) -> str | None:
    """Why forking this process now is unsafe, or ``None``: torch initialized CUDA (a forked process cannot
    use it), or a thread besides this one is running (a fork copies only the thread that forks; a lock
    another thread held stays locked forever in the rank)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return f"importing {', '.join(modules)} initialized CUDA, which a forked process cannot use"
    if _threads() > 1:
        _probe_fork()
    extra = _threads() - 1
    if extra == 0:
        return None
    python = threading.active_count() - 1
    return (
        f"importing {', '.join(modules)} left {extra} native thread{'s' if extra != 1 else ''} running "
        f"besides the main one{f' ({python} of them Python threads)' if python else ''}; a fork copies only "
        "the thread that forks, so a lock another one held would stay locked in the rank"
    )


def reseed() -> None:
    """Draw the random state a fresh interpreter would have, from the OS's entropy as it does: torch's CPU
    generator, numpy's global ``RandomState`` and :mod:`random` (which CPython also reseeds at a fork), each
    as loaded here. CUDA's generators are made and seeded from entropy in the rank, at its first use of
    CUDA, as in a fresh interpreter (:func:`fork_hazard`: the zygote never initialized CUDA). A rank's own
    seeding comes after this and wins. The hash seed cannot be drawn again in a running interpreter: every
    rank of a zygote has the zygote's (:mod:`lioncub.launch.preload` says what that means)."""
    if (random := sys.modules.get("random")) is not None:
        random.seed()
    if (numpy_random := sys.modules.get("numpy.random")) is not None:
        numpy_random.seed()
    if (torch := sys.modules.get("torch")) is not None:
        torch.default_generator.seed()


def enter_netns(name: str) -> None:
    """What ``ip netns exec NAME`` does before it runs its command: join network namespace ``NAME``, in a
    mount namespace of its own whose ``/sys`` describes that network and whose ``/etc`` shows the files of
    ``/etc/netns/NAME`` (iproute2's ``netns_switch`` and ``bind_etc``)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        check(libc.setns(fd, 0x40000000), "setns(CLONE_NEWNET)")
    finally:
        os.close(fd)
    check(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"", b"/", b"none", 0x80000 | 0x4000, None), "mount --make-rslave /")  # MS_SLAVE|MS_REC
    flags = 0
    if libc.umount2(b"/sys", 2) != 0 and os.statvfs("/sys").f_flag & os.ST_RDONLY:  # MNT_DETACH
        flags = 1  # MS_RDONLY: a read-only sysfs cannot be shadowed by a writable one
    check(libc.mount(name.encode(), b"/sys", b"sysfs", flags, None), "mount sysfs on /sys")
    etc = f"/etc/netns/{name}"  # the namespace's own files (lioncub writes its hosts) over /etc's
    for entry in sorted(os.listdir(etc)) if os.path.isdir(etc) else []:
        source, target = f"{etc}/{entry}".encode(), f"/etc/{entry}".encode()
        check(libc.mount(source, target, b"none", 4096, None), f"mount --bind {etc}/{entry} /etc/{entry}")


def run_rank(request: dict[str, Any]) -> None:
    """Become ``python ARGV`` (``ARGV``: ``-m MODULE ARGS`` or ``-c CODE ARGS``) in the request's ``cwd``
    with its ``env``, inside network namespace ``netns`` if given, with a random state of its own."""
    import runpy

    argv, env, cwd, netns = request["argv"], request["env"], request["cwd"], request["netns"]
    if len(argv) < 2 or argv[0] not in ("-m", "-c"):
        raise SystemExit(f"lioncub.launch.zygote: a rank runs `-m MODULE ...` or `-c CODE`, got {argv!r}")
    if netns is not None:
        try:
            enter_netns(netns)
        except OSError as exc:
            why = f"cannot enter network namespace {netns}: {exc}"
            raise SystemExit(f"lioncub.launch.zygote: {why}") from None
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    reseed()
    if argv[0] == "-c":  # as `python -c CODE ARGS`: sys.argv[0] is "-c", the code runs as __main__
        import types

        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""  # as `python -c` puts it: the working directory, as it is when imports run
        main = types.ModuleType("__main__")  # not the zygote's module: none of its names
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), vars(main))
        return
    sys.argv = ["-m", *argv[2:]]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m lioncub.launch.zygote FD [MODULE ...]  (started by the launcher)")
    _sock = socket.socket(fileno=int(sys.argv[1]))
    _rank = serve(_sock, sys.argv[2:])
    if _rank is None:  # the zygote, done: without the teardown of what it imported (~0.1 s of a core)
        end_rank(0)
    del _sock
    run_rank(_rank)
