""":class:`~lioncub.optim.LionCub`'s state across a save: each rank's own momenta, the step (the tie
rule's phase), and the checks that refuse a state that is not this job's (:class:`PerRankState`).

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
from typing import Any

import torch

from lioncub._validate import is_int
from lioncub.collectives import Comm
from lioncub.optim.config import ONE_BIT_VOTES, PRESETS, VoteConfig
from lioncub.optim.engine import StepEngine
from lioncub.optim.layout import ParamLayout
from lioncub.optim.local_steps import LocalSteps
from lioncub.optim.windows import check_group_sizes, check_settings_change, restore_window, window_record

__all__ = ["STATE_VERSION", "PerRankState"]

#: 2: ``rule`` (the update's knobs) instead of comparing variant names; ``ranks`` holds the gathering
#: rank's entry as ``None``; ``consolidated``. 3: local steps decay outside the vote (each parameter's
#: ``window_decay``) and a state saved in a window's middle records its layout (``window``). Earlier
#: versions load as before, except in the middle of a window (refused: the window ran other steps).
STATE_VERSION = 3
_READABLE = (1, 2, 3)


class PerRankState:
    """The state-dict methods of :class:`~lioncub.optim.LionCub` (a mixin over ``torch.optim.Optimizer``:
    it reads the attributes declared here)."""

    comm: Comm
    variant: str
    config: VoteConfig
    local_steps: LocalSteps | None
    single_process: bool
    layout: ParamLayout
    engine: StepEngine
    window_decay: list[float]
    _global_step: int
    _consolidated: list[dict[str, Any] | None] | None
    _pending_replicas: dict[int, tuple[torch.Tensor, torch.Tensor]]
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
        if (
            self.local_steps is not None
            and self._global_step % self.local_steps.h
            and not self.single_process
        ):
            self._add_replicas(sd)
            sd["lioncub"]["window"] = window_record(self.param_groups, self.state, self.layout.names)
            sd["lioncub"]["window_decay"] = list(self.window_decay)
        return sd

    def _add_replicas(self, sd: dict[str, Any]) -> None:
        """Each parameter's value on this rank as ``sd["state"][i]["replica"]`` — the window's, and those
        outside it, which may differ between the ranks too (added in the window, not yet given rank 0's
        value) — in new dicts (``self.state``'s own are left alone), as copies, not views of the
        parameters: a state dict kept while training goes on, or an async save, still holds the values of
        its step, and a loaded replica never aliases the model it was saved with. The indices are
        ``torch.optim.Optimizer.state_dict``'s."""
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                sd["state"][index] = {**sd["state"].get(index, {}), "replica": p.detach().clone()}
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
        check_group_sizes(sd.get("param_groups", []), self.param_groups, (meta or {}).get("window"))
        members = self._window_of(meta, sd["state"]) if meta is not None else None
        if meta is not None:
            self._global_step = int(meta["step"])
            for engine in self._engines():
                generator = getattr(engine.vote, "generator", None)
                if meta.get("generator") is not None and generator is not None:
                    generator.set_state(meta["generator"])
        super().load_state_dict(sd)  # type: ignore[misc]
        self._consolidated = None
        self._pending_replicas = {}
        with torch.no_grad():  # the replicas, saved in a window's middle (local steps)
            for group in self.param_groups:
                for p in group["params"]:
                    replica = self.state.get(p, {}).pop("replica", None)
                    if replica is not None:
                        p.copy_(replica)
                        self._pending_replicas[id(p)] = (p, replica)  # written again by the next step()
                    if p in self.state and not self.state[p]:
                        del self.state[p]  # held the replica only
        if members is not None:  # the window in progress keeps its own layout
            self.layout.rebuild(self.param_groups, members)
            self.engine.state.refresh()
            self.window_decay = [float(d) for d in meta.get("window_decay", [])]  # type: ignore[union-attr]

    def _window_of(self, meta: dict[str, Any], saved: dict[int, Any]) -> set[int] | None:
        """The parameters of the window in progress at the state's step (``saved``: its per-parameter
        states, by index), checked before anything is loaded (:func:`~lioncub.optim.windows.
        restore_window`); ``None`` where no window is in progress."""
        step, local = int(meta["step"]), self.local_steps
        if local is None or self.single_process or step % local.h == 0:
            return None
        if int(meta.get("version", 1)) < 3:
            why = f"its local steps decayed inside the window (state version {meta['version']})"
        else:
            why = "it was saved by one process (whose steps are Lion's, without windows)"
        return restore_window(
            self.param_groups, saved, meta.get("window"), step=step, h=local.h, why_missing=why
        )

    def put_back_replicas(self) -> None:
        """Write the replicas of the last :meth:`load_state_dict` into the parameters again (the start of the
        next ``step()``: a model file loaded after the optimizer state may have replaced them)."""
        pending = self._pending_replicas
        if pending:
            with torch.no_grad():
                for p, replica in pending.values():
                    p.copy_(replica)
            self._pending_replicas = {}

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


def _generator_state(vote: Any) -> torch.Tensor | None:
    gen = getattr(vote, "generator", None)
    return None if gen is None else gen.get_state()
