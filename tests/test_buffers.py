"""Memory a step leaves behind or stages (issue 44, finding 7): the dense presets' exchange buffers live for
one exchange, not for the life of the optimizer (where the device has a caching allocator: CUDA; on the CPU
each bucket keeps its own, ``DenseMean.keep_buffers``), and momentum sync stages one bucket at a time, not a
copy of every momentum.

Allocations are seen at the ATen level (:class:`Allocations`, a ``TorchDispatchMode``: every op output with a
storage of its own), so the checks do not depend on how the code allocates. On gloo a finished work holds its
tensors and the comm keeps its last finished works (``Comm.retire``: gloo only, NCCL keeps none); the checks
let go of those before they count what is still alive.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lioncub.collectives import Comm, DenseMean
from lioncub.optim import LionCub, LocalSteps, MomentumSync
from lioncub.optim.sync import synchronize
from sim_comm import fake_comm

from processes import run_workers

#: every test here runs gloo ranks or stages tens of MB (tests/README.md: slow)
pytestmark = pytest.mark.slow

DENSE_FILE = os.path.join("collectives", "dense.py")


class Allocations(TorchDispatchMode):
    """Every tensor of at least ``min_numel`` elements that an ATen op creates with a storage of its own
    (factories, copies, ``cat``, ``clone``; not views or in-place results), while ``when()`` holds: weak
    references to them, and the peak of the bytes of those alive at once."""

    def __init__(self, min_numel: int = 16, when: Callable[[], bool] = lambda: True) -> None:
        super().__init__()
        self.min_numel, self.when = min_numel, when
        self.made: list[tuple[weakref.ref, int]] = []  # (tensor, bytes), in order
        self.peak = 0

    def __torch_dispatch__(
        self, func: Any, arg_types: Any, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.when():
            return out
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if _plain(t)}
        for t in tree_leaves(out):
            if _plain(t) and t.numel() >= self.min_numel and t.untyped_storage().data_ptr() not in inputs:
                self.made.append((weakref.ref(t), t.untyped_storage().nbytes()))
                self.peak = max(self.peak, self.alive_bytes())
        return out

    def alive(self) -> list[torch.Tensor]:
        return [t for ref, _ in self.made if (t := ref()) is not None]

    def alive_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self.made if ref() is not None)


def _plain(t: object) -> bool:
    """A strided CPU tensor (whose storage can be compared)."""
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu"


def in_dense_mean() -> bool:
    """Whether a frame of :mod:`lioncub.collectives.dense` is on the calling thread's stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(DENSE_FILE):
            return True
        frame = frame.f_back
    return False


def let_go(comm: Comm) -> None:
    """Drop the gloo works the comm keeps after they finished (each holds its tensors; NCCL keeps none), and
    collect the garbage (under :func:`own_garbage`: what was made since it began)."""
    retired = getattr(comm, "_retired", None)
    if retired is not None:
        retired.clear()
    gc.collect()


@contextlib.contextmanager
def own_garbage() -> Iterator[None]:
    """The pooled worker's objects from before (torch's modules, earlier calls' leftovers) frozen for the
    while: a full collection then walks this call's objects only (over 0.2 s of CPU each when it also walks
    torch's). It still frees every unreachable cycle of them (one through a frozen object that is garbage
    too would stay, and be counted alive: a failure, never a pass). A native collective's tensors are held
    by gloo's worker thread a moment after its wait returned: :func:`worker_dense_phases` waits for them
    (:func:`settled`)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def tensors_held_by(obj: object) -> list[str]:
    """Names of the tensors in ``obj``'s attributes (and the dicts, lists and tuples under them)."""
    found, seen = [], set()

    def walk(value: object, name: str) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found.append(name)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{name}[{k!r}]")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{name}[{i}]")

    for key, value in vars(obj).items():
        if key != "comm":
            walk(value, key)
    return found


# -- the dense presets' exchange --------------------------------------------------------------------------

DENSE_CONFIGS: dict[str, dict[str, Any]] = {
    "32bit": {"variant": "32bit"},
    "16bit": {"variant": "16bit"},
    "dsm h2": {"variant": "32bit", "local_steps": LocalSteps(h=2, outer="dsm")},
    "diloco h2": {"variant": "16bit", "local_steps": LocalSteps(h=2, outer="diloco")},
}


def dense_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 24), nn.Linear(24, 8))


def worker_dense_steps(rank: int, world: int, name: str, keep: bool | None) -> dict[str, Any]:
    """Four steps of ``DENSE_CONFIGS[name]`` (several buckets; the vote's ``keep_buffers=keep``, its default
    for ``None``) with the
    allocations made under :class:`DenseMean` tracked; after each step, what is still alive of them (but
    the momenta it created, the optimizer's state) and what the vote holds."""
    with own_garbage():
        return _dense_steps(rank, name, keep)


