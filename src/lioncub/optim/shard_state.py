""":class:`~lioncub.optim.LionCub`'s state on shards in the form ``torch.distributed.checkpoint`` saves
(docs/shards.md, "Checkpoints"): each rank's own momenta, as slices of tensors of the whole mesh.

DCP saves a plain tensor as if every rank held the same one, and a ``DTensor`` as the pieces of one
global tensor. On shards every rank's state differs: along ``"shard"`` it is its rows of each parameter,
along ``"replicate"`` its replica's own (each voter keeps its own momentum). So each state tensor of a
parameter ``P`` of shape ``(D, ...)`` is saved as a ``DTensor`` of shape ``(R, D, ...)`` on the 2-D mesh,
placed ``(Shard(0), Shard(1))``: replica r's tensor is row r, cut along ``D`` as FSDP2 cuts ``P``. A
replica's ranks write its row together; a load on another number of shards reads the rows of its new
shards (DCP reshards); another number of replicas is refused (the momenta are the voters').

DCP loads *into* the state dict of a freshly built optimizer (the template), key by key: keys of the
checkpoint the template lacks are silently not read, and a key of the template the checkpoint lacks
fails. So the form's keys depend only on the parameters and on whether local steps run, never on the
step at which it was saved: every parameter has every key of :func:`state_keys` (zeros where this rank
holds none) and ``"held"``, which of them it holds (a bit mask, ``uint8`` of shape ``(R,)`` placed
``(Shard(0), Replicate())``: a replica's ranks hold the same keys). The optimizer's record
(``sd["lioncub"]``: step, variant, settings, the window in progress) is one JSON string in the first param
group (``get_state_dict`` keeps the param groups and the per-parameter state only), beside the stochastic
quantizer's generator state, one per replica like ``"held"`` (zeros without one).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from lioncub.optim.local_steps import LocalSteps, window_flag
from lioncub.optim.outer import OUTER_RULES
from lioncub.optim.shards import ShardView
from lioncub.optim.windows import check_settings_change

__all__ = ["FLAG_KEYS", "from_checkpoint", "is_checkpoint_form", "state_keys", "to_checkpoint"]

#: the state keys of which only the presence counts (``"held"`` says it; no tensor is saved)
FLAG_KEYS = ("window_grad",)
#: the key of the first param group that carries the optimizer's record
RECORD = "lioncub"

_ROWS = (Shard(0), Shard(1))  # a replica's row, cut along the parameter's dim 0
_PER_REPLICA = (Shard(0), Replicate())


def state_keys(local_steps: LocalSteps | None) -> tuple[str, ...]:
    """The per-parameter state keys of the checkpoint form: the momentum; with local steps the anchor,
    the outer rule's momentum, the replica (a window's middle) and the window's gradient flag."""
    if local_steps is None:
        return ("exp_avg",)
    return ("exp_avg", "anchor", OUTER_RULES[local_steps.outer].state_key, "replica", *FLAG_KEYS)


def is_checkpoint_form(sd: dict[str, Any]) -> bool:
    """Whether ``sd`` is a state dict of LionCub on shards (:func:`to_checkpoint`'s form)."""
    groups = sd.get("param_groups")
    return isinstance(groups, list) and bool(groups) and isinstance(groups[0], dict) and RECORD in groups[0]


def to_checkpoint(sd: dict[str, Any], view: ShardView, keys: Sequence[str]) -> dict[str, Any]:
    """This rank's state dict (momenta of its shards, ``sd["lioncub"]`` its record) in the checkpoint form:
    every state tensor a ``DTensor`` of the whole mesh whose local piece is this rank's; ``sd`` is not
    modified, its tensors are shared."""
    meta = dict(sd["lioncub"])
    params = _params(view)
    replicas = view.mesh.size(0)
    state: dict[int, dict[str, Any]] = {}
    for index, p in enumerate(params):
        own = sd["state"].get(index, {})
        unknown = sorted(set(own) - set(keys))
        if unknown:
            raise RuntimeError(
                f"LionCub: the state {unknown} of {_name(p, index)} has no checkpoint form on shards "
                f"(the form holds {list(keys)})"
            )
        alias = view.alias(p)
        entry: dict[str, Any] = {}
        for key in keys:
            if key in FLAG_KEYS:
                continue
            value = own.get(key)
            if value is None:
                value = alias.new_zeros(alias.shape)
            elif value.shape != alias.shape or value.dtype != alias.dtype:
                raise RuntimeError(
                    f"LionCub: the state {key!r} of {_name(p, index)} is {value.dtype} of shape "
                    f"{tuple(value.shape)}, not its shard's {alias.dtype} of shape {tuple(alias.shape)}"
                )
            entry[key] = _stacked(value, view, (replicas, *p.shape), _ROWS)
        mask = sum(1 << bit for bit, key in enumerate(keys) if key in own)
        held = torch.full((), mask, dtype=torch.uint8, device=alias.device)
        entry["held"] = _stacked(held, view, (replicas,), _PER_REPLICA)
        state[index] = entry
    generator = meta.pop("generator", None)
    meta.pop("rank", None)
    meta["stochastic"] = generator is not None
    meta["mesh"] = [replicas, view.shards]
    meta["keys"] = list(keys)
    meta.setdefault("window", None)
    meta.setdefault("window_decay", None)
    if meta["window"] is not None:  # the whole parameters' shapes: the same on every shard rank
        meta["window"] = [
            [gi, i, name, list(params[_flat(view, gi, i)].shape)] for gi, i, name, _ in meta["window"]
        ]
    device = view.shard_comm.device
    if generator is None:
        generator = torch.zeros(_generator_bytes(device), dtype=torch.uint8, device=device)
    groups = [dict(g) for g in sd["param_groups"]]
    groups[0][RECORD] = {
        "record": json.dumps(meta),
        "generator": _stacked(generator.to(device), view, (replicas, generator.numel()), _PER_REPLICA),
    }
    return {"state": state, "param_groups": groups}


