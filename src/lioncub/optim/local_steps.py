r"""Votes needed less often: H local Lion steps on every rank, then one outer step on the pseudo-gradients
(``LionCub(..., local_steps=LocalSteps(h=16))``; the formulas and the choices are in ``docs/local-steps.md``).

From the shared parameters θ_t every rank r takes H inner steps of Lion on its own batches (the param
groups' ``lr`` and ``betas``, schedule included; its own inner momentum; no communication; no weight
decay), reaching θ_r. Its pseudo-gradient is Δ_r = θ_t − θ_r. The outer step (:mod:`lioncub.optim.outer`),
on every rank alike, is followed by the window's weight decay: θ_{t+1} ← D·θ_{t+1} with D = Π (1 − lr·wd)
over the window's inner steps, for the parameters the outer step moved:

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
moves a parameter by at most H·lr; default min(1, √(8/H)), :func:`default_outer_lr`), for DiLoCo ``ηᵒ =
outer_lr`` (default 0.7). The outer betas default to (0.9, 0.96) for the sign steps. The inner momentum at
the outer step is ``"reset"`` (zeros; the default, chosen by measurement: ``docs/findings.md`` §8.4),
``"keep"`` (each rank's own, as it was) or ``"average"`` (the ranks' mean: an fp32 allreduce of the
momenta, counted). With
H = 1 the ``vote`` rule is *not* the per-step vote: it votes on the inner Lion step itself,
``Δ_r = lr·sign(β1·m_r + (1−β1)·g_r)``, blended with the outer momentum, where the per-step
vote votes on ``β1·m_r + (1−β1)·g_r``.

State (every rank its own, in ``state[p]``): ``exp_avg`` (inner momentum), ``anchor`` (θ_t), and
``outer_exp_avg`` (vote, dsm) or ``outer_buf`` (diloco); the position in the window is the optimizer step
modulo H, so a resume in the middle of a window continues it bitwise (:mod:`lioncub.optim.windows`: the
window's layout, replicas and decay travel with a state saved in its middle).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from lioncub._validate import Named, OptionError, is_int, is_number
from lioncub.collectives import Comm
from lioncub.optim.config import INNER_MOMENTA
from lioncub.optim.context import StepContext
from lioncub.optim.engine import StepTimes
from lioncub.optim.outer import OUTER_RULES, OuterInputs, OuterRule
from lioncub.optim.policies import StepPolicy, lion_step
from lioncub.optim.round import VoteRound
from lioncub.optim.step_check import check_step, grad_checksum, step_settings, warn_identical_gradients
from lioncub.optim.sync import synchronize
from lioncub.optim.windows import LoadedReplicas, restore_window, window_record

__all__ = ["INNER_MOMENTA", "OUTER_RULES", "LocalSteps", "LocalWindow", "default_outer_lr"]


def default_outer_lr(outer: str, h: int) -> float:
    """``outer_lr`` where none is given: the rule's default at H = ``h`` (vote, dsm: min(1, √(8/H));
    diloco: 0.7)."""
    return OUTER_RULES[outer].default_lr(h)


def _error(option: str, value: Any, problem: str, sep: str = " ") -> OptionError:
    """:class:`LocalSteps`' error of ``option``: ``LocalSteps: option=value problem``."""
    return OptionError("LocalSteps", option, value, problem, sep=sep, prefix="LocalSteps: ")


