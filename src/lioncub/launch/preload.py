"""Ranks forked from a preloaded interpreter: a rank of ``python -m MODULE ...`` started as a fork of a
process (the *zygote*, :mod:`lioncub.launch.zygote`) that has already imported torch, instead of as a fresh
interpreter.

Why: a fresh rank spends about 3 s of CPU importing torch and ``torch._dynamo`` (which the first
``torch.optim`` optimizer or DDP imports) before it trains; ``lioncub compare`` pays that for every rank of
every variant, and on a 2-core machine 4 ranks' imports take longer than a short run's training. A zygote
imports once per launching process and forks each rank in milliseconds, as ``torch.multiprocessing``'s
forkserver does.

What a forked rank gets is what ``python -m MODULE ARGS`` would have given it: its own session and process
group (``start_new_session``), SIGTERM when the zygote dies (which dies with the launcher, so a killed
launcher still takes its ranks with it), stdin on ``/dev/null``, stdout and stderr on the launcher's pipes,
its environment and working directory, ``sys.argv`` and ``__main__`` as ``-m`` sets them, Python's own exit
(atexit handlers, the exit status, death by an uncaught signal), and random state of its own: torch's,
numpy's and :mod:`random`'s generators drawn from the OS's entropy, as a fresh interpreter draws them
(distinct per rank and per run; a script that seeds gets its seed). The launcher sees a :class:`ForkedRank`
with the subset of :class:`subprocess.Popen` it uses (``pid``, ``stdout``, ``stderr``, ``poll``,
``wait``); the zygote reports each rank's exit status as ``Popen.returncode`` would (``-N``: signal N), and
a rank that the zygote's death took with it says so (``ForkedRank.reason``).

What differs: the preloaded modules were imported under the zygote's environment, the variables the ranks
share (:func:`shared_env`; a launch whose shared environment differs on any variable other than
:data:`RUNTIME_ONLY` gets a new zygote); their import-time warnings are not repeated per rank; a generator
that a preloaded module itself seeded while it was imported is drawn again in each rank; and the hash seed
(``str`` hashes, the order of a set of strings): a fresh interpreter draws its own unless
``PYTHONHASHSEED`` is set, a running one cannot draw another, so every rank of a zygote has the zygote's
(the same on all ranks; ``PYTHONHASHSEED`` set for the launch reaches the zygote, which then has exactly
that seed); and the objects of the preloaded imports are frozen (``gc.freeze`` in the zygote, after a
collection): a rank's garbage collections, and the full one at its exit, skip them (about 0.6 s of a core
per rank with torch imported, measured on a 2-core AMD EPYC VM), and their pages stay shared. lioncub's
own processes (its training ranks, its replica groups, the zygote) end through :func:`end_rank`: as Python's
exit, without the teardown that would write those pages; a user's module keeps Python's own exit.

When a rank is not forked: only launches that ask for it fork ranks (``LaunchConfig.preload``,
``lioncub launch --preload``): ``lioncub train`` does for ranks on the CPU under ``--nproc``, unless
``LIONCUB_PRELOAD=0``. On a machine with a GPU (:data:`GPU_DEVICE_FILES`) ranks that may use it start fresh
(:func:`gpu_refusal`); a zygote whose imports started threads (native ones included) or initialized CUDA,
or that cannot start, leaves every rank a fresh interpreter, with a note saying why. Behind emulated links
(``--link``) a forked rank enters its network namespace as ``ip netns exec`` would (the namespace, a mount
namespace with that network's ``/sys`` and ``/etc/netns/NAME`` over ``/etc``); under ``--nnodes`` torchrun
starts the ranks.

A launching process keeps one zygote (:func:`lease`): a launch whose environment, working directory or
modules differ from the last one's replaces it, and the old one is closed as soon as no launch holds it.

Protocol (a ``SOCK_SEQPACKET`` socket pair, one JSON object per packet): the zygote sends ``{"ready":
true}`` or ``{"error": ...}`` once its imports are done; the launcher sends ``{"argv": ["-m", MODULE,
...], "env": {...}, "cwd": ..., "netns": NAME or null}`` with the rank's stdout and stderr as passed
descriptors, the zygote answers ``{"pid": P}`` (once the rank leads its own session) or ``{"error": ...}``
and later ``{"exit": P, "code": C}``. The zygote exits when the launcher closes its end. Every wait of the
launcher on the zygote is bounded (:data:`START_TIMEOUT_S`, :data:`FORK_TIMEOUT_S`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any, NoReturn

from lioncub.launch.environment import TORCHRUN_VARIABLES
from lioncub.launch.supervisor import pdeathsig_setup

__all__ = [
    "FORK_TIMEOUT_S",
    "GPU_DEVICE_FILES",
    "MODULES",
    "RUNTIME_ONLY",
    "START_TIMEOUT_S",
    "ForkedRank",
    "PreloadError",
    "Zygote",
    "end_rank",
    "gpu_refusal",
    "lease",
    "receive",
    "send",
    "shared_env",
]

#: what a zygote imports: torch, torch._dynamo (imported by the first optimizer or DDP), torch.distributed
MODULES = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel")
#: variables (names, or prefixes ending in ``_``) that are set per launch or per test and read only at run
#: time, never while torch imports: the zygote's environment leaves them out (each rank gets its own).
#: torchrun's line prefix is set for the agents of a launch across nodes only, which a plain launch of the
#: same process then shares a zygote with
RUNTIME_ONLY = (
    *TORCHRUN_VARIABLES, "GLOO_SOCKET_IFNAME", "PYTEST_CURRENT_TEST", "LIONCUB_",
    "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
)  # fmt: skip
#: device files of NVIDIA's driver, AMD's (ROCm) and WSL's: a machine with one may run ranks on a GPU
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
_PACKET = 1 << 20  # the largest message (an environment) in bytes
#: seconds the zygote may take to import its modules, and to answer a fork request
START_TIMEOUT_S, FORK_TIMEOUT_S = 300.0, 60.0


class PreloadError(OSError):
    """The zygote could not start, import its modules or fork a rank."""


class ForkedRank:
    """A rank the zygote forked: the part of :class:`subprocess.Popen` the launcher uses, and ``reason``:
    why it ended when that was not its own doing (the zygote died), else ``None``."""

    def __init__(self, pid: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self.returncode: int | None = None
        self.reason: str | None = None
        self._done = threading.Event()

    def _exited(self, code: int, reason: str | None = None) -> None:
        self.returncode, self.reason = code, reason
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired([f"rank pid {self.pid}"], timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send one message of the protocol, with descriptors ``fds``."""
    data = json.dumps(message).encode()
    if len(data) > _PACKET:
        raise PreloadError(f"a message to or from the zygote is {len(data)} bytes, above {_PACKET}")
    socket.send_fds(sock, [data], list(fds))


def receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and its descriptors; ``(None, [])`` at the end of the stream."""
    data, fds, _, _ = socket.recv_fds(sock, _PACKET, 4)
    return (json.loads(data) if data else None), fds


def _key(
    executable: str, cwd: str, modules: Sequence[str], env: Mapping[str, str]
) -> tuple[str, str, tuple[str, ...], tuple[tuple[str, str], ...]]:
    """What makes two zygotes the same: the interpreter, directory, modules and environment."""
    return executable, os.path.realpath(cwd), tuple(modules), tuple(sorted(env.items()))


def _how(code: int | None) -> str:
    """How a process ended: ``killed by SIGKILL``, ``exited with code 1``."""
    if code is None:
        return "it stopped answering"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exited with code {code}"


class Zygote:
    """One preloaded interpreter (``python -m lioncub.launch.zygote``), started by :meth:`start` in ``cwd``
    with ``env``; :meth:`fork` starts a rank. Thread-safe. ``users``: the launches that hold it
    (:func:`lease`)."""

    def __init__(self, executable: str, modules: Sequence[str], env: Mapping[str, str], cwd: str) -> None:
        self.executable, self.modules, self.env, self.cwd = executable, tuple(modules), dict(env), cwd
        self.key = _key(executable, cwd, modules, env)
        self.lock = threading.Lock()
        # one request at a time until its reply: waiting for a reply releases ``lock``, and replies carry
        # no request id, so a second request sent meanwhile could take the first one's pid
        self.forking = threading.Lock()
        self.replies: list[dict[str, Any]] = []
        self.replied = threading.Condition(self.lock)
        self.ranks: dict[int, ForkedRank] = {}
        self.exits: dict[int, int] = {}  # exits read before their rank was registered
        self.closed = False
        self.users, self.retired = 0, False
        self.thread = threading.current_thread()  # PR_SET_PDEATHSIG follows the thread that started it

    def start(self) -> None:
        """Start the zygote and wait for its imports; raises :class:`PreloadError` if they fail."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        try:
            self.proc = subprocess.Popen(
                [self.executable, "-m", "lioncub.launch.zygote", str(theirs.fileno()), *self.modules],
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
            message, _ = receive(self.sock)
        except TimeoutError:
            message = {"error": f"importing {', '.join(self.modules)} took more than {START_TIMEOUT_S:g} s"}
        self.sock.settimeout(None)
        if message is None or "ready" not in message:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=10)
            why = (message or {}).get("error") or err.decode(errors="replace").strip()[-400:] or "no reason"
            self.sock.close()
            self.closed = True
            raise PreloadError(f"the preloaded interpreter did not start: {why}")
        assert self.proc.stderr is not None
        self.proc.stderr.close()
        threading.Thread(target=self._read, name="lioncub-zygote", daemon=True).start()

    def alive(self) -> bool:
        return not self.closed and self.proc.poll() is None and self.thread.is_alive()

    def fork(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None,
        *,
        netns: str | None = None,
        stdio: tuple[int, int] | None = None,
    ) -> ForkedRank:
        """Start ``argv`` (``[python, "-m", MODULE, *ARGS]`` or ``[python, "-c", CODE, *ARGS]``) as a fork of
        the zygote inside network namespace ``netns`` (a name in ``/run/netns``; ``None``: the zygote's),
        like ``subprocess.Popen(["ip", "netns", "exec", netns, *argv], env=env, cwd=cwd, stdin=DEVNULL,
        stdout=PIPE, stderr=PIPE, start_new_session=True)``; with ``stdio`` (two descriptors, which stay the
        caller's to close) the rank writes its stdout and stderr there instead, and the returned rank has no
        pipes. Raises :class:`PreloadError` if it cannot."""
        if len(argv) < 3 or argv[1] not in ("-m", "-c"):
            raise PreloadError(f"a forked rank runs `python -m MODULE ...` or `-c CODE`, got {list(argv)!r}")
        request = {"argv": list(argv[1:]), "env": dict(env), "cwd": cwd or self.cwd, "netns": netns}
        if stdio is not None:
            out_r, out_w, err_r, err_w = -1, os.dup(stdio[0]), -1, os.dup(stdio[1])
        else:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
        try:
            with self.forking, self.lock:
                if self.closed:
                    raise PreloadError("the preloaded interpreter has exited")
                try:
                    send(self.sock, request, [out_w, err_w])
                except PreloadError:
                    raise
                except OSError as exc:
                    raise PreloadError(f"the preloaded interpreter has exited ({exc})") from exc
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
                if stdio is not None:
                    rank = ForkedRank(reply["pid"], None, None)
                else:
                    rank = ForkedRank(reply["pid"], os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))
                self.ranks[rank.pid] = rank
                if rank.pid in self.exits:
                    rank._exited(self.exits.pop(rank.pid))
                return rank
        except BaseException:
            for fd in (out_r, err_r):
                if fd >= 0:
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
                message, fds = receive(self.sock)
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
        code = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = self.proc.wait(5.0)
        reason = f"the preload zygote died ({_how(code)})"
        with self.lock:  # its ranks got SIGTERM from its death; nobody reports their exit now
            self.closed = True
            self.replied.notify_all()
            for pid, rank in self.ranks.items():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                rank._exited(-signal.SIGKILL, reason)
            self.ranks.clear()

    def close(self) -> None:
        """End the zygote (the ranks it forked are not waited for)."""
        self.closed = True
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


