r"""Votes needed less often: H local Lion steps on every rank, then one outer step on the pseudo-gradients
(``LionCub(..., local_steps=LocalSteps(h=16))``; the formulas and the choices are in ``docs/local-steps.md``).

From the shared parameters θ_t every rank r takes H inner steps of Lion on its own batches (the param
groups' ``lr``, ``betas``, ``weight_decay``, schedule included; its own inner momentum; no communication),
reaching θ_r. Its pseudo-gradient is Δ_r = θ_t − θ_r. The outer step, on every rank alike:

* ``"vote"``: each rank keeps its own outer momentum M_r; ``c_r = β1ᵒ·M_r + (1−β1ᵒ)·Δ_r`` goes through
  the optimizer's vote (its ``variant``: 1bit, 4bit, 8bit, 8bit-sign, dlion-avg, …, and its topology) to
  the update u; ``θ_{t+1} = θ_t·(1 − ηᵒ·λᵒ) − ηᵒ·u``; ``M_r ← β2ᵒ·M_r + (1−β2ᵒ)·Δ_r``. One vote every H steps:
  with ``1bit``, 1/H bit per parameter and inner step.
* ``"dsm"`` (Yu et al. 2024, distributed sign momentum): the same sign step on the mean Δ̄ = mean_r Δ_r
  (an fp32 or bf16 allreduce: ``variant="32bit"`` or ``"16bit"``), one outer momentum shared by every
  rank — the dense variants' global Lion step, applied to the pseudo-gradients.
* ``"diloco"`` (Douillard et al. 2023): Nesterov SGD on Δ̄: ``v ← μ·v + Δ̄``, ``θ_{t+1} = θ_t − ηᵒ·(Δ̄ +
  μ·v)`` (``torch.optim.SGD(nesterov=True)``; DiLoCo's ηᵒ = 0.7, μ = 0.9), the allreduce fp32 or bf16.

The outer learning rate ``outer_lr`` is dimensionless: for the sign steps (vote, dsm) ``ηᵒ = outer_lr ·
H · lr`` with each group's ``lr`` as the schedule has it at the outer step (a window of H inner steps
moves a parameter by at most H·lr), for DiLoCo ``ηᵒ = outer_lr``. The inner momentum at the outer step is
``"reset"`` (zeros; the default, chosen by measurement: ``docs/findings.md`` §8.4), ``"keep"`` (each rank's
own, as it was) or ``"average"`` (the ranks' mean: an fp32 allreduce of the momenta, counted). With
H = 1 the ``vote`` rule is *not* the per-step vote: it votes on the inner Lion step itself,
``Δ_r = lr·(sign(β1·m_r + (1−β1)·g_r) + wd·θ_t)``, blended with the outer momentum, where the per-step
vote votes on ``β1·m_r + (1−β1)·g_r``.

State (every rank its own, in ``state[p]``): ``exp_avg`` (inner momentum), ``anchor`` (θ_t), and
``outer_exp_avg`` (vote, dsm) or ``outer_buf`` (diloco); the position in the window is the optimizer step
modulo H, so a resume in the middle of a window continues it bitwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from lioncub._validate import is_int, is_number
from lioncub.collectives import Hyper, flat_views
from lioncub.optim.engine import StepTimes
from lioncub.optim.step_check import check_step, grad_checksum, step_settings, warn_identical_gradients
from lioncub.optim.sync import synchronize

__all__ = ["INNER_MOMENTA", "OUTER_RULES", "LocalSteps", "OuterState", "WindowedSteps"]

#: the outer steps (module docstring)
OUTER_RULES = ("vote", "dsm", "diloco")
#: what the inner momentum becomes at an outer step
INNER_MOMENTA = ("keep", "reset", "average")
#: ``outer_lr`` where none is given
DEFAULT_OUTER_LR = {"vote": 1.0, "dsm": 1.0, "diloco": 0.7}
#: ``outer_betas`` where none are given (DiLoCo: the Nesterov momentum μ = β1ᵒ)
DEFAULT_OUTER_BETAS = {"vote": (0.9, 0.99), "dsm": (0.9, 0.99), "diloco": (0.9, 0.0)}


@dataclass(frozen=True)
class LocalSteps:
    """H local steps per outer step (see the module docstring).

    Args:
        h: inner steps per outer step (≥ 1).
        outer: ``"vote"``, ``"dsm"`` (needs ``variant="32bit"`` or ``"16bit"``) or ``"diloco"`` (the same).
        outer_lr: dimensionless (module docstring); ``None``: 1.0 for the sign steps, 0.7 for DiLoCo.
        outer_betas: (β1ᵒ, β2ᵒ) of the outer momentum; DiLoCo's Nesterov momentum is β1ᵒ. ``None``: (0.9,
            0.99), DiLoCo (0.9, unused).
        outer_weight_decay: λᵒ of the sign steps, on top of the window's decay by the param groups'
            ``weight_decay`` (default 0; refused for DiLoCo).
        inner_momentum: ``"reset"`` (default), ``"keep"`` or ``"average"`` at each outer step.
    """

    h: int
    outer: str = "vote"
    outer_lr: float | None = None
    outer_betas: tuple[float, float] | None = None
    outer_weight_decay: float = 0.0
    inner_momentum: str = "reset"

    def __post_init__(self) -> None:
        if isinstance(self.outer_betas, list):  # a config file's form: hashable, as the dataclass is
            object.__setattr__(self, "outer_betas", tuple(self.outer_betas))
        if not is_int(self.h, 1):
            raise ValueError(f"LocalSteps: h={self.h!r} must be an int >= 1 (inner steps per outer step)")
        if self.outer not in OUTER_RULES:
            raise ValueError(f"LocalSteps: outer={self.outer!r}: allowed values are {list(OUTER_RULES)}")
        if self.outer_lr is not None and not is_number(self.outer_lr, gt=0):
            raise ValueError(f"LocalSteps: outer_lr={self.outer_lr!r} must be a finite number > 0")
        betas = self.outer_betas
        if betas is not None and not (
            isinstance(betas, (tuple, list))
            and len(betas) == 2
            and all(is_number(b, ge=0, lt=1) for b in betas)
        ):
            raise ValueError(f"LocalSteps: outer_betas={betas!r} must be two numbers in [0, 1)")
        if not is_number(self.outer_weight_decay, ge=0):
            raise ValueError(
                f"LocalSteps: outer_weight_decay={self.outer_weight_decay!r} must be a number >= 0"
            )
        if self.outer == "diloco" and self.outer_weight_decay:
            raise ValueError(
                f"LocalSteps: outer_weight_decay={self.outer_weight_decay!r} applies to the sign steps "
                "(outer='vote', 'dsm'); DiLoCo's outer step is Nesterov SGD, without a decay of its own (the "
                "param groups' weight_decay is applied at every outer step already)"
            )
        if self.inner_momentum not in INNER_MOMENTA:
            allowed = list(INNER_MOMENTA)
            raise ValueError(
                f"LocalSteps: inner_momentum={self.inner_momentum!r}: allowed values are {allowed}"
            )

    @property
    def lr(self) -> float:
        """``outer_lr``, or the rule's default."""
        return DEFAULT_OUTER_LR[self.outer] if self.outer_lr is None else float(self.outer_lr)

    @property
    def betas(self) -> tuple[float, float]:
        """``outer_betas``, or the rule's default."""
        b = DEFAULT_OUTER_BETAS[self.outer] if self.outer_betas is None else self.outer_betas
        return float(b[0]), float(b[1])

    def check_variant(self, transport: str, variant: str) -> None:
        """``ValueError`` when the rule needs a dense exchange and ``variant`` (``transport``) is not one."""
        if self.outer in ("dsm", "diloco") and transport != "dense":
            raise ValueError(
                f"local_steps: outer={self.outer!r} averages the pseudo-gradients in fp32 or bf16: use "
                f"variant='32bit' or '16bit', not {variant!r} (outer='vote' takes the votes)"
            )

    def describe(self) -> dict[str, Any]:
        """The settings as plain values (the state dict records them)."""
        return {**dataclasses.asdict(self), "outer_lr": self.lr, "outer_betas": list(self.betas)}