def _dense_steps(rank: int, name: str, keep: bool | None) -> dict[str, Any]:
    model = dense_model()
    opt = LionCub(model.parameters(), lr=1e-3, bucket_mb=1000 * 4 / 2**20, **DENSE_CONFIGS[name])
    vote = opt.engine.vote
    assert isinstance(vote, DenseMean)
    if keep is not None:
        vote.keep_buffers = keep
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(rank))
    out: dict[str, Any] = {"made": [], "alive": [], "held": []}
    for _ in range(4):
        opt.zero_grad()
        model(x).square().mean().backward()
        with Allocations(when=in_dense_mean) as allocations:
            opt.step()
        let_go(vote.comm)
        out["made"].append(len(allocations.made))
        state = {v.untyped_storage().data_ptr() for s in opt.state.values() for v in s.values() if _plain(v)}
        alive = [t for t in allocations.alive() if t.untyped_storage().data_ptr() not in state]
        out["alive"].append([(tuple(t.shape), t.dtype) for t in alive])
        out["held"].append(tensors_held_by(vote))
    out["buckets"] = len(opt.layout.buckets)
    return out


@pytest.mark.parametrize("name", list(DENSE_CONFIGS))
def test_dense_exchange_buffers_are_released_after_the_step(name: str) -> None:
    """Without ``keep_buffers`` (CUDA's default), per step (32bit, 16bit) or per outer step (dsm, diloco:
    every second step) the dense exchange makes its buffers, and none of them is alive once the step
    returns; the vote keeps no tensor."""
    for res in run_workers(worker_dense_steps, 2, name, False):
        assert res["buckets"] >= 3
        assert res["held"] == [[]] * 4, res["held"]
        assert res["alive"] == [[]] * 4, res["alive"]
        exchanges = res["made"] if "h2" not in name else res["made"][1::2]
        assert all(made >= 3 * res["buckets"] for made in exchanges), res["made"]  # the check is not empty


def test_dense_buffers_are_kept_only_without_a_caching_allocator() -> None:
    """``keep_buffers`` defaults to the device: kept on the CPU (fresh pages fault in at every exchange), not
    on CUDA; kept, each bucket reuses its 4 buffers (send, receive, slice, gathered) step after step."""
    assert DenseMean(fake_comm(2), torch.float32).keep_buffers
    cuda = types.SimpleNamespace(world_size=2, rank=0, device=torch.device("cuda", 0), alone=False)
    assert not DenseMean(cuda, torch.bfloat16).keep_buffers  # type: ignore[arg-type]
    assert DenseMean(cuda, keep_buffers=True).keep_buffers  # type: ignore[arg-type]
    for res in run_workers(worker_dense_steps, 2, "32bit", True):
        assert [len(held) for held in res["held"]] == [4 * res["buckets"]] * 4
        assert res["made"][1:] == [0, 0, 0], res["made"]  # nothing allocated after the first step


#: elements of the phases test's exchange
PHASE_D = 10_001


