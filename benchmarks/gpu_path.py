"""LionCub's whole vote path on one device, for ``benchmarks/gpu_check.sh`` (section 3 of gpu_check.py).

Every check runs the same ranks twice: on ``device`` over the default group (NCCL on a GPU) and on the CPU
over a gloo group of the same ranks, and compares the two bit for bit — the vote algorithms, every
``LionCub`` preset, the overlap hook, local steps, ``consolidate_state_dict`` and a checkpoint round trip
through the CPU — and it counts the host synchronizations of a step. At world size 1 the votes run their
collectives too (:func:`lioncub.collectives.exchange_when_alone`): step check, encode, exchange, decode
and apply all run on one GPU. With several GPUs ``gpu_check.py`` also starts one process per GPU, each
running :func:`vote_path` (``python benchmarks/gpu_path.py --rank R --world N --store FILE``).

The data of the cross-device checks lies on a grid of multiples of 2^-6 below 4 and the betas are
(0.5, 0.5), and no tensor has more than 2^16 elements: every contribution, momentum and quantizer
normaliser (a sum of |c|, below 2^18) is then exact in float32, so the CPU's and the GPU's reductions,
which add in different orders and widths, agree to the bit and any difference is a defect. The overlap
check compares two runs on the same device and takes any data.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from lioncub.collectives import exchange_when_alone

#: (section, item, differing elements) of a bitwise check; (section, item, measured, target, ok) of a row
Check = Callable[[str, str, int], None]
Row = Callable[..., None]

BETAS = (0.5, 0.5)  # with grid data every value stays exact in float32 (module docstring)
LR, WD = 2.0**-7, 0.125
SHAPES = [(64, 48), (48,), (33, 7), (1,), (96, 5)]


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements that differ bit for bit (a NaN equals a NaN); a shape or dtype mismatch: all of them."""
    a, b = a.detach().reshape(-1).cpu(), b.detach().reshape(-1).cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel(), 1)
    if a.dtype.is_floating_point:
        an, bn = a.isnan(), b.isnan()
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return int(((an != bn) | (~an & ~bn & (a.view(ints) != b.view(ints)))).sum())
    return int((a != b).sum())


