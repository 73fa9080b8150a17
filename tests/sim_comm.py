"""N ranks of the vote algorithms simulated in one process (used by tests/test_fuzz.py and
tests/test_halfway.py).

:class:`SimComm` stands in for :class:`~lioncub.collectives.Comm` (the algorithms only call its exchanges)
and executes each collective once every rank has posted it, with the wire arithmetic of gloo/NCCL: an
integer SUM wraps around modulo 2^bits, so a lane or int8 overflow shows up as a wrong vote.
tests/test_fuzz.py checks it against real gloo ranks. :func:`run_vote` runs one vote on all ranks.
:func:`fake_comm` is less: what the vote classes read in ``__init__`` and ``wire_bytes``, for N workers
without any communication.
"""

from __future__ import annotations

import types
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch


def fake_comm(n: int, rank: int = 0) -> types.SimpleNamespace:
    """Enough of a Comm for the vote classes' constructors and wire-byte formulas (no communication)."""
    return types.SimpleNamespace(world_size=n, rank=rank, device=torch.device("cpu"), alone=n == 1)


class _SimHandle:
    """A posted collective: :meth:`wait` runs it (once) and returns its result."""

    def __init__(self, run: Callable[[], None], result: torch.Tensor | None = None) -> None:
        self._run, self.result, self.done = run, result, False

    def wait(self) -> torch.Tensor | None:
        if not self.done:
            self._run()
            self.done = True
        return self.result

    def tensor(self) -> torch.Tensor:
        """``Handle.tensor``: the result of an exchange that has one."""
        result = self.wait()
        assert result is not None, "this collective has no result tensor"
        return result


def _wire_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The allreduce SUM as the wire computes it: integers wrap modulo 2^bits, floats add in their dtype."""
    dtype = tensors[0].dtype
    if dtype.is_floating_point:
        total = tensors[0].clone()
        for t in tensors[1:]:
            total += t
        return total
    info = torch.iinfo(dtype)
    span = info.max - info.min + 1
    exact = sum(t.to(torch.int64) for t in tensors)
    return (torch.remainder(exact - info.min, span) + info.min).to(dtype)


class SimWorld:
    """N ranks in one process: the k-th collective of every rank runs once all N have posted it;
    point-to-point sends are buffered, receives take them in order."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.posted: dict[int, dict[int, tuple[str, tuple]]] = defaultdict(dict)
        self.done: set[int] = set()
        self.mail: dict[tuple[int, int], deque[torch.Tensor]] = defaultdict(deque)

    def run(self, seq: int) -> None:
        if seq in self.done:
            return
        ops = self.posted[seq]
        assert len(ops) == self.n, f"collective #{seq} waited on before every rank posted it ({sorted(ops)})"
        kinds = {kind for kind, _ in ops.values()}
        assert len(kinds) == 1, f"ranks posted different collectives as #{seq}: {kinds}"
        kind = kinds.pop()
        args = [ops[r][1] for r in range(self.n)]
        if kind == "all_reduce":
            total = _wire_sum([t for (t,) in args])
            for (t,) in args:
                t.copy_(total)
        elif kind == "all_to_all":  # row j of rank i's input lands in row i of rank j's output
            sent = [inp.clone() for _, inp in args]
            for j, (out, _) in enumerate(args):
                for i in range(self.n):
                    out[i].copy_(sent[i][j])
        elif kind == "all_gather":
            sent = [inp.clone() for _, inp in args]
            for out, _ in args:
                for i in range(self.n):
                    out[i].copy_(sent[i].reshape(out[i].shape))
        elif kind == "broadcast":
            root = args[0][1]
            value = args[root][0].clone()
            for t, _ in args:
                t.copy_(value)
        self.done.add(seq)


class SimComm:
    """The part of :class:`~lioncub.collectives.Comm` that vote algorithms call, for one simulated rank."""

    def __init__(self, world: SimWorld, rank: int) -> None:
        self.world, self.rank, self.world_size = world, rank, world.n
        self.device = torch.device("cpu")
        self.alone = world.n == 1  # the votes' one-process shortcut, as Comm
        self.step = 0
        self._seq = 0

    def _collective(self, kind: str, args: tuple, result: torch.Tensor | None) -> _SimHandle:
        self._seq += 1
        seq = self._seq
        self.world.posted[seq][self.rank] = (kind, args)
        return _SimHandle(lambda: self.world.run(seq), result)

    def all_reduce(self, tensor: torch.Tensor, what: str, op: Any = None) -> _SimHandle:
        assert op is None, "the votes only SUM"
        return self._collective("all_reduce", (tensor,), tensor)

    def broadcast(self, tensor: torch.Tensor, root: int, what: str) -> _SimHandle:
        return self._collective("broadcast", (tensor, root), tensor)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> _SimHandle:
        assert out.shape == inp.shape and out.shape[0] == self.world_size
        return self._collective("all_to_all", (out, inp), out)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> _SimHandle:
        assert out.shape[0] == self.world_size
        return self._collective("all_gather", (out, inp), out)

    def exchange_p2p(
        self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], what: str
    ) -> _SimHandle:
        for j, t in sends:
            assert j != self.rank
            self.world.mail[(self.rank, j)].append(t.clone())

        def receive() -> None:
            for j, t in recvs:
                queue = self.world.mail[(j, self.rank)]
                assert queue, f"rank {self.rank} waits for a message from rank {j} that was never sent"
                t.copy_(queue.popleft())

        return _SimHandle(receive)


def run_vote(
    make: Callable[[SimComm], Any],
    locals_: list[torch.Tensor],
    step: int,
    segments: list[int] | None = None,
    first: int = 0,
) -> list[torch.Tensor]:
    """Start the vote on every simulated rank, advance all (posting phase 2), then wait (``first`` first)."""
    world = SimWorld(len(locals_))
    algos = [make(SimComm(world, r)) for r in range(world.n)]
    pending = [a.start(x, step=step, segments=segments) for a, x in zip(algos, locals_, strict=True)]
    for p in pending:
        p.advance()
    order = [first] + [r for r in range(world.n) if r != first]
    done = {r: pending[r].wait() for r in order}
    return [done[r] for r in range(world.n)]
