"""Ranks of emulated nodes forked from the launcher's preloaded interpreter, under real torchrun agents.

Under ``--nnodes M --nproc-per-node L`` each node runs a torchrun agent, and torchrun starts its ranks:
as fresh interpreters, each spending about 3 s of a core importing torch before it trains (on 2 cores, a
2 × 2 launch spent 20 CPU-s, three quarters of it in imports). With ``LaunchConfig.preload`` the launcher
keeps torchrun — its rendezvous, its environment, ``--max-restarts``, its report of the failed rank — and
changes only what torchrun starts: the agent's ``--no-python`` command is :mod:`lioncub.launch.worker_shim`,
a standard-library script that asks this module's :class:`WorkerRelay` (one listening socket per node) to
fork the rank from the zygote (:mod:`lioncub.launch.preload`) inside the node's network namespace, with the
shim's environment (torchrun's, per rank), directory, stdout and stderr (torchrun's ``--tee`` files). The
shim then stands in for the rank: torchrun's signals reach the rank's process group, the rank's exit
status becomes the shim's, and if the shim dies (torchrun's SIGKILL after its shutdown timeout) the relay
kills the rank. The agents themselves are forks of the same zygote.

A rank the zygote cannot fork (it died, a thread started in it) starts as a fresh interpreter: the relay
answers with the reason and the shim execs ``python ARGS``, printing why.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from lioncub.launch.preload import ForkedRank, PreloadError, Zygote, receive, send

__all__ = ["SHIM", "WorkerRelay"]

#: the script torchrun's agents run for each rank (standard library only)
SHIM = str(Path(__file__).with_name("worker_shim.py"))


class WorkerRelay:
    """Forks the ranks that the shims of node ``k`` ask for from ``zygote`` inside ``netns[k]`` (a name in
    ``/run/netns``, or ``None``: the zygote's), listening on ``directory/nK.sock``; a context manager whose
    exit stops listening and kills the ranks it forked that are still running."""

    def __init__(self, zygote: Zygote, directory: str, netns: Sequence[str | None]) -> None:
        self.zygote, self.netns = zygote, list(netns)
        self.paths = [os.path.join(directory, f"n{k}.sock") for k in range(len(self.netns))]
        self.listeners: list[socket.socket] = []
        self.ranks: set[ForkedRank] = set()
        self.lock = threading.Lock()
        self.closed = False

    def command(self, node: int, cmd: Sequence[str]) -> list[str]:
        """What node ``node``'s torchrun agent runs per rank for ``cmd`` (``[python, -m|-c, ...]``)."""
        if len(cmd) < 3 or cmd[1] not in ("-m", "-c"):
            raise ValueError(f"forked ranks run `python -m MODULE ...` or `-c CODE`, got {list(cmd)!r}")
        return [sys.executable, "-I", "-S", SHIM, self.paths[node], *cmd[1:]]

    def __enter__(self) -> WorkerRelay:
        for node, path in enumerate(self.paths):
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            listener.bind(path)
            listener.listen(64)
            self.listeners.append(listener)
            threading.Thread(
                target=self._accept,
                args=(listener, self.netns[node]),
                name=f"lioncub-relay-n{node}",
                daemon=True,
            ).start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.closed = True
            ranks = list(self.ranks)
        for listener in self.listeners:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes its accept()
            listener.close()
        for rank in ranks:  # torchrun stopped its shims; a rank still running has lost its stand-in
            if rank.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(rank.pid, signal.SIGKILL)
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _accept(self, listener: socket.socket, netns: str | None) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(conn, netns), name="lioncub-relay", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, netns: str | None) -> None:
        """One shim: fork its rank, tell it the pid, then the rank's exit status; kill the rank if the
        shim goes first."""
        with conn:
            try:
                message, fds = receive(conn)
            except (OSError, ValueError):
                return
            try:
                if message is None or len(fds) != 2:
                    return
                rank = self.zygote.fork(
                    [sys.executable, *message["argv"]], message["env"], message["cwd"], netns=netns,
                    stdio=(fds[0], fds[1]),
                )  # fmt: skip
            except PreloadError as exc:
                with contextlib.suppress(OSError):
                    send(conn, {"error": str(exc)})
                return
            finally:
                for fd in fds:
                    os.close(fd)
            with self.lock:
                if self.closed:  # the launch is over: this rank has nobody to run for
                    os.killpg(rank.pid, signal.SIGKILL)
                self.ranks.add(rank)
            try:
                send(conn, {"pid": rank.pid})
                threading.Thread(target=self._watch, args=(conn, rank), daemon=True).start()
                code = rank.wait()
                with contextlib.suppress(OSError):
                    send(conn, {"exit": code})
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)  # ends the watcher's recv
            finally:
                with self.lock:
                    self.ranks.discard(rank)

    @staticmethod
    def _watch(conn: socket.socket, rank: ForkedRank) -> None:
        """The shim never writes after its request: a read returns when it is gone (or the relay is done)."""
        with contextlib.suppress(OSError):
            conn.recv(1)
        if rank.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(rank.pid, signal.SIGKILL)