@dataclass(frozen=True)
class LocalSteps:
    """H local steps per outer step (see the module docstring).

    Args:
        h: inner steps per outer step (≥ 1).
        outer: ``"vote"``, ``"dsm"`` (needs ``variant="32bit"`` or ``"16bit"``) or ``"diloco"`` (the same).
        outer_lr: dimensionless (module docstring); ``None``: min(1, √(8/H)) for the sign steps
            (:func:`default_outer_lr`), 0.7 for DiLoCo.
        outer_betas: (β1ᵒ, β2ᵒ) of the outer momentum; DiLoCo's Nesterov momentum is β1ᵒ. ``None``: (0.9,
            0.96) for the sign steps (``docs/findings.md`` §8.7), DiLoCo (0.9, unused).
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
            raise _error("h", self.h, "must be an int >= 1 (inner steps per outer step)")
        if self.outer not in OUTER_RULES:
            raise _error("outer", self.outer, f"allowed values are {list(OUTER_RULES)}", sep=": ")
        if self.outer_lr is not None and not is_number(self.outer_lr, gt=0):
            raise _error("outer_lr", self.outer_lr, "must be a finite number > 0")
        betas = self.outer_betas
        if betas is not None and not (
            isinstance(betas, (tuple, list))
            and len(betas) == 2
            and all(is_number(b, ge=0, lt=1) for b in betas)
        ):
            raise _error("outer_betas", betas, "must be two numbers in [0, 1)")
        if not is_number(self.outer_weight_decay, ge=0):
            raise _error("outer_weight_decay", self.outer_weight_decay, "must be a number >= 0")
        if not OUTER_RULES[self.outer].decays and self.outer_weight_decay:
            raise _error(
                "outer_weight_decay",
                self.outer_weight_decay,
                "applies to the sign steps (outer='vote', 'dsm'); DiLoCo's outer step is Nesterov SGD, "
                "without a decay of its own (the param groups' weight_decay is applied at every outer step "
                "already)",
            )
        if self.inner_momentum not in INNER_MOMENTA:
            allowed = list(INNER_MOMENTA)
            raise _error("inner_momentum", self.inner_momentum, f"allowed values are {allowed}", sep=": ")

    @property
    def lr(self) -> float:
        """``outer_lr``, or the rule's default at this H."""
        return default_outer_lr(self.outer, self.h) if self.outer_lr is None else float(self.outer_lr)

    @property
    def betas(self) -> tuple[float, float]:
        """``outer_betas``, or the rule's default."""
        b = OUTER_RULES[self.outer].betas if self.outer_betas is None else self.outer_betas
        return float(b[0]), float(b[1])

    def check_variant(self, transport: str, variant: str) -> None:
        """``ValueError`` when the rule needs a dense exchange and ``variant`` (``transport``) is not one."""
        if OUTER_RULES[self.outer].dense and transport != "dense":
            raise OptionError(
                "LocalSteps",
                "outer",
                self.outer,
                "averages the pseudo-gradients in fp32 or bf16: use {fp32} or {bf16}, not {variant} "
                "({vote} takes the votes)",
                prefix="local_steps: ",
                fp32=Named("LionCub", "variant", "32bit"),
                bf16=Named("LionCub", "variant", "16bit"),
                variant=Named("LionCub", "variant", variant),
                vote=Named("LocalSteps", "outer", "vote"),
            )

    def describe(self) -> dict[str, Any]:
        """The settings as plain values (the state dict records them)."""
        return {**dataclasses.asdict(self), "outer_lr": self.lr, "outer_betas": list(self.betas)}

    def rule(self) -> OuterRule:
        """The outer rule these settings run (:mod:`lioncub.optim.outer`)."""
        return OUTER_RULES[self.outer](self.h, self.lr, self.betas, float(self.outer_weight_decay))


#: elements per piece of the exchange of a parameter and its anchor (:func:`pseudo_gradient_in_anchor`)
SWAP_CHUNK = 1 << 20


def pseudo_gradient_in_anchor(p: torch.Tensor, anchor: torch.Tensor) -> bool:
    """In place, at an outer step: the parameter ``p`` (θ_r) gets its ``anchor``'s value θ_t and the anchor
    the pseudo-gradient Δ_r = θ_t − θ_r, bit for bit ``anchor - p`` (one subtraction into ``p``'s
    storage, then the two exchanged through a scratch of at most :data:`SWAP_CHUNK` elements). Δ so
    needs no tensor of the model's size next to the user's gradients, which the step puts back after.
    Returns False (nothing done) unless both are dense, contiguous and of one dtype and device."""
    if not (
        p.is_contiguous()
        and anchor.is_contiguous()
        and p.layout == anchor.layout == torch.strided
        and (p.dtype, p.device, p.shape) == (anchor.dtype, anchor.device, anchor.shape)
    ):
        return False
    theta = p.detach()
    torch.sub(anchor, theta, out=theta)  # θ_r's storage holds Δ (anchor − p, as a new tensor would)
    flat_p, flat_a = theta.view(-1), anchor.view(-1)
    n = flat_p.numel()
    scratch = torch.empty(min(n, SWAP_CHUNK), dtype=p.dtype, device=p.device)
    for start in range(0, n, SWAP_CHUNK):
        piece_p, piece_a = flat_p[start : start + SWAP_CHUNK], flat_a[start : start + SWAP_CHUNK]
        tmp = scratch[: piece_p.numel()]
        tmp.copy_(piece_p)
        piece_p.copy_(piece_a)
        piece_a.copy_(tmp)
    return True


