"""The ranks' agreement before a step is applied: one all-gather of a few int32 per rank
(:func:`check_step`), and the errors it raises on every rank when the ranks would apply different
updates."""

from __future__ import annotations

import sys
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lioncub._validate import OptionError, is_int
from lioncub.collectives import Comm
from lioncub.optim.callers import caller_stacklevel

__all__ = [
    "NONFINITE_MODES",
    "STEP_CHECK_WORDS",
    "Checks",
    "GradientChangedError",
    "HyperparameterMismatchError",
    "NonFiniteGradientError",
    "StepCheck",
    "StepMismatchError",
    "check_step",
    "grad_checksum",
    "step_settings",
]

#: what a step does when a rank's gradients hold NaN or Inf (:class:`Checks`)
NONFINITE_MODES = ("skip", "raise")


class NonFiniteGradientError(FloatingPointError):
    """A rank's gradients held NaN or Inf and ``nonfinite="raise"``."""


@dataclass(frozen=True)
class Checks:
    """What :class:`~lioncub.optim.LionCub` checks and does to keep the replicas identical.

    Args:
        broadcast_init: copy rank 0's parameters to every rank at construction.
        replica_check_every: every k steps (with local steps: every k outer steps) compare a checksum of
            the parameters across ranks and raise :class:`~lioncub.optim.replicas.ReplicaDivergenceError`
            on a mismatch (0 = never).
        nonfinite: what a step does when any rank's gradients hold NaN or Inf: ``"skip"`` (every rank
            leaves parameters and momenta untouched, counted in ``comm_stats()["total"]["skipped_steps"]``)
            or ``"raise"`` (:class:`NonFiniteGradientError` on every rank, naming the ranks). Checked
            before anything is quantized or sent: one max-abs reduction per bucket and one all-gather of
            :data:`STEP_CHECK_WORDS` int32 per rank and step (counted in
            :meth:`~lioncub.optim.LionCub.comm_stats`). With local steps an inner step's NaN/Inf is that
            rank's alone (skipped or raised there); the outer step is checked on every rank.
    """

    broadcast_init: bool = True
    replica_check_every: int = 0
    nonfinite: str = "skip"

    def __post_init__(self) -> None:
        if not isinstance(self.broadcast_init, bool):
            raise ValueError(f"broadcast_init={self.broadcast_init!r} must be True or False")
        if not is_int(self.replica_check_every, 0):
            raise ValueError(f"replica_check_every={self.replica_check_every!r} must be an int >= 0")
        if self.nonfinite not in NONFINITE_MODES:
            allowed = list(NONFINITE_MODES)
            raise OptionError(
                "Checks", "nonfinite", self.nonfinite, f"allowed values are {allowed}", sep=": "
            )


#: int32 words every rank all-gathers once per step (:func:`check_step`)
STEP_CHECK_WORDS = 7


class StepMismatchError(RuntimeError):
    """The ranks called ``step()`` a different number of times, or optimize different parameter lists."""


class HyperparameterMismatchError(StepMismatchError):
    """The ranks would apply one step with different learning rates, betas, weight decays or maximize
    flags, or were handed different gradient scales (each rank's own GradScaler backing off on its own)."""


class GradientChangedError(RuntimeError):
    """With the overlap hook, ``.grad`` changed between the backward (whose gradients the votes used) and
    ``step()``: gradient clipping, ``GradScaler.unscale_`` or an edit of ``.grad``."""


@dataclass(frozen=True)
class StepCheck:
    """What every rank learns from :func:`check_step`, the same on every rank.

    Attributes:
        ok: no rank had NaN/Inf (or a GradScaler overflow): the step is applied.
        bad_ranks: the ranks with NaN/Inf or an overflow.
        missing_grads: some rank has a parameter without a gradient (``.grad is None``).
        identical_grads: the gradient checksums sent were equal and non-zero on every rank (only asked
            for on one step: see ``grad_checksum``); ``False`` when not asked.
    """

    ok: bool
    bad_ranks: list[int]
    missing_grads: bool
    identical_grads: bool


