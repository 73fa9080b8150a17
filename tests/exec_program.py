"""``python -m exec_program CODE``: ``python -c CODE`` as a module, so that a launch can fork its ranks from
an interpreter that imported torch once (``LaunchConfig(preload=...)`` forks ``-m MODULE`` commands only).
Run from ``tests/`` (the launch's ``cwd``).

:func:`in_job` runs code the same way as ``background.Spawned``'s target: in a fork of the fork server
(torch imported, lioncub not), for code that must import lioncub itself (after setting the environment
lioncub reads) without paying for an interpreter that imports torch."""

import sys
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


if __name__ == "__main__":
    code = sys.argv[1]
    sys.argv = ["-c", *sys.argv[2:]]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