def gpu_refusal(device: str = "auto") -> str | None:
    """Why ranks on ``device`` (``auto``, ``cpu`` or ``cuda``) are not forked on this machine, or ``None``.
    A fork of a process that may have touched CUDA cannot use CUDA safely: ranks on ``cuda`` are never
    forked, ranks on ``auto`` only on a machine without a GPU's device file (:data:`GPU_DEVICE_FILES`), and
    the zygote itself refuses to fork once torch initialized CUDA in it
    (:func:`lioncub.launch.zygote.fork_hazard`)."""
    if device == "cpu":
        return None
    found = next((path for path in GPU_DEVICE_FILES if os.path.exists(path)), None)
    if device == "auto" and found is None:
        return None
    where = f"this machine has {found} and " if found is not None else ""
    return (
        f"{where}ranks on device {device!r} may use a GPU, which a fork of a process that may have touched "
        "CUDA cannot do safely"
    )


_lock = threading.Lock()
_current: Zygote | None = None  # the zygote the next launch of the same key gets
_open: set[Zygote] = set()  # the current one and replaced ones still held by a launch


def end_rank(status: int) -> NoReturn:
    """End this process as the interpreter ends ``python -m MODULE`` whose main returned ``status``: its
    other non-daemon threads joined, the atexit handlers run, stdout and stderr flushed, exit status
    ``status``; but without the interpreter's teardown, which frees every object still alive. In a rank
    forked from a zygote that writes each page it still shares with the zygote: about 0.27 s of a core per
    rank with torch imported, against 0.01 s without it (measured on a 2-core AMD EPYC VM), at the end of
    every rank while its launcher waits (a zygote's own, at its end: ~0.1 s). For lioncub's own processes
    (the zygote, ``lioncub.train.rank``, ``lioncub.train.replica_group``), whose files are written and
    closed when their main returns; a user's module keeps Python's own exit, which also flushes a file its
    script left open."""
    main = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # what the interpreter runs at its exit (CPython's own entry point)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: nothing left to flush
            stream.flush()
    os._exit(status)