def check_step(
    comm: Comm,
    peaks: Sequence[torch.Tensor],
    *,
    step: int,
    layout: int,
    missing_grads: int,
    overflow: bool = False,
    changed: Sequence[str] = (),
    grad_checksum: int | None = None,
    nonfinite: str,
    settings: str = "",
) -> StepCheck:
    """The ranks' agreement before a step is applied: one all-gather of :data:`STEP_CHECK_WORDS` int32 per
    rank — flags (non-finite: from this rank's max-abs per bucket, ``peaks``, or a GradScaler ``overflow``;
    gradients ``changed`` after the overlapped votes used them: this rank's parameter names),
    optimizer step number, parameter ``layout`` hash (int32), number of this rank's optimized parameters
    without a gradient, an int64 ``grad_checksum`` (0 when not asked) and a hash of the step's
    ``settings`` (:func:`step_settings`: what the step applies, the same on every rank unless something
    diverged).

    Raises on every rank: :class:`StepMismatchError` when the step numbers or layouts differ (naming
    the ranks and both values), :class:`HyperparameterMismatchError` when the settings differ (naming the
    ranks and their values: one more gather, on that step only), :class:`GradientChangedError` when any
    rank's gradients changed, and with ``nonfinite="raise"`` :class:`NonFiniteGradientError` instead of
    returning ``ok=False``."""
    bad = bool(overflow) or bool(peaks and (~torch.isfinite(torch.stack(list(peaks)))).any())
    checksum = 0 if grad_checksum is None else grad_checksum
    words = [
        int(bad) | int(bool(changed)) << 1,
        step,
        layout,
        missing_grads,
        checksum >> 32,
        checksum & 0xFFFFFFFF,
        zlib.crc32(settings.encode()),
    ]
    mine = torch.tensor(words, dtype=torch.int64)  # host words: the verdict is read on the host
    mine = ((mine + 2**31) % 2**32 - 2**31).to(torch.int32)  # each word as a signed int32
    n = comm.world_size
    if not comm.alone:
        rows = torch.empty(n, STEP_CHECK_WORDS, dtype=torch.int32, device=comm.device)
        comm.all_gather(rows, mine.to(comm.device), "step check").wait()
        rows = rows.cpu()
    else:
        rows = mine.reshape(1, -1)
    _raise_on_disagreement(comm, rows, mine, changed)
    if len(set(rows[:, 6].tolist())) > 1:
        _raise_on_settings(comm, settings, int(mine[1]))
    flags = rows[:, 0] & 1
    sums = rows[:, 4:].to(torch.int64)
    sums = sums[:, 0] * 2**32 + (sums[:, 1] & 0xFFFFFFFF)
    identical = grad_checksum is not None and n > 1 and bool((sums == sums[0]).all()) and grad_checksum != 0
    missing = bool(rows[:, 3].any())
    if not bool(flags.any()):
        return StepCheck(True, [], missing, identical)
    ranks = flags.nonzero().flatten().tolist()
    if nonfinite == "raise":
        raise NonFiniteGradientError(
            f"rank {comm.rank}: non-finite gradients (NaN or Inf) at step {int(mine[1])} on rank(s) {ranks}; "
            "nothing was applied (nonfinite='raise')"
        )
    return StepCheck(False, ranks, missing, identical)


def _raise_on_disagreement(
    comm: Comm, rows: torch.Tensor, mine: torch.Tensor, changed: Sequence[str]
) -> None:
    """:class:`StepMismatchError` when the ranks' step numbers or layouts (``rows``: every rank's words,
    ``mine``: this rank's) differ, :class:`GradientChangedError` when a rank's gradients changed."""
    step, layout = int(mine[1]), int(mine[2])
    steps, layouts = rows[:, 1].tolist(), rows[:, 2].tolist()
    if len(set(steps)) > 1:
        others = [r for r, s in enumerate(steps) if s != step]
        raise StepMismatchError(
            f"rank {comm.rank}: this rank is at optimizer step {step}, rank(s) {others} at step(s) "
            f"{[steps[r] for r in others]}: a rank skipped or repeated step(). Call step() once per "
            "iteration on every rank, also when this rank's gradients overflowed: LionCub skips a step with "
            "NaN/Inf on any rank on every rank by itself (and takes a GradScaler's decision)"
        )
    if len(set(layouts)) > 1:
        others = [r for r, h in enumerate(layouts) if h != layout]
        raise StepMismatchError(
            f"rank {comm.rank}: rank(s) {others} optimize a different list of parameters at step {step} "
            "(parameters frozen/unfrozen with requires_grad_ or add_param_group on some ranks only, or with "
            "other shapes/dtypes); every rank must change the trainable parameters the same way"
        )
    flags = rows[:, 0]
    if bool((flags & 2).any()):
        ranks = (flags & 2).nonzero().flatten().tolist()
        mine_names = f" (here: {list(changed)[:5]})" if changed else ""
        raise GradientChangedError(
            f"rank {comm.rank}: .grad changed between backward and step() {step} on rank(s) {ranks}"
            f"{mine_names}, but the overlapped votes already used the gradients backward produced "
            "(gradient clipping, GradScaler.unscale_ or an edit of .grad). Use the plain step instead of "
            "overlap_with (lioncub.optim.ddp.skip_gradient_allreduce(model)), or leave .grad as backward "
            "wrote it"
        )


