"""Mixed precision with a vote: a ``torch.amp.GradScaler`` whose overflow decision every rank shares.

With DDP the gradients are averaged before the scaler looks at them, so every rank sees the same
overflow. With :class:`~lioncub.optim.LionCub` each rank keeps its local gradient, so a plain scaler
decides per rank: LionCub itself skips the step on every rank when any rank overflows (it gets the
scaler's ``found_inf`` in ``step()``), but each rank's scaler still adjusts its own scale, and a framework
that skips the lr scheduler after a skipped step (accelerate's ``AcceleratedScheduler``, the Trainer)
would then step it on some ranks only — the replicas' learning rates, and then the replicas, diverge.

:class:`GradScaler` all-reduces (MAX) the overflow flags over the optimizer's process group when it
unscales, so every rank's scaler skips, backs off and grows together::

    scaler = lioncub.optim.amp.GradScaler("cuda")       # instead of torch.amp.GradScaler("cuda")
    scaler.scale(loss).backward()
    scaler.step(opt)                                    # opt: a LionCub
    scaler.update()

:func:`agree_on_overflow` turns a scaler a framework already made into one (``lioncub.integrations`` do).
Collective: every rank of the group must unscale (``scaler.step`` / ``scaler.unscale_``) together.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lioncub.collectives.base import backend_for_device

__all__ = ["GradScaler", "agree_on_overflow"]


def agreement_device(optimizer: torch.optim.Optimizer, flags: list[torch.device]) -> torch.device:
    """Where the overflow flags are all-reduced: a LionCub's comm device; for another optimizer (over the
    default group) the CPU when the group has a CPU backend (gloo), else the first device of ``flags``
    (the gradients') it serves, else the current CUDA device (an NCCL-only group: a rank without
    gradients)."""
    comm = getattr(optimizer, "comm", None)
    if comm is not None and getattr(comm, "device", None) is not None:
        device: torch.device = comm.device
        return device
    config = str(dist.get_backend_config(None))
    capability = getattr(dist.Backend, "backend_capability", {})
    if ":" not in config and config in capability:  # a bare name: the device types torch gives it
        config = ",".join(f"{kind}:{config}" for kind in capability[config])
    for device in [torch.device("cpu"), *flags]:
        try:
            backend_for_device(config, device.type)
        except ValueError:
            continue
        return device
    return torch.device("cuda", torch.cuda.current_device())


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose per-device overflow flags are the MAX over the ranks of the
    optimizer's group (a LionCub's, else the default group) — one allreduce of one float per device, on a
    device the group's backend serves (:func:`agreement_device`)."""

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if not (dist.is_available() and dist.is_initialized()):
            return per_device
        group = getattr(getattr(optimizer, "comm", None), "group", None)
        device = agreement_device(optimizer, list(per_device))
        flags = list(per_device.values())
        agreed = torch.zeros(1, dtype=torch.float32, device=device)
        for flag in flags:
            agreed = torch.maximum(agreed, flag.reshape(1).to(device=device, dtype=torch.float32))
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        if not flags:  # no gradient on this rank: the others' decision still counts
            per_device[device] = agreed.to(found_inf.dtype)
        for flag in flags:
            flag.copy_(agreed.reshape(flag.shape))
        return per_device


def agree_on_overflow(scaler: Any) -> Any:
    """Make an existing ``torch.amp.GradScaler`` (or ``torch.cuda.amp.GradScaler``) a :class:`GradScaler`
    in place, keeping its scale and growth state; returns it. ``None`` is returned as is."""
    if scaler is None or isinstance(scaler, GradScaler):
        return scaler
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"agree_on_overflow: expected a torch.amp.GradScaler, got {type(scaler).__name__}")
    scaler.__class__ = GradScaler
    return scaler
