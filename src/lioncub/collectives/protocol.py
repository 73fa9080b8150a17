r"""The one protocol every vote follows, and what travels between the optimizer and a vote.

A **vote** combines the ranks' contributions of one bucket (a list of parameters laid out one after
another in a flat buffer) into one update, the same on every rank, and applies it. It owns its wire format
end to end, in four calls per bucket and step (as a DDP communication hook owns its compress and
decompress), each taking the bucket's :class:`Ballot`:

1. :meth:`Vote.contribute` — this rank's contribution from each parameter's momentum and gradient:
   ``c = β1·m + (1−β1)·g`` for the sign votes, ``g`` for the dense mean — written straight into the
   vote's payload where a fused CPU kernel can (packed votes, int8 signs, the scaled gradient), else into
   the flat buffer; and its max-abs ``ballot.peak`` (NaN or Inf propagate) for the ranks' non-finite check;
2. :meth:`Vote.post` — encode what is left and post the first collective;
3. :meth:`Vote.advance` — the work between the phases of a two-phase vote (count, repack), posting the
   next phase (the engine advances every ballot before it waits on the first); :meth:`Vote.wait` waits for
   the result;
4. :meth:`Vote.apply` — decode and apply: ``p ← p·(1 − lr·wd) − lr·u`` and
   ``m ← β2·m + (1−β2)·g`` (a sign vote), or global Lion with the mean gradient (the dense mean).

:meth:`Vote.discard` waits for a posted ballot without applying it (a skipped step). Underneath,
:meth:`Vote.start` is the collective itself: flat contributions in, a :class:`Pending` whose ``wait()`` is
the update ``u`` (what the tests compare with the N-worker simulation).

The optimizer hands a vote its state through :class:`ParamState` (each parameter's momentum and current
hyperparameters) and chooses each bucket's backend once, when it builds the bucket (``Ballot.backend``: a
:class:`lioncub.ops.kernels.StepBackend`: the fused C kernels of :mod:`lioncub.ops.native`, Triton, or
torch).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Protocol

import torch

from lioncub import transports
from lioncub.collectives.base import Comm
from lioncub.ops import kernels, native

__all__ = ["Ballot", "Hyper", "ParamState", "Pending", "Result", "Vote"]


@dataclass(frozen=True)
class Hyper:
    """One parameter's Lion hyperparameters as its param group holds them now."""

    lr: float
    beta1: float
    beta2: float
    weight_decay: float
    maximize: bool


class ParamState(Protocol):
    """What a vote reads and writes of the optimizer (:class:`lioncub.optim.engine.OptimizerState`)."""

    def momentum(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's momentum of ``p`` (created as zeros on first use; written in place)."""
        ...

    def hyper(self, p: torch.Tensor) -> Hyper:
        """``p``'s hyperparameters, read from its param group at every call."""
        ...


class Result(ABC):
    """A vote's result as it came off the wire, before its decode: :meth:`decode` is the update ``u`` (d
    elements: int8 votes, or floating values); where :meth:`fused_for` says so, :meth:`apply_fused`
    applies it to one parameter with a fused C kernel that decodes as it reads
    (:mod:`lioncub.collectives.formats`)."""

    @abstractmethod
    def decode(self) -> torch.Tensor: ...

    def fused_for(self, dtype: torch.dtype) -> bool:
        """Whether :meth:`apply_fused` takes a parameter of ``dtype``."""
        return False

    def apply_fused(
        self,
        param: torch.Tensor,
        position: int,
        *,
        lr: float,
        weight_decay: float,
        momentum: native.Momentum | None,
    ) -> None:
        """``p ← p·(1 − lr·wd) − lr·u[position : position + p.numel()]``, then the ``momentum`` update, in
        one pass (``p``: a CPU parameter's data)."""
        raise NotImplementedError(f"{type(self).__name__} has no fused apply")


@dataclass
class Pending:
    """A vote in flight. :meth:`advance` runs the work between the phases of a multi-phase vote and posts
    the next phase without waiting for it; :meth:`result` finishes and returns the :class:`Result`
    (kept); :meth:`wait` is its decoded update ``u`` (kept)."""

    finish: Callable[[], Result]
    middle: Callable[[], None] | None = None
    _result: Result | None = None
    _update: torch.Tensor | None = None

    def advance(self) -> None:
        if self.middle is not None:
            middle, self.middle = self.middle, None
            middle()

    def result(self) -> Result:
        if self._result is None:
            self.advance()
            self._result = self.finish()
        return self._result

    def wait(self) -> torch.Tensor:
        if self._update is None:
            self._update = self.result().decode()
        return self._update


@dataclass
class Ballot:
    """One bucket's vote in one step on this rank.

    Attributes:
        key: the bucket (its buffers are reused; ballots in flight at once need distinct keys).
        params: the bucket's parameters, in the flat layout's order.
        backend: the bucket's :class:`~lioncub.ops.kernels.StepBackend`, chosen when it was built.
        local: the flat buffer of the contributions (the bucket's dtype and device, ``sum(p.numel())``
            elements); holds no values where the contribution went straight into ``payload``.
        peak: float32 scalar, max ``|contribution|`` (NaN or Inf when some element is not finite).
        payload: the vote's encoded contribution, written by a fused kernel (else ``None``).
        next_momenta: (fused) each parameter's next momentum ``β2·m + (1−β2)·g`` and its ``β2``, computed
            in the contribution pass (``None`` entries: not computed).
        direction: (diagnostics) a copy of the contribution.
        pending: the vote once posted.
    """

    key: Hashable
    params: list[torch.Tensor]
    backend: kernels.StepBackend
    local: torch.Tensor
    peak: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float32))
    payload: torch.Tensor | None = None
    next_momenta: list[tuple[torch.Tensor, float] | None] | None = None
    direction: torch.Tensor | None = None
    pending: Pending | None = None

    @property
    def segments(self) -> list[int]:
        """Elements of each parameter, in order."""
        return [p.numel() for p in self.params]


