"""All-to-all and all-gather of packed bytes: gloo's own collectives vs lioncub's pairwise isend/irecv.

Driver::

    python benchmarks/bench_exchange.py --nproc 4 --link 1gbit --sizes 4,16,40

launches itself on ``--nproc`` ranks behind shaped links (``lioncub launch``; needs root) and prints, per
operation and size, the median time over ``--iters`` iterations after a warm-up (max over ranks) and
the bus bandwidth ``size · (N−1)/N / time`` (nccl-tests convention) as a share of the link's TCP payload
rate (95.6 % of the line rate at MTU 1500).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from lioncub.collectives import Comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    n, rank = dist.get_world_size(), dist.get_rank()
    comms = {"gloo": Comm(exchange="native"), "p2p": Comm(exchange="p2p")}
    out = {}
    for mb in [float(s) for s in args.sizes.split(",")]:
        size = int(mb * 1e6) // n * n
        inp = torch.randint(0, 255, (n, size // n), dtype=torch.uint8)
        recv = torch.empty_like(inp)
        chunk = torch.randint(0, 255, (size // n,), dtype=torch.uint8)
        gathered = torch.empty(n, size // n, dtype=torch.uint8)
        for impl, comm in comms.items():
            for op in ("all_to_all", "all_gather"):
                times = []
                for it in range(args.iters + 1):
                    dist.barrier()
                    t0 = time.perf_counter()
                    if op == "all_to_all":
                        comm.all_to_all(recv, inp, "bench").wait()
                    else:
                        comm.all_gather(gathered, chunk, "bench").wait()
                    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                    if it:
                        times.append(float(dt))
                out[f"{op}/{impl}/{mb:g}MB"] = {
                    "median_s": statistics.median(times),
                    "min_s": min(times),
                    "bytes": size,
                }
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world_size": n, "results": out}, f)
    dist.barrier()  # nobody tears down its connections while a peer still reads from them
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--sizes", default="4,16,40", help="MB per rank's full buffer")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from lioncub.launch import LaunchConfig, launch, parse_rate

    rate = parse_rate(args.link)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "r.json")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--out",
            path,
            "--sizes",
            args.sizes,
            "--iters",
            str(args.iters),
        ]
        res = launch(LaunchConfig(cmd, nproc=args.nproc, link_rate_bps=rate, timeout_s=1800))
        if not res.ok:
            raise SystemExit(res.message)
        with open(path) as f:
            data = json.load(f)
    n = data["world_size"]
    payload = 0.956 * rate / 8
    print(
        f"# bench_exchange {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {n} ranks, "
        f"link {args.link}, {args.iters} iterations, median (max over ranks)"
    )
    print("| op | size | gloo ms | p2p ms | gloo busbw % of link | p2p busbw % of link | p2p speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mb in args.sizes.split(","):
        for op in ("all_to_all", "all_gather"):
            g = data["results"][f"{op}/gloo/{float(mb):g}MB"]
            p = data["results"][f"{op}/p2p/{float(mb):g}MB"]
            bus = g["bytes"] * (n - 1) / n
            share_g, share_p = (100 * bus / x["median_s"] / payload for x in (g, p))
            print(
                f"| {op} | {mb} MB | {g['median_s'] * 1e3:.1f} | {p['median_s'] * 1e3:.1f} | "
                f"{share_g:.0f} % | {share_p:.0f} % | {g['median_s'] / p['median_s']:.2f}× |"
            )


if __name__ == "__main__":
    main()
