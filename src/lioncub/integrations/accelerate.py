"""LionCub with Hugging Face ``accelerate`` (the ``hf`` extra, docs/install.md): one call after
``accelerator.prepare(...)``::

    import lioncub.integrations.accelerate as lioncub_accelerate

    accelerator = Accelerator()                          # joins the process group (torchrun)
    model = model.to(accelerator.device)                 # before LionCub: it votes on the parameters' device
    opt = LionCub(model.parameters(), lr=3e-4, variant="1bit")
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    lioncub_accelerate.prepare(accelerator, model, opt)  # before the first backward

Build LionCub once the model is on ``accelerator.device``: its process-group comm and vote buckets are
made on the parameters' device at construction, and ``accelerator.prepare`` moving the model later does
not move them. Built on the CPU in a job of several GPUs, the construction refuses an NCCL group (no
backend for CPU tensors), and :func:`prepare` refuses an optimizer whose parameters
``accelerator.prepare`` moved, naming the device and this fix.

:func:`prepare` replaces the prepared DDP model's gradient allreduce with a no-op hook, so every rank's
``.grad`` is its local gradient and only the vote travels (or, with ``overlap=True``, makes the vote DDP's
hook, run during the backward pass: then do not clip gradients, ``accelerator.clip_grad_norm_`` changes
``.grad`` after the votes have started and LionCub's step raises). It registers a ``save_state`` pre-hook
that gathers every rank's momenta into the ``optimizer.bin`` rank 0 writes
(:meth:`LionCub.consolidate_state_dict`); ``load_state`` loads that file on every rank and each rank takes
its own. (With ``ProjectConfiguration(save_on_each_node=True)`` on several nodes the other nodes' files
hold their local main process's state only, and loading them is refused.)

With ``LionCub(..., local_steps=16)`` each rank trains its own replica between outer steps. A
``save_state`` in the middle of a window writes θ of the last outer step as the model — the same on every
rank (:meth:`LionCub.shared_values`) — and resumes bitwise through ``load_state`` (each rank's replica is
in its optimizer state).
accelerate has no evaluation loop of its own: evaluate inside ``with opt.shared_parameters():`` to score
the model the ranks share.

``DistributedDataParallelKwargs(comm_hook=...)`` takes only accelerate's ``DDPCommunicationHookType``
values and silently ignores anything else, so a callable hook there never runs: :func:`prepare` refuses
it, and refuses accelerate's compression hooks too (they would allreduce the gradients LionCub votes on).
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from lioncub.integrations.common import require

require(["accelerate"], "hf", "lioncub.integrations.accelerate")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.utils import DDPCommunicationHookType, DistributedType  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from lioncub.integrations.common import find_lioncub, install_vote, world_size  # noqa: E402
from lioncub.optim.amp import agree_on_overflow  # noqa: E402
from lioncub.optim.lioncub import LionCub  # noqa: E402

__all__ = ["prepare"]

#: the save_state pre-hooks registered: optimizer -> accelerators it gathers its state for
_HOOKED: weakref.WeakKeyDictionary[LionCub, weakref.WeakSet[Accelerator]] = weakref.WeakKeyDictionary()


def prepare(
    accelerator: Accelerator, model: torch.nn.Module, optimizer: Any, *, overlap: bool = False
) -> LionCub:
    """Install LionCub's vote on ``model`` and its per-rank state in ``accelerator``'s checkpoints.

    Args:
        accelerator: the ``Accelerator`` that prepared ``model`` and ``optimizer``.
        model: the model ``accelerator.prepare`` returned (a ``DistributedDataParallel`` in a job of several
            processes, or ``torch.compile``'s module around one with ``Accelerator(dynamo_backend=...)``).
        optimizer: the optimizer ``accelerator.prepare`` returned (an ``AcceleratedOptimizer`` around a
            :class:`LionCub`).
        overlap: vote during the backward pass (:meth:`LionCub.overlap_with`) instead of in ``step()``;
            gradients must then not be clipped.

    Returns the :class:`LionCub` (for ``comm_stats()``). Collective: every rank calls it, before the first
    backward. Calling it again with the same arguments changes nothing. Refuses (``RuntimeError``) a
    LionCub built before ``accelerator.prepare`` moved its parameters to another device.
    """
    where = "lioncub.integrations.accelerate.prepare"
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"{where}: expected an accelerate.Accelerator, got {type(accelerator).__name__}")
    _refuse_comm_hook(accelerator, where)
    if not isinstance(optimizer, AcceleratedOptimizer):
        raise TypeError(
            f"{where}: optimizer is a {type(optimizer).__name__}: pass the optimizer that "
            "accelerator.prepare(...) returned (its checkpoints hold the prepared optimizers only)"
        )
    opt = find_lioncub(optimizer, where)
    refuse_fsdp(accelerator.distributed_type, _fsdp_version(accelerator), opt, world_size(), where)
    if not opt.single_process:
        fix = (
            "accelerator.prepare moved the model, not the optimizer: build LionCub after model = "
            f"model.to(accelerator.device) ({accelerator.device}), then accelerator.prepare(model, opt, ...)"
        )
        try:
            opt.layout.check_device(opt.comm.device, opt.comm.rank, fix=fix)
        except RuntimeError as err:
            raise RuntimeError(f"{where}: {err}") from None
    if accelerator.num_processes == 1 and world_size() > 1:
        raise ValueError(
            f"{where}: accelerate runs this job of {world_size()} processes as one "
            f"(distributed_type={accelerator.distributed_type}), so it did not wrap the model in DDP; "
            "without a GPU, make the Accelerator with Accelerator(cpu=True)"
        )
    install_vote(opt, model, overlap=overlap, where=where)
    # fp16: every rank's scaler skips, backs off and grows together (else the scheduler skips per rank)
    agree_on_overflow(getattr(accelerator, "scaler", None))
    hooked = _HOOKED.setdefault(opt, weakref.WeakSet())
    if accelerator not in hooked and world_size() > 1:

        def gather_every_rank(models: list[Any], weights: list[Any], output_dir: str) -> None:
            """accelerate's save_state pre-hook (every rank runs it): in a local-steps window's middle the
            models' weights to be written become θ of the last outer step (the parameters keep this rank's
            replica); rank 0 saves every rank's optimizer state (with its replica)."""
            shared = opt.shared_values()
            if shared:
                by_storage = {p.data_ptr(): shared[id(p)] for g in opt.param_groups for p in g["params"]
                              if id(p) in shared}  # fmt: skip
                for state in weights:
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor) and value.data_ptr() in by_storage:
                            state[key] = by_storage[value.data_ptr()]
            opt.consolidate_state_dict(to=0)

        accelerator.register_save_state_pre_hook(gather_every_rank)
        hooked.add(accelerator)
    return opt


