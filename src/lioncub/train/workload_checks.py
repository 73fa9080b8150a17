"""The field checks of the training workloads (:mod:`lioncub.train.workloads`): what each field allows,
and :func:`check_fields`, which names the first field that breaks it."""

from __future__ import annotations

from typing import Any

import torch

from lioncub._validate import is_int, is_number
from lioncub.train.data import DATASETS, MODES, TEXTS

__all__ = ["check_fields"]

_INT_GE_1 = ("an int >= 1", lambda v: is_int(v) and v >= 1)
_RATE = ("a finite number >= 0", lambda v: is_number(v, ge=0))
_BOOL = ("true or false", lambda v: isinstance(v, bool))

#: field -> (what is allowed, test); fields of every workload, then of each one
_COMMON_CHECKS: dict[str, tuple[str, Any]] = {
    "rank": ("an int >= 0", lambda v: is_int(v) and v >= 0),
    "world_size": _INT_GE_1,
    "seed": ("an int >= 0", lambda v: is_int(v) and v >= 0),
    "data_mode": (f"one of {list(MODES)}", lambda v: v in MODES),
    "device": ("a device name such as 'cpu' or 'cuda:0'", lambda v: isinstance(v, (str, torch.device))),
    "batch_size": _INT_GE_1,
    "lr": _RATE,
    "betas": (
        "a pair [beta1, beta2] with 0 <= beta < 1",
        lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(is_number(b, ge=0, lt=1) for b in v),
    ),
    "weight_decay": _RATE,
}
_CHECKS: dict[str, dict[str, tuple[str, Any]]] = {
    "gpt": {
        "corpus": (
            "one of austen_slice, shakespeare, austen, or several joined by '+'",
            lambda v: isinstance(v, str) and all(p in TEXTS for p in v.split("+")),
        ),
        "tokenizer": ("'char' or 'gpt2'", lambda v: v in ("char", "gpt2")),
        "val_fraction": ("a number in (0, 1)", lambda v: is_number(v, gt=0, lt=1)),
        "n_layer": _INT_GE_1,
        "n_head": _INT_GE_1,
        "n_embd": _INT_GE_1,
        "block_size": _INT_GE_1,
        "bias": _BOOL,
        "tie_embeddings": _BOOL,
        "dropout": ("a number in [0, 1)", lambda v: is_number(v, ge=0, lt=1)),
        "head_lr": _RATE,
        "embed_lr": _RATE,
        "scalar_lr": _RATE,
        "eval_windows": _INT_GE_1,
    },
    "cnn": {
        "dataset": (f"one of {list(DATASETS)}", lambda v: v in DATASETS),
        "widths": (
            "a non-empty list of ints >= 1, e.g. [16, 32, 64]",
            lambda v: isinstance(v, (list, tuple)) and len(v) > 0 and all(is_int(w) and w >= 1 for w in v),
        ),
        "blocks_per_stage": _INT_GE_1,
        "eval_examples": _INT_GE_1,
        "recalibrate_bn": _BOOL,
        "bn_calibration_examples": _INT_GE_1,
    },
}


def check_fields(cls: type[Any], values: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the field, its value and what is allowed for the first bad field of
    ``values`` (a workload's fields, as ``make_workload`` overrides or ``--set FIELD=VALUE`` give them)."""
    for name, (allowed, ok) in {**_COMMON_CHECKS, **_CHECKS.get(cls.name, {})}.items():
        if name in values and not ok(values[name]):
            raise ValueError(f"{cls.name} workload: {name}={values[name]!r} must be {allowed}")
    if not values["rank"] < values["world_size"]:
        raise ValueError(f"rank {values['rank']} out of range for world size {values['world_size']}")
    if cls.name == "gpt" and values["n_embd"] % values["n_head"]:
        raise ValueError(
            f"gpt workload: n_embd={values['n_embd']} must be a multiple of n_head={values['n_head']} "
            "(every head gets n_embd / n_head dimensions)"
        )