def step_settings(grad_scale: torch.Tensor | None, param_groups: Sequence[dict[str, Any]]) -> str:
    """What a step applies, as text every rank compares: the gradient scale it was handed (a GradScaler's)
    and each param group's ``lr``, ``betas``, ``weight_decay`` and ``maximize``, as applied now."""
    scale = "none" if grad_scale is None else repr(float(grad_scale))
    groups = "; ".join(
        f"group {i}: lr={float(g['lr'])!r} betas=({float(g['betas'][0])!r}, {float(g['betas'][1])!r}) "
        f"weight_decay={float(g['weight_decay'])!r} maximize={bool(g['maximize'])}"
        for i, g in enumerate(param_groups)
    )
    return f"grad scale {scale}; {groups}"


def _raise_on_settings(comm: Comm, settings: str, step: int) -> None:
    """Every rank's settings (a gather of the texts) and :class:`HyperparameterMismatchError` naming them."""
    texts = comm.all_gather_object(settings, "step settings gather")
    differ = [r for r, t in enumerate(texts) if t != texts[0]]
    lines = "\n".join(f"  rank {r}: {t}" for r, t in enumerate(texts))
    raise HyperparameterMismatchError(
        f"rank {comm.rank}: at optimizer step {step} rank(s) {differ} would apply other settings than rank 0 "
        f"(every rank must apply one update):\n{lines}\nA per-rank GradScaler backs off on its own after an "
        "overflow and a framework then skips the lr scheduler on some ranks only: use "
        "lioncub.optim.amp.GradScaler (the ranks share the overflow decision) or lioncub's integrations, and "
        "change lr/betas/weight_decay on every rank alike"
    )


def grad_checksum(grads: Sequence[torch.Tensor], sample: int = 1 << 16) -> int:
    """An int64 fingerprint of the gradients' bits (the first ``sample`` elements of each), equal on two
    ranks only if those elements are bitwise equal (up to hash collisions)."""
    total = 0
    for g in grads:
        head = g.detach().reshape(-1)[:sample].float().contiguous()
        bits = head.view(torch.int32).to(torch.int64)
        weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
        total = (total * 1_000_003 + int((bits * weights).sum())) % (2**61 - 1)
    return total


#: the frameworks lioncub integrates with (module imported → the integration that installs the vote)
_FRAMEWORKS = {
    "transformers": "the Trainer: lioncub.integrations.hf.LionCubTrainer or LionCubCallback",
    "accelerate": "accelerate: lioncub.integrations.accelerate.prepare",
    "lightning": "Lightning: lioncub.integrations.lightning.LionCubStrategy",
}


def framework_hint() -> str:
    """The integrations that make that fix for the frameworks imported in this process ("" when none)."""
    used = [fix for module, fix in _FRAMEWORKS.items() if module in sys.modules]
    return f"; with {', with '.join(used)}" if used else ""


def warn_identical_gradients(consequence: str) -> None:
    """The warning of a first step whose gradients are identical on every rank (rank 0 calls it):
    ``consequence`` says what that costs in the caller's mode."""
    warnings.warn(
        "LionCub: the gradients are identical on every rank at the first step: they look already averaged "
        f"by DDP's allreduce, so {consequence}. Register lioncub.optim.ddp.skip_gradient_allreduce(model) or "
        f"call opt.overlap_with(model) on the DDP model{framework_hint()} (identical data on every rank also "
        "gives identical gradients)",
        stacklevel=caller_stacklevel(),  # the line that called step()
    )
