"""Keep ``DistributedDataParallel`` for what it does well, without paying for its gradient allreduce.

A :class:`~lioncub.optim.LionCub` vote variant communicates by itself, so DDP's bucketed gradient
allreduce is wasted work. DDP still broadcasts the parameters at construction and synchronises buffers
(BatchNorm statistics) in every forward; :func:`skip_gradient_allreduce` keeps those and replaces the
gradient allreduce with a no-op communication hook, so each rank's ``.grad`` stays its own local
gradient::

    model = DistributedDataParallel(model)
    opt = LionCub(model.parameters(), lr=3e-4, variant="8bit")
    if opt.config.transport != "dense":
        skip_gradient_allreduce(model)

(``LionCub``'s ``"32bit"``/``"16bit"`` presets allreduce gradients themselves; with those you may use
plain DDP + :class:`~lioncub.optim.Lion` instead, which overlaps the allreduce with the backward pass.)
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "GradientTraffic",
    "compressed_allreduce_dtype",
    "count_gradient_allreduce",
    "local_gradient_hook",
    "skip_gradient_allreduce",
]


# No ``from __future__ import annotations`` here: DDP checks the hook's annotations as objects.
def local_gradient_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that returns the bucket's local gradients untouched (no communication)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def skip_gradient_allreduce(model: DistributedDataParallel) -> DistributedDataParallel:
    """Register :func:`local_gradient_hook` on ``model``; returns the model. Call once per DDP instance."""
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"expected a DistributedDataParallel model, got {type(model).__name__}")
    model.register_comm_hook(None, local_gradient_hook)
    return model


@dataclass
class GradientTraffic:
    """Bytes one rank hands to DDP's gradient allreduces (ring: ``2·(N−1)/N`` of each bucket's wire
    bytes, both directions), counted from the buckets themselves; reset it after reading."""

    world_size: int
    wire_bytes_per_elem: int
    bytes_sent: float = 0.0
    bytes_recv: float = 0.0
    collectives: int = 0

    def add(self, numel: int) -> None:
        n = self.world_size
        nbytes = 2 * (n - 1) / n * numel * self.wire_bytes_per_elem
        self.bytes_sent += nbytes
        self.bytes_recv += nbytes
        self.collectives += 1

    def take(self) -> tuple[float, float, int]:
        """(sent, received, collectives) since the last call."""
        out = (self.bytes_sent, self.bytes_recv, self.collectives)
        self.bytes_sent = self.bytes_recv = 0.0
        self.collectives = 0
        return out


def compressed_allreduce_dtype(
    group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu"
) -> torch.dtype:
    """``torch.bfloat16`` if the backend ``group`` has for ``device`` (the gradients') can allreduce it
    (NCCL, recent gloo), else ``torch.float16``.

    Collective: every rank of ``group`` must call it (it tries a one-element bf16 allreduce on ``device``)."""
    probe = torch.zeros(1, dtype=torch.bfloat16, device=device)
    try:
        dist.all_reduce(probe, group=group)
    except (RuntimeError, ValueError):
        return torch.float16
    return torch.bfloat16


def count_gradient_allreduce(
    model: DistributedDataParallel, wire_dtype: torch.dtype = torch.float32
) -> GradientTraffic:
    """Register DDP's own allreduce hook (fp32), or its bf16/fp16 compression hook, wrapped so that the
    bytes of every bucket are counted; returns the counter. Call once per DDP instance."""
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"expected a DistributedDataParallel model, got {type(model).__name__}")
    hooks: dict[torch.dtype, Callable[..., torch.futures.Future[torch.Tensor]]] = {
        torch.float32: default_hooks.allreduce_hook,
        torch.bfloat16: default_hooks.bf16_compress_hook,
        torch.float16: default_hooks.fp16_compress_hook,
    }
    if wire_dtype not in hooks:
        raise ValueError(f"wire_dtype={wire_dtype} must be one of {sorted(map(str, hooks))}")
    inner = hooks[wire_dtype]
    traffic = GradientTraffic(dist.get_world_size(model.process_group), wire_dtype.itemsize)

    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        traffic.add(bucket.buffer().numel())
        return inner(state, bucket)

    model.register_comm_hook(model.process_group, hook)
    return traffic
