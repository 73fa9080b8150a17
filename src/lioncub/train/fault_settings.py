"""The settings of a fault-tolerant run (``lioncub train --fault-tolerant``, docs/fault-tolerance.md) and of
``--variant torchft-diloco``, checked with the rest of :meth:`lioncub.train.config.TrainConfig.check`."""

from __future__ import annotations

from typing import Any

from lioncub.launch.groups import parse_faults
from lioncub.names import BASELINES, PEER_VARIANTS
from lioncub.optim.config import DENSE_SGD_RULE

__all__ = ["FT_CUDA", "check_checkpoints", "check_fault_tolerant", "cpu_note"]

#: why ``--device cuda`` is refused with ``--fault-tolerant``
FT_CUDA = (
    "--device cuda with --fault-tolerant: the replica groups vote over torchft's gloo process group "
    "(ProcessGroupGloo) on CPU tensors, so a fault-tolerant run trains on the CPU and CUDA is not supported; "
    "use --device cpu (or auto, which takes the CPU with --fault-tolerant)"
)


def check_fault_tolerant(config: Any) -> None:
    """``config`` (a :class:`~lioncub.train.config.TrainConfig`) with ``--fault-tolerant``: the failure
    schedule against the groups and steps (:func:`lioncub.launch.groups.parse_faults`), the lighthouse's
    URL, the variants it takes, what groups of several ranks (``--nnodes``) do not take; and
    ``--variant torchft-diloco`` (torchft's DiLoCo: Lion inside, Nesterov SGD outside, each worker's inner
    momenta kept), which needs it and ``--local-steps H``; ``--device cuda`` (:data:`FT_CUDA`); the
    checkpoints (:func:`check_checkpoints`)."""
    cluster, opt = config.cluster, config.optimizer
    if opt.variant in PEER_VARIANTS:
        if not cluster.fault_tolerant or opt.local_steps is None:
            raise ValueError(
                f"--variant {opt.variant}: runs on torchft's Manager between replica groups, every H steps; "
                "add --fault-tolerant and --local-steps H (its sync_every)"
            )
        if opt.outer != DENSE_SGD_RULE or opt.inner_momentum != "keep":
            raise ValueError(
                f"--variant {opt.variant} with --outer {opt.outer} --inner-momentum {opt.inner_momentum}: "
                "torchft's DiLoCo averages the pseudo-gradients (--outer diloco) and keeps each worker's "
                "inner momenta (--inner-momentum keep)"
            )
    if not cluster.fault_tolerant:
        return
    if config.run.device == "cuda":
        raise ValueError(FT_CUDA)
    if opt.variant in BASELINES and opt.local_steps is None:
        raise ValueError(
            f"--fault-tolerant with --variant {opt.variant}: DDP + Lion has no vote between groups; give a "
            "LionCub variant (e.g. 1bit), or --local-steps H for its dense outer step"
        )
    if cluster.lighthouse is not None and not str(cluster.lighthouse).startswith(("http://", "https://")):
        raise ValueError(f"--lighthouse {cluster.lighthouse!r}: give the lighthouse's URL, http://HOST:PORT")
    if cluster.nnodes is not None:  # groups of several ranks: DDP inside, each group one voter
        why = {"--variant torchft-diloco": opt.variant in PEER_VARIANTS, "--momentum-sync": opt.momentum_sync
               != "none", f"--topology {opt.topology}": opt.topology != "flat"}  # fmt: skip
        for flag in (f for f, refused in why.items() if refused):
            raise ValueError(
                f"{flag} with --fault-tolerant --nnodes: each node is one replica group (DDP inside, one "
                "flat vote between the groups); use --nproc N for groups of one rank"
            )
    parse_faults(cluster.kill, cluster.rejoin, cluster.replica_groups, config.run.steps, opt.local_steps)
    check_checkpoints(config)


def check_checkpoints(config: Any) -> None:
    """A fault-tolerant run's ``--checkpoint-every K`` and ``--stop-at STEP``: at a commit boundary's end,
    where the quorum's groups hold equal parameters (a multiple of ``--local-steps H``), and not with
    ``--variant torchft-diloco`` (torchft's DiLoCo keeps its outer state and backup inside torchft)."""
    run, opt = config.run, config.optimizer
    given = [f"--{name.replace('_', '-')} {value}" for name, value in
             (("checkpoint_every", run.checkpoint_every), ("stop_at", run.stop_at)) if value]  # fmt: skip
    if given and opt.variant in PEER_VARIANTS:
        raise ValueError(
            f"{given[0]} with --fault-tolerant --variant {opt.variant}: torchft's DiLoCo keeps its state "
            "(the outer momenta, its backup of the parameters) inside torchft, which lioncub does not "
            "checkpoint; drop it, or use --variant 32bit --outer diloco --inner-momentum keep"
        )
    h = opt.local_steps
    for text, value in zip(given, (v for v in (run.checkpoint_every, run.stop_at) if v), strict=True):
        if h and value % h:
            raise ValueError(
                f"{text} with --fault-tolerant --local-steps {h}: must be a multiple of {h} (e.g. "
                f"{max(h, value // h * h)}): a checkpoint is taken at a window's end, where the groups' "
                "parameters are equal and committed"
            )
    cluster = config.cluster
    faults = parse_faults(cluster.kill, cluster.rejoin, cluster.replica_groups, run.steps, h)
    for f in faults if run.stop_at is not None else ():
        joins = -(-f.step // (h or 1)) * (h or 1)  # it joins the quorum after this step
        if f.kind == "rejoin" and f.step <= run.stop_at <= joins:
            raise ValueError(
                f"--stop-at {run.stop_at} with {f.spec}: group {f.group} is started again after step "
                f"{f.step} and joins the quorum only after step {joins}, so it would stop unhealed; stop "
                f"before step {f.step} or after step {joins}"
            )


def cpu_note(config: Any) -> str | None:
    """What a ``--fault-tolerant --device auto`` run says on a machine with CUDA: its replica groups train
    on the CPU (None: nothing to say: not fault-tolerant, ``--device cpu``, or no CUDA device)."""
    import torch

    if not config.cluster.fault_tolerant or config.run.device != "auto" or not torch.cuda.is_available():
        return None
    n = torch.cuda.device_count()
    return (
        "--fault-tolerant --device auto: the replica groups train on the CPU (torchft's gloo process group "
        f"runs on CPU tensors); this machine's {n} CUDA device{'s are' if n != 1 else ' is'} not used"
    )
