"""The step engine of :class:`~lioncub.optim.LionCub`: the optimizer's buckets, and the walk over them.

The engine knows nothing of any wire format: for every bucket it calls the vote's protocol
(:mod:`lioncub.collectives.protocol`) — contribute, post, advance, wait, apply — and times the phases. It
hands the vote the optimizer's state through :class:`OptimizerState` (each parameter's momentum
``exp_avg`` and param group, read at every call, so LR schedules, ``load_state_dict`` and DDP's bucket
rebuild change nothing). :class:`~lioncub.optim.LionCub`'s ``step()`` walks its own :class:`Bucket` s; the
DDP hook of :mod:`lioncub.optim.overlap` walks DDP's buckets during the backward and ``step()`` applies
them. Both give the same bits (every vote is elementwise, with quantizer normalisation per tensor).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lioncub.collectives import Ballot, Comm, Hyper, ParamState, Vote
from lioncub.ops import kernels, native

__all__ = [
    "PHASES",
    "Bucket",
    "Mark",
    "OptimizerState",
    "PhaseClock",
    "StateHolder",
    "StepEngine",
    "StepTimes",
    "make_buckets",
]


#: the phases of :class:`StepTimes`, by field name
PHASES = ("direction", "encode", "exchange", "apply", "sync", "overlapped")


@dataclass
class StepTimes:
    """Wall time of one step's phases, in seconds.

    On a GPU a phase is a pair of CUDA events (:meth:`PhaseClock.book`) until it is read: ``pending`` holds
    ``(phase, start, end)`` and :meth:`settle` turns the finished pairs into seconds. Reading the times
    (:meth:`as_dict`) settles them all, waiting for the last event of each pair (not for the whole device);
    :class:`~lioncub.optim.accounting.Accounting` settles a step's finished pairs at the next step."""

    direction: float = 0.0  # the local contributions (c_i, or the gradient copy of the dense presets)
    encode: float = 0.0  # quantize / pack and posting the collectives
    exchange: float = 0.0  # waiting for the exchanges, incl. the work between phases (count, repack)
    apply: float = 0.0  # decoding and applying the update and the momentum
    sync: float = 0.0  # momentum synchronization (on the steps it is due)
    overlapped: float = 0.0  # overlap: contributions, quantize/pack and between-phase work in the backward
    #: GPU phases not read yet: (phase, start event, end event)
    pending: list[tuple[str, Any, Any]] = field(default_factory=list, repr=False, compare=False)

    def add(self, other: StepTimes) -> None:
        """Add ``other``'s times (its pending event pairs too: they are read when this is settled)."""
        for name in PHASES:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.pending.extend(other.pending)

    def copy(self) -> StepTimes:
        """An independent copy (its own list of pending pairs)."""
        return dataclasses.replace(self, pending=list(self.pending))

    def settle(self, *, wait: bool = True) -> None:
        """Turn pending event pairs into seconds: all of them, waiting for each end event (``wait``), or only
        those whose end event has completed (``wait=False``: never blocks the host)."""
        left = []
        for phase, start, end in self.pending:
            if wait:
                end.synchronize()  # this event only: the work queued before it, not the whole device
            elif not end.query():
                left.append((phase, start, end))
                continue
            setattr(self, phase, getattr(self, phase) + start.elapsed_time(end) / 1000.0)
        self.pending = left

    def as_dict(self) -> dict[str, float]:
        self.settle()
        return {
            "direction_s": self.direction,
            "encode_s": self.encode,
            "exchange_s": self.exchange,
            "apply_s": self.apply,
            "sync_s": self.sync,
            "overlapped_s": self.overlapped,
            "communication_s": self.encode + self.exchange + self.sync,  # quantize/pack + wire + unpack
        }


#: a point in a step (:meth:`PhaseClock.mark`): a host time in seconds, or a recorded CUDA event
Mark = Any


