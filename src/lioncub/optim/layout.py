"""Which parameters a :class:`~lioncub.optim.LionCub` step votes on, in which buckets, under which names —
and the hash of that layout the ranks compare at every step (:class:`ParamLayout`)."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch

from lioncub.optim.engine import Bucket, make_buckets

__all__ = ["ParamLayout", "named_parameters"]


def named_parameters(
    param_groups: list[dict[str, Any]], model: torch.nn.Module | None
) -> list[tuple[str, torch.Tensor]]:
    """The optimized parameters that require grad, with names: ``model``'s, else ``param_groups[g][i]``."""
    mine = {id(p) for g in param_groups for p in g["params"] if p.requires_grad}
    if model is None:
        return [
            (f"param_groups[{gi}][{i}]", p)
            for gi, g in enumerate(param_groups)
            for i, p in enumerate(g["params"])
            if p.requires_grad
        ]
    named: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in model.named_parameters() if id(p) in mine]
    missing = len(mine) - len({id(p) for _, p in named})
    if missing:
        raise ValueError(f"model=: {missing} optimized parameters are not parameters of the model")
    return named


class ParamLayout:
    """The parameters that require grad, in ``param_groups`` order, bucketed by :func:`make_buckets`.

    Args:
        bucket_mb: the bucket size cap (MiB of parameter bytes).
        model_names: ``id(p)`` → the model's name of ``p`` (others are named ``param_groups[g][i]``).
        weight: the elements a parameter counts for the bucket cap (:func:`make_buckets`; default: its own).
    """

    def __init__(
        self,
        bucket_mb: float,
        model_names: dict[int, str],
        weight: Callable[[torch.Tensor], int] | None = None,
    ) -> None:
        self.bucket_mb = bucket_mb
        self.model_names = model_names
        self.weight = weight
        self.buckets: list[Bucket] = []
        #: ``id(p)`` → name, for every parameter of the groups
        self.names: dict[int, str] = {}
        #: ``id(p)`` → position in the vote order (bucket by bucket)
        self.order: dict[int, int] = {}
        #: an int32 hash of the groups' shapes, dtypes and membership (compared by the step check)
        self.hash = 0
        self._ids: tuple[int, ...] | None = None

    @property
    def built(self) -> bool:
        return self._ids is not None

    def params(self) -> list[torch.Tensor]:
        """The voted parameters, in vote order."""
        return [p for b in self.buckets for p in b.params]

    def check_device(self, device: torch.device, rank: int, fix: str = "") -> None:
        """Raise ``RuntimeError`` when a voted parameter is no longer on ``device``, the device the
        optimizer's comm and buckets were made for (the model moved after the optimizer was built): a
        kernel's device check would fail in the middle of the step instead. Reads one parameter per
        bucket (a model moves as a whole), on the host: no device synchronization. ``fix``: how to build
        it right, for the message (default: move the model, then build the optimizer)."""
        how = fix or (
            "Build the optimizer after moving the model: model.to(device) first, then "
            "LionCub(model.parameters(), ...)"
        )
        for bucket in self.buckets:
            p = bucket.params[0]
            if p.device != device:
                raise RuntimeError(
                    f"rank {rank}: LionCub: parameter {self.names.get(id(p), '?')!r} moved from {device} to "
                    f"{p.device} after LionCub was built; its process-group comm and vote buckets stay on "
                    f"{device}. {how}"
                )

    def changed(self, param_groups: list[dict[str, Any]]) -> bool:
        """Whether the parameters that require grad differ from the layout's (``requires_grad_``,
        ``add_param_group``)."""
        return tuple(id(p) for g in param_groups for p in g["params"] if p.requires_grad) != self._ids

    def rebuild(self, param_groups: list[dict[str, Any]], members: set[int] | None = None) -> None:
        """Buckets, names, order and hash of the parameters that require grad now — or, with ``members``,
        of the parameters whose ``id`` it holds (a local-steps window restored from a saved state: its
        layout is the window's, whatever ``requires_grad`` says now)."""
        if members is None:
            members = {id(p) for g in param_groups for p in g["params"] if p.requires_grad}
        self.buckets = make_buckets(param_groups, self.bucket_mb, members, self.weight)
        self.names = {
            id(p): self.model_names.get(id(p), f"param_groups[{gi}][{i}]")
            for gi, g in enumerate(param_groups)
            for i, p in enumerate(g["params"])
        }
        self.order = {id(p): i for i, p in enumerate(self.params())}
        described = [
            (gi, i, tuple(p.shape), str(p.dtype), id(p) in members)
            for gi, g in enumerate(param_groups)
            for i, p in enumerate(g["params"])
        ]
        self._ids = tuple(id(p) for g in param_groups for p in g["params"] if id(p) in members)
        self.hash = zlib.crc32(repr(described).encode())
