"""Every preset against its wire ideal, with the fused CPU passes, paired in one job per link (issue 20).

    python benchmarks/bench_fused.py --links 1gbit,100mbit --workloads mlp,gpt --rounds 8

For every (workload, link): one ``lioncub launch --nproc 4 --link RATE`` (root) in which every rank (one
intra-op thread) builds the workload once and steps these configurations **in turns**, on the same
batches (pairing: the drifts of a shared machine hit all alike). A turn is ``--turn`` (2) consecutive steps
of one configuration of which the last is timed: on this VM memory left untouched for a few seconds is
several times slower to touch again (a copy of 128 MiB: 20 ms hot, 50–80 ms after 5–10 s idle), so a
configuration's own buffers (the votes' payloads, the next momenta, the exchange buffers) would be cold at
every single-step turn, which a training run never sees.

* ``floor``: forward + backward + a local :class:`lioncub.Lion` step, no communication at all (the Lion
  step is also timed alone: ``lion ms``);
* ``ddp``: DDP (fp32 gradient allreduce overlapped with the backward) + :class:`lioncub.Lion` — the
  baseline every speedup is taken against;
* every LionCub preset (``32bit``, ``16bit``, ``1bit``, ``4bit``, ``8bit``, ``8bit-sign``, ``dlion-mavo``,
  ``dlion-avg``), the plain step (the vote after the backward), ``bucket_mb=25``.

Workloads: ``mlp`` — ``Linear(2048,4096)–ReLU–Linear(4096,4096)–ReLU–Linear(4096,2048)`` (33.6 M
parameters), batch 8 of random inputs, MSE to random targets; ``gpt`` — the GPT workload ``size=small``
with ``n_embd=256, batch_size=8`` (3.2 M parameters, the model of the long GPT benchmark). The floor and
the LionCub configurations share one model and one momentum per parameter (timing does not depend on the
values; memory would not hold nine copies of the 33.6 M model on 4 ranks); ``ddp`` has its own copy.

Per configuration (medians over the rounds after one warm-up round, rank 0's clock; bytes: the largest of
any rank's sent or received bytes per step, LionCub's own counters, DDP's from the ring formula
``2·(N−1)/N·4·d``):

* ``ideal`` = floor + bytes / (0.956 × link) (TCP payload at MTU 1500);
* ``speedup`` = step(ddp) / step(preset); ``ideal speedup`` = ideal(ddp) / ideal(preset); ``of ideal``
  = speedup / ideal speedup. Target: ≥ 90 % for every preset on both links.
* LionCub's local work (``direction + encode + apply`` of its ``comm_stats``; the 1-bit count runs inside
  the exchange wait and is not in it) and, for ``1bit``, that local work beyond the Lion step, over the
  Lion step. Target: ≤ 25 %.

The one-time build (or cache load) of the fused CPU kernels happens when the optimizers are built, before
the first timed step; its seconds are reported (``kernels``). ``--torch`` runs with
``LIONCUB_CPU_KERNELS=0`` (the torch passes: the "before" numbers). Prints markdown; ``--json`` keeps rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRESETS = ("32bit", "16bit", "1bit", "4bit", "8bit", "8bit-sign", "dlion-mavo", "dlion-avg")
CONFIGS = ("floor", "ddp", *PRESETS)
PAYLOAD = 0.956  # TCP payload share of the link at MTU 1500


# ------------------------------------------------------------------------------------- one rank (worker)


def _mlp_model():
    import torch.nn as nn

    return nn.Sequential(
        nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 2048)
    )


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lioncub.ops import native
    from lioncub.optim import Checks, Lion, LionCub

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.workload == "mlp":
        torch.manual_seed(0)
        model, ddp_net = _mlp_model(), _mlp_model()
        gen = torch.Generator().manual_seed(100 + rank)
        batches = [
            (torch.randn(8, 2048, generator=gen), torch.randn(8, 2048, generator=gen)) for _ in range(4)
        ]

        def loss_of(net, step: int):
            x, y = batches[step % len(batches)]
            return torch.nn.functional.mse_loss(net(x), y)

    else:
        from lioncub.train.workloads import make_workload

        wl = make_workload(
            "gpt", "small", rank=rank, world_size=world, seed=0, n_embd=256, batch_size=8, data_mode="random"
        )
        torch.manual_seed(0)
        model, ddp_net = wl.build_model(), wl.build_model()

        def loss_of(net, step: int):
            return wl.loss(net, wl.train_batch(step))

    params = [p for p in model.parameters() if p.requires_grad]
    d = sum(p.numel() for p in params)
    t0 = time.perf_counter()
    shared = {p: torch.zeros_like(p) for p in params}  # one momentum for the floor and every preset
    floor_opt = Lion(params, lr=1e-5, weight_decay=0.1)
    for p in params:
        floor_opt.state[p] = {"step": 0, "exp_avg": shared[p]}
    ddp = DistributedDataParallel(ddp_net)
    ddp_opt = Lion(ddp.parameters(), lr=1e-5, weight_decay=0.1)
    runs: dict[str, tuple] = {"floor": (model, floor_opt), "ddp": (ddp, ddp_opt)}
    for preset in PRESETS:
        opt = LionCub(params, lr=1e-5, weight_decay=0.1, variant=preset, checks=Checks(broadcast_init=False))
        for p in params:
            opt.state[p]["exp_avg"] = shared[p]
        runs[preset] = (model, opt)
    setup_s = time.perf_counter() - t0
    times: dict[str, dict[str, list[float]]] = {name: {} for name in CONFIGS}

    def note(name: str, key: str, value: float) -> None:
        times[name].setdefault(key, []).append(value)

    for step in range(args.rounds + 1):  # round 0: warm-up (first-touch pages, DDP's bucket rebuild)
        for name, (net, opt) in runs.items():
            for _ in range(args.turn):  # the last step of a turn is timed: its buffers are warm
                dist.barrier()
                t0 = time.perf_counter()
                loss_of(net, step).backward()
                t1 = time.perf_counter()
                opt.step()
                t2 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
            if step == 0:
                continue
            note(name, "step_s", time.perf_counter() - t0)
            note(name, "backward_s", t1 - t0)
            note(name, "opt_s", t2 - t1)
            if isinstance(opt, LionCub):
                last = opt.comm_stats()["last"]
                for key in ("direction_s", "encode_s", "exchange_s", "apply_s"):
                    note(name, key, last[key])
                note(name, "bytes", max(last["bytes_sent"], last["bytes_recv"]))
    med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    med["ddp"]["bytes"] = 2 * (world - 1) / world * 4 * d
    every = [None] * world
    dist.all_gather_object(every, {name: m.get("bytes", 0.0) for name, m in med.items()})
    for name in CONFIGS:
        med[name]["bytes"] = max(r[name] for r in every)  # the busiest rank (dlion-mavo: the server)
    if rank == 0:
        info = {
            "params": d,
            "world": world,
            "rounds": args.rounds,
            "setup_s": setup_s,
            "kernels": native.reason() or "fused CPU kernels",
            "kernel_build_s": native.build_seconds(),
        }
        Path(args.worker_out).write_text(json.dumps({"info": info, "configs": med}))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ the driver


def run_job(args: argparse.Namespace, workload: str, link: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "rows.json"
        os.chmod(tmp, 0o755)
        cmd = [sys.executable, "-m", "lioncub.cli", "launch", "--nproc", str(args.nproc), "--timeout", "7200"]
        cmd += ["--link", link]
        cmd += ["--", sys.executable, __file__, "--worker-out", str(result), "--rounds", str(args.rounds)]
        cmd += ["--workload", workload, "--turn", str(args.turn)]
        env = dict(os.environ)
        if args.torch:
            env["LIONCUB_CPU_KERNELS"] = "0"
        print(f"[bench] {workload} {link}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        done = subprocess.run(cmd, check=False, stdout=sys.stderr, env=env)
        if done.returncode != 0 and not result.exists():
            raise SystemExit(f"bench_fused: {workload} on {link} failed (exit code {done.returncode})")
        if done.returncode != 0:  # e.g. a rank aborted while leaving the group, after rank 0 wrote the rows
            print(f"[bench] warning: exit code {done.returncode} after rank 0's rows", file=sys.stderr)
        out = json.loads(result.read_text())
        out["info"]["wall_s"] = time.perf_counter() - t0
        return out


def rate_bytes(link: str) -> float:
    from lioncub.units import parse_rate

    return parse_rate(link) / 8


def table_rows(workload: str, link: str, measured: dict) -> list[dict]:
    cfg = measured["configs"]
    rate = PAYLOAD * rate_bytes(link)
    floor = cfg["floor"]["step_s"]
    lion = cfg["floor"]["opt_s"]
    base, base_ideal = cfg["ddp"]["step_s"], floor + cfg["ddp"]["bytes"] / rate
    rows = []
    for name in CONFIGS:
        c = cfg[name]
        ideal = floor + c["bytes"] / rate
        row = {
            "workload": workload,
            "link": link,
            "config": name,
            "step_s": c["step_s"],
            "opt_s": c["opt_s"],
            "bytes": c["bytes"],
            "ideal_s": ideal,
            "speedup": base / c["step_s"],
            "ideal_speedup": base_ideal / ideal,
        }
        row["of_ideal"] = row["speedup"] / row["ideal_speedup"]
        if "apply_s" in c:
            row["split_s"] = [c["direction_s"], c["encode_s"], c["apply_s"]]
            row["local_s"] = c["direction_s"] + c["encode_s"] + c["apply_s"]
            row["exchange_s"] = c["exchange_s"]
            row["beyond_lion"] = (row["local_s"] - lion) / lion
        rows.append(row)
    return rows


def markdown(rows: list[dict], infos: dict[tuple[str, str], dict]) -> str:
    lines = [
        "| workload | link | config | step ms | optimizer ms | local ms (dir+enc+apply) | MB/step | "
        "ideal ms | speedup | ideal speedup | of ideal | local beyond Lion |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        split = "+".join(f"{v * 1e3:.0f}" for v in r.get("split_s", []))
        local = f"{r['local_s'] * 1e3:.0f} ({split})" if "local_s" in r else ""
        beyond = f"{100 * r['beyond_lion']:+.0f}%" if "beyond_lion" in r else ""
        of_ideal = "" if r["config"] in ("floor", "ddp") else f"{100 * r['of_ideal']:.0f}%"
        lines.append(
            f"| {r['workload']} | {r['link']} | {r['config']} | {r['step_s'] * 1e3:.0f} | "
            f"{r['opt_s'] * 1e3:.1f} | {local} | {r['bytes'] / 1e6:.2f} | {r['ideal_s'] * 1e3:.0f} | "
            f"{r['speedup']:.2f}× | {r['ideal_speedup']:.2f}× | {of_ideal} | {beyond} |"
        )
    lines.append("")
    for (workload, link), info in infos.items():
        lines.append(
            f"- {workload} {link}: {info['params']:,} parameters, {info['world']} ranks, "
            f"{info['rounds']} rounds, job {info['wall_s']:.0f} s; kernels: {info['kernels']} (build/load "
            f"{info['kernel_build_s']:.2f} s, before the first timed step; optimizer setup "
            f"{info['setup_s']:.1f} s)"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--links", default="1gbit,100mbit")
    p.add_argument("--workloads", default="mlp,gpt")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8, help="measured steps of each configuration")
    p.add_argument("--torch", action="store_true", help="LIONCUB_CPU_KERNELS=0: the torch passes")
    p.add_argument("--turn", type=int, default=2, help="consecutive steps per turn; the last one is timed")
    p.add_argument("--json", help="write the rows here too")
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker_out:
        worker(args)
        return 0
    if os.geteuid() != 0:
        print("bench_fused: shaped links need root (network namespaces and tc)", file=sys.stderr)
        return 2
    rows: list[dict] = []
    infos: dict[tuple[str, str], dict] = {}
    for workload in args.workloads.split(","):
        for link in args.links.split(","):
            measured = run_job(args, workload, link)
            infos[(workload, link)] = measured["info"]
            rows += table_rows(workload, link, measured)
            print(markdown(rows, infos), file=sys.stderr, flush=True)  # progress: the table so far
    print(
        f"<!-- {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{os.cpu_count()} cores: {' '.join(sys.argv)} -->"
    )
    print(markdown(rows, infos))
    for r in rows:
        if r["config"] in PRESETS:
            print(
                f"{r['workload']} {r['link']} {r['config']}: of ideal {100 * r['of_ideal']:.0f}% "
                "(target ≥ 90%)"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "info": [[*k, v] for k, v in infos.items()]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
