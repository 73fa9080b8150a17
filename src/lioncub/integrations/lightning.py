"""LionCub in Lightning (the ``lightning`` extra, docs/install.md): :class:`LionCubStrategy`, a
``DDPStrategy``::

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
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.optim import Optimizer  # noqa: E402

from lioncub.integrations.common import find_lioncub, install_vote  # noqa: E402
from lioncub.optim.amp import agree_on_overflow  # noqa: E402
from lioncub.optim.lioncub import LionCub  # noqa: E402
from lioncub.optim.shards import SHARD_DIMS  # noqa: E402

__all__ = ["LionCubFSDPStrategy", "LionCubStrategy"]

_HOOK_OPTIONS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


class _SharedModel(Strategy):
    """What both strategies show Lightning in a local-steps window's middle: θ of the last outer step, the
    same on every rank, for validation, testing, prediction and the model in checkpoints (each rank's
    replica goes back into the parameters afterwards)."""

    lioncub: LionCub | None

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
        copy: the replicas go back into the parameters), else the base strategy's."""
        if self.lioncub is None:
            return super().lightning_module_state_dict()
        with self.lioncub.shared_parameters() as shown:
            state = super().lightning_module_state_dict()
            return {k: v.clone() for k, v in state.items()} if shown else state


def _the_lioncub(optimizers: list[Optimizer], where: str) -> LionCub:
    """The one LionCub among the optimizers ``configure_optimizers`` returned."""
    found = [o for o in optimizers if _is_lioncub(o)]
    if len(found) != 1:
        raise TypeError(
            f"{where}: configure_optimizers must return exactly one lioncub.LionCub; got "
            f"{[type(o).__name__ for o in optimizers]}"
        )
    return find_lioncub(found[0], where)


def _warn_partial_window(opt: LionCub, trainer: pl.Trainer, is_global_zero: bool, where: str) -> None:
    h = opt.local_steps.h if opt.local_steps is not None else 1
    if trainer.max_steps > 0 and trainer.max_steps % h and is_global_zero:
        warnings.warn(
            f"{where}: max_steps={trainer.max_steps} is not a multiple of local_steps h={h}: the "
            f"last {trainer.max_steps % h} inner steps end without an outer step. Validation and the "
            "checkpoints use θ of the last outer step, but after fit() each rank's model holds its own "
            "replica (evaluate or export it inside opt.shared_parameters())",
            stacklevel=user_stacklevel("lightning", "pytorch_lightning", "lightning_utilities"),  # fit()
        )


