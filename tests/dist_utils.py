"""Run a function on N gloo ranks (separate processes) and collect what each returns.

Usage: ``results = run_workers(fn, world_size, *args)`` where ``fn(rank, world_size, *args)`` is a
module-level function; ``results[r]`` is what rank r returned (anything ``torch.save`` can store). A
failing rank's traceback is re-raised in the test process; a hung group is killed after ``timeout``.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch


def _entry(
    fn: Callable[..., Any], rank: int, world_size: int, tmp: str, args: tuple, pg_timeout: float
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = os.path.join(tmp, f"rank{rank}.pt")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/store",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        torch.save({"ok": result}, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise SystemExit(1) from None


def run_workers(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, pg_timeout: float = 60.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results."""
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
        results: list[Any] = []
        errors: list[str] = []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})")
                results.append(None)
                continue
            data = torch.load(path, weights_only=False)
            if "error" in data:
                errors.append(f"rank {r} failed:\n{data['error']}")
                results.append(None)
            else:
                results.append(data["ok"])
        if hung:
            errors.insert(0, f"ranks {hung} still running after {timeout} s (killed)")
        if errors:
            raise AssertionError("\n".join(errors))
        return results
