"""A local-steps window across a save (:mod:`lioncub.optim.state_dict` calls these).

A state saved in the middle of a window records the window's layout — which parameters it covers, by
position in the param groups, with their names and shapes (``sd["lioncub"]["window"]``) — because the
layout of the rest of the window is the window's, not what ``requires_grad`` says when the state is
loaded: a parameter frozen in the window still takes its outer step, one unfrozen or added in it waits
for the next window. :func:`restore_window` gives back that layout, or refuses, naming the parameter and
what to do, where it cannot hold (the parameter is gone, or has another shape).

A change of the local-steps settings (``h``, the outer rule, its lr and betas, the inner-momentum rule)
is accepted at a step that starts a window under both the saved and the new ``h`` (the momenta carry
over: the inner one as the rule says at a window's start, the outer one as it was; a new outer rule
starts its own momentum at zeros), with a warning naming each setting that changes (a state saved under
an earlier lioncub's defaults continues under today's: say so); elsewhere :func:`check_settings_change`
refuses, naming each setting that differs.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch

from lioncub.optim.callers import caller_stacklevel

__all__ = ["LoadedReplicas", "check_group_sizes", "check_settings_change", "restore_window", "window_record"]


def window_record(param_groups: list[dict[str, Any]], state: Any, names: dict[int, str]) -> list[list[Any]]:
    """``[group, index, name, shape]`` of every parameter of the window in progress (those with an
    ``anchor``), in param-group order."""
    return [
        [gi, i, names.get(id(p), f"param_groups[{gi}][{i}]"), list(p.shape)]
        for gi, g in enumerate(param_groups)
        for i, p in enumerate(g["params"])
        if "anchor" in state.get(p, {})
    ]


def check_settings_change(saved: dict[str, Any] | None, mine: dict[str, Any] | None, step: int) -> None:
    """Refuse other local-steps settings than the saved ones (``LocalSteps.describe()`` of each, ``None``
    for none) unless ``step`` starts a window under both (then warn); the message names each setting that
    differs."""
    if saved == mine:
        return
    if saved is None or mine is None:
        which = "without" if saved is None else "with"
        raise ValueError(
            f"the optimizer state was saved {which} local steps (local_steps={saved}), this optimizer has "
            f"local_steps={mine}: give the optimizer the saved setting to resume"
        )
    differ = [
        f"{key}={saved.get(key)!r} (now {mine.get(key)!r})" for key in mine if saved.get(key) != mine.get(key)
    ]
    old_h, new_h = int(saved["h"]), int(mine["h"])
    if step % old_h == 0 and step % new_h == 0:  # a window boundary under both: the next window runs them
        warnings.warn(
            f"LionCub: the optimizer state was saved at step {step} with other local-steps settings: "
            f"{', '.join(differ)}; the windows from step {step + 1} run the new ones (give the saved values "
            "to keep them)",
            stacklevel=caller_stacklevel(),  # the line that called load_state_dict
        )
        return
    raise ValueError(
        f"the optimizer state was saved at step {step} with other local-steps settings: "
        f"{', '.join(differ)}. They can change only where a window starts under both h={old_h} and "
        f"h={new_h} (a step that is a multiple of both): resume with the saved settings and change them "
        "at such a step"
    )


def check_group_sizes(
    saved_groups: list[dict[str, Any]], param_groups: list[dict[str, Any]], record: list[list[Any]] | None
) -> None:
    """Refuse a state of other param groups (their number, or the number of parameters in one), naming the
    window's parameters that are gone."""
    sizes = [len(g["params"]) for g in saved_groups]
    mine = [len(g["params"]) for g in param_groups]
    if sizes == mine:
        return
    gone = [name for gi, i, name, _ in record or [] if gi >= len(mine) or i >= mine[gi]]
    also = f"; the window in progress has {gone}, which this optimizer lacks" if gone else ""
    raise ValueError(
        f"the optimizer state holds param groups of {sizes} parameters, this optimizer {mine}{also}. Keep "
        "every parameter in the optimizer (freeze one with requires_grad_(False) instead of removing it), "
        "or resume from a state saved where a window starts"
    )


def restore_window(
    param_groups: list[dict[str, Any]],
    saved: dict[int, Any],
    record: list[list[Any]] | None,
    *,
    step: int,
    h: int,
    why_missing: str,
) -> set[int]:
    """The ``id`` of the parameters of the window in progress at ``step`` (``record``: the saved
    :func:`window_record`), each checked to be there with its shape and a saved ``anchor`` (``saved``: the
    state dict's per-parameter states, by index); ``why_missing`` says why a state has no record (refused
    then)."""
    if record is None:
        raise ValueError(
            f"the optimizer state is at step {step}, in the middle of a window of h={h} local steps, but "
            f"{why_missing}: it cannot continue that window. Resume from a state saved where a window "
            f"starts (a multiple of {h})"
        )
    first = [sum(len(g["params"]) for g in param_groups[:gi]) for gi in range(len(param_groups))]
    members = set()
    for gi, i, name, shape in record:
        p = param_groups[gi]["params"][i]
        anchor = saved.get(first[gi] + i, {}).get("anchor")
        if list(p.shape) != list(shape) or not isinstance(anchor, torch.Tensor):
            raise ValueError(
                f"the window in progress at step {step} covers {name} (param_groups[{gi}][{i}], shape "
                f"{tuple(shape)}), but this optimizer's parameter there has shape {tuple(p.shape)} or no "
                f"saved anchor; resume from a state saved where a window starts (a multiple of {h})"
            )
        members.add(id(p))
    return members