def phase_bytes(world: int) -> list[int]:
    """The bytes :meth:`DenseMean.start` of :data:`PHASE_D` fp32 elements keeps alive after each phase on
    ``world`` ranks: send and receive buffers (2 × N·⌈d/N⌉ fp32) while the reduce-scatter is in flight,
    the slice and the all-gather's output once this rank's slice is summed, nothing after the result."""
    padded = -(-PHASE_D // world) * world * 4
    return [2 * padded, padded + padded // world, 0]


def settled(allocations: Allocations, comm: Comm, bound: int | None) -> int:
    """The bytes alive once the comm's finished works are let go (:func:`let_go`); ``bound`` (a native
    exchange: gloo's worker thread lets go of a collective's tensors a moment after its wait returned):
    polled every 5 ms until they are at most ``bound``, for 1 s at most. What is returned is what was
    measured last, so a phase that keeps more than ``bound`` still fails the test, 1 s later."""
    deadline = time.monotonic() + 1.0
    while True:
        let_go(comm)
        alive = allocations.alive_bytes()
        if bound is None or alive <= bound or time.monotonic() > deadline:
            return alive
        time.sleep(0.005)


def worker_dense_phases(rank: int, world: int, exchange: str) -> list[int]:
    """One :meth:`DenseMean.start` of :data:`PHASE_D` elements, phase by phase, under :func:`own_garbage`:
    the bytes of what it allocated that are still alive after the post, after ``advance()`` (the
    reduce-scatter done, the all-gather posted) and after the result was taken and dropped (native: once
    gloo's thread let go, :func:`settled`)."""
    bounds = phase_bytes(world) if exchange == "native" else [None] * 3
    with own_garbage():
        vote = DenseMean(Comm(exchange=exchange), torch.float32)
        vote.keep_buffers = False  # as on CUDA
        local = torch.randn(PHASE_D, generator=torch.Generator().manual_seed(rank))
        alive = []
        with Allocations(min_numel=64) as allocations:
            pending = vote.start(local, step=1)
            alive.append(settled(allocations, vote.comm, bounds[0]))
            pending.advance()
            alive.append(settled(allocations, vote.comm, bounds[1]))
            mean = pending.result().decode()
            assert torch.isfinite(mean).all()
            del mean, pending
            alive.append(settled(allocations, vote.comm, bounds[2]))
        return alive


@pytest.mark.parametrize("exchange", ["p2p", "native"])
def test_dense_exchange_frees_each_phase_when_done(exchange: str) -> None:
    """While the reduce-scatter is in flight: send and receive buffers (2 × N·⌈d/N⌉ fp32); once this
    rank's slice is summed only the slice and the all-gather's output are alive; nothing after the result
    (:func:`phase_bytes`)."""
    for alive in run_workers(worker_dense_phases, 2, exchange):
        assert alive == phase_bytes(2)


# -- momentum sync ----------------------------------------------------------------------------------------


class ElementwiseComm:
    """A stand-in for a 2-rank :class:`Comm` whose other rank holds ``2·x + 1`` wherever this one holds
    ``x`` (an elementwise rule, so the sum does not depend on how the momenta are cut): ``all_reduce`` turns
    ``x`` into ``3·x + 1`` in place, allocating nothing."""

    world_size = 2

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def all_reduce(self, tensor: torch.Tensor, what: str) -> types.SimpleNamespace:
        self.sizes.append(tensor.numel())
        tensor.mul_(3).add_(1)
        return types.SimpleNamespace(wait=lambda: tensor)


def reference_sync(comm: Any, momenta: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
    """Momentum sync as one allreduce of every momentum of a dtype, concatenated (lioncub before issue 44)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for m in momenta:
        by_dtype.setdefault(m.dtype, []).append(m)
    for moms in by_dtype.values():
        flat = torch.cat([m.reshape(-1) for m in moms]).to(dtype)
        comm.all_reduce(flat, "momentum sync").wait()
        flat.div_(comm.world_size)
        pos = 0
        for m in moms:
            m.copy_(flat[pos : pos + m.numel()].view_as(m))
            pos += m.numel()


def test_momentum_sync_stages_one_bucket_at_a_time() -> None:
    """40 MB of fp32 momenta, the default bucket (25 MiB): what momentum sync allocates alive at once stays
    within one bucket (the concatenation of every momentum did not), and the mean is the same bits."""
    torch.manual_seed(0)
    momenta = [torch.randn(3_500_000), torch.randn(1_000, 2_500), torch.randn(4_000_000)]
    expected = [m.clone() for m in momenta]
    reference_sync(ElementwiseComm(), expected, torch.float32)
    comm = ElementwiseComm()
    with Allocations(min_numel=1) as allocations:
        synchronize(comm, momenta, torch.float32)  # type: ignore[arg-type]
    total = sum(m.numel() for m in momenta) * 4
    assert total > 25 * 2**20
    assert 0 < allocations.peak <= 25 * 2**20, (allocations.peak, total)
    assert max(comm.sizes) * 4 <= 25 * 2**20 and sum(comm.sizes) == total // 4
    for got, want in zip(momenta, expected, strict=True):
        assert torch.equal(got, want)


def sync_cases(small: bool = False) -> list[tuple[list[torch.Tensor], torch.dtype]]:
    """Momenta of several dtypes and layouts (a non-contiguous one, an empty one, one larger than a
    bucket: 301 elements, cut across fillings at every bucket size of the test but the whole, as 1000 were;
    fewer 1-element allreduces), each with the wire dtype it is synchronized in. ``small``: the same
    layouts with fewer elements (every one but the empty one still more than one: cut at each element by
    a bucket of 1)."""
    g = torch.Generator().manual_seed(dist.get_rank())

    def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    if small:
        channels_last = rand(2, 3, 2, 2).to(memory_format=torch.channels_last)
        mixed = [rand(3, 2), rand(9), rand(0), channels_last, rand(5, dtype=torch.bfloat16), rand(4, 2)]
        return [(mixed, torch.float32), ([rand(11), rand(2, 3, dtype=torch.bfloat16)], torch.bfloat16)]
    channels_last = rand(3, 4, 5, 6).to(memory_format=torch.channels_last)
    mixed = [rand(7, 5), rand(301), rand(0), channels_last, rand(33, dtype=torch.bfloat16), rand(300, 2)]
    return [(mixed, torch.float32), ([rand(517), rand(64, 3, dtype=torch.bfloat16)], torch.bfloat16)]


#: the buckets (elements) of the momentum-sync test. A bucket of 1 cuts every momentum at each of its
#: elements whatever its size, so it runs on :func:`sync_cases`' small momenta (57 one-element allreduces per
#: rank instead of ~2000, 98 % of the test's collectives); the others on the full ones
SYNC_BUCKETS = (1, 64, 300, 10**6)


def worker_sync_buckets(rank: int, world: int) -> list[bool]:
    """For each bucket size and case: whether the sync in buckets gives the bits of one allreduce."""
    comm = Comm()
    same = []
    for bucket_elements in SYNC_BUCKETS:
        for momenta, dtype in sync_cases(small=bucket_elements == 1):
            expected = [m.clone(memory_format=torch.preserve_format) for m in momenta]
            reference_sync(comm, expected, dtype)
            got = [m.clone(memory_format=torch.preserve_format) for m in momenta]
            synchronize(comm, got, dtype, bucket_mb=bucket_elements * dtype.itemsize / 2**20)
            same.append(
                all(
                    torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(got, expected, strict=True)
                )
            )
    return same


def test_momentum_sync_in_buckets_matches_one_allreduce() -> None:
    """On 2 gloo ranks, buckets of 1, 64, 300 elements or all of them give the bits of one allreduce of the
    concatenated momenta (fp32 and bf16 on the wire, bf16 momenta, a channels-last and an empty one)."""
    for same in run_workers(worker_sync_buckets, 2):
        assert all(same), same


@pytest.mark.parametrize("name", [n for n in DENSE_CONFIGS if "h2" in n])
def test_the_outer_rules_keep_no_dense_buffers_between_their_votes(name: str) -> None:
    """An outer rule of local steps votes once per H steps: its dense vote keeps no exchange buffers
    between votes, on the CPU too (``make_vote(every_step=False)``), where a vote every step keeps them."""
    for res in run_workers(worker_dense_steps, 2, name, None):
        assert res["held"] == [[]] * 4, res["held"]
        assert res["alive"] == [[]] * 4, res["alive"]


def worker_sync_bucket_mb(rank: int, world: int) -> list[float]:
    """Momentum sync every step and at each outer step: the ``bucket_mb`` each call was given."""
    from lioncub.optim import local_steps, policies

    seen: list[float] = []
    modules = (policies, local_steps)
    real = [module.synchronize for module in modules]
    for module, sync in zip(modules, real, strict=True):
        module.synchronize = lambda *a, _real=sync, **k: (
            seen.append(k.get("bucket_mb", -1.0)) or _real(*a, **k)
        )
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(rank))
    try:
        for options in (
            dict(variant="1bit", momentum_sync=MomentumSync("all", every=1), bucket_mb=0.01),
            dict(variant="1bit", local_steps=LocalSteps(h=2, inner_momentum="average"), bucket_mb=0.02),
        ):
            model = dense_model()
            opt = LionCub(model.parameters(), lr=1e-3, **options)
            for _ in range(2):
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
    finally:  # the worker process runs other tests' functions after this one
        for module, sync in zip(modules, real, strict=True):
            module.synchronize = sync
    return seen


def test_momentum_sync_stages_in_the_optimizers_buckets() -> None:
    """Momentum sync (every step, and a local-steps window's ``inner_momentum="average"``) stages the momenta
    in buckets of the optimizer's ``bucket_mb``."""
    for seen in run_workers(worker_sync_bucket_mb, 2):
        assert seen == [0.01, 0.01, 0.02], seen


def worker_contribution_buffers(rank: int, world: int) -> list[list[bool]]:
    """After each of four steps, which buckets hold a contribution buffer: a vote every step, and local
    steps with H = 2 (a sign vote and DiLoCo as the outer rule)."""
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(rank))
    out = []
    for options in (
        dict(variant="1bit"),
        dict(variant="1bit", local_steps=LocalSteps(h=2)),
        dict(variant="32bit", local_steps=LocalSteps(h=2, outer="diloco")),
    ):
        model = dense_model()
        opt = LionCub(model.parameters(), lr=1e-3, bucket_mb=1000 * 4 / 2**20, **options)
        held = []
        for _ in range(4):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            held.append(any(b.flat is not None for b in opt.layout.buckets))
        out.append(held)
    return out


def test_an_outer_rule_keeps_no_contribution_buffers_between_its_votes() -> None:
    """The buckets' contribution buffers (one element per parameter) stay between the votes of a vote every
    step, and are let go after each outer step of local steps (the next is H steps away)."""
    for held in run_workers(worker_contribution_buffers, 2):
        assert held == [[True] * 4, [False] * 4, [False] * 4], held
