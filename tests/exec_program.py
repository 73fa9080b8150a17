""":func:`in_job` runs Python code as ``background.Spawned``'s target: in a fork of the fork server (torch
imported, lioncub not), for code that must import lioncub itself (after setting the environment lioncub
reads) without paying for an interpreter that imports torch."""

import traceback
from pathlib import Path


def in_job(rank: int, world: int, workdir: Path, code: str) -> None:
    """``background.Spawned(in_job, 1, args=(CODE,))``'s target: ``CODE`` executed with ``workdir`` (the job's
    scratch directory) among its globals; an exception's traceback goes to ``workdir/error`` (exit 1)."""
    try:
        exec(compile(code, "<job>", "exec"), {"__name__": "__main__", "workdir": workdir})
    except BaseException:
        (workdir / "error").write_text(traceback.format_exc())
        raise SystemExit(1) from None