class LoadedReplicas:
    """This rank's replicas of a state loaded in a window's middle, held in the parameters until the next
    ``step()``, whatever else is loaded into them meanwhile.

    ``load_state_dict`` writes each replica into its parameter; a model state loaded *after* it (one file
    for all ranks: rank 0's replica, or θ_t) overwrites them, and the forward before the next ``step()``
    would run on those values. So, until that step, a global forward pre-hook of ``torch.nn.Module``
    (:func:`torch.nn.modules.module.register_module_forward_pre_hook`) writes a replica back into its
    parameter wherever the parameter was written since (its version counter ``p._version`` moved): every
    pending parameter at the first module call, then a module's own parameters at each call. The forward
    and backward so run on this rank's replica in either order of loading, and the results are bitwise
    those of the uninterrupted run. Where the parameters are used outside an ``nn.Module`` call (a
    functional loss on ``model.weight``), no hook sees the use: a gradient accumulated into a parameter
    written after its replica (a post-accumulate-grad hook compares the versions) makes :meth:`check`
    raise at the next step on every rank that loaded the model so (rank 0 too, whose replica the file may
    hold: a version counter says "written", not "another value"), naming the parameter and the fix (load
    the model first, or call ``LionCub.restore_replicas()`` after loading it). The hooks are removed at the
    next step (or when the optimizer is collected); until then a module call reads a few version counters.
    """

    def __init__(self, names: dict[int, str], rank: int) -> None:
        self._names, self._rank = names, rank
        self._entries: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # id → (p, replica, version)
        self._handles: list[Any] = []
        self._stale: list[int] = []  # parameters whose gradient was computed on an overwritten value
        self._all_checked = False

    def hold(self, replicas: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Hold ``replicas`` (``id(p)`` → ``(p, replica)``, already written into the parameters)."""
        self.clear()
        if not replicas:
            return
        self._entries = {i: (p, r, p._version) for i, (p, r) in replicas.items()}
        me = weakref.ref(self)

        def pre_forward(module: torch.nn.Module, args: Any) -> None:
            guard = me()
            if guard is None:
                handle.remove()
            elif not torch.compiler.is_compiling():
                guard.before_forward(module)

        handle = torch.nn.modules.module.register_module_forward_pre_hook(pre_forward)
        self._handles.append(handle)
        weakref.finalize(self, handle.remove)

        def accumulated(p: torch.Tensor) -> None:
            guard = me()
            if guard is not None:
                guard.after_accumulate(p)

        register = cast(
            Callable[[torch.Tensor, Callable[[torch.Tensor], None]], Any],
            torch.Tensor.register_post_accumulate_grad_hook,
        )
        for p, _, _ in self._entries.values():
            if p.requires_grad:
                self._handles.append(register(p, accumulated))

    def after_accumulate(self, p: torch.Tensor) -> None:
        """A gradient was accumulated into ``p``: computed on an overwritten value if ``p`` was written
        since its replica."""
        entry = self._entries.get(id(p))
        if entry is not None and p._version != entry[2] and id(p) not in self._stale:
            self._stale.append(id(p))

    @property
    def pending(self) -> bool:
        return bool(self._entries)

    def before_forward(self, module: torch.nn.Module) -> None:
        """A module is called: the replicas overwritten since (all at the first call, then its own)."""
        if not self._all_checked:
            self._all_checked = True
            self.restore()
            return
        for p in module._parameters.values():
            if p is not None and id(p) in self._entries:
                self._restore_one(id(p))

    def _restore_one(self, key: int) -> None:
        p, replica, version = self._entries[key]
        if p._version != version:
            with torch.no_grad():
                p.copy_(replica)
            self._entries[key] = (p, replica, p._version)

    def restore(self) -> None:
        """Every replica back into its parameter where the parameter changed since it was written."""
        for key in list(self._entries):
            self._restore_one(key)

    def written(self, p: torch.Tensor) -> None:
        """``p`` was written by the optimizer itself (θ_t shown, a replica put back): not a change."""
        entry = self._entries.get(id(p))
        if entry is not None:
            self._entries[id(p)] = (p, entry[1], p._version)

    def check(self) -> None:
        """At the next step: ``RuntimeError`` where a gradient was computed on an overwritten parameter."""
        stale = [self._names.get(i, "a parameter") for i in self._entries if i in self._stale]
        if stale:
            self.clear()
            shown = ", ".join(stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
            raise RuntimeError(
                f"rank {self._rank}: LionCub: {shown} was overwritten after load_state_dict wrote this "
                "rank's local-steps replica into it (a model state loaded after the optimizer's, in the "
                "middle of a window), and this step's gradient was computed on the changed value outside an "
                "nn.Module call, where lioncub cannot put the replica back first: the step would continue "
                "another rank's window. Load the model before the optimizer state, or call "
                "opt.restore_replicas() after loading the model (before the forward)"
            )

    def clear(self) -> None:
        """Nothing held any more (the hooks removed)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._entries, self._stale, self._all_checked = [], {}, [], False
