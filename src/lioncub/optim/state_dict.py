""":class:`~lioncub.optim.LionCub`'s state across a save: each rank's own momenta, the step (the tie
rule's phase), and the checks that refuse a state that is not this job's (:class:`PerRankState`).

A state dict carries ``sd["lioncub"]``: the format ``version``, the ``step``, the ``variant`` name, the
``rule`` that decides the update (:meth:`lioncub.optim.config.VoteConfig.update_rule`), ``world_size``,
``rank``, whether it is ``consolidated`` and, when it is, ``ranks``: every rank's own state dict, each
stored once (the entry of the rank that gathered them is ``None``: that rank's state is the dict's own
top level).

With local steps, a state saved in the middle of a window also holds this rank's parameters (each
parameter's ``state["replica"]``: the ranks' replicas differ until the outer step), and loading it writes
them back into the parameters: a framework that saves one model file for all ranks (rank 0's replica) and
loads it on every rank before the optimizer still resumes every rank's own window.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lioncub._validate import is_int
from lioncub.collectives import Comm
from lioncub.optim.config import ONE_BIT_VOTES, PRESETS, VoteConfig
from lioncub.optim.engine import StepEngine
from lioncub.optim.local_steps import LocalSteps

__all__ = ["STATE_VERSION", "PerRankState"]

#: 2: ``rule`` (the update's knobs) instead of comparing variant names; ``ranks`` holds the gathering
#: rank's entry as ``None``; ``consolidated``. Version 1 states load as before.
STATE_VERSION = 2
_READABLE = (1, 2)


class PerRankState:
    """The state-dict methods of :class:`~lioncub.optim.LionCub` (a mixin over ``torch.optim.Optimizer``:
    it reads the attributes declared here)."""

    comm: Comm
    variant: str
    config: VoteConfig
    local_steps: LocalSteps | None
    single_process: bool
    _global_step: int
    _consolidated: list[dict[str, Any] | None] | None
    state: Any  # torch.optim.Optimizer's
    param_groups: list[dict[str, Any]]

    def _engines(self) -> list[StepEngine]:
        """The step engines whose votes hold state (a stochastic quantizer's generator)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (momenta, step, variant, rank, world size). After
        :meth:`consolidate_state_dict` on the rank it gathered to, ``sd["lioncub"]["ranks"]`` also holds
        every rank's own state dict (index = rank; its own entry ``None``: the top level), until the next
        ``step()``. In a job of several processes an unconsolidated state holds this rank's momenta only
        (``sd["lioncub"]["consolidated"]`` is False): every rank saves its own, or all consolidate before one
        rank saves; another rank refuses to load it, naming that."""
        sd = self._own_state_dict()
        if self._consolidated is not None:
            sd["lioncub"]["consolidated"] = True
            sd["lioncub"]["ranks"] = self._consolidated
        return sd

    def _own_state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()  # type: ignore[misc]
        sd["lioncub"] = {
            "version": STATE_VERSION,
            "step": self._global_step,
            "variant": self.variant,
            "rule": self.config.update_rule(),
            "world_size": self.comm.world_size,
            "rank": self.comm.rank,
            "consolidated": False,
            "local_steps": None if self.local_steps is None else self.local_steps.describe(),
            # a stochastic quantizer's stream: the overlap hook's vote draws from its own when overlapping
            "generator": _generator_state(self._engines()[-1].vote),
        }
        if self.local_steps is not None and self._global_step % self.local_steps.h:
            self._add_replicas(sd)
        return sd

    def _add_replicas(self, sd: dict[str, Any]) -> None:
        """Each windowed parameter's value on this rank as ``sd["state"][i]["replica"]`` (new dicts:
        ``self.state``'s own are left alone; a copy, not a view of the parameter: a state dict kept while
        training goes on, or an async save, still holds the value of its step, and a loaded replica never
        aliases the tensors of the model it was saved with); the indices are
        ``torch.optim.Optimizer.state_dict``'s."""
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if "anchor" in self.state.get(p, {}):
                    sd["state"][index] = {**sd["state"][index], "replica": p.detach().clone()}
                index += 1

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's :meth:`state_dict` on rank ``to`` (a rank of the optimizer's group), so that
        a framework that saves the optimizer from one rank only keeps every rank's momenta (the convention
        of ``torch.distributed.optim.ZeroRedundancyOptimizer``; Lightning calls it before saving).
        Collective: every rank calls it. Costs ``N`` times one rank's state in ``to``'s host memory and
        file (the states travel and stay on the CPU; :meth:`load_state_dict` moves them to the
        parameters' device)."""
        comm = self.comm
        if not (is_int(to, 0) and to < comm.world_size):
            raise ValueError(
                f"consolidate_state_dict(to={to!r}): to must be a rank in 0..{comm.world_size - 1}"
            )
        self._consolidated = None
        if self.single_process:
            self._consolidated = [None]
            return
        # pickled from the CPU: a CUDA tensor would be unpickled on this rank's GPU inside rank `to`
        own = _to_cpu(self._own_state_dict())
        gathered = comm.gather_object(own, to, f"consolidate_state_dict(to={to})")
        if gathered is not None:
            self._consolidated = [None if r == to else sd for r, sd in enumerate(gathered)]

    def load_state_dict(self, state_dict: dict[str, Any], *, allow_world_size_change: bool = False) -> None:
        """Load this rank's state: from a consolidated state dict (:meth:`consolidate_state_dict`) the
        entry of this rank, else a state dict this rank wrote. Refuses a state whose update rule differs
        (another preset, quantizer, width, ...; ``flat`` and ``hierarchical`` are the same update), another
        world size, or another rank's state, unless ``allow_world_size_change`` (the documented conversions
        of ``lioncub train --convert-momenta``: the momenta are then taken as given — from a consolidated
        state dict, rank r takes entry ``r mod K`` of the K saved)."""
        comm = self.comm
        sd = dict(state_dict)
        meta = sd.pop("lioncub", None)
        if meta is not None and "ranks" in meta:
            ranks = meta["ranks"]
            if len(ranks) != comm.world_size and not allow_world_size_change:
                raise ValueError(
                    f"rank {comm.rank}: the optimizer state holds the momenta of {len(ranks)} ranks, "
                    f"this job has world_size={comm.world_size}; per-rank momenta do not carry over "
                    "(pass allow_world_size_change=True to accept)"
                )
            entry = ranks[comm.rank % len(ranks)]
            if entry is None:  # the gathering rank's own state: this dict's top level
                entry = {**sd, "lioncub": {k: v for k, v in meta.items() if k != "ranks"}}
            self.load_state_dict(entry, allow_world_size_change=True)
            return
        if meta is not None:
            self._check_meta(meta, allow_world_size_change)
            self._global_step = int(meta["step"])
            for engine in self._engines():
                generator = getattr(engine.vote, "generator", None)
                if meta.get("generator") is not None and generator is not None:
                    generator.set_state(meta["generator"])
        super().load_state_dict(sd)  # type: ignore[misc]
        self._consolidated = None
        with torch.no_grad():  # a window's replica, saved in its middle (local steps)
            for group in self.param_groups:
                for p in group["params"]:
                    replica = self.state.get(p, {}).pop("replica", None)
                    if replica is not None:
                        p.copy_(replica)

    def _check_meta(self, meta: dict[str, Any], allow_world_size_change: bool) -> None:
        """Refuse a state of another version, update rule, world size or rank (:meth:`load_state_dict`)."""
        comm, variant = self.comm, self.variant
        if meta.get("version") not in _READABLE:
            raise ValueError(f"optimizer state version {meta.get('version')} is not one of {_READABLE}")
        rule = self.config.update_rule()
        saved = meta["rule"] if "rule" in meta else _version1_rule(meta["variant"], self.config)
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
        local = None if self.local_steps is None else self.local_steps.describe()
        if meta.get("local_steps") != local:
            raise ValueError(
                f"the checkpoint was written with local_steps={meta.get('local_steps')}, this optimizer has "
                f"local_steps={local}: a resume keeps the windows and the outer step"
            )
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


def _generator_state(vote: Any) -> torch.Tensor | None:
    gen = getattr(vote, "generator", None)
    return None if gen is None else gen.get_state()
