"""What every fault-tolerant replica group of a job must share (:mod:`lioncub.integrations.torchft`): the
optimizer's settings, compared before a heal (:func:`settings_of`, :func:`first_difference`), and CPU
parameters (:func:`refuse_off_cpu`: the groups vote over torchft's gloo process group)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lioncub.optim.lioncub import LionCub

__all__ = ["first_difference", "refuse_off_cpu", "settings_of"]


def settings_of(optimizer: LionCub) -> dict[str, Any]:
    """What every group of a job must share: the variant, its update rule, the local steps, each param
    group's betas, weight decay and maximize flag, and each parameter's shape and dtype (the learning rate
    is not compared: it follows the step, which the heal brings along)."""
    meta = optimizer.state_dict()["lioncub"]
    return {
        "variant": meta["variant"],
        "rule": meta["rule"],
        "local_steps": meta["local_steps"],
        "groups": [
            {"betas": list(g["betas"]), "weight_decay": g["weight_decay"], "maximize": g["maximize"]}
            for g in optimizer.param_groups
        ],
        "params": [[list(p.shape), str(p.dtype)] for g in optimizer.param_groups for p in g["params"]],
    }


def first_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[str, str, str] | None:
    """The first setting of :func:`settings_of` that differs, as (its name, ours, theirs), or None."""
    for key in ours:
        mine, other = ours[key], theirs.get(key)
        if mine == other:
            continue
        if key in ("groups", "params") and isinstance(other, list) and len(mine) == len(other):
            i = next(i for i in range(len(mine)) if mine[i] != other[i])
            if key == "params":
                return f"parameter {i} (shape, dtype)", repr(tuple(mine[i])), repr(tuple(other[i]))
            field = next(f for f in mine[i] if mine[i][f] != other[i].get(f))
            show = tuple if field == "betas" else (lambda v: v)
            return f"param group {i}'s {field}", repr(show(mine[i][field])), repr(show(other[i].get(field)))
        return key, repr(mine), repr(other)
    return None


def refuse_off_cpu(params: Sequence[torch.Tensor], where: str) -> None:
    """``ValueError`` naming the first of ``params`` that is not a CPU tensor: the replica groups exchange
    CPU tensors over torchft's gloo process group."""
    for i, p in enumerate(params):
        if p.device.type != "cpu":
            raise ValueError(
                f"{where}: parameter {i} is on {p.device}; the replica groups vote over torchft's gloo "
                "process group (ProcessGroupGloo) on CPU tensors, so parameters on another device (CUDA) are "
                "not supported: keep the model and its optimizer on the CPU"
            )
