"""Overlap :class:`~lioncub.optim.LionCub`'s vote with the backward pass: a DDP communication hook.

DDP + plain Lion overlaps its gradient allreduce with the backward pass; a Lion Cub step that starts
communicating only after backward gives that advantage away. With the hook, each DDP gradient bucket's
vote starts as soon as backward has produced the bucket::

    model = DistributedDataParallel(model)
    opt = LionCub(model.parameters(), lr=3e-4, variant="1bit", model=model.module)
    opt.overlap_with(model)          # instead of lioncub.optim.ddp.skip_gradient_allreduce(model)
    for batch in batches:
        loss_fn(model(batch)).backward()   # the votes start bucket by bucket
        opt.step()                         # waits for them, applies lr and weight decay
        opt.zero_grad()

What changes against the step of :mod:`lioncub.optim.lioncub` (whose module docstring describes it),
per bucket, in DDP's bucket order (the same on every rank):

1. **The hook** (the backward's thread) makes this rank's contribution of the bucket's parameters (step 2
   of the step) into a flat buffer, queues it for the vote thread, and returns the bucket's gradient
   untouched: DDP's future completes at once and ``p.grad`` stays this rank's own gradient, which the
   apply needs for the momentum. The momenta are keyed by parameter in the optimizer's state, so DDP's
   bucket rebuild after the first iteration changes nothing.
2. **The vote thread** (whose current CUDA device, a per-thread setting, it sets to the parameters' device
   before anything else: :meth:`~lioncub.collectives.Comm.bind_thread`), on the stream the hook ran on (the
   backward's, a user's side stream included, where the contribution was written), posts the bucket's
   vote (:meth:`~lioncub.collectives.Vote.post`), then finishes
   the first phase of the previous bucket's vote and posts its second phase (``advance``). The schedule
   ``post(0), post(1), advance(0), post(2), advance(1), …`` is fixed, so every rank posts the same
   collectives in the same order, on a process group of their own (a duplicate of the optimizer's, made
   at registration): collectives of the main thread on the optimizer's group — DDP's buffer broadcast, a
   logged loss allreduce — cannot interleave with them.
3. **step()** waits until the vote thread is idle, runs the step check (which also carries whether the
   gradients changed since the backward), waits for every vote and applies it with each group's current
   lr and weight decay; then momentum sync, replica check and diagnostics as without overlap.

**Bitwise parity.** Every vote is elementwise, with quantizer normalisation per parameter tensor, and
:class:`~lioncub.collectives.DenseMean` sums in rank order, so DDP's bucketing gives the same update as
the step's own buckets: the parameters, momenta and diagnostics are bit for bit those of the step without
overlap (tested for every preset at 2 and 3 ranks). A stochastic quantizer (``quantizer="qsgd"``) draws
its random numbers in bucket order: same distribution, not the same bits.

**Non-finite gradients.** Without overlap nothing non-finite is quantized or sent. With overlap the votes
have started before the last bucket exists, so a step with NaN/Inf on any rank is still voted on (the
quantizers give defined, in-range results for NaN/Inf) but its result is dropped on every rank:
parameters and momenta untouched (``"skip"``), or :class:`~lioncub.optim.step_check.NonFiniteGradientError`
on every rank after the votes have finished (``"raise"``).

**Rules.** One synchronised backward per step: accumulate gradients inside ``model.no_sync()`` (the hook
does not run there). A synchronised backward that no ``step()`` follows (a skipped step) is dropped when
the next one starts: its votes are waited for and discarded (every rank must skip alike, as with any
collective). A ``step()`` without a backward since the last one (no hook ran) is the plain step.
``.grad`` must stay as the backward left it: the votes already used it, so gradient clipping, a
``GradScaler`` or an edit of ``.grad`` between backward and ``step()`` raises
:class:`~lioncub.optim.step_check.GradientChangedError` on every rank (the version counters of the gradients
are compared, no pass over the data); use the plain step for those. Errors of the vote thread (a failed
or timed-out collective, naming the rank and the operation) are raised by the next ``step()``.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lioncub.collectives import Ballot, Comm
from lioncub.optim.engine import Bucket, StepEngine, StepTimes, bucket_backend

__all__ = ["OverlapHook", "overlap_group"]

_log = logging.getLogger("lioncub")


def backward_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The calling thread's current CUDA stream on ``device`` (in the hook: the backward's, which autograd
    makes current for the ops that produced the gradients), or ``None`` off a GPU."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
    """Make ``stream`` current in this thread (``torch.cuda.stream``); nothing for ``None``."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class OverlapHook:
    """The communication hook and vote thread of :meth:`LionCub.overlap_with` (see the module docstring).

    Args:
        model: the DDP model whose trainable parameters are exactly the optimizer's.
        engine: the optimizer's :class:`~lioncub.optim.engine.StepEngine` on the group the votes travel
            on (a group of their own, with the optimizer's ranks in its order).
        next_step: the optimizer step the coming backward is for.
        diagnostics_every: the optimizer's (the hook keeps a copy of the contributions on those steps).
        names: the optimizer's parameters (``id`` → name), in its order.
    """

    def __init__(
        self,
        model: DistributedDataParallel,
        engine: StepEngine,
        *,
        next_step: Callable[[], int],
        diagnostics_every: int,
        names: dict[int, str],
    ) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                f"overlap_with(model): expected a DistributedDataParallel model, got {type(model).__name__}"
            )
        _check_same_parameters(model, names)
        self.engine = engine
        #: the votes' own view of the group (bytes counted here, added to the step's in comm_stats)
        self.comm = engine.comm
        self._next_step = next_step
        self._diagnostics_every = diagnostics_every
        self._names = names
        self._inflight: list[Ballot] = []
        self._step = 0  # the optimizer step the buckets in flight are for
        self._generation = 0  # one per synchronised backward: the vote thread pairs phases within one
        self._grad_versions: dict[int, tuple[int, int] | None] = {}  # id(p) -> (id(grad), grad._version)
        self._buckets: dict[int, Bucket] = {}  # DDP's bucket index -> its bucket (rebuilt with DDP's)
        self._times = StepTimes()  # the hook's and the vote thread's work since the last step
        self._mark = self.comm.counter.snapshot()
        self._error: BaseException | None = None
        self._closed = False
        self._inflight_at_collect: list[Ballot] = []
        self.bucket_numels: list[int] = []
        self._queue: queue.Queue[tuple[Ballot, int, int, torch.cuda.Stream | None] | None] = queue.Queue()
        self._thread = threading.Thread(
            target=self._vote_thread, name=f"lioncub-overlap-rank{self.comm.rank}", daemon=True
        )
        self._thread.start()
        model.register_comm_hook(None, self._hook)

    # -- the hook (backward's thread) ----------------------------------------------------------------

    def _hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self._closed:
            raise RuntimeError("LionCub overlap: the hook was closed; this DDP model cannot train further")
        if self._error is None:  # after a failure nothing more is posted; step() raises the error
            self._start_bucket(bucket)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())  # the local gradient, untouched
        return fut

    @torch.no_grad()
    def _start_bucket(self, bucket: dist.GradBucket) -> None:
        rank, step, index = self.comm.rank, self._next_step(), bucket.index()
        if self._step != step or any(b.key == index for b in self._inflight) or not self._inflight:
            if self._inflight:  # a backward that no step() followed: its votes are dropped
                self._drop_inflight(step)
            self._step = step
            self._generation += 1
            self._grad_versions = {}
            engine = torch.autograd.Variable._execution_engine
            # a callback queued by a callback runs after DDP's own end-of-backward callback (which
            # writes the buckets back into .grad): the versions step() compares against
            engine.queue_callback(lambda: engine.queue_callback(self._record_grad_versions))
        t0 = time.perf_counter()
        params, grads, flat = bucket.parameters(), bucket.gradients(), bucket.buffer()
        unknown = [p for p in params if not self.engine.state.holds(p)]
        if unknown:
            raise ValueError(
                f"rank {rank}: LionCub overlap: DDP bucket {index} holds a parameter "
                f"{tuple(unknown[0].shape)} that the optimizer does not optimize"
            )
        diagnose = bool(self._diagnostics_every) and step % self._diagnostics_every == 0
        item = self.engine.contribute(self._bucket(index, params, flat), grads, step=step, keep_copy=diagnose)
        self._times.direction += time.perf_counter() - t0
        self._inflight.append(item)
        self._queue.put((item, step, self._generation, backward_stream(self.comm.device)))

    def _bucket(self, index: int, params: list[torch.Tensor], flat: torch.Tensor) -> Bucket:
        """The :class:`~lioncub.optim.engine.Bucket` of DDP's bucket ``index`` (its backend chosen once,
        when DDP's bucket is first seen or rebuilt)."""
        bucket = self._buckets.get(index)
        if (
            bucket is None
            or [id(p) for p in bucket.params] != [id(p) for p in params]
            or bucket.numel != flat.numel()
            or bucket.dtype != flat.dtype
        ):
            bucket = Bucket(
                index, list(params), flat.dtype, flat.device, flat.numel(), bucket_backend(params)
            )
            self._buckets[index] = bucket
        return bucket

    def _drop_inflight(self, step: int) -> None:
        """Wait for the votes of a backward that no ``step()`` followed and discard them."""
        self._queue.join()
        if self._error is None:
            self.engine.discard(self._inflight)
        _log.warning(
            "rank %d: LionCub overlap: a synchronised backward was not followed by step() (optimizer step "
            "%d); its votes were discarded",
            self.comm.rank,
            step,
        )
        self._inflight = []

    def _record_grad_versions(self) -> None:
        self._grad_versions = {
            id(p): None if p.grad is None else (id(p.grad), p.grad._version)
            for b in self._inflight
            for p in b.params
        }

    def changed_gradients(self) -> list[str]:
        """Names of the parameters whose ``.grad`` was replaced or modified in place since the end of the
        last backward (whose gradients the votes in flight used)."""
        changed = []
        for b in self._inflight_at_collect:
            for p in b.params:
                now = None if p.grad is None else (id(p.grad), p.grad._version)
                if self._grad_versions.get(id(p), now) != now:
                    changed.append(self._names.get(id(p), str(tuple(p.shape))))
        return changed

    # -- the vote thread -----------------------------------------------------------------------------

    # The hook's and the vote thread's times (``overlapped_s``) are host times, never synchronized with
    # the device: a synchronize there would stall the backward it overlaps.

    def _vote_thread(self) -> None:
        previous: tuple[Ballot, int, int, torch.cuda.Stream | None] | None = None
        try:  # the current CUDA device is per host thread: the kernels and NCCL work run on the rank's GPU
            self.comm.bind_thread()
        except BaseException as err:  # raised by the next step()
            self._error = err
        while True:
            entry = self._queue.get()
            try:
                if entry is None:
                    return
                if self._error is not None:
                    continue
                t0 = time.perf_counter()
                item, step, generation, stream = entry
                # the backward's stream, where the hook wrote the contribution (a user's side stream
                # included): this thread's work is ordered after it, and step() on that stream after this
                with on_stream(stream):
                    self.engine.post(item, step)
                    if previous is not None and previous[2] == generation and previous[0].pending is not None:
                        self.engine.vote.advance(previous[0])  # waits for its first phase, posts its second
                self._times.overlapped += time.perf_counter() - t0
                previous = entry
            except BaseException as err:  # raised by the next step()
                self._error = err
            finally:
                self._queue.task_done()

    # -- what step() calls -----------------------------------------------------------------------------

    def collect(self, step: int, times: StepTimes) -> list[Ballot] | None:
        """The posted votes of ``step`` (``None`` if no backward ran since the last step: the plain step),
        once the vote thread is idle; adds the hook's times to ``times`` (the wait for the vote thread to
        ``exchange``: it is communication the backward did not hide). Raises the vote thread's error."""
        t0 = self.engine.clock.mark()
        self._queue.join()
        self.engine.clock.book(times, "exchange", t0)
        if self._error is not None:
            err, self._error = self._error, None
            self._inflight = []
            raise err
        inflight, self._inflight = self._inflight, []
        self._inflight_at_collect = inflight
        if not inflight:
            return None
        #: DDP's buckets (elements each, in order) of the last overlapped step
        self.bucket_numels = [b.local.numel() for b in inflight]
        if self._step != step:
            raise RuntimeError(
                f"rank {self.comm.rank}: LionCub overlap: votes for step {self._step} reached step {step}"
            )
        covered = {id(p) for b in inflight for p in b.params}
        missing = [name for i, name in self._names.items() if i not in covered]
        if missing:
            raise RuntimeError(
                f"rank {self.comm.rank}: LionCub overlap: DDP's buckets of step {step} did not hold "
                f"{missing[:5]} (the model's parameters must be the optimizer's)"
            )
        # quantize/pack and the between-phase work ran during the backward: reported apart (overlapped_s)
        times.overlapped += self._times.direction + self._times.overlapped
        self._times = StepTimes()
        return inflight

    def take_traffic(self) -> tuple[float, float, int]:
        """(bytes sent, bytes received, collectives) posted on the votes' group since the last call."""
        delta = self.comm.counter.minus(self._mark)
        self._mark = self.comm.counter.snapshot()
        return delta.bytes_sent, delta.bytes_recv, delta.collectives

    def close(self) -> None:
        """Stop the vote thread (after the last step; the DDP model cannot be trained further with it)."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()


def overlap_group(model: object, comm: Comm, process_group: dist.ProcessGroup | None) -> Comm:
    """The group the overlapped votes travel on: ``process_group``, or a new duplicate of ``comm``'s
    (collective), checked to hold the optimizer's ranks in its order and to match ``model``, a
    :class:`~torch.nn.parallel.DistributedDataParallel` of the optimizer's data-parallel group."""
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"overlap_with(model): expected a DistributedDataParallel model, got {type(model).__name__}"
        )
    if dist.get_world_size(model.process_group) != comm.world_size:
        raise ValueError(
            f"overlap_with: the DDP model's process group has {dist.get_world_size(model.process_group)} "
            f"ranks, the optimizer's {comm.world_size}; they must be the same data-parallel group"
        )
    if process_group is None:
        ranks = dist.get_process_group_ranks(comm.group or dist.group.WORLD)
        process_group = dist.new_group(ranks=ranks, backend=comm.backend_config)
    votes = Comm(process_group, device=comm.device, exchange=comm.exchange)
    if votes.world_size != comm.world_size or votes.rank != comm.rank:
        raise ValueError("overlap_with: process_group must have the optimizer's ranks, in its order")
    return votes


def _check_same_parameters(model: DistributedDataParallel, names: dict[int, str]) -> None:
    """The DDP model's trainable parameters must be exactly the optimizer's (the hook votes on DDP's
    buckets; a parameter in only one of them would never be updated, or updated from nothing)."""
    ddp = {id(p): n for n, p in model.module.named_parameters() if p.requires_grad}
    extra = [n for i, n in ddp.items() if i not in names]
    missing = [n for i, n in names.items() if i not in ddp]
    if extra or missing:
        raise ValueError(
            "overlap_with: the DDP model's trainable parameters must be exactly the optimizer's: "
            f"not optimized: {extra[:5]}; not in the model: {missing[:5]}"
        )