class OuterState:
    """The outer step's view of the optimizer (:class:`lioncub.collectives.ParamState`): each parameter's
    outer momentum ``state[p][key]`` (``"outer_exp_avg"`` of the sign steps, ``"outer_buf"`` of DiLoCo;
    zeros at first), and the outer hyperparameters (``ηᵒ = outer_lr · H · lr`` with the group's current lr,
    β1ᵒ, β2ᵒ, λᵒ; never ``maximize``: Δ already points the way the inner steps went)."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, config: LocalSteps, group_of: Any, key: str = "outer_exp_avg"
    ) -> None:
        self._optimizer, self._config, self._group_of, self._key = optimizer, config, group_of, key

    def momentum(self, p: torch.Tensor) -> torch.Tensor:
        state = self._optimizer.state[p]
        if self._key not in state:
            state[self._key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state[self._key]

    def hyper(self, p: torch.Tensor) -> Hyper:
        c = self._config
        beta1, beta2 = c.betas
        lr = c.lr * c.h * float(self._group_of(p)["lr"])
        return Hyper(lr, beta1, beta2, float(c.outer_weight_decay), False)


class WindowedSteps:
    """The step of :class:`~lioncub.optim.LionCub` with local steps (a mixin: it calls the optimizer's
    ``_lion_step``, ``_vote_step``, ``_check_step``, ``_broadcast_new``, ``_without_gradient`` and
    ``_finish_step``, and reads its ``local_steps``, ``layout``, ``engine``, ``comm``, ``checks``, ``state``
    and ``accounting``).

    The layout is fixed for a window (:meth:`LionCub.step` refreshes it at window starts only): a parameter
    frozen, unfrozen or added in the middle of a window takes effect at the next one, so every collective
    of the window (its outer step) runs over the layout the step check compared. A parameter that had no
    gradient on this rank during the window (``state[p]["window_grad"]`` absent) enters the outer step
    with ``.grad = None``: untouched where no rank had one, a zero vote where some did — as a step without
    local steps treats a ``None`` gradient."""

    local_steps: LocalSteps
    state: Any
    #: the window's weight decay so far, per param group: Π (1 − lr·weight_decay) over its inner steps
    window_decay: list[float]

    @torch.no_grad()
    def _local_step(self, overflow: bool) -> None:
        """One inner step on this rank, and after every H of them the outer step (collective then)."""
        step, h = self._global_step, self.local_steps.h  # type: ignore[attr-defined]
        params = self.layout.params()  # type: ignore[attr-defined]
        if (step - 1) % h == 0:  # a window starts (a resume in its middle keeps the saved anchors)
            self._start_window(params)
        if not self._grads_compared:  # type: ignore[has-type]
            self._compare_first_gradients(params)
        before, times = self.accounting.snapshot(), StepTimes()  # type: ignore[attr-defined]
        t0 = self.engine.clock()
        skipped = self._lion_step(overflow, local=True)  # type: ignore[attr-defined]
        times.apply = self.engine.clock() - t0
        for p in params:
            if p.grad is not None and "window_grad" not in self.state[p]:
                self.state[p]["window_grad"] = p.new_ones(())
        decay = self.window_decay  # the window's weight decay: every inner step's, on every rank alike
        decay += [1.0] * (len(self.param_groups) - len(decay))  # type: ignore[attr-defined]  # groups added
        for gi, group in enumerate(self.param_groups):  # type: ignore[attr-defined]
            decay[gi] *= 1.0 - float(group["lr"]) * float(group["weight_decay"])
        self.accounting.finish_step(before, times, skipped=skipped)  # type: ignore[attr-defined]
        if step % h == 0:
            self.accounting.continue_step()  # type: ignore[attr-defined]  # "last": inner + outer
            self._outer_step(step // h, params)

    def _start_window(self, params: list[torch.Tensor]) -> None:
        """θ_t: every parameter of the window's layout gets its anchor; the others have none."""
        in_window = {id(p) for p in params}
        for group in self.param_groups:  # type: ignore[attr-defined]
            for p in group["params"]:
                if id(p) in in_window:
                    state = self.state[p]
                    if "anchor" in state:
                        state["anchor"].copy_(p)
                    else:
                        state["anchor"] = p.detach().clone(memory_format=torch.preserve_format)
                    state.pop("window_grad", None)
                elif p in self.state:  # left the layout: its value is the last outer step's
                    self.state[p].pop("anchor", None)
                    self.state[p].pop("window_grad", None)
        self.window_decay = [1.0] * len(self.param_groups)  # type: ignore[attr-defined]

    def _compare_first_gradients(self, params: list[torch.Tensor]) -> None:
        """The first step's check, with the gradients' checksum: identical gradients on every rank mean
        that DDP averaged them (its allreduce then runs at every inner step, unseen by the counts)."""
        grads = [p.grad for p in params if p.grad is not None]
        check = check_step(
            self.comm,  # type: ignore[attr-defined]
            [],
            step=self._global_step,  # type: ignore[attr-defined]
            layout=self.layout.hash,  # type: ignore[attr-defined]
            missing_grads=0,
            grad_checksum=grad_checksum(grads),
            nonfinite="skip",
            settings=step_settings(None, self.param_groups),  # type: ignore[attr-defined]
        )
        self._grads_compared = True
        if check.identical_grads and self.comm.rank == 0:  # type: ignore[attr-defined]
            warn_identical_gradients(
                "every inner step then allreduces the gradients through DDP (each replica follows the mean "
                "gradient, and the bytes of local steps are not saved)"
            )

    def _outer_step(self, outer_step: int, params: list[torch.Tensor]) -> None:
        """Δ_r = θ_t − θ_r into ``.grad`` (``None`` where this rank had no gradient in the window; the
        user's gradients are put back after), the parameters back to θ_t, the rule's step, then the inner
        momentum's policy (also when the outer step was skipped: the parameters stay at θ_t)."""
        user_grads = [p.grad for p in params]
        for p in params:
            state = self.state[p]
            p.grad = state["anchor"] - p.detach() if state.pop("window_grad", None) is not None else None
            p.copy_(state["anchor"])
        config = self.local_steps
        self._grad_scale = None  # type: ignore[has-type]  # Δ is not scaled: the ranks' scales may differ
        booked = {"before": self.accounting.snapshot(), "times": StepTimes()}  # type: ignore[attr-defined]
        try:
            if config.outer == "diloco":
                untouched = self._diloco_step(outer_step, **booked)
            else:
                outer = OuterState(self, config, self.engine.state.group)  # type: ignore[arg-type,attr-defined]
                untouched = self._vote_step(False, state=outer, vote_step=outer_step, **booked)  # type: ignore[attr-defined]
        finally:
            for p, g in zip(params, user_grads, strict=True):
                p.grad = g
        index_of = self.engine.state.group_index  # type: ignore[attr-defined]
        for p in params:  # the window's weight decay, where the outer step moved the parameter
            decay = self.window_decay[index_of(p)]
            if untouched is not None and id(p) not in untouched and decay != 1.0:
                p.mul_(decay)
        for p in params:  # the next window starts from θ_{t+1} (θ_t where the outer step was skipped)
            self.state[p]["anchor"].copy_(p)
        if config.inner_momentum != "keep":  # after the step check: the ranks agree on the layout
            before, times = self.accounting.snapshot(), StepTimes()  # type: ignore[attr-defined]
            momenta = [self.engine.state.momentum(p) for p in params]  # type: ignore[attr-defined]
            t0 = self.engine.clock()
            if config.inner_momentum == "reset":
                for m in momenta:
                    m.zero_()
            else:
                synchronize(self.comm, momenta, torch.float32)  # type: ignore[attr-defined]
            times.sync = self.engine.clock() - t0
            self.accounting.continue_step()  # type: ignore[attr-defined]
            self.accounting.finish_step(before, times, skipped=False)  # type: ignore[attr-defined]

    def _diloco_step(self, outer_step: int, before: Any, times: StepTimes) -> frozenset[int] | None:
        """DiLoCo's outer step: the mean pseudo-gradient (the dense variant's exchange), then Nesterov SGD
        with each parameter's ``outer_buf`` (bit for bit ``torch.optim.SGD(nesterov=True)``); parameters
        without a gradient on any rank are untouched; booked as one step from ``before`` with ``times``.
        Returns ``None`` when skipped, else the ``id`` of the untouched parameters."""
        engine, lr, (mu, _) = self.engine, self.local_steps.lr, self.local_steps.betas  # type: ignore[attr-defined]
        outer = OuterState(self, self.local_steps, engine.state.group, key="outer_buf")  # type: ignore[arg-type]
        t0 = self.engine.clock()
        ballots = [
            engine.contribute(b, [p.grad for p in b.params], step=outer_step, state=outer)
            for b in self.layout.buckets  # type: ignore[attr-defined]
        ]
        times.direction += self.engine.clock() - t0
        check = self._check_step(ballots, False, False)  # type: ignore[attr-defined]
        untouched = None
        if check.ok:
            untouched = self._without_gradient() if check.missing_grads else frozenset()  # type: ignore[attr-defined]
            if self.checks.broadcast_init:  # type: ignore[attr-defined]  # joined this window (the ranks agree)
                self._broadcast_new()  # type: ignore[attr-defined]
            t0 = self.engine.clock()
            for ballot in ballots:
                engine.post(ballot, outer_step)
            times.encode += self.engine.clock() - t0
            means = engine.means(ballots, times)
            t0 = self.engine.clock()
            for ballot, mean in zip(ballots, means, strict=True):
                for p, d in zip(ballot.params, flat_views(mean, ballot.params), strict=True):
                    if id(p) not in untouched:  # v ← μ·v + Δ̄ (v starts at 0: Δ̄ at the first step)
                        buf = outer.momentum(p).mul_(mu).add_(d)
                        p.add_(d.add(buf, alpha=mu), alpha=-lr)
            times.apply += self.engine.clock() - t0
        self._finish_step(before, times, skipped=not check.ok)  # type: ignore[attr-defined]
        return untouched