class PhaseClock:
    """The clock of a step's phase times (:class:`StepTimes`).

    On the CPU a mark is ``time.perf_counter()`` and a phase's seconds are booked at once. On a CUDA
    device kernels and the compute stream's waits for NCCL run asynchronously, so the host clock alone
    would time their launches; a mark is instead a CUDA event recorded on the current stream (a few
    microseconds, no synchronization) and a phase is booked as a pair of events, read when the times are
    read (:meth:`StepTimes.settle`): inside a step the host never waits for the device, and applying one
    bucket overlaps communicating the next as it would untimed.

    Calling the clock (``clock()``) is the synchronized reading of a harness that times whole steps (the
    training loop, the benchmarks): on a GPU it waits for the device (``torch.cuda.synchronize``), then
    reads ``perf_counter``. The optimizer's step never calls it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._gpu = device.type == "cuda"

    def __call__(self) -> float:
        if self._gpu:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def mark(self) -> Mark:
        """Now: a host time on the CPU, a CUDA event recorded on the device's current stream on a GPU."""
        if not self._gpu:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(self.device):
            event.record()
        return event

    def book(self, times: StepTimes, phase: str, start: Mark, end: Mark | None = None) -> Mark:
        """Add the span from ``start`` to ``end`` (now, when ``None``) to ``times``'s ``phase``; returns
        ``end`` (the next phase's start)."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not one of {PHASES}")
        end = self.mark() if end is None else end
        if self._gpu:
            times.pending.append((phase, start, end))
        else:
            setattr(times, phase, getattr(times, phase) + (end - start))
        return end


class StateHolder(Protocol):
    """What the engine reads of an optimizer (or of :class:`lioncub.optim.shards.ShardView`, its view on
    shards): the param groups and the per-parameter state."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    @property
    def state(self) -> MutableMapping[torch.Tensor, Any]: ...