@contextlib.contextmanager
def lease(env: Mapping[str, str], cwd: str, modules: Sequence[str] = MODULES) -> Iterator[Zygote]:
    """This process's zygote for ranks of environment ``env`` (:func:`shared_env`) in ``cwd``, held until
    the block ends: the one an earlier launch started with the same, else a new one that replaces it (the
    old one is closed once no launch holds it). Raises :class:`PreloadError` if it cannot start."""
    global _current
    with _lock:
        zygote = _current
        if zygote is None or zygote.key != _key(sys.executable, cwd, modules, env) or not zygote.alive():
            _current = None
            if zygote is not None:
                _retire(zygote)
            zygote = Zygote(sys.executable, modules, env, cwd)
            zygote.start()
            _current = zygote
            _open.add(zygote)
        zygote.users += 1
    try:
        yield zygote
    finally:
        with _lock:
            zygote.users -= 1
            if zygote.retired and zygote.users == 0:
                _close(zygote)


def _retire(zygote: Zygote) -> None:
    """``zygote`` is replaced: close it now if no launch holds it (or it died), else when the last one ends
    (under ``_lock``)."""
    zygote.retired = True
    if zygote.users == 0 or not zygote.alive():
        _close(zygote)


def _close(zygote: Zygote) -> None:
    _open.discard(zygote)
    zygote.close()


@atexit.register
def _close_all() -> None:
    global _current
    with _lock:
        for zygote in list(_open):
            _close(zygote)
        _current = None
