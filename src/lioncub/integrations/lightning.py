"""LionCub in Lightning (``pip install 'lioncub[lightning]'``): :class:`LionCubStrategy`, a ``DDPStrategy``::

    from lioncub.integrations.lightning import LionCubStrategy

    class Module(L.LightningModule):
        def configure_optimizers(self):
            return LionCub(self.parameters(), lr=3e-4, variant="1bit")

    trainer = L.Trainer(strategy=LionCubStrategy(), devices=2, accelerator="cpu", max_steps=100)
    trainer.fit(Module(), ckpt_path="last")

The strategy wraps the model in DDP as ``DDPStrategy`` does, then replaces DDP's gradient allreduce with a
no-op hook (every rank's ``.grad`` stays its local gradient and only the vote travels), on CPU and on GPU
alike (``DDPStrategy`` registers communication hooks on CUDA only), or, with ``overlap=True``, makes the
vote DDP's hook, run during the backward pass (no ``gradient_clip_val`` then: clipping changes ``.grad``
after the votes have started). ``gradient_clip_val`` works with ``precision="bf16-mixed"`` and
``"16-mixed"`` (Lightning unscales before it clips; an overflow on any rank skips the step on every
rank). Its checkpoints hold every rank's momenta: before rank 0 writes the optimizer state, every rank's
is gathered into it (:meth:`LionCub.consolidate_state_dict`), and ``fit(ckpt_path=...)`` loads that state
on every rank, each taking its own. Everything else (accumulation with ``accumulate_grad_batches``, which
runs the non-final backward passes in ``no_sync``, lr schedulers, loggers) is Lightning's. With
``LionCub(..., local_steps=16)`` each rank trains its own replica between outer steps, and Lightning never
sees one as the model: validation, testing and prediction run on θ of the last outer step, the same on
every rank (:meth:`LionCub.shared_parameters`; a metric logged with ``sync_dist`` is then the mean of one
model's scores), and the model in every checkpoint (``last.ckpt`` too) is θ; a checkpoint in the middle of
a window resumes bitwise (each rank's replica is in its optimizer state). ``max_steps`` that is not a
multiple of H is warned about once: after ``fit`` each rank's model holds its own replica.
"""

from __future__ import annotations

import warnings
from typing import Any

from lioncub.integrations.callers import user_stacklevel
from lioncub.integrations.common import require