def grid(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """float32 multiples of 2^-6 in (−4, 4) (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-255, 256, shape, generator=gen).to(torch.float32) / 64


# ------------------------------------------------------------------------------------ the checks


def _run(device: torch.device, group: Any, variant: str, steps: int, **options: Any) -> list[torch.Tensor]:
    """``steps`` LionCub steps of ``variant`` on ``device`` over ``group`` (rank-dependent grid gradients):
    the parameters and momenta after them."""
    from lioncub.optim import LionCub

    rank = dist.get_rank()
    params = [torch.nn.Parameter(grid(s, 100 + i).to(device)) for i, s in enumerate(SHAPES)]
    opt = LionCub(
        params, lr=LR, betas=BETAS, weight_decay=WD, variant=variant, process_group=group, **options
    )
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = grid(p.shape, 1000 * step + 10 * rank + i).to(device)
        opt.step()
    return [p.detach() for p in params] + [opt.state[p]["exp_avg"] for p in params]


def votes(device: torch.device, gloo: Any, check: Check, n: int) -> None:
    """Every vote algorithm on ``device`` against the CPU over gloo."""
    from lioncub.collectives import (
        AverageVote,
        Comm,
        DenseMean,
        LaneVote,
        OneBitVote,
        QuantizedVote,
        ServerVote,
        SignSumVote,
    )

    comm_dev, comm_cpu = Comm(None, device=device), Comm(gloo)
    makers = {
        "OneBitVote": lambda c: OneBitVote(c),
        "LaneVote(4)": lambda c: LaneVote(c, 4),
        "LaneVote(auto)": lambda c: LaneVote(c, "auto"),
        "SignSumVote": lambda c: SignSumVote(c),
        "QuantizedVote(l1, 8)": lambda c: QuantizedVote(c, "l1", 8),
        "QuantizedVote(l1, 4)": lambda c: QuantizedVote(c, "l1", 4),
        "QuantizedVote(linf, 8, chunk 256)": lambda c: QuantizedVote(c, "linf", 8, chunk_size=256),
        "AverageVote": lambda c: AverageVote(c),
        "ServerVote(majority)": lambda c: ServerVote(c, "majority"),
        "ServerVote(average)": lambda c: ServerVote(c, "average"),
        "DenseMean(fp32)": lambda c: DenseMean(c, torch.float32),
        "DenseMean(bf16)": lambda c: DenseMean(c, torch.bfloat16),
    }
    n = min(n, 1 << 16)  # exact sums (module docstring)
    local = grid((n,), 5 + comm_dev.rank)
    local[::97] = 0.0
    segments = [n // 2, n - n // 2]
    for step in (1, 2):  # both phases of the tie rule
        for name, make in makers.items():
            out_dev = make(comm_dev).start(local.to(device), step=step, segments=segments).wait()
            out_cpu = make(comm_cpu).start(local.clone(), step=step, segments=segments).wait()
            what = f"{name}, step {step} ({comm_dev.backend} vs gloo)"
            check("vote path", what, differing(out_dev, out_cpu))


def presets(device: torch.device, gloo: Any, check: Check) -> None:
    """Every LionCub preset, 3 steps (step check, encode, exchange, decode, apply) against the CPU."""
    from lioncub.optim.config import PRESETS

    for preset in PRESETS:
        ours = _run(device, None, preset, 3)
        ref = _run(torch.device("cpu"), gloo, preset, 3)
        diff = sum(differing(a, b) for a, b in zip(ours, ref, strict=True))
        check("vote path", f"LionCub {preset}: 3 steps, parameters and momenta vs gloo", diff)


def overlap(device: torch.device, check: Check) -> None:
    """``LionCub.overlap_with`` (the DDP hook, the vote thread on the device) against the plain step."""
    from torch.nn.parallel import DistributedDataParallel

    from lioncub.optim import LionCub
    from lioncub.optim.ddp import skip_gradient_allreduce

    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    batches = [torch.randn(16, 32, generator=gen) for _ in range(3)]
    for preset in ("1bit", "8bit", "32bit"):
        results = []
        for overlapped in (False, True):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
            net = net.to(device)
            ids = [device.index] if device.type == "cuda" else None
            model = DistributedDataParallel(net, device_ids=ids, bucket_cap_mb=0.004)
            opt = LionCub(net.parameters(), lr=1e-2, weight_decay=0.1, variant=preset)
            if overlapped:
                opt.overlap_with(model)
            else:
                skip_gradient_allreduce(model)
            for x in batches:
                model(x.to(device)).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if overlapped:
                opt.overlap_hook.close()
            results.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
        check("vote path", f"LionCub {preset}: overlap_with vs plain step, 3 steps", differing(*results))


def local_steps(device: torch.device, gloo: Any, check: Check) -> None:
    """Local steps (inner Lion steps, the outer vote or DiLoCo's mean) on the device against the CPU."""
    from lioncub.optim import LocalSteps

    for preset, rule in (("1bit", "vote"), ("4bit", "vote"), ("32bit", "diloco")):
        local = LocalSteps(h=2, outer=rule)
        ours = _run(device, None, preset, 5, local_steps=local)
        ref = _run(torch.device("cpu"), gloo, preset, 5, local_steps=local)
        diff = sum(differing(a, b) for a, b in zip(ours, ref, strict=True))
        check("vote path", f"LionCub {preset}, local steps h=2 outer={rule}: 5 steps vs gloo", diff)


def checkpoint_round_trip(device: torch.device, check: Check) -> None:
    """``consolidate_state_dict`` (every rank's state gathered on rank 0, on the CPU) and a save/load through
    the CPU (``map_location="cpu"``, as ``lioncub.train.checkpoint``) in the middle of a run: the resumed run
    equals the uninterrupted one, and the loaded momenta are on the parameters' device."""
    from lioncub.optim import LionCub

    rank = dist.get_rank()
    for variant, options in (("8bit", {}), ("1bit", {"local_steps": 2})):
        whole = _run(device, None, variant, 4, **options)
        params = [torch.nn.Parameter(grid(s, 100 + i).to(device)) for i, s in enumerate(SHAPES)]
        opt = LionCub(params, lr=LR, betas=BETAS, weight_decay=WD, variant=variant, **options)
        for step in range(4):
            if step == 3:  # mid-window with local steps (step 3 of h=2 windows): the replicas travel too
                opt.consolidate_state_dict(to=0)
                if rank == 0:
                    entries = [e for e in opt.state_dict()["lioncub"]["ranks"] if e is not None]
                    where = {t.device.type for e in entries for s in e["state"].values() for t in s.values()}
                    check(
                        "vote path",
                        f"{variant}: consolidated states are on the CPU",
                        int(where - {"cpu"} != set()),
                    )
                buf = io.BytesIO()
                torch.save({"model": [p.detach() for p in params], "opt": opt.state_dict()}, buf)
                saved = torch.load(io.BytesIO(buf.getvalue()), map_location="cpu", weights_only=False)
                params = [torch.nn.Parameter(t.to(device)) for t in saved["model"]]
                opt = LionCub(params, lr=LR, betas=BETAS, weight_decay=WD, variant=variant, **options)
                opt.load_state_dict(saved["opt"])
                wrong = sum(opt.state[p]["exp_avg"].device != p.device for p in params)
                check("vote path", f"{variant}: loaded momenta on the parameters' device", int(wrong))
            for i, p in enumerate(params):
                p.grad = grid(p.shape, 1000 * step + 10 * rank + i).to(device)
            opt.step()
        resumed = [p.detach() for p in params] + [opt.state[p]["exp_avg"] for p in params]
        diff = sum(differing(a, b) for a, b in zip(resumed, whole, strict=True))
        label = f"{variant}{', local steps h=2' if options else ''}: saved at step 3 and resumed"
        check("vote path", f"{label} = uninterrupted, 4 steps", diff)


# ------------------------------------------------------------------------------------ host syncs


class HostReads(TorchFunctionMode):
    """Counts what makes the host wait for a device: a tensor's value read on the host (``bool``,
    ``int``, ``float``, ``item``, ``tolist``, a copy to the CPU or numpy) and a tensor built from host data
    (``torch.tensor``, a copy to the device). On the CPU these cost nothing; on a GPU each is a
    synchronization, so a step's count must not grow with its number of tensors."""

    READS = frozenset(
        {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "numpy", "tensor"}
    )

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.names: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.count += 1
            self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _sync_events(device: torch.device, step: Callable[[], None]) -> int | None:
    """CUDA synchronizations (``cuda*Synchronize`` and blocking copies) in one ``step()``, from the
    profiler; ``None`` on the CPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    names = [e.name for e in prof.events()]
    return sum("Synchronize" in n or n == "cudaMemcpy" for n in names) - 1  # the one above


def _stepper(opt: Any, params: list[torch.nn.Parameter], device: torch.device) -> Callable[[], None]:
    """One step of ``opt`` on fixed grid gradients."""
    grads = [grid(p.shape, 7 + i).to(device) for i, p in enumerate(params)]

    def step() -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()

    return step


def host_syncs(device: torch.device, row: Row, verdict: Callable[[bool], bool | None]) -> None:
    """Host reads (and, on a GPU, profiled synchronizations) of one LionCub step for 8 and for 64 tensors
    (16 on the CPU) of the same total size: the step's synchronizations must not grow with its tensors."""
    from lioncub.optim import LionCub

    # the count depends neither on the tensors' size nor (much) on their number; on the CPU the Triton
    # interpreter's time does: there a dry run takes fewer and smaller tensors
    per_8, few, many = (32, 8, 64) if device.type == "cuda" else (2, 8, 16)
    for variant in ("1bit", "8bit"):
        counts = {}
        for tensors in (few, many):
            params = [
                torch.nn.Parameter(grid((4096 // tensors * per_8,), i).to(device)) for i in range(tensors)
            ]
            opt = LionCub(params, lr=LR, betas=BETAS, weight_decay=WD, variant=variant)
            step = _stepper(opt, params, device)
            for _ in range(2):  # the first steps build buffers and compare gradients once
                step()
            with HostReads() as reads:
                step()
            counts[tensors] = (reads.count, _sync_events(device, step), reads.names)
        (r8, s8, names8), (r64, s64, _) = counts[few], counts[many]
        measured = f"{r8} host reads {names8}" + ("" if s8 is None else f", {s8} CUDA syncs") + " per step"
        measured += f"; {many} tensors: {r64}" + ("" if s64 is None else f", {s64}")
        flat = r8 == r64 and s8 == s64
        label = f"LionCub {variant} step, {few} vs {many} tensors"
        row("host syncs", label, measured, "same count", verdict(flat))


# ------------------------------------------------------------------------------------ entry points


def vote_path(
    device: torch.device, n: int, check: Check, row: Row, verdict: Callable[[bool], bool | None]
) -> None:
    """Every check of this module on this rank (collective: every rank of the default group calls it)."""
    gloo = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    with exchange_when_alone():
        votes(device, gloo, check, n)
        presets(device, gloo, check)
        overlap(device, check)
        local_steps(device, gloo, check)
        checkpoint_round_trip(device, check)
        host_syncs(device, row, verdict)


def _rank_main() -> int:
    """One rank of the several-GPU check: the rows it produced as JSON in ``--out``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    rows: list[list[Any]] = []
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", args.rank)
    bound: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        bound["device_id"] = device
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo" if args.dry_run else "nccl",
        init_method=f"file://{args.store}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=120),
        **bound,
    )
    t0 = time.perf_counter()
    try:
        vote_path(
            device,
            args.n,
            lambda section, item, diff: rows.append(["check", section, item, diff]),
            lambda section, item, measured, target="", ok=None: rows.append(
                ["row", section, item, measured, target, ok]
            ),
            lambda ok: None if args.dry_run else ok,
        )
    finally:
        dist.destroy_process_group()
    rows.append(
        ["row", "vote path", f"rank {args.rank}: wall time", f"{time.perf_counter() - t0:.0f} s", "", None]
    )
    with open(args.out, "w") as f:
        json.dump(rows, f)
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())
