"""The wire formats the votes share: what a fused kernel writes from ``(m, g)`` (a :class:`Payload`), and
what comes off the wire (a :class:`~lioncub.collectives.protocol.Result`) with its decode and its fused
apply.

==============================  ==================================================  ====================
payload                          written by (fused C, straight from ``m`` and ``g``)  used by
==============================  ==================================================  ====================
:class:`PackedVotes` (1 bit)     votes ``[c > 0]`` packed MSB first, "+" padding     1-bit vote, server
:class:`PackedVotes` (p bits)    votes in p-bit lanes, zero padding lanes           lane vote
:class:`Int8Signs`               ``sign(c)`` as int8 (NaN → 0)                      sign sum, average
==============================  ==================================================  ====================

==============================  ==================================================  ====================
result                           the update ``u``                                    from
==============================  ==================================================  ====================
:class:`PackedSigns`             +1 where a bit is set, −1 elsewhere                1-bit vote
:class:`LaneTable`               ``table[v]`` for a lane holding v                  lanes, 2/4-bit levels,
                                                                                    server (majority)
:class:`SignOfSum`               the sign of an int8 sum                            sign sum, 8-bit levels
:class:`MeanOfSigns`             an int8 sum / N, in the parameter's dtype          average
:class:`MeanGradient`            the mean gradient, in the wire dtype               dense
:class:`Decoded`                 the update itself (int8 votes or floating values)  hierarchical, server
                                                                                    (average)
==============================  ==================================================  ====================
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from lioncub.collectives.protocol import Result
from lioncub.ops import native, packing

__all__ = [
    "Decoded",
    "Int8Signs",
    "LaneTable",
    "MeanGradient",
    "MeanOfSigns",
    "PackedSigns",
    "PackedVotes",
    "Payload",
    "SignOfSum",
    "sign_int8",
]


def sign_int8(values: torch.Tensor) -> torch.Tensor:
    """``sign(values)`` as int8, NaN → 0 (casting a NaN ``torch.sign`` to int8 would be undefined)."""
    return torch.gt(values, 0).view(torch.int8) - torch.lt(values, 0).view(torch.int8)


# -------------------------------------------------------------------------------------------- payloads


class Payload(ABC):
    """What a vote's first step makes of the contributions ``c`` of d elements, written by a fused C kernel
    straight from each parameter's momentum and gradient (no pass over ``c``)."""

    dtype: torch.dtype

    @abstractmethod
    def numel(self, d: int) -> int:
        """Payload elements for d contributions."""

    @abstractmethod
    def write(
        self,
        exp_avg: torch.Tensor,
        grad: torch.Tensor | None,
        beta1: float,
        *,
        out: torch.Tensor,
        position: int,
        negate: bool,
        next_momentum: torch.Tensor | None,
        beta2: float,
        zeros_vote_plus: bool = True,
    ) -> float:
        """One parameter's payload at element ``position`` of the bucket (and, with ``next_momentum``,
        ``β2·m + (1−β2)·g`` into it; ``zeros_vote_plus``: how an exact zero votes in a one-bit vote);
        returns max ``|c|``."""

    def finish(self, out: torch.Tensor, d: int) -> None:  # noqa: B027 (most payloads have no padding)
        """After every parameter's :meth:`write`: the padding past element d."""


