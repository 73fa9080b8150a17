r"""Lion's elementwise pieces as pure tensor functions, in torch (the reference every fused kernel of
:mod:`lioncub.ops.native` and :mod:`lioncub.ops.kernels` matches bit for bit)::

    c = β1·m + (1 − β1)·g          lion_direction
    p ← p·(1 − lr·wd) − lr·u       apply_update_  (u = sign(c) for Lion, a vote's result for Lion Cub)
    m ← β2·m + (1 − β2)·g          update_momentum_

The decay multiplication is skipped when ``lr·wd == 0``. :class:`lioncub.optim.Lion` composes them into
one step; a vote (:mod:`lioncub.collectives`) replaces ``sign(c)`` by the workers' combined ``u``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["apply_update_", "apply_update_converting_", "lion_direction", "update_momentum_"]


def lion_direction(exp_avg: Tensor, grad: Tensor, beta1: float) -> Tensor:
    """``c = β1·exp_avg + (1 − β1)·grad`` as a new tensor of ``exp_avg``'s shape and dtype (its sign is
    Lion's direction; ``grad`` already negated for maximisation)."""
    return exp_avg.mul(beta1).add_(grad, alpha=1.0 - beta1)


def apply_update_(param: Tensor, update: Tensor, *, lr: float, weight_decay: float) -> Tensor:
    """In place: ``param ← param·(1 − lr·wd) − lr·update``; returns ``param``. ``update`` has the shape
    of ``param`` (for Lion ``sign(c)``, values in ``{−1, 0, 1}``)."""
    if lr * weight_decay != 0:
        param.mul_(1.0 - lr * weight_decay)
    return param.add_(update, alpha=-lr)


def update_momentum_(exp_avg: Tensor, grad: Tensor, beta2: float) -> Tensor:
    """In place: ``exp_avg ← β2·exp_avg + (1 − β2)·grad``; returns ``exp_avg``."""
    return exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)


_PIECE = 1 << 16  # elements per cache-sized piece when converting an integer update


def apply_update_converting_(param: Tensor, update: Tensor, *, lr: float, weight_decay: float) -> None:
    """:func:`apply_update_` for an update in another dtype (the int8 result of a vote), converted to
    ``param``'s dtype first — on CPU piece by piece in cache, because a mixed-dtype ``add_`` is several
    times slower. The same bits as ``apply_update_(param, update.to(param.dtype), ...)``."""
    if update.dtype == param.dtype or not param.is_contiguous() or param.device.type != "cpu":
        apply_update_(param, update.to(param.dtype), lr=lr, weight_decay=weight_decay)
        return
    flat_p, flat_u = param.view(-1), update.reshape(-1)
    scratch = torch.empty(min(_PIECE, flat_p.numel()), dtype=param.dtype)
    for c0 in range(0, flat_p.numel(), _PIECE):
        c1 = min(c0 + _PIECE, flat_p.numel())
        u = scratch[: c1 - c0].copy_(flat_u[c0:c1])
        apply_update_(flat_p[c0:c1], u, lr=lr, weight_decay=weight_decay)
