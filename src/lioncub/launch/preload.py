"""Ranks forked from a preloaded interpreter: a rank of ``python -m MODULE ...`` started as a fork of a
process (the *zygote*) that has already imported torch, instead of as a fresh interpreter.

Why: a fresh rank spends about 3 s of CPU importing torch and ``torch._dynamo`` (which the first
``torch.optim`` optimizer or DDP imports) before it trains; ``lioncub compare`` pays that for every rank of
every variant, and on a 2-core machine 4 ranks' imports take longer than a short run's training. A zygote
imports once per launching process and forks each rank in milliseconds, as ``torch.multiprocessing``'s
forkserver does.

What a forked rank gets is what ``python -m MODULE ARGS`` would have given it: its own session and process
group (``start_new_session``), SIGTERM when the zygote dies (which dies with the launcher, so a killed
launcher still takes its ranks with it), stdin on ``/dev/null``, stdout and stderr on the launcher's pipes,
its environment and working directory, ``sys.argv`` and ``__main__`` as ``-m`` sets them, Python's own exit
(atexit handlers, the exit status, death by an uncaught signal). The launcher sees a :class:`ForkedRank`
with the subset of :class:`subprocess.Popen` it uses (``pid``, ``stdout``, ``stderr``, ``poll``,
``wait``); the zygote reports each rank's exit status as ``Popen.returncode`` would (``-N``: signal N).

What differs: the preloaded modules were imported under the zygote's environment, the variables the ranks
share (:func:`shared_env`; a launch whose shared environment differs on any variable other than
:data:`RUNTIME_ONLY` gets a new zygote); their import-time warnings are not repeated per rank; and every rank
starts with the hash seed and numpy's global random state of the zygote (Python's :mod:`random` is reseeded
on fork). Only launches that ask for it fork ranks (``LaunchConfig.preload``, ``lioncub launch --preload``):
``lioncub train`` does for ranks on the CPU under ``--nproc``, unless ``LIONCUB_PRELOAD=0``. Behind emulated
links (``--link``) a forked rank enters its network namespace as ``ip netns exec`` would (the namespace, a
mount namespace with that network's ``/sys`` and ``/etc/netns/NAME`` over ``/etc``); under ``--nnodes``
torchrun starts the ranks.

Protocol (a ``SOCK_SEQPACKET`` socket pair, one JSON object per packet): the zygote sends ``{"ready":
true}`` or ``{"error": ...}`` once its imports are done; the launcher sends ``{"argv": [...], "env": {...},
"cwd": ..., "netns": NAME or null}`` with the rank's stdout and stderr as passed descriptors, the zygote
answers ``{"pid": P}`` (once the rank leads its own session) and later ``{"exit": P, "code": C}``. The
zygote exits when the launcher closes its end. Every wait of the launcher on the zygote is bounded
(:data:`START_TIMEOUT_S`, :data:`FORK_TIMEOUT_S`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any

from lioncub.launch.environment import TORCHRUN_VARIABLES
from lioncub.launch.supervisor import pdeathsig_setup

__all__ = [
    "FORK_TIMEOUT_S",
    "MODULES",
    "RUNTIME_ONLY",
    "START_TIMEOUT_S",
    "ForkedRank",
    "PreloadError",
    "Zygote",
    "shared_env",
    "zygote_for",
]

#: what a zygote imports: torch, torch._dynamo (imported by the first optimizer or DDP), torch.distributed
MODULES = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel")
#: variables (names, or prefixes ending in ``_``) that are set per launch or per test and read only at run
#: time, never while torch imports: the zygote's environment leaves them out (each rank gets its own)
RUNTIME_ONLY = (*TORCHRUN_VARIABLES, "GLOO_SOCKET_IFNAME", "PYTEST_CURRENT_TEST", "LIONCUB_")
_PACKET = 1 << 20  # the largest message (an environment) in bytes
#: seconds the zygote may take to import its modules, and to answer a fork request
START_TIMEOUT_S, FORK_TIMEOUT_S = 300.0, 60.0


class PreloadError(OSError):
    """The zygote could not start, import its modules or fork a rank."""


class ForkedRank:
    """A rank the zygote forked: the part of :class:`subprocess.Popen` the launcher uses."""

    def __init__(self, pid: int, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self.returncode: int | None = None
        self._done = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired([f"rank pid {self.pid}"], timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


def _send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    if len(data) > _PACKET:
        raise PreloadError(f"a message to or from the zygote is {len(data)} bytes, above {_PACKET}")
    socket.send_fds(sock, [data], list(fds))


def _receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and its descriptors; ``(None, [])`` at the end of the stream."""
    data, fds, _, _ = socket.recv_fds(sock, _PACKET, 4)
    return (json.loads(data) if data else None), fds