def from_checkpoint(
    sd: dict[str, Any], view: ShardView, keys: Sequence[str], rank: int, local_steps: dict[str, Any] | None
) -> dict[str, Any]:
    """A state dict in the checkpoint form (DCP's load into this optimizer's own, or any state dict
    :func:`to_checkpoint` gave on this mesh) as this rank's state dict (``rank``: its rank in the vote's
    group; ``local_steps``: the optimizer's settings, ``LocalSteps.describe()``). Refuses another number of
    replicas and other local-steps settings; the optimizer's load checks the rest of the record."""
    groups = [dict(g) for g in sd["param_groups"]]
    blob = groups[0].pop(RECORD)
    for g in groups[1:]:
        g.pop(RECORD, None)
    meta = json.loads(blob["record"])
    replicas, shards = view.mesh.size(0), view.shards
    saved_replicas, saved_shards = meta["mesh"]
    if saved_replicas != replicas:
        raise ValueError(
            f"the optimizer state was saved by {saved_replicas} replicas × {saved_shards} shards (mesh "
            f"('replicate', 'shard')), this optimizer's mesh is {replicas} × {shards}: each replica's "
            "momenta are its own and do not carry over to another number of replicas (another number of "
            "shards loads: DCP reshards)"
        )
    if list(meta["keys"]) != list(keys):
        check_settings_change(meta.get("local_steps"), local_steps, int(meta["step"]))
        raise ValueError(
            f"the optimizer state holds the per-parameter state {meta['keys']}, this optimizer {list(keys)}"
        )
    params = _params(view)
    ids = [pid for g in groups for pid in g["params"]]
    if len(ids) != len(params):
        raise ValueError(
            f"the optimizer state holds {len(ids)} parameters (param groups of "
            f"{[len(g['params']) for g in groups]}), this optimizer {len(params)} "
            f"({[len(g['params']) for g in view.optimizer.param_groups]})"
        )
    position = {pid: i for i, pid in enumerate(ids)}
    state: dict[int, dict[str, Any]] = {}
    for pid, entry in sd["state"].items():
        index = position[pid]
        p, alias = params[index], view.alias(params[index])
        mask = int(_local(entry["held"], (), f"{_name(p, index)}: 'held'"))
        own: dict[str, Any] = {}
        for bit, key in enumerate(keys):
            if not mask >> bit & 1:
                continue
            if key in FLAG_KEYS:
                own[key] = window_flag()
            else:
                own[key] = _local(entry[key], tuple(alias.shape), f"{_name(p, index)}: {key!r}")
        if own:
            state[index] = own
    if meta["window"] is not None:  # back to this rank's shapes (its shards')
        window = []
        for gi, i, name, shape in meta["window"]:
            p = params[_flat(view, gi, i)]
            if list(p.shape) != list(shape):
                raise ValueError(
                    f"the window in progress at step {meta['step']} covers {name} (param_groups[{gi}][{i}]) "
                    f"of shape {tuple(shape)}, this optimizer's parameter there has shape {tuple(p.shape)}"
                )
            window.append([gi, i, name, list(view.alias(p).shape)])
        meta["window"] = window
    else:
        del meta["window"]
    if meta["window_decay"] is None:
        del meta["window_decay"]
    generator = _local(blob["generator"], None, "the generator state").cpu().clone()
    meta["generator"] = generator if meta.pop("stochastic") else None
    meta["rank"] = rank
    del meta["mesh"], meta["keys"]
    for g in groups:
        g["params"] = [position[pid] for pid in g["params"]]
    return {"state": state, "param_groups": groups, "lioncub": meta}


def _stacked(
    local: torch.Tensor, view: ShardView, shape: Sequence[int], placements: tuple[Placement, ...]
) -> DTensor:
    """``local`` as this rank's piece (row r of the replicas) of a ``DTensor`` of ``shape`` on the mesh."""
    return DTensor.from_local(
        local.unsqueeze(0),
        view.mesh,
        placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )


def _local(value: Any, shape: tuple[int, ...] | None, what: str) -> torch.Tensor:
    """This rank's piece of a ``DTensor`` of the checkpoint form (its replica's row), of ``shape``."""
    if not isinstance(value, DTensor):
        raise TypeError(
            f"the optimizer state's {what} is a {type(value).__name__}, not the DTensor of the whole mesh a "
            "LionCub on shards saves"
        )
    local = value.to_local()
    if local.dim() < 1 or local.shape[0] != 1 or (shape is not None and tuple(local.shape[1:]) != shape):
        raise ValueError(
            f"the optimizer state's {what} holds a piece of shape {tuple(local.shape)} on this rank, not one "
            f"replica's row of its shard {(1, *shape) if shape is not None else ''}"
        )
    return local[0]


def _params(view: ShardView) -> list[torch.Tensor]:
    return [p for g in view.optimizer.param_groups for p in g["params"]]


def _flat(view: ShardView, gi: int, i: int) -> int:
    return sum(len(g["params"]) for g in view.optimizer.param_groups[:gi]) + i


def _name(p: torch.Tensor, index: int) -> str:
    return f"parameter {index} (shape {tuple(p.shape)})"


def _generator_bytes(device: torch.device) -> int:
    """The length of a generator state on ``device`` (the template's, where no quantizer draws)."""
    return torch.Generator(device=device).get_state().numel()
