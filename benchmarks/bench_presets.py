"""Per-step optimizer time and bytes of every LionCub preset on a flat model, per network, in one run.

Driver (no RANK in the environment)::

    python benchmarks/bench_presets.py --params 25M --nproc 4 --links loopback,1gbit --steps 5

launches itself on ``--nproc`` ranks once per link (``lioncub launch``; a shaped link needs root) and
prints a table. Each rank builds ``--params`` parameters split into tensors of realistic sizes, sets
rank-dependent random gradients and times ``optimizer.step()``: the local direction, quantize/pack, the
exchange, unpack and apply (for ``32bit``: the fp32 gradient allreduce and the Lion update, as DDP +
Lion). The issue's measure is the *communication time including quantize/pack/unpack*: the optimizer's
``encode`` + ``exchange`` phases (median over steps, rank 0); the full step adds the local Lion
arithmetic that every preset shares. Step time is the max over ranks, median over ``--steps`` steps
after one warm-up; also the bytes each rank sent per step (the optimizer's own accounting) and, under a
shaped link, the bytes the rank's interface really sent (kernel counters, whole run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

SPLITS = ("direction_s", "encode_s", "exchange_s", "apply_s", "communication_s")
PRESET_ORDER = ["32bit", "16bit", "dlion-mavo", "dlion-avg", "8bit-sign", "8bit", "4bit", "1bit"]


def parse_count(text: str) -> int:
    mult = {"K": 10**3, "M": 10**6, "B": 10**9}
    t = text.strip().upper()
    return int(float(t[:-1]) * mult[t[-1]]) if t[-1] in mult else int(t)


def tensor_sizes(total: int) -> list[int]:
    """A transformer-like mix: large matrices, medium matrices and small vectors adding up to ``total``."""
    sizes: list[int] = []
    left = total
    pattern = [4_000_000, 1_000_000, 1_000_000, 250_000, 4096, 4096, 1024]
    i = 0
    while left > 0:
        s = min(pattern[i % len(pattern)], left)
        sizes.append(s)
        left -= s
        i += 1
    return sizes


# ----------------------------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from lioncub.optim import LionCub, resolve_variant

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = tensor_sizes(parse_count(args.params))
    results = {}
    for preset in args.presets.split(","):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in sizes]
        config = resolve_variant(preset, exchange=args.exchange)
        opt = LionCub(params, lr=1e-4, variant=config, bucket_mb=args.bucket_mb)
        gen = torch.Generator().manual_seed(1000 + rank)
        grads = [torch.randn(s, generator=gen) for s in sizes]
        times: list[float] = []
        splits: list[dict] = []
        for step in range(args.steps + 1):
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if step > 0:  # the first step allocates buffers and momenta
                times.append(float(dt))
                splits.append(opt.comm_stats()["last"])
        results[preset] = {
            "median_s": statistics.median(times),
            "min_s": min(times),
            "bytes_sent": splits[-1]["bytes_sent"],
            "bytes_recv": splits[-1]["bytes_recv"],
            "collectives": splits[-1]["collectives"],
            **{k: statistics.median(s[k] for s in splits) for k in SPLITS},
            "steps_taken": args.steps + 1,
        }
        del opt, params
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world_size": world, "params": sum(sizes), "results": results}, f)
    dist.barrier()  # nobody tears down its connections while a peer still reads from them
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- driver


def run_link(args: argparse.Namespace, link: str) -> dict:
    from lioncub.launch import LaunchConfig, launch, parse_rate

    rate = None if link == "loopback" else parse_rate(link)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--out",
            out,
            "--params",
            args.params,
            "--presets",
            args.presets,
            "--steps",
            str(args.steps),
            "--bucket-mb",
            str(args.bucket_mb),
            "--exchange",
            args.exchange,
        ]
        res = launch(LaunchConfig(cmd, nproc=args.nproc, link_rate_bps=rate, timeout_s=args.timeout))
        if not res.ok:
            raise SystemExit(f"benchmark on {link} failed: {res.message}")
        with open(out) as f:
            data = json.load(f)
    data["link"] = link
    if res.traffic:
        data["iface_tx_bytes"] = [t.tx_bytes for t in res.traffic]
    return data


def markdown(all_data: list[dict]) -> str:
    lines = [
        "| link | preset | step ms | comm ms (quantize+wire+unpack) | × 32bit (comm) | × 32bit (step) | "
        "sent MB/step/rank | direction ms | encode ms | exchange ms | apply ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for data in all_data:
        res = data["results"]
        base = res.get("32bit")
        for preset in [p for p in PRESET_ORDER if p in res] + [p for p in res if p not in PRESET_ORDER]:
            r = res[preset]
            comm_ratio = f"{base['communication_s'] / r['communication_s']:.2f}" if base else "—"
            step_ratio = f"{base['median_s'] / r['median_s']:.2f}" if base else "—"
            ms = {k: r[k] * 1e3 for k in ("median_s", *SPLITS)}
            lines.append(
                f"| {data['link']} | {preset} | {ms['median_s']:.1f} | {ms['communication_s']:.1f} | "
                f"{comm_ratio} | {step_ratio} | {r['bytes_sent'] / 1e6:.2f} | {ms['direction_s']:.1f} | "
                f"{ms['encode_s']:.1f} | {ms['exchange_s']:.1f} | {ms['apply_s']:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="25M")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--links", default="loopback,1gbit")
    ap.add_argument("--presets", default=",".join(PRESET_ORDER))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--exchange", default="auto", choices=["auto", "p2p", "native"])
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    started = datetime.datetime.now(datetime.timezone.utc)
    all_data = [run_link(args, link) for link in args.links.split(",")]
    import torch

    print(
        f"# bench_presets {started:%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {args.nproc} ranks, {parse_count(args.params):,} params, "
        f"bucket {args.bucket_mb} MB, exchange {args.exchange}, {args.steps} timed steps"
    )
    print(markdown(all_data))
    for data in all_data:
        if "iface_tx_bytes" in data:
            steps = sum(r["steps_taken"] for r in data["results"].values())
            print(
                f"{data['link']}: interface tx per rank over the whole run: "
                f"{[round(b / 1e6, 1) for b in data['iface_tx_bytes']]} MB ({steps} optimizer steps)"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_data, f, indent=1)


if __name__ == "__main__":
    main()