class Zygote:
    """One preloaded interpreter (``python -m lioncub.launch.preload``), started by :meth:`start` in ``cwd``
    with ``env``; :meth:`fork` starts a rank. Thread-safe."""

    def __init__(self, executable: str, modules: Sequence[str], env: Mapping[str, str], cwd: str) -> None:
        self.executable, self.modules, self.env, self.cwd = executable, tuple(modules), dict(env), cwd
        self.lock = threading.Lock()
        self.replies: list[dict[str, Any]] = []
        self.replied = threading.Condition(self.lock)
        self.ranks: dict[int, ForkedRank] = {}
        self.exits: dict[int, int] = {}  # exits read before their rank was registered
        self.closed = False
        self.thread = threading.current_thread()  # PR_SET_PDEATHSIG follows the thread that started it

    def start(self) -> None:
        """Start the zygote and wait for its imports; raises :class:`PreloadError` if they fail."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        try:
            self.proc = subprocess.Popen(
                [self.executable, "-m", "lioncub.launch.preload", str(theirs.fileno()), *self.modules],
                env=self.env,
                cwd=self.cwd,
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=pdeathsig_setup(),
            )
        except OSError as exc:
            ours.close()
            raise PreloadError(f"could not start {self.executable}: {exc}") from exc
        finally:
            theirs.close()
        self.sock.settimeout(START_TIMEOUT_S)
        try:
            message, _ = _receive(self.sock)
        except TimeoutError:
            message = {"error": f"importing {', '.join(self.modules)} took more than {START_TIMEOUT_S:g} s"}
        self.sock.settimeout(None)
        if message is None or "ready" not in message:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=10)
            why = (message or {}).get("error") or err.decode(errors="replace").strip()[-400:] or "no reason"
            self.sock.close()
            raise PreloadError(f"the preloaded interpreter did not start: {why}")
        assert self.proc.stderr is not None
        self.proc.stderr.close()
        threading.Thread(target=self._read, name="lioncub-zygote", daemon=True).start()

    def alive(self) -> bool:
        return not self.closed and self.proc.poll() is None and self.thread.is_alive()

    def fork(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None) -> ForkedRank:
        """Start ``argv`` (``[python, "-m", MODULE, *ARGS]``, or that behind ``[ip, "netns", "exec",
        NAME]``) as a fork of the zygote, like ``subprocess.Popen(argv, env=env, cwd=cwd, stdin=DEVNULL,
        stdout=PIPE, stderr=PIPE, start_new_session=True)``."""
        netns = None
        if len(argv) > 4 and os.path.basename(argv[0]) == "ip" and list(argv[1:3]) == ["netns", "exec"]:
            netns, argv = argv[3], argv[4:]
        request = {"argv": list(argv[1:]), "env": dict(env), "cwd": cwd or self.cwd, "netns": netns}
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            with self.lock:
                if self.closed:
                    raise PreloadError("the preloaded interpreter has exited")
                _send(self.sock, request, [out_w, err_w])
                if not self.replied.wait_for(lambda: self.replies or self.closed, FORK_TIMEOUT_S):
                    self.closed = True  # a late answer would be taken for the next request's: replace it
                    self.proc.kill()
                    raise PreloadError(
                        f"the preloaded interpreter did not fork the rank in {FORK_TIMEOUT_S:g} s"
                    )
                if not self.replies:
                    raise PreloadError("the preloaded interpreter exited before it forked the rank")
                reply = self.replies.pop(0)
                if "pid" not in reply:
                    raise PreloadError(f"the preloaded interpreter could not fork the rank: {reply['error']}")
                rank = ForkedRank(reply["pid"], os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))
                self.ranks[rank.pid] = rank
                if rank.pid in self.exits:
                    rank._exited(self.exits.pop(rank.pid))
                return rank
        except BaseException:
            for fd in (out_r, err_r):
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)

    def _read(self) -> None:
        """The zygote's replies and exit reports, until it exits; then its ranks are killed."""
        while True:
            try:
                message, fds = _receive(self.sock)
            except OSError:
                message, fds = None, []
            for fd in fds:
                os.close(fd)
            with self.lock:
                if message is None:
                    break
                if "exit" in message:
                    pid, code = message["exit"], message["code"]
                    rank = self.ranks.pop(pid, None)
                    if rank is None:
                        self.exits[pid] = code
                    else:
                        rank._exited(code)
                else:
                    self.replies.append(message)
                    self.replied.notify_all()
        with self.lock:  # its ranks got SIGTERM from its death; nobody reports their exit now
            self.closed = True
            self.replied.notify_all()
            for pid, rank in self.ranks.items():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                rank._exited(-signal.SIGKILL)
            self.ranks.clear()

    def close(self) -> None:
        """End the zygote (the ranks it forked are not waited for)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5.0)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.sock.close()


def shared_env(envs: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """The zygote's environment for ranks with environments ``envs``: the variables they all have with the
    same value, but :data:`RUNTIME_ONLY`."""
    first, *rest = envs

    def kept(name: str, value: str) -> bool:
        runtime = any(name.startswith(p) if p.endswith("_") else name == p for p in RUNTIME_ONLY)
        return not runtime and all(e.get(name) == value for e in rest)

    return {k: v for k, v in first.items() if kept(k, v)}


_zygotes: dict[tuple, Zygote] = {}
_zygotes_lock = threading.Lock()


def zygote_for(env: Mapping[str, str], cwd: str, modules: Sequence[str] = MODULES) -> Zygote:
    """A running zygote of this interpreter with environment ``env`` (:func:`shared_env`) in ``cwd``: the
    one an earlier launch of this process started with the same, else a new one (raises
    :class:`PreloadError` if it cannot start)."""
    key = (sys.executable, os.path.realpath(cwd), tuple(modules), tuple(sorted(env.items())))
    with _zygotes_lock:
        zygote = _zygotes.get(key)
        if zygote is not None and zygote.alive():
            return zygote
        if zygote is not None:
            zygote.close()
        zygote = Zygote(sys.executable, modules, env, cwd)
        zygote.start()
        _zygotes[key] = zygote
        return zygote


@atexit.register
def _close_all() -> None:
    for zygote in _zygotes.values():
        zygote.close()
    _zygotes.clear()


# -- the zygote's side -----------------------------------------------------------------------------------


def _serve(sock: socket.socket, modules: Sequence[str]) -> dict[str, Any] | None:
    """The zygote: import ``modules``, then fork a rank per request until the launcher closes ``sock``.
    Returns ``None`` in the zygote, and the request in a forked rank (which then runs it)."""
    import importlib

    try:
        for name in modules:
            importlib.import_module(name)
        if threading.active_count() != 1:
            raise PreloadError(f"importing {', '.join(modules)} started Python threads; forking is unsafe")
    except BaseException as exc:
        _send(sock, {"error": f"{type(exc).__name__}: {exc}"})
        return None
    _send(sock, {"ready": True})
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    deathsig = pdeathsig_setup()  # a rank gets SIGTERM when this zygote dies
    while True:
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        _report_exits(sock)
        if sock not in ready:
            continue
        message, fds = _receive(sock)
        if message is None:
            return None
        set_up_r, set_up_w = os.pipe()  # closed by the rank once it leads its own session
        try:
            pid = os.fork()
        except OSError as exc:
            _send(sock, {"error": str(exc)})
            pid = -1
        if pid == 0:  # the rank
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w, set_up_r):
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
            return message
        for fd in (set_up_w, *fds):
            os.close(fd)
        if pid > 0:  # the launcher may signal the rank's process group once it has the pid: wait for it
            os.read(set_up_r, 1)
            _send(sock, {"pid": pid})
        os.close(set_up_r)


def _report_exits(sock: socket.socket) -> None:
    """Reap every rank that exited and tell the launcher its exit status."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _enter_netns(name: str) -> None:
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


def _run_rank(request: dict[str, Any]) -> None:
    """Become ``python ARGV`` (``ARGV``: ``-m MODULE ARGS``) in the request's ``cwd`` with its ``env``,
    inside network namespace ``netns`` if given."""
    import runpy

    argv, env, cwd, netns = request["argv"], request["env"], request["cwd"], request.get("netns")
    if len(argv) < 2 or argv[0] != "-m":
        raise SystemExit(f"lioncub.launch.preload: a rank runs `-m MODULE ...`, got {argv!r}")
    if netns is not None:
        try:
            _enter_netns(netns)
        except OSError as exc:
            raise SystemExit(
                f"lioncub.launch.preload: cannot enter network namespace {netns}: {exc}"
            ) from None
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["-m", *argv[2:]]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m lioncub.launch.preload FD [MODULE ...]  (started by the launcher)")
    _sock = socket.socket(fileno=int(sys.argv[1]))
    _rank = _serve(_sock, sys.argv[2:])
    if _rank is not None:
        del _sock
        _run_rank(_rank)
