"""LionCub in the Hugging Face ``transformers.Trainer`` (the ``hf`` extra, docs/install.md).

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
  (``variant``, ``betas``, ``bucket_mb``, ``momentum_sync``, ``checks``, ...); ``TrainingArguments(optim=,
  optim_args=)`` are ignored, with a warning. The Trainer's lr scheduler drives the lr: LionCub reads each
  group's lr at every step.
* **No gradient allreduce.** DDP's allreduce is replaced by a no-op hook, so every rank's ``.grad`` is its
  local gradient and only the vote travels; with ``overlap=True`` the vote itself becomes DDP's hook and
  runs during the backward pass (:meth:`LionCub.overlap_with`). Overlap needs ``max_grad_norm=0``: clipping
  changes ``.grad`` after the votes have started.
* **Checkpoints.** Wherever the Trainer saves the optimizer (``_save_optimizer_and_scheduler``, which every
  rank runs before rank 0 writes, whoever set ``should_save``: ``save_strategy``, a callback of yours),
  every rank's momenta are first gathered into the state rank 0 writes
  (:meth:`LionCub.consolidate_state_dict`); ``resume_from_checkpoint`` loads that file on every rank, onto
  the CPU (the Trainer would load all N ranks' momenta onto every GPU), and each takes its own to its
  parameters' device. Resuming on another number of ranks is refused unless
  ``lioncub=dict(allow_world_size_change=True)`` (rank r then takes saved rank r mod K's momenta). A
  checkpoint without optimizer state (``save_only_model=True``) resumes with zero momenta, with a warning.
* **torch.compile.** ``TrainingArguments(torch_compile=True)`` compiles around the DDP model; the vote is
  installed on the DDP model inside.
* **Logs.** ``lioncub_bytes_sent_per_step`` and ``lioncub_skipped_steps`` join every log of the Trainer
  (:class:`~lioncub.integrations.common.CommLog`).
* **Local steps** (``lioncub=dict(local_steps=16)``): each rank trains its own replica between outer
  steps. The Trainer never sees a replica as the model: its evaluations (``evaluate``, during training and
  after) and its model saves (``save_model``: checkpoints, the final and the best model) run on θ of the
  last outer step, the same on every rank (:meth:`LionCub.shared_parameters`), so every rank scores and
  writes the same model and the best checkpoint is picked by the score of the model it holds. A
  checkpoint in the middle of a window resumes bitwise (each rank's replica is in its optimizer state,
  restored whatever the load order); a model-only one (``save_only_model=True``) continues at its step
  (:meth:`LionCub.continue_at`: the window in progress restarts from θ and ends where it would have).
  ``max_steps`` that is not a multiple of H is warned about: after ``train()`` each rank's model holds its
  own replica (the saves are θ).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from lioncub.integrations.callers import user_stacklevel
from lioncub.integrations.common import require

require(["transformers", "accelerate"], "hf", "lioncub.integrations.hf")

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments  # noqa: E402
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME  # noqa: E402
from transformers.trainer_pt_utils import reissue_pt_warnings  # noqa: E402
from transformers.utils import (  # noqa: E402
    check_torch_load_is_safe,
    is_sagemaker_mp_enabled,
    is_torch_xla_available,
)

from lioncub.integrations.common import CommLog, find_lioncub, install_vote, world_size  # noqa: E402
from lioncub.optim.amp import agree_on_overflow  # noqa: E402
from lioncub.optim.lioncub import LionCub  # noqa: E402

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
        allow_world_size_change: let ``resume_from_checkpoint`` load a checkpoint written by another number
            of ranks (rank r takes the momenta of saved rank r mod K; :meth:`LionCub.load_state_dict`).
        **lioncub: options of :class:`LionCub` (``variant``, ``betas``, ``bucket_mb``, ``momentum_sync``,
            ``checks``, ``diagnostics_every``, ``maximize``, ``process_group``); the lr and weight decay come
            from the Trainer's arguments. If the Trainer was given a LionCub (``optimizers=(opt, sched)``)
            or builds one in its own ``create_optimizer``, pass no options here.
    """

    def __init__(
        self,
        trainer: Trainer,
        *,
        overlap: bool = False,
        allow_world_size_change: bool = False,
        **lioncub: Any,
    ) -> None:
        if not isinstance(trainer, Trainer):
            raise TypeError(
                f"LionCubCallback(trainer): expected a transformers.Trainer, got {type(trainer).__name__}"
            )
        for name, value in (("overlap", overlap), ("allow_world_size_change", allow_world_size_change)):
            if not isinstance(value, bool):
                raise TypeError(f"LionCubCallback: {name}={value!r} must be True or False")
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
        self.allow_world_size_change = allow_world_size_change
        self.options = dict(lioncub)
        #: how the user wrote it: ``"LionCubTrainer"`` or ``"LionCubCallback"`` (for messages)
        self.where = "LionCubTrainer" if isinstance(trainer, LionCubTrainer) else "LionCubCallback"
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
            # transformers types it (an Optimizer class, kwargs); its create_optimizer takes a factory too
            trainer.optimizer_cls_and_kwargs = (_Factory(self), {})  # type: ignore[assignment]  # a factory
        self._warn_ignored_args(trainer.args)
        self._wrap_the_trainer()

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

    def option(self, text: str) -> str:
        """Where the user passes the option ``text`` (``"allow_world_size_change=True"``)."""
        if self.where == "LionCubTrainer":
            return f"LionCubTrainer(..., lioncub=dict({text}))"
        return f"LionCubCallback(trainer, {text})"

    # -- the Trainer's saves and loads ------------------------------------------------------------------

    def _warn_ignored_args(self, args: TrainingArguments) -> None:
        default = TrainingArguments.__dataclass_fields__["optim"].default
        optim = getattr(args.optim, "value", args.optim)
        ignored = [f"optim={optim!r}"] if optim != default else []
        if args.optim_args:
            ignored.append(f"optim_args={args.optim_args!r}")
        if ignored:
            warnings.warn(
                f"{self.where}: TrainingArguments({', '.join(ignored)}) is ignored: the Trainer trains with "
                f"LionCub, whose options go in {self.option('variant=..., betas=..., ...')}",
                stacklevel=user_stacklevel("transformers", "accelerate"),  # the user's line
            )

    def _wrap_the_trainer(self) -> None:
        """Wrap the Trainer's own optimizer save and load, which every rank runs (whoever asked for the
        save): every rank's state is gathered on rank 0 before it writes; a resume's state is checked."""
        trainer = self.trainer
        names = ("_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler")
        save, load = (getattr(trainer, name, None) for name in names)
        if not (callable(save) and callable(load)):
            raise RuntimeError(
                f"{self.where}: this transformers Trainer has no {names[0]} / {names[1]}, where lioncub "
                "gathers every rank's momenta into the checkpoint; install transformers>=5 (the hf extra)"
            )

        def save_every_rank(output_dir: str) -> None:
            if world_size() > 1:
                self.optimizer.consolidate_state_dict(to=0)
            save(output_dir)

        def load_checked(checkpoint: str | None) -> None:
            if checkpoint is None:
                return load(checkpoint)
            opt = self.optimizer
            # this instance's own load_state_dict (without the class's keyword), until it has run once
            loader = self._loader(opt, checkpoint)
            opt.load_state_dict = loader  # type: ignore[method-assign, assignment]  # for this one load
            try:
                if not self._load_on_cpu(checkpoint):
                    load(checkpoint)
            finally:
                vars(opt).pop("load_state_dict", None)
            step = trainer.state.global_step
            if opt.global_step == 0 and step:
                opt.continue_at(step)  # the tie phase and the windows keep their place in the run
                if trainer.args.process_index == 0:
                    warnings.warn(
                        f"{self.where}: resuming at step {step} from {checkpoint}, which holds no optimizer "
                        "state (TrainingArguments(save_only_model=True) writes none): LionCub continues at "
                        "that step with zero momenta on every rank, a fresh warm-up (with local steps the "
                        "window in progress restarts from the saved model, θ of its last outer step). Save "
                        "with save_only_model=False to resume the momenta",
                        stacklevel=user_stacklevel("transformers", "accelerate"),  # trainer.train(...)
                    )

        # mypy refuses every assignment to a method: these wrap the Trainer's own, on this instance only
        trainer._save_optimizer_and_scheduler = save_every_rank  # type: ignore[method-assign]  # wrapped
        trainer._load_optimizer_and_scheduler = load_checked  # type: ignore[method-assign]  # wrapped
        trainer.evaluate = self._on_shared(trainer.evaluate)  # type: ignore[method-assign]  # wrapped
        trainer.save_model = self._on_shared(trainer.save_model)  # type: ignore[method-assign]  # wrapped

    def _load_on_cpu(self, checkpoint: str) -> bool:
        """The Trainer's own optimizer and scheduler load for a DDP (or one-process) run, with the
        optimizer file read onto the CPU: the Trainer would read it onto every rank's GPU
        (``map_location=args.device`` on several GPUs), and a consolidated LionCub state holds every
        rank's momenta; :meth:`LionCub.load_state_dict` moves this rank's part to the parameters'
        device. Returns False, having loaded nothing, where the Trainer loads otherwise (DeepSpeed, FSDP,
        XLA, SageMaker), the files are not both there, or the Trainer has not made its optimizer and
        scheduler (it loads after making them): then the Trainer's own load runs."""
        trainer = self.trainer
        optimizer, scheduler = trainer.optimizer, trainer.lr_scheduler
        optim_file, sched_file = (os.path.join(checkpoint, name) for name in (OPTIMIZER_NAME, SCHEDULER_NAME))
        elsewhere = (
            trainer.is_deepspeed_enabled
            or trainer.is_fsdp_enabled
            or is_torch_xla_available()
            or is_sagemaker_mp_enabled()
        )
        if optimizer is None or scheduler is None or elsewhere:
            return False
        if not (os.path.isfile(optim_file) and os.path.isfile(sched_file)):
            return False
        check_torch_load_is_safe()
        optimizer.load_state_dict(torch.load(optim_file, map_location="cpu", weights_only=True))
        # as the Trainer: the warnings are reissued without torch's "save the optimizer too"
        with warnings.catch_warnings(record=True) as caught:
            sched = torch.load(sched_file, map_location="cpu", weights_only=True)
            scheduler.load_state_dict(sched)
        reissue_pt_warnings(caught)
        return True

    def _on_shared(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` run on the ranks' shared parameters (θ of the last outer step in a local-steps
        window's middle; :meth:`LionCub.shared_parameters`), once the Trainer has its LionCub."""

        def on_shared(*args: Any, **kwargs: Any) -> Any:
            if self.trainer.optimizer is None:
                return method(*args, **kwargs)
            with self.optimizer.shared_parameters():
                return method(*args, **kwargs)

        return on_shared

    def _loader(self, opt: LionCub, checkpoint: str | None) -> Callable[[dict[str, Any]], None]:
        """A one-time ``opt.load_state_dict`` for the Trainer's resume: with this callback's
        ``allow_world_size_change``, and refusing another world size with a message naming that option."""

        def load_state_dict(state_dict: dict[str, Any]) -> None:
            del opt.load_state_dict  # the class's from now on
            meta = state_dict.get("lioncub")
            if isinstance(meta, Mapping) and not self.allow_world_size_change:
                saved = len(meta["ranks"]) if "ranks" in meta else meta.get("world_size")
                now = opt.comm.world_size
                if saved is not None and saved != now:
                    raise ValueError(
                        f"{self.where}: the checkpoint {checkpoint} holds the optimizer state of {saved} "
                        f"ranks, this job has {now}: each rank's momenta are its own. To resume anyway "
                        f"(rank r takes the momenta of saved rank r mod {saved}), pass "
                        f"{self.option('allow_world_size_change=True')}"
                    )
            opt.load_state_dict(state_dict, allow_world_size_change=self.allow_world_size_change)

        return load_state_dict

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
        h = opt.local_steps.h if opt.local_steps is not None else 1
        if state.max_steps % h and args.process_index == 0:
            warnings.warn(
                f"{self.where}: max_steps={state.max_steps} is not a multiple of local_steps h={h}: the last "
                f"{state.max_steps % h} inner steps end without an outer step. The Trainer's evaluations and "
                "saves use θ of the last outer step, but after train() each rank's model holds its own "
                "replica (evaluate or save it inside opt.shared_parameters())",
                stacklevel=user_stacklevel("transformers", "accelerate"),  # trainer.train()
            )
        # fp16: every rank's scaler skips, backs off and grows together (lioncub.optim.amp)
        agree_on_overflow(getattr(self.trainer.accelerator, "scaler", None))
        self.comm_log = CommLog(opt)

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
    ``betas``, ...), ``overlap`` and ``allow_world_size_change`` (default False), as
    :class:`LionCubCallback`."""

    def __init__(self, *args: Any, lioncub: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if lioncub is not None and not isinstance(lioncub, Mapping):
            raise TypeError(f"LionCubTrainer: lioncub={lioncub!r} must be a dict of LionCub's options")
        super().__init__(*args, **kwargs)
        options = dict(lioncub or {})
        overlap = options.pop("overlap", False)
        resize = options.pop("allow_world_size_change", False)
        #: the callback that does the work (see :class:`LionCubCallback`)
        self.lioncub_callback = LionCubCallback(
            self, overlap=overlap, allow_world_size_change=resize, **options
        )
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