class Vote(ABC):
    """One way to combine the ranks' contributions (see the module docstring for the protocol)."""

    name: str = ""
    #: the update's type: ``"vote"`` → int8 in {−1, 0, +1}; ``"value"`` → floating (a mean)
    result: Literal["vote", "value"] = "vote"
    #: its transport (:data:`lioncub.transports.FACTS`): widths, capacity and bytes (``None``: a vote laid
    #: over nodes, which counts its own bytes)
    facts: ClassVar[transports.Transport | None] = None
    #: the width of its packed lanes where its transport lets ``bits`` choose one (``None``: fixed)
    bits: int | None = None

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._buffers: dict[tuple[Hashable, str], torch.Tensor] = {}

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def buffer(self, key: Hashable | None, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reusable scratch tensor (fresh when ``key`` is None); avoids page faults on large buckets."""
        device = self.comm.device
        if key is None:
            return torch.empty(numel, dtype=dtype, device=device)
        buf = self._buffers.get((key, name))
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[(key, name)] = buf
        return buf

    # -- the collective ------------------------------------------------------------------------------

    @abstractmethod
    def start(
        self,
        local: torch.Tensor,
        *,
        step: int,
        key: Hashable | None = None,
        segments: Sequence[int] | None = None,
        encoded: torch.Tensor | None = None,
    ) -> Pending:
        """Start combining ``local`` (1-D, this rank's contributions). ``step`` (≥ 1) drives the tie rule;
        ``key`` names the bucket (reusable buffers); ``segments`` are the lengths of the parameter tensors
        in ``local`` (per-tensor quantizer normalisation); ``encoded``: this vote's payload of ``local``
        already written by :meth:`contribute` (then ``local`` is only read for its length)."""

    def wire_bytes(self, numel: int) -> tuple[float, float]:
        """(sent, received) bytes per rank for one :meth:`start` of ``numel`` elements: its transport's
        :meth:`~lioncub.transports.Transport.wire_bytes`."""
        if self.facts is None:
            raise NotImplementedError
        return self.facts.wire_bytes(numel, self.world_size, bits=self.bits)

    # -- the protocol --------------------------------------------------------------------------------

    @abstractmethod
    def contribute(
        self,
        ballot: Ballot,
        grads: Sequence[torch.Tensor | None],
        state: ParamState,
        *,
        step: int,
        keep_copy: bool = False,
    ) -> None:
        """Step 1: this rank's contribution of ``ballot.params`` (gradients ``grads``, ``None`` = zeros)
        to optimizer step ``step`` into ``ballot.local`` or ``ballot.payload``, and ``ballot.peak``;
        ``keep_copy`` keeps a copy of it in ``ballot.direction`` (diagnostics)."""

    def post(self, ballot: Ballot, step: int) -> None:
        """Step 2: encode and post the vote of ``ballot`` for optimizer step ``step``."""
        self.comm.step = step
        ballot.pending = self.start(
            ballot.local, step=step, key=ballot.key, segments=ballot.segments, encoded=ballot.payload
        )

    def advance(self, ballot: Ballot) -> None:
        """Step 3: the work between phases (waits for the first, posts the next)."""
        assert ballot.pending is not None, "advance() before post()"
        ballot.pending.advance()

    def wait(self, ballot: Ballot) -> None:
        """Wait until the vote's result is here (the exchange; :meth:`apply` then decodes and applies)."""
        assert ballot.pending is not None, "wait() before post()"
        ballot.pending.result()

    @abstractmethod
    def apply(
        self,
        ballot: Ballot,
        state: ParamState,
        *,
        untouched: frozenset[int] = frozenset(),
        keep_update: bool = False,
    ) -> torch.Tensor | None:
        """Step 4: wait for the vote and apply it to every parameter but those whose ``id`` is in
        ``untouched`` (no gradient on any rank: value and momentum kept). Returns a copy of the flat update
        when ``keep_update`` (diagnostics), else ``None``."""

    def update(self, ballot: Ballot) -> torch.Tensor:
        """The decoded update ``u`` of a ballot whose vote is done (flat, the ballot's length), for a rule
        that applies it itself (DiLoCo's outer step applies the dense mean with Nesterov momentum)."""
        assert ballot.pending is not None, "update() before post()"
        return ballot.pending.wait()

    def discard(self, ballot: Ballot) -> None:
        """Wait for a posted vote without applying it (a dropped step: none stays in flight)."""
        if ballot.pending is not None:
            ballot.pending.wait()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(N={self.world_size})"
