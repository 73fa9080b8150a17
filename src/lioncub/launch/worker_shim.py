"""The process a torchrun agent starts for a rank when lioncub's launcher forks the ranks of its emulated
nodes from a preloaded interpreter (:mod:`lioncub.launch.workers`): it asks the launcher to fork the rank
with this process's environment, directory, stdout and stderr, then stands in for it until it exits.

    python -I -S worker_shim.py SOCKET -m MODULE ARGS...     (or -c CODE ARGS...)

Standard library only, run from its file (``-S``: no site packages; about 20 ms of a core, where a rank's
fresh interpreter spends about 3 s importing torch). To torchrun it is the rank: SIGTERM, SIGINT, SIGHUP,
SIGUSR1 and SIGUSR2 are passed on to the rank's process group, and it exits as the rank did (with its code,
or killed by the same signal). If this process dies, the launcher kills the rank. If the launcher cannot
fork the rank, this process becomes the rank as a fresh interpreter (``exec``), saying why on stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_PACKET = 1 << 20  # the largest message, as lioncub.launch.preload's


def main(path: str, argv: list[str]) -> int:
    """Have the launcher at ``path`` fork ``python ARGV`` as this process's rank; its exit code."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
        request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
        socket.send_fds(sock, [json.dumps(request).encode()], [1, 2])
        data = sock.recv(_PACKET)
        reply = json.loads(data) if data else {"error": "the launcher closed the connection"}
    except OSError as exc:
        reply = {"error": f"cannot reach the launcher at {path}: {exc}"}
    if "pid" not in reply:
        sock.close()
        print(f"[lioncub] this rank starts as a fresh interpreter: {reply.get('error')}", file=sys.stderr)
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, *argv])
    pid = int(reply["pid"])

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signum)  # the rank leads its own session and process group

    for sig in FORWARDED:
        signal.signal(sig, forward)
    data = sock.recv(_PACKET)  # PEP 475: a forwarded signal does not end the wait
    code = json.loads(data).get("exit") if data else None
    if code is None:
        print(f"[lioncub] lost the launcher while rank pid {pid} ran", file=sys.stderr)
        return 1
    if code < 0:  # killed by a signal: so is this process, as torchrun should see it
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # these two always act as their default
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return int(code)


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[2] not in ("-m", "-c"):
        raise SystemExit("usage: python -I -S worker_shim.py SOCKET -m MODULE ARGS...  (started by torchrun)")
    sys.exit(main(sys.argv[1], sys.argv[2:]))
