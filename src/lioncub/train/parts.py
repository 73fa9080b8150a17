"""A run's optimizer settings as the optimizer's objects, built in one place: :func:`optimizer_parts`
(:meth:`lioncub.train.config.OptimizerConfig.build`).

The vote (:class:`~lioncub.optim.VoteConfig`, from ``resolve_variant``), :class:`~lioncub.optim.Checks`,
:class:`~lioncub.optim.MomentumSync` and :class:`~lioncub.optim.LocalSteps`, each checked as ``LionCub``
checks it (``lioncub.optim.arguments``): :meth:`lioncub.train.config.TrainConfig.__post_init__` validates
a run by building them, and the driver (the vote's lanes), the loop (``LionCub``'s arguments, the vote
whose bytes the nodes count) and a replica group (torchft's DiLoCo's outer rule) take them from here.
The optimizer's :class:`~lioncub._validate.OptionError` names the option at fault (and the others its
message mentions) in parts; :func:`_flags` writes it with the settings' flags
(:func:`lioncub.train.settings.flag_message`). Other errors keep the optimizer's wording.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from lioncub._validate import OptionError
from lioncub.names import BASELINES, PEER_VARIANTS
from lioncub.optim.arguments import check_local_steps, check_options
from lioncub.optim.config import VoteConfig, resolve_variant
from lioncub.optim.local_steps import LocalSteps
from lioncub.optim.step_check import Checks
from lioncub.optim.sync import MomentumSync
from lioncub.train.settings import Described, flag_message

__all__ = ["OptimizerParts", "optimizer_parts"]


@dataclass(frozen=True)
class OptimizerParts:
    """The optimizer's objects of a run (:func:`optimizer_parts`)."""

    variant: str
    """The preset the optimizer runs: ``--variant``, ``32bit`` for torchft's DiLoCo (lioncub's dense outer
    rule)."""
    vote: VoteConfig
    """The preset with the run's quantizer, topology and zero rule, validated."""
    checks: Checks
    momentum_sync: MomentumSync
    local_steps: LocalSteps | None

    @property
    def lioncub_variant(self) -> str | VoteConfig:
        """``LionCub``'s ``variant=``: a DDP baseline's name (local steps' dense exchange), else the vote."""
        return self.variant if self.variant in BASELINES else self.vote


@contextmanager
def _flags(settings: dict[str, Described]) -> Iterator[None]:
    """The optimizer's :class:`~lioncub._validate.OptionError` written with the flags of ``settings``."""
    try:
        yield
    except OptionError as exc:
        raise ValueError(flag_message(exc, settings)) from None


def optimizer_parts(opt: Any, settings: dict[str, Described], topology: str | None = None) -> OptimizerParts:
    """The optimizer's objects of ``opt`` (a :class:`~lioncub.train.config.OptimizerConfig`), checked;
    ``settings``: the run's descriptions (:data:`lioncub.train.config.SETTINGS`), whose flags the messages
    name. ``topology``: the one ``--topology auto`` chose (the loop's, by the cost model); ``None``:
    ``hierarchical``, the stricter of auto's choices (the checks of a configuration), a ``ValueError``
    prefixed ``--topology auto: `` where it does not apply."""
    variant = "32bit" if opt.variant in PEER_VARIANTS else opt.variant  # DiLoCo: lioncub's dense outer rule
    chosen = opt.topology if opt.topology != "auto" else topology or "hierarchical"
    try:
        with _flags(settings):
            vote = resolve_variant(variant, quantizer=opt.quantizer, topology=chosen, zero_vote=opt.zero_vote)
    except ValueError as exc:
        raise ValueError(f"--topology auto: {exc}" if opt.topology == "auto" else str(exc)) from None
    with _flags(settings):
        checks = Checks(broadcast_init=False, nonfinite=opt.nonfinite)
        sync = MomentumSync(opt.momentum_sync, every=opt.sync_every)
        check_options(vote, variant, opt.bucket_mb, None, checks, opt.diagnostics_every)
        local = None
        if opt.local_steps is not None:
            local = LocalSteps(
                opt.local_steps, opt.outer, opt.outer_lr, opt.outer_betas, inner_momentum=opt.inner_momentum
            )
            check_local_steps(local, vote, variant, opt.momentum_sync, opt.diagnostics_every)
    return OptimizerParts(variant, vote, checks, sync, local)