class OptimizerState:
    """A vote's view of an optimizer (:class:`lioncub.collectives.ParamState`): each parameter's momentum
    ``state[p]["exp_avg"]`` and param group, read from the optimizer at every call."""

    def __init__(self, optimizer: StateHolder) -> None:
        self._optimizer = optimizer
        self._group_of: dict[int, int] = {}
        self.refresh()

    def refresh(self) -> None:
        """Re-read which param group each parameter belongs to (after ``add_param_group``)."""
        groups = self._optimizer.param_groups
        self._group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}

    def holds(self, p: torch.Tensor) -> bool:
        return id(p) in self._group_of

    def group(self, p: torch.Tensor) -> dict[str, Any]:
        """The param group of ``p`` (``KeyError`` if the optimizer does not hold ``p``)."""
        return self._optimizer.param_groups[self._group_of[id(p)]]

    def group_index(self, p: torch.Tensor) -> int:
        """The index of ``p``'s param group."""
        return self._group_of[id(p)]

    def momentum(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's momentum of ``p`` (created as zeros on first use)."""
        state = self._optimizer.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        momentum: torch.Tensor = state["exp_avg"]
        return momentum

    def hyper(self, p: torch.Tensor) -> Hyper:
        group = self.group(p)
        beta1, beta2 = group["betas"]
        return Hyper(
            float(group["lr"]),
            float(beta1),
            float(beta2),
            float(group["weight_decay"]),
            bool(group["maximize"]),
        )


def bucket_backend(params: Sequence[torch.Tensor]) -> kernels.StepBackend:
    """The backend of a bucket's fused passes, chosen once when the bucket is built: Triton where it takes
    its tensors, the C kernels of :mod:`lioncub.ops.native` where they may (dense contiguous CPU
    float32/float64 tensors, the kernels available; see :func:`lioncub.ops.kernels.step_backend_for`), else
    torch."""
    return kernels.step_backend(*params) if params else kernels.STEP_BACKENDS["torch"]


@dataclass
class Bucket:
    """Parameters of one dtype and device, voted on together from one flat buffer (``key``: its index)."""

    key: Hashable
    params: list[torch.Tensor]
    dtype: torch.dtype
    device: torch.device
    numel: int = 0
    backend: kernels.StepBackend = kernels.STEP_BACKENDS["torch"]
    flat: torch.Tensor | None = field(default=None, repr=False)  # reused buffer of the contributions

    def ballot(self) -> Ballot:
        """This bucket's ballot of one step (its contribution buffer allocated on first use)."""
        if self.flat is None or self.flat.numel() != self.numel:
            self.flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        return Ballot(self.key, self.params, self.backend, self.flat)


def make_buckets(
    param_groups: list[dict[str, Any]],
    bucket_mb: float,
    members: set[int] | None = None,
    weight: Callable[[torch.Tensor], int] | None = None,
) -> list[Bucket]:
    """The parameters that require grad (or whose ``id`` is in ``members``), in ``param_groups`` order, in
    dtype- and device-homogeneous buckets of at most ``bucket_mb`` MiB (a larger parameter gets a bucket of
    its own), each with its backend. ``weight``: the elements a parameter counts for the cap (default: its
    own; on shards the padded shard's, the same on every rank of a replica, which then cut the same
    buckets: :mod:`lioncub.optim.shards`)."""
    cap = int(bucket_mb * 2**20)
    open_buckets: dict[tuple[torch.dtype, torch.device], Bucket] = {}
    filled: dict[Hashable, int] = {}  # bucket key → the elements counted for the cap
    buckets: list[Bucket] = []
    for group in param_groups:
        for p in group["params"]:
            if not (p.requires_grad if members is None else id(p) in members):
                continue
            if p.is_complex():
                raise ValueError("LionCub does not support complex parameters")
            key = (p.dtype, p.device)
            b = open_buckets.get(key)
            size = p.numel() if weight is None else weight(p)
            if b is None or ((filled[b.key] + size) * p.element_size() > cap and b.params):
                b = Bucket(len(buckets), [], p.dtype, p.device)
                open_buckets[key] = b
                buckets.append(b)
                filled[b.key] = 0
            b.params.append(p)
            b.numel += p.numel()
            filled[b.key] += size
    for b in buckets:
        b.backend = bucket_backend(b.params)
    return buckets


class StepEngine:
    """Walks the buckets of one step through ``vote``'s protocol on behalf of ``optimizer``.

    Args:
        vote: the vote on the group the ballots travel on (:func:`lioncub.optim.factory.make_vote`).
        optimizer: whose ``param_groups`` and ``state`` (momenta) are read at every call.
    """

    def __init__(self, vote: Vote, optimizer: StateHolder) -> None:
        self.vote = vote
        self.comm: Comm = vote.comm
        self.state = OptimizerState(optimizer)
        #: the phase clock of the comm's device (:class:`PhaseClock`)
        self.clock = PhaseClock(self.comm.device)
        if any(p.device.type == "cpu" for g in optimizer.param_groups for p in g["params"]):
            native.available()  # builds or loads the fused CPU kernels now, not in the first step

    @torch.no_grad()
    def contribute(
        self,
        bucket: Bucket,
        grads: Sequence[torch.Tensor | None],
        *,
        step: int,
        keep_copy: bool = False,
        state: ParamState | None = None,
    ) -> Ballot:
        """Step 1 for one bucket (``grads``: its parameters' gradients, ``None`` = zeros) of optimizer step
        ``step`` (``state``: whose momenta and hyperparameters, the optimizer's by default)."""
        ballot = bucket.ballot()
        self.vote.contribute(ballot, grads, state or self.state, step=step, keep_copy=keep_copy)
        return ballot

    def post(self, ballot: Ballot, step: int) -> None:
        """Step 2: encode and post the vote for optimizer step ``step``."""
        self.vote.post(ballot, step)

    @torch.no_grad()
    def apply(
        self,
        ballots: Sequence[Ballot],
        times: StepTimes,
        *,
        keep_updates: bool = False,
        untouched: frozenset[int] = frozenset(),
        state: ParamState | None = None,
    ) -> list[torch.Tensor]:
        """Steps 3 and 4 for every ballot: the work between phases of every vote before waiting for the
        first (phase 2 of one bucket overlaps the wait for the next), then each vote's wait and apply. The
        parameters whose ``id`` is in ``untouched`` (no gradient on any rank) keep their value and
        momentum. Returns copies of the flat updates if ``keep_updates`` (diagnostics), else ``[]``."""
        state = state or self.state
        clock = self.clock
        t0 = clock.mark()
        for ballot in ballots:
            self.vote.advance(ballot)
        t0 = clock.book(times, "exchange", t0)
        updates: list[torch.Tensor] = []
        for ballot in ballots:
            self.vote.wait(ballot)
            t0 = clock.book(times, "exchange", t0)
            update = self.vote.apply(ballot, state, untouched=untouched, keep_update=keep_updates)
            if update is not None:
                updates.append(update)
            t0 = clock.book(times, "apply", t0)
        return updates

    def means(self, ballots: Sequence[Ballot], times: StepTimes) -> list[torch.Tensor]:
        """Steps 3 and the wait for every ballot, and the decoded updates (for a rule that applies them
        itself; with a dense variant, the mean of the ranks' contributions, flat)."""
        t0 = self.clock.mark()
        for ballot in ballots:
            self.vote.advance(ballot)
        for ballot in ballots:
            self.vote.wait(ballot)
        self.clock.book(times, "exchange", t0)
        return [self.vote.update(ballot) for ballot in ballots]

    @staticmethod
    def release(buckets: Sequence[Bucket]) -> None:
        """Let go of the buckets' contribution buffers (made again at the next contribution): for a vote
        that runs once per H steps (an outer rule), not a bucket-sized buffer per bucket kept between."""
        for bucket in buckets:
            bucket.flat = None

    def discard(self, ballots: Sequence[Ballot]) -> None:
        """Wait for every posted vote without applying it (a dropped step: none stays in flight)."""
        for ballot in ballots:
            self.vote.discard(ballot)
