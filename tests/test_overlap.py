"""``LionCub.overlap_with``: the vote as a DDP communication hook, against the plain step.

Every test compares the overlapped path with the plain path (DDP with its allreduce skipped, the step
votes on its own buckets) on rank-dependent data, bit for bit: parameters, every rank's momenta,
diagnostics. DDP's buckets are made small and different from the optimizer's, and DDP rebuilds them after
the first iteration, so parity cannot come from identical layouts.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lioncub.optim import PRESETS, LionCub, MomentumSync
from lioncub.optim.ddp import skip_gradient_allreduce
from lioncub.optim.lioncub import Checks, NonFiniteGradientError

from processes import run_workers

STEPS = 5


class Net(torch.nn.Module):
    """Embedding, layer norm, two linear layers with biases and a tied-free head: tensors of many sizes
    (some shorter than a 1-bit vote's 8·N padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(37, 24)
        self.norm = torch.nn.LayerNorm(24)
        self.hidden = torch.nn.Linear(24, 40)
        self.out = torch.nn.Linear(40, 37)
        self.scale = torch.nn.Parameter(torch.ones(3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embed(tokens)) * self.scale.sum()
        return self.out(torch.relu(self.hidden(x)))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 37, (16,), generator=g), torch.randint(0, 37, (16,), generator=g)


def _build(preset: str, overlap: bool, **options) -> tuple[DistributedDataParallel, LionCub]:
    torch.manual_seed(0)
    net = Net()
    # ~2 KiB DDP buckets (several per step, rebuilt after step 1) against the optimizer's 4 KiB buckets
    model = DistributedDataParallel(net, bucket_cap_mb=2 / 1024)
    groups = [
        {"params": [net.embed.weight, net.out.weight], "lr": 0.01, "weight_decay": 0.1},
        {
            "params": [net.norm.weight, net.norm.bias, net.hidden.weight, net.hidden.bias, net.out.bias],
            "lr": 0.003,
            "betas": (0.95, 0.98),
        },
        {"params": [net.scale], "lr": 0.02, "maximize": False},
    ]
    opt = LionCub(groups, variant=preset, bucket_mb=4 / 1024, model=net, **options)
    if overlap:
        opt.overlap_with(model)
    else:
        skip_gradient_allreduce(model)
    return model, opt


def _train(rank: int, preset: str, overlap: bool, steps: int = STEPS, nan_at: int = 0, **options) -> dict:
    model, opt = _build(preset, overlap, **options)
    diags, stats, layouts = {}, [], []
    for step in range(1, steps + 1):
        for group in opt.param_groups:  # an lr schedule: the hook must read each step's lr
            group["lr"] *= 0.9
        tokens, target = _batch(rank, step)
        loss = torch.nn.functional.cross_entropy(model(tokens), target)
        if step == nan_at and rank == 1:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats.append(opt.comm_stats()["last"])
        if opt.last_diagnostics is not None and opt.last_diagnostics[0] == step:
            diags[step] = opt.last_diagnostics[1]
        if overlap:
            layouts.append(list(opt._overlap.bucket_numels))
    return {
        "params": [p.detach().clone() for p in model.module.parameters()],
        "momenta": [opt.state[p]["exp_avg"].clone() for p in model.module.parameters()],
        "diags": diags,
        "stats": stats,
        "layouts": layouts,
        "own_buckets": opt.bucket_numels,
        "state": opt.state_dict(),
    }


def worker_parity(rank: int, world: int, presets: list[str], options: dict[str, dict]) -> dict:
    """``options``: keyword arguments of :func:`_train` per preset."""
    return {
        (preset, overlap): _train(rank, preset, overlap, **options.get(preset, {}))
        for preset in presets
        for overlap in (False, True)
    }


def _assert_same(plain: dict, over: dict, what: str) -> None:
    for key in ("params", "momenta"):
        for i, (a, b) in enumerate(zip(plain[key], over[key], strict=True)):
            assert torch.equal(a, b), f"{what}: {key}[{i}] differs between the plain and overlapped step"


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_every_preset_bitwise_equal_with_overlap(world: int) -> None:
    """3 steps per preset: step 1 on DDP's first buckets, step 2 on the buckets it rebuilt after it (the
    momenta carried across), step 3 on them again (the steady layout)."""
    presets = sorted(PRESETS)
    results = run_workers(worker_parity, world, presets, {p: {"steps": 3} for p in presets}, timeout=400)
    for preset in presets:
        for rank in range(world):
            plain, over = results[rank][(preset, False)], results[rank][(preset, True)]
            _assert_same(plain, over, f"{preset} rank {rank}")
            # the same bytes on the wire (the votes are the same size, just bucketed differently)
            for step, (a, b) in enumerate(zip(plain["stats"], over["stats"], strict=True), 1):
                assert b["skipped_steps"] == a["skipped_steps"] == 0
                tolerance = 8 * 2 * world * len(over["layouts"][step - 1])  # padding per bucket
                assert b["bytes_sent"] == pytest.approx(a["bytes_sent"], abs=tolerance), (preset, step)
                assert b["overlapped_s"] > 0 and a["overlapped_s"] == 0
        over = results[0][(preset, True)]
        assert len(over["layouts"][-1]) >= 3, "DDP should make several buckets"
        assert over["own_buckets"] not in over["layouts"], "the layouts must differ for the test to bite"
        # DDP rebuilt its buckets after the first iteration (the momenta survived it: parity above)
        assert over["layouts"][0] != over["layouts"][-1]
        if (
            preset not in ("32bit", "16bit") and world == 3
        ):  # the votes really differ between ranks (not a trivial test)
            assert not torch.equal(
                results[0][(preset, True)]["momenta"][0], results[1][(preset, True)]["momenta"][0]
            )


def _nan_equal(a: object, b: object) -> bool:
    """``a == b`` for nested dicts of floats, with NaN equal to NaN."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_nan_equal(a[k], b[k]) for k in a)
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.slow  # ~1 s: the quick loop (-m 'not slow') leaves it to the full suite
def test_sync_diagnostics_and_skip_with_overlap() -> None:
    """Momentum sync every 2 steps, diagnostics every 2 steps, and a NaN on rank 1 at step 3 (skipped on
    every rank), 4 steps (a sync and diagnostics before the NaN and after it): the same parameters, momenta
    and diagnostics with and without overlap."""
    voting = {"momentum_sync": MomentumSync("all", every=2), "diagnostics_every": 2, "nan_at": 3, "steps": 4}
    options = {"1bit": voting, "8bit": voting, "32bit": {"nan_at": 3, "steps": 4}}
    results = run_workers(worker_parity, 3, ["1bit", "8bit", "32bit"], options, timeout=300)
    for (preset, overlap), res in results[0].items():
        assert [s["skipped_steps"] for s in res["stats"]] == [0, 0, 1, 0], (preset, overlap)
        if preset != "32bit":
            assert sorted(res["diags"]) == [2, 4]
    for preset in ("1bit", "8bit", "32bit"):
        for rank in range(3):
            plain, over = results[rank][(preset, False)], results[rank][(preset, True)]
            _assert_same(plain, over, f"{preset} rank {rank}")
            assert _nan_equal(plain["diags"], over["diags"]), f"{preset}: diagnostics differ"


def worker_resume(rank: int, world: int, preset: str) -> dict:
    """3 overlapped steps, the state saved; a fresh model + optimizer (plain path) loads it and runs 2 more;
    against 5 overlapped steps in one go."""
    whole = _train(rank, preset, True, steps=STEPS)
    first = _train(rank, preset, True, steps=3)
    model, opt = _build(preset, False)
    with torch.no_grad():
        for p, q in zip(model.module.parameters(), first["params"], strict=True):
            p.copy_(q)
    opt.load_state_dict(first["state"])  # with the param groups' lr as they were at step 3
    for step in range(4, STEPS + 1):
        for group in opt.param_groups:
            group["lr"] *= 0.9
        tokens, target = _batch(rank, step)
        torch.nn.functional.cross_entropy(model(tokens), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    resumed = {
        "params": [p.detach().clone() for p in model.module.parameters()],
        "momenta": [opt.state[p]["exp_avg"].clone() for p in model.module.parameters()],
    }
    return {"whole": whole, "resumed": resumed}


def test_overlapped_state_resumes_on_the_plain_path() -> None:
    results = run_workers(worker_resume, 2, "1bit", timeout=200)
    for rank in range(2):
        _assert_same(results[rank]["whole"], results[rank]["resumed"], f"rank {rank}")


def worker_errors(rank: int, world: int) -> dict:
    out = {}
    # nonfinite="raise": every rank raises, after the votes finished; the group still works afterwards
    model, opt = _build("1bit", True, checks=Checks(nonfinite="raise"))
    tokens, target = _batch(rank, 1)
    loss = torch.nn.functional.cross_entropy(model(tokens), target)
    (loss * (float("inf") if rank == 0 else 1.0)).backward()
    try:
        opt.step()
    except NonFiniteGradientError as err:
        out["raise"] = str(err)
    opt.zero_grad(set_to_none=True)
    tokens, target = _batch(rank, 2)
    torch.nn.functional.cross_entropy(model(tokens), target).backward()
    opt.step()
    out["after"] = opt.global_step
    # the votes' own group names the optimizer step in its errors (CollectiveError "... at optimizer step N")
    out["hook_steps"] = []
    for step in (1, 2):
        tokens, target = _batch(rank, step)
        torch.nn.functional.cross_entropy(model(tokens), target).backward()
        opt.step()
        out["hook_steps"].append((opt.overlap_hook.comm.step, opt.global_step))
        opt.zero_grad(set_to_none=True)
    # a synchronised backward that no step() follows: its votes are dropped, and the next step uses the
    # gradients as the two backwards accumulated them, as the plain step does
    for overlap in (True, False):
        torch.manual_seed(0)
        model, opt = _build("8bit", overlap)
        for step in (1, 2):
            tokens, target = _batch(rank, step)
            torch.nn.functional.cross_entropy(model(tokens), target).backward()
        opt.step()
        out[f"twice_{overlap}"] = [p.detach().clone() for p in model.module.parameters()]
    # gradient accumulation inside no_sync: the hook runs once, on the accumulated gradient
    torch.manual_seed(0)
    model, opt = _build("8bit", True)
    with model.no_sync():
        tokens, target = _batch(rank, 1)
        torch.nn.functional.cross_entropy(model(tokens), target).backward()
    tokens, target = _batch(rank, 2)
    torch.nn.functional.cross_entropy(model(tokens), target).backward()
    opt.step()
    out["accumulated"] = [p.detach().clone() for p in model.module.parameters()]
    plain_model, plain = _build("8bit", False)
    for step in (1, 2):
        tokens, target = _batch(rank, step)
        torch.nn.functional.cross_entropy(plain_model(tokens), target).backward()
    plain.step()
    out["accumulated_plain"] = [p.detach().clone() for p in plain_model.module.parameters()]
    # the DDP model and the optimizer must hold the same parameters
    net = Net()
    model = DistributedDataParallel(net)
    opt = LionCub([net.hidden.weight], variant="1bit")
    try:
        opt.overlap_with(model)
    except ValueError as err:
        out["mismatch"] = str(err)
    dist.barrier()
    return out


def test_overlap_errors_and_accumulation() -> None:
    results = run_workers(worker_errors, 2, timeout=200)
    for rank, res in enumerate(results):
        assert f"rank {rank}: non-finite gradients" in res["raise"] and "rank(s) [0]" in res["raise"]
        assert res["after"] == 2
        assert res["hook_steps"] == [(3, 3), (4, 4)]
        for a, b in zip(res["twice_True"], res["twice_False"], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(res["accumulated"], res["accumulated_plain"], strict=True):
            assert torch.equal(a, b)
        assert "the DDP model's trainable parameters must be exactly the optimizer's" in res["mismatch"]
        assert "'embed.weight'" in res["mismatch"] and "'hidden.weight'" not in res["mismatch"]


def worker_dense_layouts(rank: int, world: int) -> dict:
    from lioncub.collectives import Comm, DenseMean

    x = torch.randn(10_007, generator=torch.Generator().manual_seed(rank))
    vote = DenseMean(Comm(exchange="p2p"), torch.float32)
    whole = vote.start(x, step=1).wait().clone()
    parts = [vote.start(x[a:b], step=1).wait().clone() for a, b in ((0, 3001), (3001, 3002), (3002, 10_007))]
    return {"whole": whole, "parts": torch.cat(parts)}


def test_dense_mean_does_not_depend_on_the_bucket_layout() -> None:
    """The dense mean of 3 ranks adds in rank order wherever an element sits (gloo's allreduce does not:
    its result changed in the last bit when the buffer was split differently)."""
    results = run_workers(worker_dense_layouts, 3)
    xs = [torch.randn(10_007, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    want = (xs[0] / 3 + xs[1] / 3) + xs[2] / 3  # float32, rank order
    for res in results:
        assert torch.equal(res["whole"], want) and torch.equal(res["parts"], want)


def worker_streams(rank: int, world: int) -> dict:
    """Two overlapped steps with the backward's stream faked: which streams the vote thread entered."""
    import contextlib
    import threading

    from lioncub.optim import overlap

    entered: list[tuple[str, object]] = []

    @contextlib.contextmanager
    def stream(s: object):  # torch.cuda.stream, recorded
        entered.append((threading.current_thread().name, s))
        yield

    real = overlap.backward_stream, torch.cuda.stream
    overlap.backward_stream = lambda device: ("backward-stream", rank)
    torch.cuda.stream = stream
    try:
        got = _train(rank, "1bit", True, steps=2)
    finally:  # the worker process runs other tests' functions after this one
        overlap.backward_stream, torch.cuda.stream = real
    return {"entered": entered, "buckets": got["layouts"]}


@pytest.mark.slow
def test_the_vote_thread_works_on_the_backwards_stream() -> None:
    """The overlap hook runs in the backward, on the stream autograd made current for the gradients (a
    user's side stream included); the vote thread's quantize/pack kernels and collectives run on that
    stream (``torch.cuda.stream``), not on the thread's default stream, which would race the gradients'
    kernels. Faked on the CPU: the stream the hook sees is a marker, and ``torch.cuda.stream`` records."""
    for rank, got in enumerate(run_workers(worker_streams, 2)):
        posts = sum(len(layout) for layout in got["buckets"])
        assert len(got["entered"]) == posts > 2
        assert all(
            name == f"lioncub-overlap-rank{rank}" and s == ("backward-stream", rank)
            for name, s in got["entered"]
        ), got["entered"]


def test_the_backward_stream_is_the_current_cuda_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    from lioncub.optim.overlap import backward_stream

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("current", device))
    assert backward_stream(torch.device("cpu")) is None
    assert backward_stream(torch.device("cuda", 1)) == ("current", torch.device("cuda", 1))
