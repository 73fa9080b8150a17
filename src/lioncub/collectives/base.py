"""What every vote algorithm shares: this rank's view of a process group, byte accounting, exchanges.

:class:`Comm` wraps a ``torch.distributed`` process group. Its exchanges return handles whose
``wait()`` raises :class:`CollectiveError` naming the rank, the operation and the optimizer step, and
never waits longer than the group's timeout. Bytes are counted from the tensors handed to each exchange:

* all-to-all and all-gather (as pairwise sends): ``(N − 1) · chunk`` bytes sent and received;
* allreduce: ``2 · (N − 1) / N · size`` sent and received (ring algorithm, nccl-tests convention;
  gloo's and NCCL's large-message algorithms move exactly this);
* point-to-point: the bytes of the tensor.

On gloo, all-to-all and all-gather run as pairwise ``isend``/``irecv`` by default
(``exchange="p2p"``): gloo's own ``all_to_all_single`` and ``all_gather`` serialise the two directions
of a pair and reach only 46–94 % of a link (``benchmarks/bench_exchange.py``). ``exchange="native"``
uses the library collectives (the default on NCCL).
"""

from __future__ import annotations

import collections
import datetime
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

__all__ = ["CollectiveError", "Comm", "CommCounter", "Handle"]

Exchange = Literal["auto", "p2p", "native"]


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the rank, the operation and the step."""


@dataclass
class CommCounter:
    """Bytes this rank handed to the network and received, and the number of collectives issued."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    collectives: int = 0

    def add(self, sent: float, recv: float, collectives: int = 1) -> None:
        self.bytes_sent += round(sent)
        self.bytes_recv += round(recv)
        self.collectives += collectives

    def snapshot(self) -> CommCounter:
        return CommCounter(self.bytes_sent, self.bytes_recv, self.collectives)

    def minus(self, earlier: CommCounter) -> CommCounter:
        return CommCounter(
            self.bytes_sent - earlier.bytes_sent,
            self.bytes_recv - earlier.bytes_recv,
            self.collectives - earlier.collectives,
        )


@dataclass
class Handle:
    """Pending work of one exchange; ``wait()`` finishes it (idempotent) and returns ``result``."""

    works: list = field(default_factory=list)
    what: str = ""
    comm: Comm | None = None
    result: torch.Tensor | None = None
    done: bool = False

    def wait(self) -> torch.Tensor | None:
        if not self.done:
            timeout = self.comm.timeout if self.comm is not None else None
            for work in self.works:
                try:
                    ok = work.wait(timeout) if timeout is not None else work.wait()
                except Exception as err:
                    raise self._error(err) from err
                if ok is False:
                    raise self._error(TimeoutError(f"no answer within {timeout}"))
            self.done = True
            if self.comm is not None:
                self.comm.retire(self.works)
        return self.result

    def _error(self, err: BaseException) -> CollectiveError:
        comm = self.comm
        where = f"rank {comm.rank}/{comm.world_size}" if comm is not None else "this rank"
        step = f" at optimizer step {comm.step}" if comm is not None and comm.step else ""
        return CollectiveError(f"{where}: {self.what} failed{step}: {type(err).__name__}: {err}")


