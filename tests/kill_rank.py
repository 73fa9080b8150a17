"""A rank killed from outside lioncub, for the tests of restarts (``lioncub train --restarts``, torchrun's
``--max-restarts``) and of failed runs: lioncub's training step has no fault hook of its own.

* ``python tests/kill_rank.py RANK:STEP MODULE [ARGS...]`` (or ``-m kill_rank`` where ``tests/`` is on the
  path): ``python -m MODULE ARGS`` (e.g. ``lioncub.cli train ...`` as a torchrun worker) in which the process
  of rank ``RANK`` (``$RANK``) SIGKILLs itself just before its ``STEP``-th optimizer step, after that step's
  backward (a global ``torch.optim`` step pre-hook; in a new run the STEP-th step is step STEP), in a job's
  first attempt only (``$TORCHELASTIC_RESTART_COUNT`` 0 or unset, as torchrun and ``lioncub launch`` set it).
* ``python tests/kill_rank.py --launches RANK:STEP MODULE [ARGS...]``: ``python -m MODULE ARGS`` (e.g.
  ``lioncub train ...``) whose launches start every rank through this module (:func:`launches`).
* :func:`launches`: the same in the test process (``lioncub.cli.main`` in-process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import runpy
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def arm(spec: str) -> None:
    """SIGKILL this process just before its STEP-th optimizer step if it is rank RANK (``spec``:
    ``RANK:STEP``) of a job's first attempt."""
    rank, step = (int(part) for part in spec.split(":"))
    if os.environ.get("RANK") != str(rank) or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    calls = [0]

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == step:
            os.kill(os.getpid(), signal.SIGKILL)

    register_optimizer_step_pre_hook(hook)


@contextlib.contextmanager
def launches(spec: str) -> Iterator[None]:
    """While the block runs, every ``lioncub.launch.launch`` of this process starts its ``-m MODULE`` ranks
    as ``-m tests.kill_rank SPEC MODULE``, forked as before when the launch forks: a preloaded interpreter
    (:mod:`lioncub.launch.preload`) started in the repository imports it from there, so the launch keeps
    the zygote of the launches before it. Run from elsewhere, the ranks run ``-m kill_rank`` in ``tests/``
    (another zygote)."""
    import lioncub.launch

    real = lioncub.launch.launch
    from_root = (Path.cwd() / "tests" / "kill_rank.py").resolve() == Path(__file__).resolve()

    def launch(config: Any, **kwargs: Any) -> Any:
        cmd = list(config.cmd)
        if cmd[1:2] == ["-m"]:
            cmd[1:2] = ["-m", "tests.kill_rank" if from_root else "kill_rank", spec]
        where = {} if from_root else {"cwd": str(HERE)}
        return real(dataclasses.replace(config, cmd=cmd, **where), **kwargs)

    lioncub.launch.launch = launch
    try:
        yield
    finally:
        lioncub.launch.launch = real


def main(argv: list[str]) -> None:
    """The command line of the module docstring."""
    through_launches = argv[:1] == ["--launches"]
    if through_launches:
        argv = argv[1:]
    if len(argv) < 2:
        raise SystemExit("usage: kill_rank.py [--launches] RANK:STEP MODULE [ARGS...]")
    spec, module, *args = argv
    sys.argv = [sys.argv[0], *args]
    if through_launches:
        with launches(spec):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        arm(spec)
        runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
