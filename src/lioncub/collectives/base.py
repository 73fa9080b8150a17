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

**Devices.** A :class:`Comm` works on one device, the device of the tensors it exchanges (LionCub passes
its parameters' device): its buffers are made there, the backend is the one the group has for that
device type (``"cpu:gloo,cuda:nccl"`` sends CUDA tensors over NCCL; :func:`backend_for_device`; CUDA
tensors on a group whose backend for them is gloo are refused: docs/gpu.md), and the
small object collectives run under that device (``gather_object``, which carries consolidated optimizer
states, stays in CPU memory: on a gloo side group where the group is NCCL only). What differs between
backends is held once, in a :class:`Backend`: on NCCL a wait carries no timeout (``Work.wait(timeout)``
there blocks the host until the work completes; the group's own timeout and its watchdog bound the
collective and abort the rank with the operation named), finished works are not kept (each holds its
output tensors in GPU memory), and point-to-point pairs are posted as one batch (one communicator; single
``isend``/``irecv`` pairs would create a two-rank communicator per pair).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from lioncub import env
from lioncub._validate import is_int

__all__ = [
    "Backend",
    "CollectiveError",
    "Comm",
    "CommCounter",
    "GroupComm",
    "Handle",
    "backend_for_device",
    "exchange_when_alone",
]

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


@dataclass(frozen=True)
class Backend:
    """What lioncub does differently per ``torch.distributed`` backend, chosen once per :class:`Comm`.

    Attributes:
        name: ``"gloo"``, ``"nccl"``, ... (``"none"``: no process group).
        bounded_wait: a wait may carry the :class:`Comm`'s timeout (gloo). On NCCL ``Work.wait(timeout)``
            blocks the host until the work completes; the group's timeout and watchdog bound it instead.
        keep_finished: keep finished works referenced (:meth:`Comm.retire`: gloo only).
        exchange: the default of ``exchange="auto"``: ``"p2p"`` (gloo: pairwise sends reach the link's
            rate, its own all-to-all does not) or ``"native"``.
        batched_p2p: post point-to-point pairs as one ``batch_isend_irecv`` (NCCL: one communicator for
            all pairs, not one per pair).
    """

    name: str
    bounded_wait: bool = True
    keep_finished: bool = False
    exchange: Literal["p2p", "native"] = "native"
    batched_p2p: bool = False

    @classmethod
    def named(cls, name: str) -> Backend:
        """The :class:`Backend` of a backend name (an unknown one: bounded waits, native exchanges)."""
        known = {
            "gloo": cls("gloo", bounded_wait=True, keep_finished=True, exchange="p2p"),
            "nccl": cls("nccl", bounded_wait=False, keep_finished=False, exchange="native", batched_p2p=True),
        }
        return known.get(name, cls(name))


def backend_for_device(config: str, device_type: str) -> str:
    """The backend a process group with backend ``config`` (``torch.distributed.get_backend_config``:
    ``"gloo"``, ``"cpu:gloo,cuda:nccl"``, ...) uses for tensors of ``device_type``; ``ValueError`` when it
    has none (a CUDA parameter on a gloo-only group, say)."""
    backends: dict[str, str] = {}
    for part in config.split(","):
        device, _, name = part.strip().rpartition(":")
        if device:
            backends[device] = name
        elif name:
            return name  # one backend for every device type
    if device_type not in backends:
        raise ValueError(
            f"the process group has no backend for {device_type} tensors (its backends: {config!r}); "
            "init_process_group('nccl') for CUDA tensors, 'gloo' for CPU tensors, or "
            "'cpu:gloo,cuda:nccl' for both"
        )
    return backends[device_type]


#: what a guarded call returns (:meth:`Comm._guard`)
_T = TypeVar("_T")

_ALONE = {"exchange": False}


@contextlib.contextmanager
def exchange_when_alone() -> Iterator[None]:
    """Within this context, a :class:`Comm` built on a group of one process runs every vote's collectives
    (over that group of one) instead of taking the one-process shortcut (``Comm.alone`` is False), and
    :class:`~lioncub.optim.LionCub` votes instead of taking Lion's step: the whole vote path — step check,
    encode, exchange, decode, apply, overlap — runs on one device (``benchmarks/gpu_check.sh``). The
    results equal a vote of one rank (not always Lion's step: a 1-bit vote of an exact zero is ±1)."""
    before = _ALONE["exchange"]
    _ALONE["exchange"] = True
    try:
        yield
    finally:
        _ALONE["exchange"] = before


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
            comm = self.comm
            timeout = comm.timeout if comm is not None and comm.wire.bounded_wait else None
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

    def tensor(self) -> torch.Tensor:
        """:meth:`wait`, for an exchange that has a result tensor (an allreduce's, a gather's)."""
        result = self.wait()
        if result is None:
            raise RuntimeError(f"{self.what}: this exchange has no result tensor")
        return result

    def _error(self, err: BaseException) -> CollectiveError:
        comm = self.comm
        where = f"rank {comm.rank}/{comm.world_size}" if comm is not None else "this rank"
        step = f" at optimizer step {comm.step}" if comm is not None and comm.step else ""
        return CollectiveError(f"{where}: {self.what} failed{step}: {type(err).__name__}: {err}")


# torch >= 2.13 names the flat all-gather ``all_gather_single`` (``all_gather_into_tensor`` warns there).
_ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Comm:
    """This rank's view of a process group, on one device, with byte accounting and bounded waits.

    Args:
        group: the process group (``None``: the default group, which must be initialised).
        device: the device of the tensors it exchanges (LionCub: its parameters'); ``None``: the CPU when
            the group has a CPU backend, else ``cuda:current_device()``.
        exchange: ``"p2p"`` (pairwise isend/irecv), ``"native"`` (library all-to-all / all-gather) or
            ``"auto"`` (p2p on gloo, native elsewhere).
        timeout: bound for every wait on gloo (default: ``$LIONCUB_PG_TIMEOUT`` seconds if set — ``lioncub
            launch --collective-timeout`` sets it — else the group's own timeout); NCCL waits carry none
            (:class:`Backend`).

    Attributes:
        backend: the backend's name for ``device``; ``wire``: its :class:`Backend`.
        alone: one process and nothing to exchange (the votes' shortcut; see :func:`exchange_when_alone`).
        fixed_members: the members stay those of the construction (False for :class:`GroupComm`: nothing
            collective can run before the first quorum).
    """

    fixed_members = True

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        device: torch.device | str | None = None,
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
        #: the group's backends by device type, e.g. ``"cpu:gloo,cuda:nccl"``
        self.backend_config = str(dist.get_backend_config(group))
        self.device = _device_of(device, self.backend_config)
        self.backend = _backend_of(self.backend_config, self.device)
        if self.device.type == "cuda" and self.backend == "gloo":
            raise ValueError(_gloo_for_cuda(self.backend_config, self.device))
        self.wire = Backend.named(self.backend)
        self.alone = self.world_size == 1 and not _ALONE["exchange"]
        self.exchange = self.wire.exchange if exchange == "auto" else exchange
        if timeout is None:
            timeout = env.seconds("LIONCUB_PG_TIMEOUT")
        self.timeout = timeout
        self.counter = CommCounter()
        self.step = 0
        self._tag = 0
        self._retired: collections.deque = collections.deque(maxlen=256)
        #: the gloo group over the same ranks that object gathers use on a group without a CPU backend
        #: (made by the first :meth:`gather_object`)
        self._side_group: dist.ProcessGroup | None = None

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> Comm:
        """A group of one process without ``torch.distributed`` (rank 0 of 1, on ``device``); nothing is
        sent."""
        comm = cls.__new__(cls)
        comm.group = None
        comm.rank, comm.world_size, comm.backend, comm.backend_config = 0, 1, "none", "none"
        comm.device, comm.wire, comm.alone = torch.device(device), Backend("none"), True
        comm.exchange, comm.timeout = "p2p", None
        comm.counter, comm.step, comm._tag = CommCounter(), 0, 0
        comm._retired = collections.deque(maxlen=256)
        comm._side_group = None
        return comm

    # -- helpers -------------------------------------------------------------------------------------

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def retire(self, works: list) -> None:
        """On gloo, keep the finished ``works`` referenced for a while: a gloo work whose last reference its
        worker thread drops is destroyed there, and one destroyed during interpreter shutdown takes the GIL
        and aborts the process ("terminate called without an active exception"); from here the last
        reference goes with this rank's Python objects, under the GIL. Elsewhere (NCCL) nothing is kept: a
        finished work holds its output tensors, which would stay in GPU memory."""
        if self.wire.keep_finished:
            self._retired.extend(works)

    def bind_thread(self) -> None:
        """Make :attr:`device` the calling thread's current CUDA device (the current device is per host
        thread: a thread that launches kernels or NCCL work for this rank calls it first). No-op on CPU."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The object collectives (``all_gather_object``, ...) serialise through tensors on
        ``torch.cuda.current_device()`` under NCCL: inside this context that is :attr:`device`."""
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                yield
        else:
            yield

    def all_gather_object(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order; a failure names the rank and ``what``."""
        out: list[Any] = [None] * self.world_size
        with self.on_device():
            self._guard(what, lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def gather_object(self, obj: Any, to: int, what: str) -> list[Any] | None:
        """Every rank's ``obj`` on group rank ``to`` (``None`` elsewhere); tensors in ``obj`` should be on
        the CPU: the receiving rank unpickles each on the device it was saved from.

        The pickles travel as CPU tensors: on the comm's group when it has a CPU backend (gloo,
        ``"cpu:gloo,cuda:nccl"``), else (NCCL only) on a gloo group over the same ranks, made by the first
        call (collective anyway) and kept — NCCL would stage N times the largest pickle in rank ``to``'s
        GPU memory (a consolidated optimizer state: N ranks' momenta)."""
        dst = self.global_rank(to)
        if self._has_cpu_backend():
            out: list[Any] | None = [None] * self.world_size if self.rank == to else None
            self._guard(what, lambda: dist.gather_object(obj, out, dst=dst, group=self.group))
            return out
        side = self._guard(what, self._gloo_side_group)
        ranks = self._global_ranks()
        order = sorted(ranks)  # the side group's rank order (new_group sorts its ranks)
        got: list[Any] | None = [None] * self.world_size if self.rank == to else None
        self._guard(what, lambda: dist.gather_object(obj, got, dst=dst, group=side))
        if got is None:
            return None
        by_global = dict(zip(order, got, strict=True))
        return [by_global[r] for r in ranks]

    def _has_cpu_backend(self) -> bool:
        try:
            backend_for_device(self.backend_config, "cpu")
        except ValueError:
            return False
        return True

    def _global_ranks(self) -> list[int]:
        """The group's members as global ranks, in group-rank order."""
        return [self.global_rank(r) for r in range(self.world_size)]

    def _gloo_side_group(self) -> dist.ProcessGroup:
        """The gloo group over this comm's ranks (made on first use; every member calls it at the same
        collective: only the members take part, ``use_local_synchronization``)."""
        if self._side_group is None:
            kwargs: dict[str, Any] = {} if self.timeout is None else {"timeout": self.timeout}
            self._side_group = dist.new_group(
                self._global_ranks(), backend="gloo", use_local_synchronization=True, **kwargs
            )
        return self._side_group

    def _next_tag(self) -> int:
        self._tag = (self._tag + 1) % (1 << 20)
        return self._tag

    def _guard(self, what: str, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except Exception as err:
            raise Handle(what=what, comm=self)._error(err) from err

    # -- exchanges -----------------------------------------------------------------------------------

    def all_reduce(
        self, tensor: torch.Tensor, what: str, op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> Handle:
        """In-place async SUM (or ``op``) over the group; counts ring-allreduce bytes."""
        n = self.world_size
        nbytes = tensor.numel() * tensor.element_size()
        self.counter.add(2 * (n - 1) / n * nbytes, 2 * (n - 1) / n * nbytes)
        work = self._guard(what, lambda: self._issue_all_reduce(tensor, op))
        return Handle([work], what, self, tensor)

    def broadcast(self, tensor: torch.Tensor, root: int, what: str) -> Handle:
        """In-place async broadcast from group rank ``root`` (counted as root sending to N−1 ranks)."""
        nbytes = tensor.numel() * tensor.element_size()
        n = self.world_size
        self.counter.add((n - 1) * nbytes if self.rank == root else 0, 0 if self.rank == root else nbytes)
        work = self._guard(what, lambda: self._issue_broadcast(tensor, root))
        return Handle([work], what, self, tensor)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> Handle:
        """``inp`` and ``out`` are ``[N, chunk]``: row j of ``inp`` goes to rank j, row j of ``out``
        comes from rank j (this rank's own row is copied locally)."""
        n, r = self.world_size, self.rank
        chunk = inp[0].numel() * inp.element_size()
        self.counter.add((n - 1) * chunk, (n - 1) * chunk)
        if self.exchange == "native":
            work = self._guard(what, lambda: self._issue_all_to_all(out.view(-1), inp.view(-1)))
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
            work = self._guard(what, lambda: self._issue_all_gather(out, inp))
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
        # Stagger the sends (rank r starts with r+1) so that no receiver is hit by everyone at once.
        order = sorted(sends, key=lambda jt: (jt[0] - self.rank) % self.world_size)
        if self.wire.batched_p2p:  # one batch: NCCL's own communicator, not one per pair
            ops = [dist.P2POp(dist.irecv, t, self.global_rank(j), self.group, tag) for j, t in recvs]
            ops += [
                dist.P2POp(dist.isend, t.contiguous(), self.global_rank(j), self.group, tag) for j, t in order
            ]
            return list(dist.batch_isend_irecv(ops)) if ops else []
        works = [self._issue_recv(t, j, tag) for j, t in recvs]
        works += [self._issue_send(t.contiguous(), j, tag) for j, t in order]
        return works

    # -- how each operation is issued: the raw async work, neither counted nor guarded (the exchanges above
    # -- are the API); :class:`~lioncub.collectives.group.GroupComm` issues them as the group's own methods

    def _issue_all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp | dist.ReduceOp.RedOpType) -> Any:
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=True)

    def _issue_broadcast(self, tensor: torch.Tensor, root: int) -> Any:
        return dist.broadcast(tensor, src=self.global_rank(root), group=self.group, async_op=True)

    def _issue_all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        return dist.all_to_all_single(out, inp, group=self.group, async_op=True)

    def _issue_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        return _ALL_GATHER_FLAT(out.view(-1), inp.reshape(-1), group=self.group, async_op=True)

    def _issue_recv(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        return dist.irecv(tensor, src=self.global_rank(peer), group=self.group, tag=tag)

    def _issue_send(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        return dist.isend(tensor, dst=self.global_rank(peer), group=self.group, tag=tag)


def _backend_of(config: str, device: torch.device) -> str:
    """:func:`backend_for_device`, naming the cause of CPU tensors on a group whose backends are for CUDA
    tensors only (NCCL): the parameters were not on their GPU yet when the optimizer was built."""
    try:
        return backend_for_device(config, device.type)
    except ValueError as err:
        if device.type != "cpu":
            raise
        try:
            cuda = backend_for_device(config, "cuda")
        except ValueError:
            raise err from None
        raise ValueError(
            f"LionCub was built with parameters on cpu but the process group has no backend for cpu "
            f"tensors: its backend is {cuda}, for CUDA tensors only (its backends: {config!r}). Move the "
            "model to its GPU before building LionCub (model.to(accelerator.device) with accelerate, "
            "model.cuda() or model.to(f'cuda:{local_rank}') otherwise), or init the process group with "
            "gloo ('gloo', or 'cpu:gloo,cuda:nccl' for both CPU and CUDA tensors)"
        ) from err


def _gloo_for_cuda(config: str, device: torch.device) -> str:
    """Why a :class:`Comm` of CUDA tensors on a group whose backend for them is gloo is refused: the votes
    of GPU parameters go over NCCL, on the GPU (docs/gpu.md). Gloo would be handed the tensors' device
    pointers by its point-to-point sends (lioncub's exchanges on gloo), and its collectives stage every
    tensor through host memory with a host wait per collective."""
    return (
        f"the process group's backend for {device} tensors is gloo (its backends: {config!r}): LionCub's "
        "votes of GPU parameters go over NCCL, on the GPU; nothing is staged on the host (docs/gpu.md). "
        "init_process_group('nccl') or init_process_group('cpu:gloo,cuda:nccl') (a DeviceMesh: without a "
        "backend_override of gloo for the vote's dimension), or keep the model on the CPU for a gloo group"
    )


def _device_of(device: torch.device | str | None, config: str) -> torch.device:
    """The :class:`Comm`'s device: ``device`` (a CUDA device without an index: the current one), or by
    default the CPU when the group has a CPU backend, else ``cuda:current_device()``."""
    if device is None:
        try:
            device = backend_for_device(config, "cpu") and "cpu"
        except ValueError:
            device = "cuda"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class GroupComm(Comm):
    """A :class:`Comm` on a process-group object that ``torch.distributed`` does not know and whose members
    change: torchft's reconfigurable groups between replica groups (:mod:`lioncub.integrations.torchft`).

    ``torch.distributed``'s functions look a group up in their registry (its ranks, its backend); a group
    that a fault-tolerance library reconfigures at every quorum is not there. This comm issues every
    operation as the group's own method (c10d's ``ProcessGroup`` interface: ``allreduce``, ``broadcast``,
    ``alltoall_base``, ``allgather``, ``send``/``recv``), with group ranks, and takes its rank and size
    from the caller: :meth:`reconfigure` sets them again whenever the members change. The object
    collectives travel as pickled bytes. It never takes the one-process shortcut (``alone`` is False): a
    quorum of one still runs the vote over its group of one, so a step is the same code whatever N is.
    ``fixed_members`` is False: an optimizer built on it runs nothing collective at construction.

    Args:
        group: the process group object.
        rank, world_size: this member's rank in it and its size now.
        device: the device of the tensors it exchanges (CPU: gloo).
        backend: the backend's name (``"gloo"``), for :class:`Backend`.
        exchange, timeout: as :class:`Comm`'s.
    """

    #: torchft's process group object (c10d's ``ProcessGroup`` interface), not one torch.distributed knows
    group: dist.ProcessGroup

    def __init__(
        self,
        group: Any,
        *,
        rank: int,
        world_size: int,
        device: torch.device | str = "cpu",
        backend: str = "gloo",
        exchange: Exchange = "auto",
        timeout: datetime.timedelta | None = None,
    ) -> None:
        if exchange not in ("auto", "p2p", "native"):
            raise ValueError(f"exchange={exchange!r} is not one of 'auto', 'p2p', 'native'")
        self.group = group
        self.backend, self.backend_config = backend, backend
        self.device = torch.device(device)
        self.wire = Backend.named(backend)
        self.exchange = self.wire.exchange if exchange == "auto" else exchange
        self.timeout = env.seconds("LIONCUB_PG_TIMEOUT") if timeout is None else timeout
        self.counter, self.step, self._tag = CommCounter(), 0, 0
        self._retired = collections.deque(maxlen=256)
        self.alone = False
        self.fixed_members = False
        self.rank, self.world_size = 0, 1
        self.reconfigure(rank, world_size)

    def reconfigure(self, rank: int, world_size: int) -> None:
        """A new round of the group (at every quorum, whether its members changed or not): this member is
        now ``rank`` of ``world_size``, and the point-to-point tags start again at 0 on every member (a
        member whose last exchange failed half-way would otherwise count them from elsewhere)."""
        if not (is_int(world_size, 1) and is_int(rank, 0) and rank < world_size):
            raise ValueError(f"rank={rank!r}, world_size={world_size!r}: need 0 <= rank < world_size")
        self.rank, self.world_size, self._tag = rank, world_size, 0

    def global_rank(self, group_rank: int) -> int:
        return group_rank

    def all_gather_object(self, obj: Any, what: str) -> list[Any]:
        """Every member's ``obj`` (picklable), in rank order: the sizes, then the padded pickles."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        sizes = torch.zeros(self.world_size, 1, dtype=torch.int64, device=self.device)
        mine = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        self.all_gather(sizes, mine, what).wait()
        padded = torch.zeros(int(sizes.max()), dtype=torch.uint8, device=self.device)
        padded[: payload.numel()] = payload
        out = torch.empty(self.world_size, padded.numel(), dtype=torch.uint8, device=self.device)
        self.all_gather(out, padded, what).wait()
        rows = out.cpu()
        return [pickle.loads(rows[j, : int(sizes[j, 0])].numpy().tobytes()) for j in range(self.world_size)]

    def gather_object(self, obj: Any, to: int, what: str) -> list[Any] | None:
        every = self.all_gather_object(obj, what)
        return every if self.rank == to else None

    def _issue_all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp | dist.ReduceOp.RedOpType) -> Any:
        opts = dist.AllreduceOptions()
        # ReduceOp.SUM is a RedOpType member; the option takes a ReduceOp
        opts.reduceOp = dist.ReduceOp(op) if isinstance(op, dist.ReduceOp.RedOpType) else op
        return self.group.allreduce([tensor], opts)

    def _issue_broadcast(self, tensor: torch.Tensor, root: int) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        return self.group.broadcast([tensor], opts)

    def _issue_all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        return self.group.alltoall_base(out, inp, [], [], dist.AllToAllOptions())

    def _issue_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        rows = list(out.view(self.world_size, -1).unbind(0))
        return self.group.allgather([rows], [inp.reshape(-1)], AllgatherOptions())

    def _issue_recv(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        return self.group.recv([tensor], peer, tag)

    def _issue_send(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        return self.group.send([tensor], peer, tag)