require(["lightning"], "lightning", "lioncub.integrations.lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402
from torch.optim import Optimizer  # noqa: E402

from lioncub.integrations.common import find_lioncub, install_vote  # noqa: E402
from lioncub.optim.amp import agree_on_overflow  # noqa: E402
from lioncub.optim.lioncub import LionCub  # noqa: E402

__all__ = ["LionCubStrategy"]

_HOOK_OPTIONS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


class LionCubStrategy(DDPStrategy):
    """``DDPStrategy`` for a LightningModule whose ``configure_optimizers`` returns a
    :class:`~lioncub.optim.LionCub` (alone, in a list, or in Lightning's dict with an lr scheduler).

    Args:
        overlap: vote during the backward pass (:meth:`LionCub.overlap_with`) instead of in ``step()``;
            refused with ``Trainer(gradient_clip_val=...)``.
        **kwargs: ``DDPStrategy``'s arguments (``process_group_backend``, ``timeout``, DDP's own keyword
            arguments such as ``bucket_cap_mb``), except the communication hook options, which LionCub's
            vote replaces.
    """

    strategy_name = "lioncub"

    def __init__(self, *, overlap: bool = False, **kwargs: Any) -> None:
        if not isinstance(overlap, bool):
            raise TypeError(f"LionCubStrategy: overlap={overlap!r} must be True or False")
        given = [k for k in _HOOK_OPTIONS if kwargs.get(k) is not None]
        if given:
            raise ValueError(
                f"LionCubStrategy: {given[0]}= is not allowed: LionCub's vote is DDP's communication hook "
                "(no gradient allreduce, or the vote itself with overlap=True); drop it"
            )
        super().__init__(**kwargs)
        self.overlap = overlap
        #: the LionCub the vote was installed for (after ``setup``)
        self.lioncub: LionCub | None = None

    def setup(self, trainer: pl.Trainer) -> None:
        """``DDPStrategy.setup`` (DDP wrapping, then ``configure_optimizers``), then the vote on the DDP
        model (collective: every rank runs it)."""
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        found = [o for o in self.optimizers if _is_lioncub(o)]
        if len(found) != 1:
            raise TypeError(
                "LionCubStrategy: configure_optimizers must return exactly one lioncub.LionCub; got "
                f"{[type(o).__name__ for o in self.optimizers]}"
            )
        opt = find_lioncub(found[0], "LionCubStrategy")
        clip = trainer.gradient_clip_val
        if self.overlap and clip:
            raise ValueError(
                f"LionCubStrategy(overlap=True) with Trainer(gradient_clip_val={clip}): clipping changes "
                ".grad after the overlapped votes have started. Drop gradient_clip_val (Lion's sign update "
                "needs no clipping) or use overlap=False"
            )
        assert self.model is not None
        install_vote(opt, self.model, overlap=self.overlap, where="LionCubStrategy")
        # fp16: every rank's scaler skips, backs off and grows together (lioncub.optim.amp)
        agree_on_overflow(getattr(self.precision_plugin, "scaler", None))
        h = opt.local_steps.h if opt.local_steps is not None else 1
        if trainer.max_steps > 0 and trainer.max_steps % h and self.is_global_zero:
            warnings.warn(
                f"LionCubStrategy: max_steps={trainer.max_steps} is not a multiple of local_steps h={h}: the "
                f"last {trainer.max_steps % h} inner steps end without an outer step. Validation and the "
                "checkpoints use θ of the last outer step, but after fit() each rank's model holds its own "
                "replica (evaluate or export it inside opt.shared_parameters())",
                stacklevel=user_stacklevel("lightning", "pytorch_lightning", "lightning_utilities"),  # fit()
            )
        if not self.overlap:
            # Lightning refuses gradient_clip_val for an optimizer that unscales in its own step. Without a
            # scaler (bf16-mixed) nothing is scaled; with one (16-mixed) Lightning then unscales before
            # clipping, and the scaler skips an overflowed step on every rank (the flags agree, above).
            # Overlap keeps LionCub's own unscaling, which refuses a scaler (the votes started scaled).
            opt._step_supports_amp_scaling = False
        self.lioncub = opt

    # -- the model Lightning sees: θ of the last outer step in a local-steps window's middle -------------

    def _show_shared(self) -> None:
        if self.lioncub is not None:
            self.lioncub.show_shared_parameters()  # put back at the next step, or by _hide_shared

    def _hide_shared(self) -> None:
        if self.lioncub is not None:
            self.lioncub.hide_shared_parameters()

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._show_shared()

    def on_validation_end(self) -> None:
        self._hide_shared()
        super().on_validation_end()

    def on_test_start(self) -> None:
        super().on_test_start()
        self._show_shared()

    def on_test_end(self) -> None:
        self._hide_shared()
        super().on_test_end()

    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._show_shared()

    def on_predict_end(self) -> None:
        self._hide_shared()
        super().on_predict_end()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state for a checkpoint: θ of the last outer step in a local-steps window's middle (a
        copy: the replicas go back into the parameters), else ``DDPStrategy``'s."""
        if self.lioncub is None:
            return super().lightning_module_state_dict()
        with self.lioncub.shared_parameters() as shown:
            state = super().lightning_module_state_dict()
            return {k: v.clone() for k, v in state.items()} if shown else state

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Every rank's state gathered into rank 0's (collective: Lightning calls it on every rank when it
        saves); other optimizers as ``DDPStrategy``."""
        if not _is_lioncub(optimizer):
            return super().optimizer_state(optimizer)
        opt = find_lioncub(optimizer, "LionCubStrategy")
        opt.consolidate_state_dict(to=0)
        return opt.state_dict() if self.is_global_zero else {}


def _is_lioncub(optimizer: Any) -> bool:
    try:
        find_lioncub(optimizer, "")
    except TypeError:
        return False
    return True