def window_flag() -> torch.Tensor:
    """``state[p]["window_grad"]``: this rank had a gradient for ``p`` in the window. A 0-dim CPU bool
    tensor, whatever ``p``'s device (on a GPU one per parameter would be an allocation and a fill kernel
    each; only its presence is read). A state loaded by ``load_state_dict`` moves it to ``p``'s device,
    as torch's optimizers move every state tensor: still a flag."""
    return torch.ones((), dtype=torch.bool)


class LocalWindow(StepPolicy):
    """H local steps on every rank, then the outer rule (see the module docstring); also the optimizer's
    :class:`~lioncub.optim.policies.Window` (each rank's replicas in a window's middle).

    The layout is fixed for a window (:meth:`rebuilds_layout`): a parameter frozen, unfrozen or added in
    the middle of a window takes effect at the next one, so every collective of the window (its outer step)
    runs over the layout the step check compared. A parameter that had no gradient on this rank during the
    window (``state[p]["window_grad"]`` absent) enters the outer step with ``.grad = None``: untouched where
    no rank had one, a zero vote where some did — as a step without local steps treats a ``None`` gradient.

    Args:
        ctx: the optimizer's parts; ``rnd``: the round the outer rule votes with.
        config: the :class:`LocalSteps`.
    """

    def __init__(self, ctx: StepContext, rnd: VoteRound, config: LocalSteps) -> None:
        self.ctx, self.round = ctx, rnd
        self.config = config
        self.rule = config.rule()
        #: the window's weight decay so far, per param group: Π (1 − lr·weight_decay) over its inner steps
        self.decay: list[float] = []
        self._replicas: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a loaded state's, put back
        self._aside: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # replicas while θ_t is shown
        self._restart = False  # a model-only resume in a window's middle: the next step starts a window
        self._held = LoadedReplicas({}, 0)  # the loaded replicas, kept in the parameters until the next step

    def rebuilds_layout(self, steps_taken: int) -> bool:
        return steps_taken % self.config.h == 0  # at window starts only

    def before_step(self) -> None:
        """This rank's replicas back in place: those kept aside while θ_t was shown, and those of a loaded
        state, written again (a model file loaded after the optimizer state, one for all ranks, does not
        replace this rank's own). Refused where this step's gradients were computed on a parameter
        overwritten after the load, outside the module calls that put the replicas back first
        (:class:`~lioncub.optim.windows.LoadedReplicas`)."""
        self.hide_shared()
        if self._replicas:
            self._held.check()
            with torch.no_grad():
                for p, replica in self._replicas.values():
                    p.copy_(replica)
            self._replicas = {}
            self._held.clear()

    def restore_replicas(self) -> None:
        """The loaded replicas back into the parameters overwritten since the load (until the next step)."""
        self._held.restore()

    @torch.no_grad()
    def step(self, overflow: bool) -> None:
        """One inner step on this rank, and after every H of them the outer step (collective then)."""
        ctx, h = self.ctx, self.config.h
        step, params = ctx.global_step, ctx.layout.params()
        if (step - 1) % h == 0 or self._restart:  # a window starts (a resume keeps the saved anchors)
            self._start_window(params)
            self._restart = False
        if not self.round.gradients_compared:
            self._compare_first_gradients(params)
        before, times = ctx.accounting.snapshot(), StepTimes()
        t0 = ctx.engine.clock.mark()
        window = {id(p) for p in params}
        alone = Comm.single(ctx.comm.device)  # an inner step's nonfinite="raise" is this rank's alone
        skipped = lion_step(ctx, overflow, here=alone, window=window, decay=False)
        ctx.engine.clock.book(times, "apply", t0)
        for p in params:
            if p.grad is not None and "window_grad" not in ctx.state[p]:
                ctx.state[p]["window_grad"] = window_flag()
        self.decay += [1.0] * (len(ctx.param_groups) - len(self.decay))  # groups added in the window
        for gi, group in enumerate(ctx.param_groups):  # every inner step's decay, on every rank alike
            self.decay[gi] *= 1.0 - float(group["lr"]) * float(group["weight_decay"])
        ctx.accounting.finish_step(before, times, skipped=skipped)
        if step % h == 0:
            ctx.accounting.continue_step()  # "last": inner + outer
            self._outer_step(step // h, params)

    def _start_window(self, params: list[torch.Tensor]) -> None:
        """θ_t: every parameter of the window's layout gets its anchor; the others have none."""
        ctx, in_window = self.ctx, {id(p) for p in params}
        for group in ctx.param_groups:
            for p in group["params"]:
                if id(p) in in_window:
                    state = ctx.state[p]
                    if "anchor" in state:
                        state["anchor"].copy_(p)
                    else:
                        state["anchor"] = p.detach().clone(memory_format=torch.preserve_format)
                    state.pop("window_grad", None)
                elif p in ctx.state:  # left the layout: its value is the last outer step's
                    ctx.state[p].pop("anchor", None)
                    ctx.state[p].pop("window_grad", None)
        self.decay = [1.0] * len(ctx.param_groups)

    def _compare_first_gradients(self, params: list[torch.Tensor]) -> None:
        """The first step's check, with the gradients' checksum: identical gradients on every rank mean
        that DDP averaged them (its allreduce then runs at every inner step, unseen by the counts)."""
        ctx = self.ctx
        check = check_step(
            ctx.comm,
            [],
            step=ctx.global_step,
            layout=ctx.layout.hash,
            missing_grads=0,
            grad_checksum=grad_checksum([p.grad for p in params if p.grad is not None]),
            nonfinite="skip",
            settings=step_settings(None, ctx.param_groups),
        )
        self.round.skip_gradient_comparison()  # compared here, once
        if check.identical_grads and ctx.comm.rank == 0:
            warn_identical_gradients(
                "every inner step then allreduces the gradients through DDP (each replica follows the mean "
                "gradient, and the bytes of local steps are not saved)"
            )

    def _outer_step(self, outer_step: int, params: list[torch.Tensor]) -> None:
        """Δ_r = θ_t − θ_r into ``.grad`` (``None`` where this rank had no gradient in the window; the
        user's gradients are put back after), the parameters back to θ_t, the rule's step, the window's
        decay where it moved a parameter, then the inner momentum's policy (also when the outer step was
        skipped: the parameters stay at θ_t)."""
        ctx = self.ctx
        user_grads = [p.grad for p in params]
        swapped: list[torch.Tensor] = []  # the parameters whose anchor holds Δ during the rule's step
        try:
            for p in params:
                state = ctx.state[p]
                if state.pop("window_grad", None) is None:
                    p.grad = None
                    p.copy_(state["anchor"])
                elif pseudo_gradient_in_anchor(p, state["anchor"]):
                    p.grad = state["anchor"]
                    swapped.append(p)
                else:
                    p.grad = state["anchor"] - p.detach()
                    p.copy_(state["anchor"])
            booked = (ctx.accounting.snapshot(), StepTimes())
            inputs = OuterInputs(self.round, outer_step, ctx.state, ctx.engine.state.group, *booked)
            with self.round.unscaled():  # Δ is not scaled: the ranks' scales may differ
                untouched = self.rule.step(inputs)
        except BaseException:
            for p in swapped:  # the state as before a failed outer step: the anchors hold θ_t again
                ctx.state[p]["anchor"].copy_(p)
            raise
        finally:
            for p, g in zip(params, user_grads, strict=True):
                p.grad = g
            ctx.engine.release(ctx.layout.buckets)  # the next contribution is H steps away
        for p in params:  # the window's weight decay, where the outer step moved the parameter
            decay = self.decay[ctx.engine.state.group_index(p)]
            if untouched is not None and id(p) not in untouched and decay != 1.0:
                p.mul_(decay)
        for p in params:  # the next window starts from θ_{t+1} (θ_t where the outer step was skipped)
            ctx.state[p]["anchor"].copy_(p)
        rule = self.config.inner_momentum
        if rule != "keep":  # after the step check: the ranks agree on the layout
            before, times = ctx.accounting.snapshot(), StepTimes()
            momenta = [ctx.engine.state.momentum(p) for p in params]
            t0 = ctx.engine.clock.mark()
            if rule == "reset":
                for m in momenta:
                    m.zero_()
            else:
                synchronize(ctx.comm, momenta, torch.float32, bucket_mb=ctx.bucket_mb)
            ctx.engine.clock.book(times, "sync", t0)
            ctx.accounting.continue_step()
            ctx.accounting.finish_step(before, times, skipped=False)

    # -- a state saved in a window's middle (lioncub.optim.windows) ------------------------------------

    def _in_window(self, step: int) -> bool:
        return step % self.config.h != 0

    def save(self, sd: dict[str, Any]) -> None:
        """In a window's middle: every parameter's replica (a copy), the window's layout and its decay."""
        ctx = self.ctx
        if not self._in_window(ctx.global_step):
            return
        self._held.restore()  # a model loaded after a state: this rank's replica is the loaded one
        index = 0
        for group in ctx.param_groups:
            for p in group["params"]:
                kept = self._aside.get(id(p))  # θ_t shown: the replica is the one kept aside
                replica = kept[1].clone() if kept is not None else p.detach().clone()
                sd["state"][index] = {**sd["state"].get(index, {}), "replica": replica}
                index += 1
        sd["lioncub"]["window"] = window_record(ctx.param_groups, ctx.state, ctx.layout.names)
        sd["lioncub"]["window_decay"] = list(self.decay)

    def check_load(self, sd: dict[str, Any], meta: dict[str, Any]) -> set[int] | None:
        """The parameters of the window in progress at the state's step, checked before anything is
        loaded; ``None`` where no window is in progress."""
        ctx = self.ctx
        step = int(meta["step"])
        if not self._in_window(step):
            return None
        if int(meta.get("version", 1)) < 3:
            why = f"its local steps decayed inside the window (state version {meta['version']})"
        else:
            why = "it was saved by one process (whose steps are Lion's, without windows)"
        return restore_window(
            ctx.param_groups, sd["state"], meta.get("window"), step=step, h=self.config.h, why_missing=why
        )

    def load(self, meta: dict[str, Any], checked: set[int] | None) -> None:
        """The replicas written into the parameters (now, and again at the next step), the window's layout
        (whatever ``requires_grad`` says now) and its decay."""
        ctx = self.ctx
        self._replicas, self._aside = {}, {}
        self._held.clear()
        with torch.no_grad():
            for group in ctx.param_groups:
                for p in group["params"]:
                    replica = ctx.state.get(p, {}).pop("replica", None)
                    if replica is not None:
                        p.copy_(replica)
                        self._replicas[id(p)] = (p, replica)
                    if p in ctx.state and not ctx.state[p]:
                        del ctx.state[p]  # held the replica only
        if checked is not None:
            ctx.layout.rebuild(ctx.param_groups, checked)  # the loaded window's layout
            ctx.engine.state.refresh()
            self.decay = [float(d) for d in meta.get("window_decay", [])]
        self._held = LoadedReplicas(ctx.layout.names, ctx.comm.rank)
        self._held.hold(self._replicas)  # whatever is loaded into the parameters before the next step

    # -- the ranks' common parameters in a window's middle ----------------------------------------------

    def show_shared(self) -> bool:
        """θ_t (each window parameter's anchor: the last outer step's, the same on every rank) into the
        parameters, each rank's replica kept aside; whether a window is in progress."""
        ctx = self.ctx
        if self._aside:
            return True
        if not self._in_window(ctx.global_step):
            return False
        self._held.restore()  # the replica kept aside is the loaded one
        with torch.no_grad():
            for p in ctx.layout.params():
                anchor = ctx.state[p].get("anchor")
                if anchor is not None:
                    self._aside[id(p)] = (p, p.detach().clone())
                    p.copy_(anchor)
                    self._held.written(p)
        return True

    def shared_values(self) -> dict[int, torch.Tensor]:
        ctx = self.ctx
        if self._aside or not self._in_window(ctx.global_step):
            return {}  # shown already (the parameters hold θ_t), or no window in progress
        return {id(p): ctx.state[p]["anchor"] for p in ctx.layout.params() if "anchor" in ctx.state[p]}

    def hide_shared(self) -> None:
        if self._aside:
            with torch.no_grad():
                for p, replica in self._aside.values():
                    p.copy_(replica)
                    self._held.written(p)
            self._aside = {}

    def restart_at(self, step: int) -> None:
        """In a window's middle the window restarts from the parameters as they are at the next step and
        ends at the next multiple of H (the windows keep their place in the run)."""
        self._replicas, self._aside = {}, {}
        self._held.clear()
        self._restart = step % self.config.h != 0
