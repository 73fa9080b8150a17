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

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["local_gradient_hook", "skip_gradient_allreduce"]


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
