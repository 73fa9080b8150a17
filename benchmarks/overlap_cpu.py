"""Where an overlapped step's time goes: wall time against the CPU time of each rank, plain vs overlap.

    sudo lioncub launch --nproc 4 --link 100mbit -- python benchmarks/overlap_cpu.py --variant 8bit

On every rank, the GPT workload of ``benchmarks/bench_overlap.py`` (``size=small, n_embd=256,
batch_size=8``) trains ``--steps`` steps twice: with the plain LionCub step (the vote after the backward)
and with ``LionCub.overlap_with`` (DDP buckets of ``--bucket-mb``). Per mode, rank 0 prints the median
forward + backward time, the median ``step()`` time, and the median CPU time of the process per step
(``getrusage``: all its threads, user + system). Overlap can only hide the part of a step in which the
machine's cores would otherwise be idle: with the ranks' CPU at U % of the cores (assuming the ranks
alike, as rank 0), a plain step of wall time W has about (1 − U)·W to fill.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lioncub.optim import Checks, LionCub
from lioncub.optim.ddp import skip_gradient_allreduce
from lioncub.train.workloads import make_workload


def measure(overlap: bool, args: argparse.Namespace) -> tuple[float, float, float]:
    """Median (forward + backward, step, CPU) seconds per step of this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    wl = make_workload("gpt", "small", rank=rank, world_size=world, seed=0, n_embd=256, batch_size=8)
    net = wl.build_model()
    model = DistributedDataParallel(net, bucket_cap_mb=args.bucket_mb)
    opt = LionCub(
        net.parameters(), lr=1e-4, variant=args.variant, bucket_mb=25, checks=Checks(broadcast_init=False)
    )
    if overlap:
        opt.overlap_with(model)
    else:
        skip_gradient_allreduce(model)
    fwd_bwd, steps, cpu = [], [], []
    for step in range(args.steps + 2):
        dist.barrier()
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        wl.loss(model, wl.train_batch(step)).backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        if step >= 2:  # DDP rebuilds its buckets after the first iteration
            fwd_bwd.append(t1 - t0)
            steps.append(t2 - t1)
            cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
    return statistics.median(fwd_bwd), statistics.median(steps), statistics.median(cpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="8bit")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--bucket-mb", type=float, default=8.0, help="DDP bucket size")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = {mode: measure(mode == "overlap", args) for mode in ("plain", "overlap")}
    if dist.get_rank() == 0:
        cores, world = os.cpu_count() or 1, dist.get_world_size()
        print(
            "| mode | fwd+bwd ms | step() ms | wall ms | CPU ms per step (rank 0) | "
            f"{world} ranks' CPU / ({cores} cores × wall) |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for mode, (fb, st, cpu) in rows.items():
            wall = fb + st
            print(
                f"| {args.variant} {mode} | {fb * 1e3:.0f} | {st * 1e3:.0f} | {wall * 1e3:.0f} | "
                f"{cpu * 1e3:.0f} | {100 * world * cpu / (cores * wall):.0f} % |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
