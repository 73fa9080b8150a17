"""The outer steps of local steps, one small class per rule (``LocalSteps(outer=...)``; the formulas are in
``docs/local-steps.md``). A rule is its hyperparameters; :meth:`OuterRule.step` takes
:class:`OuterInputs` — the round it votes with (:class:`~lioncub.optim.round.VoteRound`), with each
parameter's pseudo-gradient Δ_r = θ_t − θ_r in ``.grad`` and the parameters at θ_t, and the state it
keeps (each parameter's outer momentum, in the per-parameter state a state dict saves) — and moves them
to θ_{t+1} (the window's weight decay D is applied after it by the window,
:class:`~lioncub.optim.local_steps.LocalWindow`). It reaches nothing else: no optimizer, no window.

* :class:`SignOuter` — ``"vote"``: the optimizer's vote on ``c_r = β1ᵒ·M_r + (1 − β1ᵒ)·Δ_r`` (every rank's
  own outer momentum M_r), applied with ηᵒ = outer_lr·H·lr; ``"dsm"``: the same through a dense variant,
  i.e. a sign step on the mean Δ̄ with one shared outer momentum (Yu et al. 2024);
* :class:`DiLoCoOuter` — ``"diloco"``: Nesterov SGD on the mean Δ̄ (Douillard et al. 2023).

A new rule is a class here with its name, its defaults and :meth:`OuterRule.step`, added to
:data:`OUTER_RULES`: ``LocalSteps`` validation, the CLI's ``--outer`` choices and the docs' list follow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lioncub.collectives import CommCounter, Hyper, flat_views
from lioncub.optim.engine import Bucket, PhaseClock, StepTimes
from lioncub.optim.round import VoteRound

__all__ = ["OUTER_RULES", "DiLoCoOuter", "OuterInputs", "OuterRule", "OuterState", "SignOuter"]


@dataclass(frozen=True)
class OuterInputs:
    """What an outer step works with.

    Args:
        round: the vote round it votes with (``.grad``: Δ_r; the parameters at θ_t); over ``buckets``
            (``None``: the layout's).
        outer_step: the outer step's number (the vote's tie phase).
        state: each parameter's state, where the rule keeps its outer momentum (a state dict saves it).
        group: the param group of a parameter (its current ``lr``).
        before, times: where the step's booking starts (:meth:`VoteRound.finish`), and its phase times.
        buckets: the buckets the outer step covers (``None``: all; a fragment's, say).
    """

    round: VoteRound
    outer_step: int
    state: MutableMapping[torch.Tensor, Any]
    group: Callable[[torch.Tensor], dict[str, Any]]
    before: CommCounter
    times: StepTimes
    buckets: Sequence[Bucket] | None = None

    @property
    def clock(self) -> PhaseClock:
        return self.round.engine.clock


class OuterState:
    """An outer rule's :class:`lioncub.collectives.ParamState`: each parameter's outer momentum
    ``state[p][key]`` (zeros at first), and the outer hyperparameters (ηᵒ = ``lr_scale`` × the group's
    current lr, β1ᵒ, β2ᵒ, λᵒ; never ``maximize``: Δ already points the way the inner steps went)."""

    def __init__(
        self,
        inputs: OuterInputs,
        key: str,
        lr_scale: float,
        betas: tuple[float, float],
        weight_decay: float = 0.0,
    ) -> None:
        self._state, self._group, self._key = inputs.state, inputs.group, key
        self._lr_scale, self._betas, self._weight_decay = lr_scale, betas, weight_decay

    def momentum(self, p: torch.Tensor) -> torch.Tensor:
        state = self._state[p]
        if self._key not in state:
            state[self._key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        momentum: torch.Tensor = state[self._key]
        return momentum

    def hyper(self, p: torch.Tensor) -> Hyper:
        lr = self._lr_scale * float(self._group(p)["lr"])
        return Hyper(lr, self._betas[0], self._betas[1], self._weight_decay, False)


class OuterRule:
    """An outer step (the module docstring). ``name``: the rule's ``LocalSteps(outer=...)``; ``dense``:
    it averages the pseudo-gradients (needs a dense variant); ``lr``, ``betas``: its defaults (the lr at
    H: :meth:`default_lr`)."""

    name: ClassVar[str]
    dense: ClassVar[bool] = False
    lr: ClassVar[float] = 1.0
    #: (β1ᵒ, β2ᵒ): β2ᵒ = 0.96, a shorter memory than Lion's 0.99 per step, chosen by measurement
    #: (``docs/findings.md`` §8.7; lioncub before 0.99)
    betas: ClassVar[tuple[float, float]] = (0.9, 0.96)
    #: the outer momentum's key in each parameter's state
    state_key: ClassVar[str] = "outer_exp_avg"
    #: whether the rule takes ``outer_weight_decay`` (λᵒ)
    decays: ClassVar[bool] = True

    def __init__(self, h: int, lr: float, betas: tuple[float, float], weight_decay: float) -> None:
        self.h, self.outer_lr, self.outer_betas, self.weight_decay = h, lr, betas, weight_decay

    @classmethod
    def default_lr(cls, h: int) -> float:
        """The outer lr where none is given, for H = ``h``: :attr:`lr`."""
        return cls.lr

    def step(self, inputs: OuterInputs) -> frozenset[int] | None:
        """The outer step (collective), booked as one step from ``inputs.before`` with ``inputs.times``.
        Returns ``None`` when it was skipped (the parameters stay at θ_t), else the ``id`` of the
        parameters it left untouched (no gradient on any rank in the window)."""
        raise NotImplementedError


class SignOuter(OuterRule):
    """``"vote"`` (and ``"dsm"`` with a dense variant): one LionCub step with Δ_r as the gradient, the
    outer momentum and hyperparameters, through the round and its vote."""

    name = "vote"

    @classmethod
    def default_lr(cls, h: int) -> float:
        """min(1, √(8/H)): ηᵒ = outer_lr·H·lr grows as √H·lr past H = 8, as the net move of H sign steps
        whose signs are not all alike (chosen by measurement on GPT small: 1 at H = 4, 0.7 at H = 16,
        ``docs/findings.md`` §8.7; lioncub before it used 1 at every H)."""
        return min(cls.lr, math.sqrt(8.0 / h))

    def step(self, inputs: OuterInputs) -> frozenset[int] | None:
        lr_scale = self.outer_lr * self.h
        state = OuterState(inputs, self.state_key, lr_scale, self.outer_betas, self.weight_decay)
        rnd, times = inputs.round, inputs.times
        result = rnd.run(inputs.outer_step, times, state=state, buckets=inputs.buckets)
        rnd.finish(inputs.before, times, skipped=result is None)
        return None if result is None else result.untouched


class DsmOuter(SignOuter):
    """``"dsm"``: :class:`SignOuter` through a dense variant (the mean Δ̄, one shared outer momentum)."""

    name = "dsm"
    dense = True


class DiLoCoOuter(OuterRule):
    """``"diloco"``: the mean pseudo-gradient Δ̄ (the dense variant's exchange), then Nesterov SGD with each
    parameter's ``outer_buf`` (bit for bit ``torch.optim.SGD(nesterov=True)``): ``v ← μ·v + Δ̄`` (v = Δ̄ at
    the first outer step), ``θ ← θ − ηᵒ·(Δ̄ + μ·v)``."""

    name = "diloco"
    dense = True
    lr = 0.7
    betas = (0.9, 0.0)
    state_key = "outer_buf"
    decays = False

    def step(self, inputs: OuterInputs) -> frozenset[int] | None:
        rnd, mu, times, buckets = inputs.round, self.outer_betas[0], inputs.times, inputs.buckets
        state = OuterState(inputs, self.state_key, self.outer_lr, self.outer_betas)
        ballots = rnd.contribute(inputs.outer_step, times, state, buckets=buckets)
        check = rnd.check(ballots, buckets=buckets)
        untouched = None
        if check.ok:
            untouched = rnd.untouched(check, buckets)
            rnd.post(ballots, inputs.outer_step, times)
            means = rnd.means(ballots, times)
            t0 = inputs.clock.mark()
            for ballot, mean in zip(ballots, means, strict=True):
                for p, d in zip(ballot.params, flat_views(mean, ballot.params), strict=True):
                    if id(p) not in untouched:  # v ← μ·v + Δ̄ (v starts at 0: Δ̄ at the first step)
                        buf = state.momentum(p).mul_(mu).add_(d)
                        p.add_(d.add(buf, alpha=mu), alpha=-self.outer_lr)
            inputs.clock.book(times, "apply", t0)
        rnd.finish(inputs.before, times, skipped=not check.ok)
        return untouched


#: the outer rules by name (``LocalSteps(outer=...)``, ``lioncub train --outer``)
OUTER_RULES: dict[str, type[OuterRule]] = {rule.name: rule for rule in (SignOuter, DsmOuter, DiLoCoOuter)}