@dataclass(frozen=True)
class PackedVotes(Payload):
    """The votes ``[c ≥ 0]`` in ``bits``-bit lanes, uint8: ``bits=1`` as
    :func:`lioncub.ops.packing.pack_signs` (padding votes "+" up to a multiple of ``pad_to`` bits), wider
    lanes as :func:`lioncub.ops.packing.pack_lanes` (zero lanes up to a whole byte)."""

    bits: int = 1
    pad_to: int = 8
    dtype: torch.dtype = torch.uint8

    def numel(self, d: int) -> int:
        if self.bits == 1:
            return -(-d // self.pad_to) * self.pad_to // 8
        return packing.packed_size(d, self.bits)

    def write(
        self, exp_avg, grad, beta1, *, out, position, negate, next_momentum, beta2, zeros_vote_plus=True
    ):
        more = {"negate": negate, "next_momentum": next_momentum, "beta2": beta2}
        more["zeros_vote_plus"] = zeros_vote_plus
        return native.direction_lanes(
            exp_avg, grad, beta1, out=out, position=position, bits=self.bits, **more
        )

    def finish(self, out: torch.Tensor, d: int) -> None:
        native.fill_lanes(out, d, out.numel() * 8 // self.bits, self.bits, 1 if self.bits == 1 else 0)


@dataclass(frozen=True)
class Int8Signs(Payload):
    """``sign(c)`` as int8 (NaN → 0)."""

    dtype: torch.dtype = torch.int8

    def numel(self, d: int) -> int:
        return d

    def write(
        self, exp_avg, grad, beta1, *, out, position, negate, next_momentum, beta2, zeros_vote_plus=True
    ):
        signs = out[position : position + exp_avg.numel()]
        more = {"negate": negate, "next_momentum": next_momentum, "beta2": beta2}
        return native.direction_sign(exp_avg, grad, beta1, out=signs, **more)


# --------------------------------------------------------------------------------------------- results


@dataclass
class PackedSigns(Result):
    """``u = +1`` where bit i of ``bits`` (uint8, MSB first) is set, −1 elsewhere, for d elements; decoded
    into ``out`` (int8, reused)."""

    bits: torch.Tensor
    d: int
    out: torch.Tensor | None = None

    def decode(self) -> torch.Tensor:
        return packing.unpack_signs(self.bits, self.d, torch.int8, out=self.out)

    def fused_for(self, dtype: torch.dtype) -> bool:
        return True

    def apply_fused(self, param, position, *, lr, weight_decay, momentum):
        native.apply_bits(
            param, self.bits, position=position, lr=lr, weight_decay=weight_decay, momentum=momentum
        )


@dataclass
class LaneTable(Result):
    """``u = table[v]`` for each ``bits``-bit lane value v of ``lanes`` (uint8, the layout of
    :func:`lioncub.ops.packing.pack_lanes`), d elements; ``table`` has ``2**bits`` int8 entries."""

    lanes: torch.Tensor
    bits: int
    table: tuple[int, ...]
    d: int

    def decode(self) -> torch.Tensor:
        return packing.map_lanes(self.lanes, self.bits, self.d, self.table)

    def fused_for(self, dtype: torch.dtype) -> bool:
        return True

    def apply_fused(self, param, position, *, lr, weight_decay, momentum):
        more = {"bits": self.bits, "table": self.table, "position": position}
        native.apply_lanes(param, self.lanes, lr=lr, weight_decay=weight_decay, momentum=momentum, **more)

    @staticmethod
    def signs(lane_values: range, scale: int, offset: int) -> tuple[int, ...]:
        """``sign(scale·v + offset)`` for every lane value v (the table of a lane sum's vote)."""
        return tuple((scale * v + offset > 0) - (scale * v + offset < 0) for v in lane_values)


@dataclass
class SignOfSum(Result):
    """``u = sign(sums)`` of an int8 sum over the ranks (ties 0)."""

    sums: torch.Tensor

    def decode(self) -> torch.Tensor:
        return torch.sign(self.sums).to(torch.int8)

    def fused_for(self, dtype: torch.dtype) -> bool:
        return True

    def apply_fused(self, param, position, *, lr, weight_decay, momentum):
        votes = self.sums[position : position + param.numel()]
        native.apply_int8(param, votes, sign_of=True, lr=lr, weight_decay=weight_decay, momentum=momentum)


@dataclass
class MeanOfSigns(Result):
    """``u = sums / divisor`` in ``out``'s dtype (int8 ``sums``: Distributed Lion's average of the signs),
    decoded into ``out`` (reused)."""

    sums: torch.Tensor
    divisor: int
    out: torch.Tensor

    def decode(self) -> torch.Tensor:
        return self.out.copy_(self.sums).div_(self.divisor)

    def fused_for(self, dtype: torch.dtype) -> bool:
        return True

    def apply_fused(self, param, position, *, lr, weight_decay, momentum):
        sums = self.sums[position : position + param.numel()]
        extra = {"divisor": self.divisor, "momentum": momentum}
        native.apply_mean(param, sums, lr=lr, weight_decay=weight_decay, **extra)


@dataclass
class MeanGradient(Result):
    """The dense presets' mean gradient ``wire`` in the wire dtype; decoded to ``dtype`` (the
    gradients'). The dense vote applies it itself (global Lion, :class:`lioncub.collectives.DenseMean`)."""

    wire: torch.Tensor
    dtype: torch.dtype

    def decode(self) -> torch.Tensor:
        return self.wire.to(self.dtype)


@dataclass
class Decoded(Result):
    """An update already decoded: int8 votes, or floating values (a mean, in the wire's or the
    parameters' dtype)."""

    update: torch.Tensor

    def decode(self) -> torch.Tensor:
        return self.update

    def fused_for(self, dtype: torch.dtype) -> bool:
        return self.update.dtype in (torch.int8, dtype)

    def apply_fused(self, param, position, *, lr, weight_decay, momentum):
        u = self.update[position : position + param.numel()]
        if u.dtype == torch.int8:
            native.apply_int8(param, u, lr=lr, weight_decay=weight_decay, momentum=momentum)
        else:
            native.apply_values(param, u, lr=lr, weight_decay=weight_decay, momentum=momentum)