class LionCubStrategy(_SharedModel, DDPStrategy):
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
        opt = _the_lioncub(self.optimizers, "LionCubStrategy")
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
        _warn_partial_window(opt, trainer, self.is_global_zero, "LionCubStrategy")
        if not self.overlap:
            # Lightning refuses gradient_clip_val for an optimizer that unscales in its own step. Without a
            # scaler (bf16-mixed) nothing is scaled; with one (16-mixed) Lightning then unscales before
            # clipping, and the scaler skips an overflowed step on every rank (the flags agree, above).
            # Overlap keeps LionCub's own unscaling, which refuses a scaler (the votes started scaled).
            opt._step_supports_amp_scaling = False
        self.lioncub = opt

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Every rank's state gathered into rank 0's (collective: Lightning calls it on every rank when it
        saves); other optimizers as ``DDPStrategy``."""
        if not _is_lioncub(optimizer):
            return super().optimizer_state(optimizer)
        opt = find_lioncub(optimizer, "LionCubStrategy")
        opt.consolidate_state_dict(to=0)
        return opt.state_dict() if self.is_global_zero else {}


class LionCubFSDPStrategy(_SharedModel, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` for FSDP2 inside each replica and LionCub's vote between the
    replicas on each rank's shards (docs/shards.md). It builds :attr:`mesh`, a ``DeviceMesh`` with the dims
    ``("replicate", "shard")`` of shape (``replicas``, world size / ``replicas``), ranks numbered replica by
    replica; ``configure_model`` shards over ``mesh["shard"]`` and ``configure_optimizers`` returns
    ``LionCub(self.parameters(), process_group=mesh)``. Every rank reads its own batches (the distributed
    sampler spans the world: the replica's mean gradient is FSDP2's reduce-scatter over the ranks of the
    replica). Checkpoints are ``ModelParallelStrategy``'s distributed ones (``torch.distributed.checkpoint``,
    each rank its shards and its replica's momenta), which resume bit for bit.

    Args:
        replicas: R, the number of voters (each shards the model over world size / R ranks); ``None``: one
            replica per node (``Trainer(num_nodes=...)``).
        **kwargs: ``ModelParallelStrategy``'s ``process_group_backend`` and ``timeout``. Its
            ``data_parallel_size`` and ``tensor_parallel_size`` are refused (the mesh is :attr:`mesh`; tensor
            parallelism is not supported), and so is ``save_distributed_checkpoint=False`` (a checkpoint
            gathered on rank 0 would hold one replica's momenta).
    """

    strategy_name = "lioncub_fsdp"

    def __init__(self, replicas: int | None = None, **kwargs: Any) -> None:
        where = "LionCubFSDPStrategy"
        if replicas is not None and (type(replicas) is not int or replicas < 1):
            raise ValueError(f"{where}: replicas={replicas!r} must be a positive int, or None (one per node)")
        for key in ("data_parallel_size", "tensor_parallel_size"):
            if key in kwargs:
                raise ValueError(
                    f"{where}: {key}= is not allowed: the mesh is ('replicate', 'shard') of shape (replicas, "
                    "world size / replicas) and tensor parallelism is not supported; give replicas="
                )
        if kwargs.get("save_distributed_checkpoint", True) is not True:
            raise ValueError(
                f"{where}: save_distributed_checkpoint={kwargs['save_distributed_checkpoint']!r}: each "
                "replica's optimizer state is its own and only the distributed checkpoint (each rank its "
                "shards) holds them all; use save_distributed_checkpoint=True (the default)"
            )
        super().__init__(**kwargs)
        self.replicas = replicas
        self._mesh: DeviceMesh | None = None
        #: the LionCub of the run (after ``setup``)
        self.lioncub: LionCub | None = None

    @property
    def mesh(self) -> DeviceMesh:
        """The ``("replicate", "shard")`` mesh (from ``setup_environment`` on: in ``configure_model`` and
        ``configure_optimizers``)."""
        if self._mesh is None:
            raise RuntimeError("LionCubFSDPStrategy.mesh: the processes have not joined their group yet")
        return self._mesh

    def setup_environment(self) -> None:
        """``ModelParallelStrategy``'s (joins the process group), then :attr:`mesh` (collective)."""
        super().setup_environment()
        world = self.world_size
        replicas = self.num_nodes if self.replicas is None else self.replicas
        if world % replicas:
            raise ValueError(
                f"LionCubFSDPStrategy: replicas={replicas} does not divide the world size {world} "
                f"(num_nodes={self.num_nodes} × devices={self.num_processes}); give replicas= a divisor"
            )
        self._mesh = init_device_mesh(
            self.root_device.type, (replicas, world // replicas), mesh_dim_names=SHARD_DIMS
        )

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank its own batches (``ModelParallelStrategy``'s give a data-parallel group one)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup(self, trainer: pl.Trainer) -> None:
        """``ModelParallelStrategy.setup`` (the model sharded by ``configure_model``, then
        ``configure_optimizers``), then the check that LionCub votes on the shards over :attr:`mesh`."""
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        where = "LionCubFSDPStrategy"
        opt = _the_lioncub(self.optimizers, where)
        if opt.shards is None or opt.shards.mesh != self.mesh:
            raise TypeError(
                f"{where}: LionCub does not vote on FSDP2's shards over trainer.strategy.mesh (its "
                f"parameters are {'whole tensors' if opt.shards is None else 'shards of another mesh'}): in "
                "configure_model, fully_shard(..., mesh=self.trainer.strategy.mesh['shard']) each block and "
                "then the root; in configure_optimizers, LionCub(self.parameters(), ..., "
                "process_group=self.trainer.strategy.mesh). For the whole model on every rank use "
                "LionCubStrategy"
            )
        _warn_partial_window(opt, trainer, self.is_global_zero, where)
        self.lioncub = opt


def _is_lioncub(optimizer: Any) -> bool:
    try:
        find_lioncub(optimizer, "")
    except TypeError:
        return False
    return True