# torch >= 2.13 names the flat all-gather ``all_gather_single`` (``all_gather_into_tensor`` warns there).
_ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Comm:
    """This rank's view of a process group, with byte accounting and bounded waits.

    Args:
        group: the process group (``None``: the default group, which must be initialised).
        exchange: ``"p2p"`` (pairwise isend/irecv), ``"native"`` (library all-to-all / all-gather) or
            ``"auto"`` (p2p on gloo, native elsewhere).
        timeout: bound for every wait (default: ``$LIONCUB_PG_TIMEOUT`` seconds if set — ``lioncub launch
            --collective-timeout`` sets it — else the group's own timeout).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        exchange: Exchange = "auto",
        timeout: datetime.timedelta | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group() first "
                "(or launch with `lioncub launch` / torchrun)"
            )
        if exchange not in ("auto", "p2p", "native"):
            raise ValueError(f"exchange={exchange!r} is not one of 'auto', 'p2p', 'native'")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else (torch.device("cpu"))
        )
        self.exchange = ("p2p" if self.backend == "gloo" else "native") if exchange == "auto" else exchange
        if timeout is None and os.environ.get("LIONCUB_PG_TIMEOUT"):
            timeout = datetime.timedelta(seconds=float(os.environ["LIONCUB_PG_TIMEOUT"]))
        self.timeout = timeout
        self.counter = CommCounter()
        self.step = 0
        self._tag = 0
        self._retired: collections.deque = collections.deque(maxlen=256)

    @classmethod
    def single(cls) -> Comm:
        """A group of one process without ``torch.distributed`` (rank 0 of 1, CPU); nothing is sent."""
        comm = cls.__new__(cls)
        comm.group = None
        comm.rank, comm.world_size, comm.backend = 0, 1, "none"
        comm.device = torch.device("cpu")
        comm.exchange, comm.timeout = "p2p", None
        comm.counter, comm.step, comm._tag = CommCounter(), 0, 0
        comm._retired = collections.deque(maxlen=256)
        return comm

    # -- helpers -------------------------------------------------------------------------------------

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def retire(self, works: list) -> None:
        """Keep the finished ``works`` referenced for a while: a gloo work whose last reference its worker
        thread drops is destroyed there, and one destroyed during interpreter shutdown takes the GIL and
        aborts the process ("terminate called without an active exception"); from here the last reference
        goes with this rank's Python objects, under the GIL."""
        self._retired.extend(works)

    def _next_tag(self) -> int:
        self._tag = (self._tag + 1) % (1 << 20)
        return self._tag

    def _guard(self, what: str, fn: Callable[[], object]) -> object:
        try:
            return fn()
        except Exception as err:
            raise Handle(what=what, comm=self)._error(err) from err

    # -- exchanges -----------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, what: str, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Handle:
        """In-place async SUM (or ``op``) over the group; counts ring-allreduce bytes."""
        n = self.world_size
        nbytes = tensor.numel() * tensor.element_size()
        self.counter.add(2 * (n - 1) / n * nbytes, 2 * (n - 1) / n * nbytes)
        work = self._guard(what, lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True))
        return Handle([work], what, self, tensor)

    def broadcast(self, tensor: torch.Tensor, root: int, what: str) -> Handle:
        """In-place async broadcast from group rank ``root`` (counted as root sending to N−1 ranks)."""
        nbytes = tensor.numel() * tensor.element_size()
        n = self.world_size
        self.counter.add((n - 1) * nbytes if self.rank == root else 0, 0 if self.rank == root else nbytes)
        work = self._guard(
            what,
            lambda: dist.broadcast(tensor, src=self.global_rank(root), group=self.group, async_op=True),
        )
        return Handle([work], what, self, tensor)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> Handle:
        """``inp`` and ``out`` are ``[N, chunk]``: row j of ``inp`` goes to rank j, row j of ``out``
        comes from rank j (this rank's own row is copied locally)."""
        n, r = self.world_size, self.rank
        chunk = inp[0].numel() * inp.element_size()
        self.counter.add((n - 1) * chunk, (n - 1) * chunk)
        if self.exchange == "native":
            work = self._guard(
                what,
                lambda: dist.all_to_all_single(out.view(-1), inp.view(-1), group=self.group, async_op=True),
            )
            return Handle([work], what, self, out)
        tag = self._next_tag()
        out[r].copy_(inp[r])
        works = self._guard(
            what,
            lambda: self._pairwise(
                [(j, inp[j]) for j in range(n) if j != r], [(j, out[j]) for j in range(n) if j != r], tag
            ),
        )
        return Handle(works, what, self, out)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> Handle:
        """``out`` is ``[N, *inp.shape]``; row j receives rank j's ``inp``."""
        n, r = self.world_size, self.rank
        chunk = inp.numel() * inp.element_size()
        self.counter.add((n - 1) * chunk, (n - 1) * chunk)
        if self.exchange == "native":
            work = self._guard(
                what,
                lambda: _ALL_GATHER_FLAT(out.view(-1), inp.reshape(-1), group=self.group, async_op=True),
            )
            return Handle([work], what, self, out)
        tag = self._next_tag()
        out[r].copy_(inp)
        works = self._guard(
            what,
            lambda: self._pairwise(
                [(j, inp) for j in range(n) if j != r], [(j, out[j]) for j in range(n) if j != r], tag
            ),
        )
        return Handle(works, what, self, out)

    def exchange_p2p(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        what: str,
    ) -> Handle:
        """Post point-to-point sends and receives (peer group ranks) and return one handle for all."""
        self.counter.add(
            sum(t.numel() * t.element_size() for _, t in sends),
            sum(t.numel() * t.element_size() for _, t in recvs),
        )
        tag = self._next_tag()
        return Handle(self._guard(what, lambda: self._pairwise(sends, recvs, tag)), what, self)

    def _pairwise(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]], tag: int
    ) -> list:
        works = [dist.irecv(t, src=self.global_rank(j), group=self.group, tag=tag) for j, t in recvs]
        # Stagger the sends (rank r starts with r+1) so that no receiver is hit by everyone at once.
        order = sorted(sends, key=lambda jt: (jt[0] - self.rank) % self.world_size)
        works += [
            dist.isend(t.contiguous(), dst=self.global_rank(j), group=self.group, tag=tag) for j, t in order
        ]
        return works
