"""What the framework integrations share: a clear ``ImportError`` for a missing framework, the
:class:`~lioncub.optim.LionCub` inside a framework's optimizer wrapper, the vote installed on a DDP model,
and LionCub's numbers for the framework's logs."""

from __future__ import annotations

import importlib
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lioncub.optim.ddp import skip_gradient_allreduce
from lioncub.optim.lioncub import LionCub

__all__ = ["CommLog", "find_lioncub", "install_vote", "require", "uncompiled"]

_log = logging.getLogger("lioncub")

#: the DDP models the vote is installed on: model -> (optimizer, "skip" or "overlap")
_INSTALLED: weakref.WeakKeyDictionary[DistributedDataParallel, tuple[LionCub, str]] = (
    weakref.WeakKeyDictionary()
)


def require(modules: Sequence[str], extra: str, user: str) -> None:
    """Import ``modules`` or raise an ``ImportError`` that names the extra to install (docs/install.md:
    lioncub is not on PyPI, so the install is from a clone or a wheel)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ImportError(
                f"{user} needs the {name!r} package, which is not installed: pip install '.[{extra}]' in a "
                f"clone of lioncub, or its wheel with [{extra}] (docs/install.md) ({err})"
            ) from err


def find_lioncub(optimizer: Any, where: str) -> LionCub:
    """The :class:`LionCub` that ``optimizer`` is or wraps (accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``: each keeps the real one as ``.optimizer``)."""
    opt = optimizer
    for _ in range(4):
        if isinstance(opt, LionCub):
            return opt
        inner = getattr(opt, "optimizer", None)
        if inner is None or inner is opt:
            break
        opt = inner
    raise TypeError(
        f"{where}: the optimizer is a {type(optimizer).__name__}, not a lioncub.LionCub (or a framework's "
        "wrapper of one)"
    )


def world_size() -> int:
    """The default process group's size (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` wrapped, if ``model`` is its ``OptimizedModule`` (accelerate, and the
    Trainer's ``torch_compile=True``, compile around the DDP model); else ``model``."""
    if isinstance(model, DistributedDataParallel):
        return model
    from torch._dynamo.eval_frame import OptimizedModule

    while isinstance(model, OptimizedModule):
        model = model._orig_mod
    return model


def install_vote(opt: LionCub, model: torch.nn.Module, *, overlap: bool, where: str) -> str:
    """Make ``model`` (the framework's DDP model, or ``torch.compile``'s module around it) leave the
    gradients to ``opt``'s vote: DDP's gradient allreduce replaced by a no-op hook
    (:func:`lioncub.optim.ddp.skip_gradient_allreduce`), or, with ``overlap``, by the vote itself
    (:meth:`LionCub.overlap_with`). Collective with ``overlap`` (every rank calls it). Idempotent for the
    same model and optimizer. Returns ``"skip"``, ``"overlap"``, or ``"single process"`` when there is no
    DDP model and one process."""
    if not isinstance(overlap, bool):
        raise TypeError(f"{where}: overlap={overlap!r} must be True or False")
    model = uncompiled(model)
    if not isinstance(model, DistributedDataParallel):
        if world_size() > 1:
            raise TypeError(
                f"{where}: the model is a {type(model).__name__}, not a DistributedDataParallel, in a job "
                f"of {world_size()} processes: LionCub votes among DDP replicas (FSDP, DeepSpeed and "
                "tensor parallelism are not supported)"
            )
        return "single process"
    mode = "overlap" if overlap else "skip"
    done = _INSTALLED.get(model)
    if done is not None:
        if done[0] is not opt or done[1] != mode:
            raise RuntimeError(
                f"{where}: this DDP model already leaves its gradients to another LionCub, or with "
                f"overlap={done[1] == 'overlap'}; one optimizer and one mode per DDP model"
            )
        return mode
    if overlap:
        opt.overlap_with(model)
    else:
        skip_gradient_allreduce(model)
    _INSTALLED[model] = (opt, mode)
    _log.info(
        "%s: variant=%r, DDP's gradient allreduce %s",
        where,
        opt.variant,
        {
            "skip": "skipped (each rank's .grad is its local gradient)",
            "overlap": "replaced by the vote, overlapped with the backward pass",
        }[mode],
    )
    return mode


class CommLog:
    """LionCub's traffic for a framework's logs, per optimizer step since the previous :meth:`entries`.

    Keys: ``lioncub_bytes_sent_per_step`` (bytes this rank sent per optimizer step: votes, momentum
    sync, checks) and ``lioncub_skipped_steps`` (steps skipped on every rank for non-finite gradients since
    :meth:`start`)."""

    KEYS = ("lioncub_bytes_sent_per_step", "lioncub_skipped_steps")  #: what :meth:`entries` may hold

    def __init__(self, opt: LionCub) -> None:
        self.opt = opt
        self.start()

    def start(self) -> None:
        """Count from now (e.g. after a resume restored the optimizer's step counter)."""
        total = self.opt.comm_stats()["total"]
        self._bytes, self._steps, self._skipped = total["bytes_sent"], total["steps"], total["skipped_steps"]

    def entries(self) -> dict[str, float]:
        """The numbers since the previous call (``lioncub_bytes_sent_per_step`` only if steps were taken)
        and the skipped steps since :meth:`start`."""
        total = self.opt.comm_stats()["total"]
        steps = total["steps"] - self._steps
        out = {"lioncub_skipped_steps": float(total["skipped_steps"] - self._skipped)}
        if steps > 0:
            out["lioncub_bytes_sent_per_step"] = float((total["bytes_sent"] - self._bytes) / steps)
        self._bytes, self._steps = total["bytes_sent"], total["steps"]
        return out