#: what to do instead of accelerate's FSDP, in every refusal of it
_OWN_LOOP = (
    "To vote on FSDP2's shards, shard the model yourself and run your own loop (docs/shards.md): a "
    "DeviceMesh ('replicate', 'shard'), fully_shard(..., mesh=mesh['shard']), LionCub(model.parameters(), "
    "process_group=mesh), torchrun; to vote on the whole model, drop the fsdp_plugin (accelerate's DDP)"
)


def refuse_fsdp(
    distributed_type: DistributedType, fsdp_version: int | None, opt: LionCub, world: int, where: str
) -> None:
    """Raise ``ValueError`` for accelerate's FSDP, which cannot host LionCub's vote (module docstring), and
    for an optimizer whose parameters became ``DTensor`` s after LionCub was built.

    Args:
        distributed_type: ``accelerator.distributed_type``.
        fsdp_version: the ``fsdp_plugin``'s ``fsdp_version`` (``None``: no plugin in the state).
        opt: the LionCub inside the prepared optimizer.
        world: the number of processes of the job.
        where: the caller, for the messages.
    """
    params = [p for g in opt.param_groups for p in g["params"]]
    if opt.shards is None and any(isinstance(p, DTensor) for p in params):
        raise ValueError(
            f"{where}: the optimizer's parameters were replaced by FSDP2's sharded ones (DTensors) after "
            "LionCub was built on the whole tensors — what accelerate's FSDP2 prepare does "
            "(fsdp2_switch_optimizer_parameters) — so LionCub's buckets and momenta are not those of the "
            f"parameters it would step. {_OWN_LOOP}"
        )
    if distributed_type == DistributedType.FSDP:
        version = "?" if fsdp_version is None else fsdp_version
        raise ValueError(
            f"{where}: accelerate's FSDP (FullyShardedDataParallelPlugin(fsdp_version={version})) cannot "
            "host LionCub's vote: accelerator.prepare shards the model itself over its own mesh (the whole "
            "job, or with ParallelismConfig(dp_replicate_size=...) HSDP, whose gradients FSDP2 averages "
            "between the replicas: nothing is left to vote on), FSDP1's flat shards are not tensors, and "
            "FSDP2's prepare swaps the optimizer's parameters for the sharded ones after the optimizer was "
            "built. " + _OWN_LOOP
        )
    if opt.shards is not None:
        raise ValueError(
            f"{where}: LionCub votes on FSDP2's shards here, which accelerate does not support without its "
            f"FSDP plugin (it wraps a model in DDP, and refuses DTensor parameters). {_OWN_LOOP}"
        )
    if world > 1 and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        raise ValueError(
            f"{where}: accelerate was asked for FSDP (an fsdp_plugin, or accelerate launch --use_fsdp: "
            f"ACCELERATE_USE_FSDP=true) but runs {distributed_type.value}: it shards only on GPUs and other "
            "accelerators, so here every rank holds the whole model, in DDP. " + _OWN_LOOP
        )


def _fsdp_version(accelerator: Accelerator) -> int | None:
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    version = getattr(plugin, "fsdp_version", None)
    return version if isinstance(version, int) else None


def _refuse_comm_hook(accelerator: Accelerator, where: str) -> None:
    handler = accelerator.ddp_handler
    hook = getattr(handler, "comm_hook", DDPCommunicationHookType.NO)
    if hook == DDPCommunicationHookType.NO:
        return
    allowed = [h.value for h in DDPCommunicationHookType]
    if not isinstance(hook, DDPCommunicationHookType) and not (isinstance(hook, str) and hook in allowed):
        raise ValueError(
            f"{where}: DistributedDataParallelKwargs(comm_hook={hook!r}) is silently ignored by accelerate, "
            f"which takes only DDPCommunicationHookType values ({allowed}); a callable hook never runs. Drop "
            "comm_hook: lioncub installs its own hook on the prepared model"
        )
    raise ValueError(
        f"{where}: DistributedDataParallelKwargs(comm_hook={hook!r}) makes DDP allreduce compressed "
        "gradients, which LionCub's vote replaces; use comm_hook=DDPCommunicationHookType.NO (the default)"
    )
