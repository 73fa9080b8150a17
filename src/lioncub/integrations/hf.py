"""LionCub in the Hugging Face ``transformers.Trainer`` (``pip install 'lioncub[hf]'``).

::

    from lioncub.integrations.hf import LionCubTrainer

    args = TrainingArguments(output_dir="out", learning_rate=3e-4, weight_decay=0.1, max_grad_norm=1.0)
    trainer = LionCubTrainer(model=model, args=args, train_dataset=data, lioncub=dict(variant="1bit"))
    trainer.train()                      # under torchrun: the ranks vote; resume_from_checkpoint works

With a Trainer subclass of your own, add the callback instead (it builds the optimizer the same way)::

    trainer = MyTrainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(LionCubCallback(trainer, variant="1bit"))

What it does:

* **The optimizer.** :class:`~lioncub.optim.LionCub` over the Trainer's two param groups — the
  parameters of ``trainer.get_decay_parameter_names(model)`` with ``args.weight_decay``, the others (biases,
  norms) without — at ``args.learning_rate``, with ``betas=(0.9, 0.99)`` (Lion's; the Trainer's Adam betas
  are not used) unless the options say otherwise. Any other :class:`LionCub` option goes in ``lioncub=``
  (``variant``, ``betas``, ``bucket_mb``, ``momentum_sync``, ``checks``, ...). The Trainer's lr scheduler
  drives the lr: LionCub reads each group's lr at every step.
* **No gradient allreduce.** DDP's allreduce is replaced by a no-op hook, so every rank's ``.grad`` is its
  local gradient and only the vote travels; with ``overlap=True`` the vote itself becomes DDP's hook and
  runs during the backward pass (:meth:`LionCub.overlap_with`). Overlap needs ``max_grad_norm=0``: clipping
  changes ``.grad`` after the votes have started.
* **Checkpoints.** Before the Trainer saves (from rank 0 only), every rank's momenta are gathered into the
  optimizer state rank 0 writes (:meth:`LionCub.consolidate_state_dict`); ``resume_from_checkpoint`` loads
  that file on every rank and each takes its own.
* **Logs.** ``lioncub_bytes_sent_per_step`` and ``lioncub_skipped_steps`` join every log of the Trainer
  (:class:`~lioncub.integrations.common.CommLog`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lioncub.integrations.common import require

require(["transformers", "accelerate"], "hf", "lioncub.integrations.hf")

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments  # noqa: E402

from lioncub.integrations.common import CommLog, find_lioncub, install_vote, world_size  # noqa: E402
from lioncub.optim import LionCub  # noqa: E402
from lioncub.optim.amp import agree_on_overflow  # noqa: E402

__all__ = ["LionCubCallback", "LionCubTrainer"]

#: options of LionCub that the Trainer's own arguments set
_FROM_ARGS = {
    "lr": "TrainingArguments(learning_rate=...)",
    "weight_decay": "TrainingArguments(weight_decay=...) (biases and norms get 0)",
    "params": "the Trainer's model",
    "model": "the Trainer's model",
}


class _Factory:
    """What the callback puts in ``trainer.optimizer_cls_and_kwargs = (factory, {})``. transformers 5.x
    treats a callable that is not an Optimizer class as a factory and calls ``factory()(model)``: the
    callback's LionCub over the Trainer's decay split of ``model``. (Called with param groups, as a Trainer
    that predates factories would, it builds over those groups.)"""

    def __init__(self, callback: LionCubCallback) -> None:
        self.callback = callback

    def __call__(self, *groups: Any, **kwargs: Any) -> Any:
        if not groups and not kwargs:
            return self.callback.build_optimizer
        return self.callback.build_from_groups(list(groups[0]))


class LionCubCallback(TrainerCallback):
    """Makes ``trainer`` train with :class:`~lioncub.optim.LionCub` (see the module's docstring); add it
    with ``trainer.add_callback(LionCubCallback(trainer, variant="1bit"))``.

    Args:
        trainer: the Trainer (any subclass) this callback is added to.
        overlap: run the vote as DDP's communication hook, during the backward pass (needs
            ``TrainingArguments(max_grad_norm=0)``).
        **lioncub: options of :class:`LionCub` (``variant``, ``betas``, ``bucket_mb``, ``momentum_sync``,
            ``checks``, ``diagnostics_every``, ``maximize``, ``process_group``); the lr and weight decay come
            from the Trainer's arguments. If the Trainer was given a LionCub (``optimizers=(opt, sched)``)
            or builds one in its own ``create_optimizer``, pass no options here.
    """

    def __init__(self, trainer: Trainer, *, overlap: bool = False, **lioncub: Any) -> None:
        if not isinstance(trainer, Trainer):
            raise TypeError(
                f"LionCubCallback(trainer): expected a transformers.Trainer, got {type(trainer).__name__}"
            )
        if not isinstance(overlap, bool):
            raise TypeError(f"LionCubCallback: overlap={overlap!r} must be True or False")
        wrong = sorted(set(lioncub) & set(_FROM_ARGS))
        if wrong:
            raise ValueError(
                f"LionCubCallback: {wrong[0]}= is set by {_FROM_ARGS[wrong[0]]}; the lioncub options are the "
                "other arguments of LionCub (variant, betas, bucket_mb, momentum_sync, checks, ...)"
            )
        if trainer.args.world_size == 1 and world_size() > 1:
            raise ValueError(
                f"LionCubCallback: the Trainer runs this job of {world_size()} processes as independent "
                f"single-process runs (parallel_mode={trainer.args.parallel_mode.value}: no DDP, no data "
                "sharding), as transformers does without a GPU; pass TrainingArguments(use_cpu=True)"
            )
        self.trainer = trainer
        self.overlap = overlap
        self.options = dict(lioncub)
        self.built: LionCub | None = None  # the optimizer this callback built, if it did
        #: LionCub's traffic for the logs (from the start of training)
        self.comm_log: CommLog | None = None
        _check_overlap(trainer.args, overlap)
        if trainer.optimizer is not None:
            find_lioncub(trainer.optimizer, "LionCubCallback: Trainer(optimizers=(optimizer, ...))")
            if self.options:
                raise ValueError(
                    f"LionCubCallback: the Trainer already has its LionCub (optimizers=...); the options "
                    f"{sorted(self.options)} would not be used: pass them to LionCub(...)"
                )
        elif trainer.optimizer_cls_and_kwargs is not None:
            raise ValueError(
                "LionCubCallback: the Trainer was given optimizer_cls_and_kwargs; LionCubCallback builds the "
                "optimizer itself: drop optimizer_cls_and_kwargs and pass LionCub's options to the callback"
            )
        else:
            trainer.optimizer_cls_and_kwargs = (_Factory(self), {})  # type: ignore[assignment]

    # -- the optimizer ----------------------------------------------------------------------------------

    def build_optimizer(self, model: torch.nn.Module) -> LionCub:
        """:class:`LionCub` over ``model``'s trainable parameters in the Trainer's two groups (decay / no
        decay, by ``trainer.get_decay_parameter_names``), at ``args.learning_rate``. Collective (every rank
        builds its optimizer at the same time, as the Trainer does)."""
        decay = set(self.trainer.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.trainer.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        return self.build_from_groups(groups, model)

    def build_from_groups(
        self, groups: list[dict[str, Any]], model: torch.nn.Module | None = None
    ) -> LionCub:
        """:class:`LionCub` over ``groups`` (empty ones dropped) at ``args.learning_rate``, with Lion's
        ``betas=(0.9, 0.99)`` unless the options say otherwise."""
        options = {"betas": (0.9, 0.99), **self.options}
        self.built = LionCub(
            [g for g in groups if g["params"]],
            lr=self.trainer.args.learning_rate,
            model=self.trainer.model if model is None else model,
            **options,
        )
        return self.built

    @property
    def optimizer(self) -> LionCub:
        """The Trainer's LionCub (the Trainer holds it wrapped in accelerate's ``AcceleratedOptimizer``)."""
        return find_lioncub(self.trainer.optimizer, "LionCubCallback")

    # -- events -----------------------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        _check_overlap(args, self.overlap)
        opt = find_lioncub(
            self.trainer.optimizer,
            "LionCubCallback (the Trainer's optimizer; a create_optimizer of your own must return a LionCub)",
        )
        if self.options and opt is not self.built:
            raise ValueError(
                f"LionCubCallback: the Trainer's LionCub was built elsewhere (its own create_optimizer); the "
                f"callback's options {sorted(self.options)} were not used: pass them to that LionCub(...)"
            )
        install_vote(opt, self.trainer.model_wrapped, overlap=self.overlap, where="LionCubCallback")
        # fp16: every rank's scaler skips, backs off and grows together (lioncub.optim.amp)
        agree_on_overflow(getattr(self.trainer.accelerator, "scaler", None))
        self.comm_log = CommLog(opt)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._before_a_save(args, control)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._before_a_save(args, control)

    def _before_a_save(self, args: TrainingArguments, control: TrainerControl) -> None:
        """Gather every rank's state on rank 0 when the Trainer is about to write a checkpoint with the
        optimizer in it (it decides that in the events before ``_maybe_log_save_evaluate``; with
        ``save_strategy="best"`` after the evaluation, so then before every evaluation)."""
        if args.save_only_model or world_size() == 1:
            return
        if control.should_save or (args.save_strategy == "best" and control.should_evaluate):
            self.optimizer.consolidate_state_dict(to=0)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        """LionCub's numbers into ``logs`` and the Trainer's ``state.log_history`` (a callback sees the logs
        after the Trainer recorded them; :class:`LionCubTrainer` adds them before)."""
        if logs is None or self.comm_log is None or "lioncub_skipped_steps" in logs:
            return
        entries = self.comm_log.entries()
        logs.update(entries)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(entries)


class LionCubTrainer(Trainer):
    """A ``transformers.Trainer`` that trains with :class:`~lioncub.optim.LionCub` (see the module's
    docstring). Takes the Trainer's arguments and ``lioncub=dict(...)``: LionCub's options (``variant``,
    ``betas``, ...) and ``overlap`` (default False), as :class:`LionCubCallback`."""

    def __init__(self, *args: Any, lioncub: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if lioncub is not None and not isinstance(lioncub, Mapping):
            raise TypeError(f"LionCubTrainer: lioncub={lioncub!r} must be a dict of LionCub's options")
        super().__init__(*args, **kwargs)
        options = dict(lioncub or {})
        overlap = options.pop("overlap", False)
        #: the callback that does the work (see :class:`LionCubCallback`)
        self.lioncub_callback = LionCubCallback(self, overlap=overlap, **options)
        self.add_callback(self.lioncub_callback)

    @property
    def lioncub_optimizer(self) -> LionCub:
        """The LionCub inside ``self.optimizer`` (``.comm_stats()``, ``.global_step``, ...)."""
        return self.lioncub_callback.optimizer

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log, with LionCub's numbers (bytes sent per step, skipped steps) in it."""
        comm_log = self.lioncub_callback.comm_log
        if comm_log is not None:
            logs.update(comm_log.entries())
        super().log(logs, start_time)


def _check_overlap(args: TrainingArguments, overlap: bool) -> None:
    if overlap and args.max_grad_norm and args.max_grad_norm > 0:
        raise ValueError(
            f"lioncub overlap=True with TrainingArguments(max_grad_norm={args.max_grad_norm}): clipping "
            "changes .grad after the overlapped votes have started. Set max_grad_norm=0 (Lion's sign update "
            "needs no clipping) or overlap=False"
        )
