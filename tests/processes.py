"""How the tests start processes: one module, one way for each need (tests/README.md, "Starting processes").

* **N gloo ranks running a function**: ``run_workers(fn, world, *args)`` (the worker pool below).
* **A Python program** (``-c CODE``, ``-m lioncub ...``, a script): :func:`python` runs it to its end, its
  output captured as text and its time bounded; :func:`python_cmd` is its argv, for a program the test talks
  to while it runs (``subprocess.Popen``) or runs in the background (``background.Subprocess``). :data:`PY`
  is the interpreter, for the commands a launch starts.

The CLI runs in-process wherever it need not be a process of its own (``conftest.run_cli``,
``lioncub.cli.main``); a rank is killed from outside lioncub with ``kill_rank.py``; system tools (``ip``,
``tc``, ``umount``) are run with ``subprocess`` directly. ``tests/test_suite_shape.py`` checks that no other
module starts the interpreter.

The worker pool: ``results = run_workers(fn, world_size, *args)`` where ``fn(rank, world_size, *args)`` is a
module-level function; ``results[r]`` is what rank r returned (anything ``torch.save`` can store). A
failing rank's traceback is re-raised in the test process; a hung group is killed after ``timeout``.

The ranks run in a pool of persistent worker processes (started once per test session, grown to the
largest world size asked for): spawning a process and importing torch costs ~2.5 s of CPU each, which
used to be most of the time of the tests on gloo ranks. The workers are forks of ``multiprocessing``'s
fork server, which imports torch once (:func:`context`: :data:`PRELOAD`), so a new worker costs
milliseconds rather than an interpreter importing torch. Every call still gets a fresh gloo group (a new
file store, ``init_process_group`` before ``fn`` and ``destroy_process_group`` after it), the caller's
environment variables and working directory, torch's default generator as a new process has it, one
intra-op thread, and the logging and warnings configuration as it was before the call. Workers of a call
in which any rank failed, died or hung are killed and replaced, so a failure never leaks into the next
test.

``fresh=True`` runs the call on newly spawned processes instead (the behaviour before the pool): for a
function that must start in a clean interpreter (module state it changes and cannot undo, a rank that
kills itself). ``LIONCUB_TEST_FRESH_WORKERS=1`` makes every call fresh (to rule the pool out).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

#: the interpreter every Python program of the suite runs on
PY = sys.executable
TESTS = Path(__file__).resolve().parent

#: what the fork server of :func:`context` imports before it forks: torch, its distributed package and
#: torch._dynamo (which torch.optim.Optimizer.add_param_group imports on first use, ~1.3 s of CPU), never
#: lioncub (a test may set its environment, e.g. ``TRITON_INTERPRET``, before lioncub is imported)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


def context() -> mp.context.BaseContext:
    """The ``forkserver`` context whose processes start with :data:`PRELOAD` imported: for the pool's
    workers and the background jobs' ranks (``background.Spawned``); ``fresh=True`` calls still spawn
    clean interpreters."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_fork_server() -> None:
    """Start :func:`context`'s fork server now (it imports :data:`PRELOAD` in its own process), from the
    session's environment and working directory, which every process forked from it inherits (a server
    first started inside a test would hand on that test's ``monkeypatch.chdir`` or ``setenv``)."""
    from multiprocessing import forkserver

    context()
    forkserver.ensure_running()


# ----------------------------------------------------------------------------------------- one rank


def _run_rank(
    fn: Callable[..., Any] | bytes, rank: int, world_size: int, tmp: str, args: tuple, pg_timeout: float
) -> bool:
    """Join the group, run ``fn`` (or the pickled ``(fn, args)``), leave the group; write ``{"ok": result}``
    or ``{"error": traceback}`` to ``tmp/rank{rank}.pt``. True if ``fn`` returned."""
    import torch.distributed as dist

    out = os.path.join(tmp, f"rank{rank}.pt")
    try:
        if isinstance(fn, bytes):
            fn, args = pickle.loads(fn)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/store",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        # Every rank has finished connecting before any runs ``fn``: a rank whose ``fn`` returns at once
        # (a non-member of a subgroup) would otherwise destroy its group, and close its sockets, while a
        # slower peer was still inside gloo's connectFullMesh ("Connection closed by peer" there, seen in
        # CI on 2 loaded cores)
        dist.barrier()
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        torch.save({"ok": result}, out)
        return True
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        return False


