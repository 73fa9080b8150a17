"""The checks of :class:`~lioncub.optim.LionCub`'s arguments, each naming the option at fault: the
variant, the keyword options, local steps, and every parameter of a param group (what LionCub can vote on),
and the framework hint of its first-step warning."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lioncub._validate import NO_VALUE, Named, OptionError, is_int, is_number
from lioncub.optim.config import VoteConfig, resolve_variant, variant_name
from lioncub.optim.lion import check_lion_hyperparameters, check_no_duplicates
from lioncub.optim.local_steps import LocalSteps
from lioncub.optim.step_check import Checks
from lioncub.optim.sync import MomentumSync

__all__ = [
    "check_group",
    "check_local_steps",
    "check_options",
    "unsupported",
    "vote_config",
]


def vote_config(variant: str | VoteConfig) -> tuple[VoteConfig, str]:
    """The validated vote configuration of ``variant`` and its name (the preset's, or ``"custom"``)."""
    if isinstance(variant, VoteConfig):
        config = variant.validate()
        return config, variant_name(config)
    return resolve_variant(variant), variant


def check_options(
    config: VoteConfig,
    variant: str,
    bucket_mb: float,
    model: torch.nn.Module | None,
    checks: Checks,
    diagnostics_every: int,
) -> None:
    """The constructor's checks of its keyword options (each error names the option)."""
    if not is_number(bucket_mb, gt=0):
        raise OptionError("LionCub", "bucket_mb", bucket_mb, "must be a finite number of MiB > 0")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model={model!r} must be the torch.nn.Module whose parameters are optimized, or None"
        )
    if not isinstance(checks, Checks):
        raise TypeError(f"checks={checks!r} must be a lioncub.optim.Checks(...)")
    if not is_int(diagnostics_every, 0):
        raise OptionError("LionCub", "diagnostics_every", diagnostics_every, "must be an int >= 0 (0: off)")
    if diagnostics_every and config.transport == "dense":
        raise OptionError(
            "LionCub",
            "diagnostics_every",
            NO_VALUE,
            "{variant} does not vote (global Lion); the vote diagnostics apply to the voting variants",
            sep=": ",
            variant=Named("LionCub", "variant", variant),
        )


def check_local_steps(
    local_steps: LocalSteps | int | Mapping[str, Any] | None,
    config: VoteConfig,
    variant: str,
    momentum_sync: Any,
    diagnostics_every: int,
) -> LocalSteps | None:
    """``local_steps=`` as a :class:`LocalSteps` (an int H is ``LocalSteps(h=H)``, a mapping its fields: a
    config file's form), after the refusals: a rule that needs a dense exchange, and the options that have
    no meaning between outer steps. The one statement of these rules: ``lioncub train`` calls it too, and
    its messages name each option as ``name=value`` (the CLI writes its flag instead)."""
    if local_steps is None:
        return None
    if isinstance(local_steps, int) and not isinstance(local_steps, bool):
        local_steps = LocalSteps(h=local_steps)
    elif isinstance(local_steps, Mapping):
        known = [f.name for f in dataclasses.fields(LocalSteps)]
        unknown = sorted(set(local_steps) - set(known))
        if unknown:
            raise ValueError(
                f"local_steps={dict(local_steps)!r}: unknown keys {unknown}; the keys are {known}"
            )
        local_steps = LocalSteps(**local_steps)
    if not isinstance(local_steps, LocalSteps):
        raise TypeError(
            f"local_steps={local_steps!r} must be a lioncub.LocalSteps(h=...), an int H, a dict of "
            "LocalSteps' fields, or None"
        )
    local_steps.check_variant(config.transport, variant)
    sync = momentum_sync.params if isinstance(momentum_sync, MomentumSync) else momentum_sync
    h = local_steps.h
    if sync != "none":
        raise OptionError(
            "LionCub",
            "momentum_sync",
            sync,
            f"with {{h}}: the ranks vote every {h} steps and their inner momenta are local between outer "
            "steps; {average} averages them at each outer step",
            h=Named("LionCub", "local_steps", h),
            average=Named("LocalSteps", "inner_momentum", "average"),
        )
    if diagnostics_every:
        raise OptionError(
            "LionCub",
            "diagnostics_every",
            diagnostics_every,
            f"with {{h}}: the ranks vote every {h} steps and the vote diagnostics describe a vote every "
            "step; drop {diagnostics} (or {local_steps}, for the per-step vote)",
            h=Named("LionCub", "local_steps", h),
            diagnostics=Named("LionCub", "diagnostics_every"),
            local_steps=Named("LionCub", "local_steps"),
        )
    return local_steps


def check_group(group: dict[str, Any], index: int) -> None:
    """A param group's hyperparameters and parameters (``index``: its position, for the messages)."""
    check_lion_hyperparameters(group)
    if not isinstance(group["maximize"], bool):
        raise ValueError(f"Invalid maximize: {group['maximize']!r} (expected True or False)")
    check_no_duplicates(group["params"], index)
    for i, p in enumerate(group["params"]):
        why = unsupported(p)
        if why:
            raise TypeError(
                f"LionCub: param_groups[{index}]['params'][{i}] is {why}. LionCub takes dense, real, "
                "materialised parameters: plain tensors that every rank holds whole (a torch.Tensor or "
                "nn.Parameter on CPU or CUDA, on one process or replicated as DDP replicates them), or "
                "FSDP2's DTensors placed (Shard(0),) with process_group=a DeviceMesh with dims ('replicate', "
                "'shard') (docs/shards.md). Tensor parallelism and quantized weights are not supported"
            )


def unsupported(p: torch.Tensor) -> str:
    """Why LionCub cannot optimize ``p`` ("" when it can). A ``DTensor`` (FSDP2's) passes here; its
    placements and mesh are checked against ``process_group`` by :mod:`lioncub.optim.shards`."""
    if isinstance(p, DTensor):
        return "" if p.layout == torch.strided and not p.is_complex() else f"a {p.dtype} {p.layout} DTensor"
    # FSDP1 (FullyShardedDataParallel, Lightning's FSDPStrategy) marks its FlatParameter and, under
    # use_orig_params=True, each parameter it turned into a view of this rank's flat shard: plain-looking
    # tensors that hold other elements on every rank, which a vote would mix silently
    if getattr(p, "_fsdp_flattened", False):
        return (
            "a parameter of FSDP1 (FullyShardedDataParallel: each rank holds its own flat shard of it, not "
            "the tensor; use FSDP2's fully_shard)"
        )
    if type(p) not in (torch.Tensor, torch.nn.Parameter) or type(p.data) is not torch.Tensor:
        return (
            f"a {type(p.data).__name__} (a tensor subclass: DTensor under FSDP2 or tensor parallelism, ...)"
        )
    if p.layout != torch.strided:
        return f"a {p.layout} tensor (sparse)"
    if p.is_quantized:
        return "a quantized tensor"
    if p.is_meta:
        return "on the meta device (not materialised: call to_empty() and initialise it first)"
    if p.is_complex():
        return f"complex ({p.dtype}); view it as real with torch.view_as_real"
    return ""
