""":class:`~lioncub.optim.LionCub`'s state across a save: each rank's own momenta, the step (the tie
rule's phase), and the checks that refuse a state that is not this job's (the functions here, which the
optimizer's ``state_dict``, ``consolidate_state_dict`` and ``load_state_dict`` call).

A state dict carries ``sd["lioncub"]``: the format ``version``, the ``step``, the ``variant`` name, the
``rule`` that decides the update (:meth:`lioncub.optim.config.VoteConfig.update_rule`), ``world_size``,
``rank``, whether it is ``consolidated`` and, when it is, ``ranks``: every rank's own state dict, each
stored once (the entry of the rank that gathered them is ``None``: that rank's state is the dict's own
top level).

With local steps, a state saved in the middle of a window also holds this rank's parameters (each
parameter's ``state["replica"]``: the ranks' replicas differ until the outer step) and the window's layout
(``sd["lioncub"]["window"]``, :mod:`lioncub.optim.windows`). Loading it restores the layout and writes
the replicas back into the parameters — at once and again at the next ``step()``, so the order of
loading does not matter: a framework that loads one model file for all ranks (rank 0's replica) after the
optimizer still resumes every rank's own window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lioncub._validate import is_int
from lioncub.collectives import Comm, Vote
from lioncub.optim.config import ONE_BIT_VOTES, PRESETS, VoteConfig
from lioncub.optim.engine import StepEngine
from lioncub.optim.local_steps import LocalSteps
from lioncub.optim.windows import check_settings_change

__all__ = ["STATE_VERSION", "StateOwner", "consolidated_entry", "gather_states", "restore_meta", "state_meta"]

#: 2: ``rule`` (the update's knobs) instead of comparing variant names; ``ranks`` holds the gathering
#: rank's entry as ``None``; ``consolidated``. 3: local steps decay outside the vote (the window's
#: ``window_decay``) and a state saved in a window's middle records its layout (``window``). Earlier
#: versions load as before, except in the middle of a window (refused: the window ran other steps).
STATE_VERSION = 3
_READABLE = (1, 2, 3)


@dataclass(frozen=True)
class StateOwner:
    """What a state records of the optimizer that writes it, and what one that loads it must match: the
    vote's name and configuration, the group (rank, world size), the local-steps settings."""

    variant: str
    config: VoteConfig
    comm: Comm
    local_steps: LocalSteps | None


def state_meta(owner: StateOwner, step: int, vote: Vote) -> dict[str, Any]:
    """``sd["lioncub"]`` of a :class:`~lioncub.optim.LionCub` at optimizer ``step`` (``vote``: the one
    whose stochastic quantizer's stream is saved: the overlap hook's when overlapping)."""
    local = owner.local_steps
    gen = getattr(vote, "generator", None)
    return {
        "version": STATE_VERSION,
        "step": step,
        "variant": owner.variant,
        "rule": owner.config.update_rule(),
        "world_size": owner.comm.world_size,
        "rank": owner.comm.rank,
        "consolidated": False,
        "local_steps": None if local is None else local.describe(),
        "generator": None if gen is None else gen.get_state(),
    }


def gather_states(
    comm: Comm, own: Callable[[], dict[str, Any]], to: int, *, alone: bool
) -> list[dict[str, Any] | None] | None:
    """Every rank's state dict (``own()``, moved to the CPU) gathered on group rank ``to`` — the list of
    :meth:`~lioncub.optim.LionCub.consolidate_state_dict` (``to``'s own entry ``None``), ``None`` on the
    other ranks. Collective. ``alone``: one process, nothing to gather."""
    if not (is_int(to, 0) and to < comm.world_size):
        raise ValueError(f"consolidate_state_dict(to={to!r}): to must be a rank in 0..{comm.world_size - 1}")
    if alone:
        return [None]
    # pickled from the CPU: a CUDA tensor would be unpickled on this rank's GPU inside rank `to`
    gathered = comm.gather_object(_to_cpu(own()), to, f"consolidate_state_dict(to={to})")
    return None if gathered is None else [None if r == to else sd for r, sd in enumerate(gathered)]


def consolidated_entry(meta: dict[str, Any], sd: dict[str, Any], comm: Comm, allow: bool) -> dict[str, Any]:
    """This rank's entry of a consolidated state dict (``meta``: its ``sd["lioncub"]``; ``sd``: the rest):
    rank r takes entry ``r mod K`` of the K saved, when ``allow`` or K is the world size."""
    ranks = meta["ranks"]
    if len(ranks) != comm.world_size and not allow:
        raise ValueError(
            f"rank {comm.rank}: the optimizer state holds the momenta of {len(ranks)} ranks, "
            f"this job has world_size={comm.world_size}; per-rank momenta do not carry over "
            "(pass allow_world_size_change=True to accept)"
        )
    entry: dict[str, Any] | None = ranks[comm.rank % len(ranks)]
    if entry is None:  # the gathering rank's own state: this dict's top level
        entry = {**sd, "lioncub": {k: v for k, v in meta.items() if k != "ranks"}}
    return entry