def _entry(
    fn: Callable[..., Any], rank: int, world_size: int, tmp: str, args: tuple, pg_timeout: float
) -> None:
    """A fresh process for one call."""
    torch.set_num_threads(1)
    if not _run_rank(fn, rank, world_size, tmp, args, pg_timeout):
        raise SystemExit(1)


# ------------------------------------------------------------------------------------- pooled worker


def _logging_state() -> dict[str, tuple]:
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    return {lg.name: (list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in loggers}


def _restore_logging(saved: dict[str, tuple]) -> None:
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for lg in loggers:
        handlers, level, propagate, disabled = saved.get(lg.name, ([], logging.NOTSET, True, False))
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled


def _serve(conn: mpc.Connection) -> None:
    """A pooled worker: runs one rank of each task it receives until it gets ``None`` (or the pipe
    closes). The rank's stdout and stderr go to ``tmp/rank{rank}.log``, which the caller prints."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    seed = torch.initial_seed()  # what a new process's default generator starts from
    dtype = torch.get_default_dtype()
    while True:
        try:
            task = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if task is None:
            return
        rank, world_size, tmp, payload, pg_timeout, env, cwd = task
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        torch.manual_seed(seed)
        torch.set_num_threads(1)
        saved_logging = _logging_state()
        sys.stdout.flush()
        sys.stderr.flush()
        saved_fds = [os.dup(1), os.dup(2)]
        with open(os.path.join(tmp, f"rank{rank}.log"), "wb") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        try:
            with warnings.catch_warnings():
                ok = _run_rank(payload, rank, world_size, tmp, (), pg_timeout)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            _restore_logging(saved_logging)
            torch.set_default_dtype(dtype)
            torch.set_grad_enabled(True)
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, saved in zip((1, 2), saved_fds, strict=True):
                os.dup2(saved, fd)
                os.close(saved)
        conn.send_bytes(pickle.dumps(ok))


class _Worker:
    def __init__(self) -> None:
        ctx = context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True, name="lioncub-test-worker")
        self.proc.start()
        child.close()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


_POOL: list[_Worker] = []


def _shutdown() -> None:
    for w in _POOL:
        with contextlib.suppress(OSError):
            w.conn.send_bytes(pickle.dumps(None))
    for w in _POOL:
        w.proc.join(2)
        w.kill()
    _POOL.clear()


atexit.register(_shutdown)


def read_results(
    tmp: str | os.PathLike[str],
    world_size: int,
    exitcodes: Sequence[int | None],
    errors: list[str],
    missing: str = "",
) -> list[Any]:
    """What ranks ``0 .. world_size-1`` wrote to ``tmp/rank{r}.pt`` (``{"ok": result}`` or ``{"error":
    traceback}``): their results (``None`` for a rank that failed or wrote nothing), each failure appended
    to ``errors`` (``missing``: said after the exit code of a rank that wrote nothing)."""
    results: list[Any] = []
    for r in range(world_size):
        path = os.path.join(tmp, f"rank{r}.pt")
        if not os.path.exists(path):
            errors.append(f"rank {r}: no result (exit code {exitcodes[r]}{missing})")
            results.append(None)
            continue
        data = torch.load(path, weights_only=False)
        if "error" in data:
            errors.append(f"rank {r} failed:\n{data['error']}")
            results.append(None)
        else:
            results.append(data["ok"])
    return results


def _run_pooled(
    fn: Callable[..., Any], world_size: int, args: tuple, timeout: float, pg_timeout: float
) -> list[Any]:
    deadline = time.monotonic() + timeout
    payload = pickle.dumps((fn, args))
    _POOL[:] = [w for w in _POOL if w.proc.is_alive()]
    while len(_POOL) < world_size:
        _POOL.append(_Worker())
    workers = _POOL[:world_size]
    env, cwd = dict(os.environ), os.getcwd()
    clean = False
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for r, w in enumerate(workers):
                w.conn.send_bytes(pickle.dumps((r, world_size, tmp, payload, pg_timeout, env, cwd)))
            pending = dict(enumerate(workers))
            replies: dict[int, bool] = {}
            while pending and (left := deadline - time.monotonic()) > 0:
                ready = mpc.wait([w.conn for w in pending.values()], timeout=left)
                for r, w in list(pending.items()):
                    if w.conn in ready:
                        with contextlib.suppress(EOFError):  # EOF: the worker died
                            replies[r] = pickle.loads(w.conn.recv_bytes())
                        del pending[r]
            hung = sorted(pending)
            for r, w in enumerate(workers):
                if r not in replies:  # hung or dead: killed (if need be) before its exit code is read
                    w.kill()
            exitcodes = [None if r in replies else w.proc.exitcode for r, w in enumerate(workers)]
            _print_logs(tmp, world_size)
            errors: list[str] = []
            results = read_results(tmp, world_size, exitcodes, errors)
            if hung:
                errors.insert(0, f"ranks {hung} still running after {timeout} s (killed)")
            clean = not errors and all(replies.get(r) is True for r in range(world_size))
            if errors:
                raise AssertionError("\n".join(errors))
            return results
        finally:
            if not clean:  # a rank failed, died or hung (or the test was interrupted): start anew
                for w in workers:
                    w.kill()
                _POOL[:] = [w for w in _POOL if w not in workers]


def _print_logs(tmp: str, world_size: int) -> None:
    """What the pooled ranks printed, to this process's stdout (pytest shows it with the test)."""
    for r in range(world_size):
        path = os.path.join(tmp, f"rank{r}.log")
        text = Path(path).read_text(errors="replace") if os.path.exists(path) else ""
        if text:
            sys.stdout.write(f"--- rank {r} output ---\n{text}")


def _run_fresh(
    fn: Callable[..., Any], world_size: int, args: tuple, timeout: float, pg_timeout: float
) -> list[Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, tmp, args, pg_timeout), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        errors: list[str] = []
        results = read_results(tmp, world_size, [p.exitcode for p in procs], errors)
        if hung:
            errors.insert(0, f"ranks {hung} still running after {timeout} s (killed)")
        if errors:
            raise AssertionError("\n".join(errors))
        return results


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results.

    ``fresh=True``: on newly spawned processes rather than the session's pool of workers."""
    if fresh or os.environ.get("LIONCUB_TEST_FRESH_WORKERS") == "1":
        return _run_fresh(fn, world_size, args, timeout, pg_timeout)
    return _run_pooled(fn, world_size, args, timeout, pg_timeout)


# ------------------------------------------------------------------------------------------- programs


def python_cmd(*args: str) -> list[str]:
    """``python ARGS``: the argv of a Python program on the suite's interpreter."""
    return [PY, *args]


def python(
    *args: str,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` to its end: stdout and stderr captured as text, killed after ``timeout``
    seconds (``TimeoutExpired``), in ``env`` (default: this process's) and ``cwd``; ``check``: raise if it
    fails."""
    return subprocess.run(
        python_cmd(*args), capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, check=check
    )


def output_captured(fn: Callable[[], int]) -> dict[str, object]:
    """``fn()`` in this process with file descriptors 1 and 2 (its output and that of the processes it
    starts: a launcher's ranks) on one temporary file: ``{"rc": what fn returned, "output": that output}``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 1)
        os.dup2(captured.fileno(), 2)
        try:
            rc = fn()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        captured.seek(0)
        return {"rc": rc, "output": captured.read().decode(errors="replace")}