def restore_meta(owner: StateOwner, meta: dict[str, Any], engines: Sequence[StepEngine], allow: bool) -> int:
    """Check ``meta`` against ``owner`` (another version, update rule, local-steps settings in a
    window's middle, world size or rank are refused), restore the stochastic quantizers' streams, and
    return the saved step."""
    _check_meta(owner, meta, allow)
    for engine in engines:
        generator = getattr(engine.vote, "generator", None)
        if meta.get("generator") is not None and generator is not None:
            generator.set_state(_rng_state(meta["generator"]))
    return int(meta["step"])


def _rng_state(state: Any) -> torch.Tensor:
    """A saved generator state as ``Generator.set_state`` takes it, a CPU ByteTensor (CPU and CUDA
    generators alike): a state loaded with ``map_location`` a GPU (the Hugging Face Trainer's resume on
    several GPUs, accelerate's optimizer placement) is on that GPU."""
    if not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8):
        raise TypeError(
            f"the optimizer state's lioncub generator state is a {type(state).__name__}"
            f"{f' of {state.dtype}' if isinstance(state, torch.Tensor) else ''}, not the uint8 tensor "
            "torch.Generator.get_state() saves"
        )
    return state.to("cpu")


def _check_meta(owner: StateOwner, meta: dict[str, Any], allow_world_size_change: bool) -> None:
    """Refuse a state of another version, update rule, local-steps settings (:mod:`lioncub.optim.windows`),
    world size or rank."""
    comm, variant = owner.comm, owner.variant
    if meta.get("version") not in _READABLE:
        raise ValueError(f"optimizer state version {meta.get('version')} is not one of {_READABLE}")
    rule = owner.config.update_rule()
    saved = meta["rule"] if "rule" in meta else _version1_rule(meta["variant"], owner.config)
    if saved != rule:
        hint = ""
        if "rule" not in meta and saved.get("zero_vote") == "plus":
            hint = (
                f" (a version-1 state ran the papers' rule for exact zeros: resume it with "
                f"variant=resolve_variant({meta['variant']!r}, zero_vote='plus'))"
            )
        raise ValueError(
            f"the checkpoint was written by variant={meta['variant']!r}, this optimizer is "
            f"variant={variant!r}; their updates differ: {saved} against {rule}{hint}"
        )
    local = None if owner.local_steps is None else owner.local_steps.describe()
    check_settings_change(meta.get("local_steps"), local, int(meta["step"]))
    if meta["world_size"] != comm.world_size and not allow_world_size_change:
        raise ValueError(
            f"the checkpoint was written with world_size={meta['world_size']}, this job has "
            f"world_size={comm.world_size}; per-rank momenta do not carry over "
            "(pass allow_world_size_change=True to accept)"
        )
    if meta.get("rank", comm.rank) != comm.rank and not allow_world_size_change:
        raise ValueError(
            f"rank {comm.rank}: this optimizer state was saved by rank {meta['rank']} and holds its "
            "momenta only: no opt.consolidate_state_dict(to=0) ran on every rank before the save (a "
            "save made from one rank keeps that rank's state). Each rank has its own momenta: save one "
            "file per rank, or consolidate on every rank right before rank 0 saves (LionCubTrainer / "
            "LionCubCallback, lioncub.integrations.accelerate.prepare and LionCubStrategy do it for the "
            "saves their framework makes); to start the other ranks from rank "
            f"{meta['rank']}'s momenta on purpose pass allow_world_size_change=True"
        )


def _version1_rule(name: str, config: VoteConfig) -> dict[str, Any]:
    """The update rule a version-1 state (which recorded the preset's name only) was written with: the
    preset ``name`` with the papers' rule for exact zeros (``zero_vote="plus"``, what every one-bit vote
    did then). A version-1 ``"custom"`` state came from a vote over nodes (``lioncub train --topology``):
    it is taken to be ``config``'s own when ``config`` votes over nodes, and refused otherwise."""
    if name in PRESETS:
        preset = PRESETS[name]
        zeros = "plus" if preset.transport in ONE_BIT_VOTES else "split"
        return dataclasses.replace(preset, zero_vote=zeros).update_rule()
    if name == "custom" and config.topology != "flat":
        return config.update_rule()
    return {"variant": name}


def _to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor in it (nested dicts, lists, tuples) moved to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
