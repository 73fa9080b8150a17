"""Long training comparison: ``lioncub compare`` per link, with the ideal (Amdahl) speedup of each variant.

    python benchmarks/bench_train.py --links 100mbit,1gbit --steps 150 --out runs/bench-train

For every link: ``lioncub compare`` of the variants on the GPT workload (4 ranks, each behind its own
shaped link; root). Then, per variant, the ideal step time by Amdahl's law is its measured compute
(forward + backward) plus the bytes it sends per rank per step over the link's TCP payload rate
(0.956 · rate at MTU 1500), and the ideal speedup over ``32bit`` is the ratio of the ideal times. The
achieved fraction is the measured speedup over the ideal one. Prints markdown for BENCHMARKS.md and
copies the report's PNGs to ``--plots DIR/<link>/``.

``--nodes MxL`` (issue 19) runs the comparison on M emulated nodes of L ranks (one shaped NIC per node,
``lioncub compare --nnodes M --nproc-per-node L``; variants may name a topology, ``1bit@hierarchical``).
The wire term of the ideal is then the bytes through a node's NIC per step (the busier direction) over
the NIC's payload rate — the traffic inside a node rides the loopback and is not charged. Those bytes
come from :func:`lioncub.planning.costmodel.predict_cluster` for the model's parameter count, whose
per-level bytes the tests hold equal to what the votes count; the table shows them per node.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

PAYLOAD_EFFICIENCY = 0.956  # TCP payload per byte of line rate at MTU 1500


def run_compare(args: argparse.Namespace, link: str) -> Path:
    out = Path(args.out) / link
    cmd = [sys.executable, "-m", "lioncub.cli", "compare", "--workload", "gpt", "--size", args.size]
    for item in args.set:
        cmd += ["--set", item]
    cmd += ["--variants", args.variants, "--steps", str(args.steps)]
    if args.nodes:
        m, ell = parse_nodes(args.nodes)
        cmd += ["--nnodes", str(m), "--nproc-per-node", str(ell)]
    else:
        cmd += ["--nproc", str(args.nproc)]
    cmd += ["--eval-every", str(args.eval_every), "--out", str(out), "--no-progress"]
    if link != "loopback":
        cmd += ["--link", link]
    if args.overwrite:
        cmd.append("--overwrite")
    if args.report_only:
        cmd.append("--report-only")
    print(f"[bench] {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    return out


def parse_nodes(text: str) -> tuple[int, int]:
    """``"2x2"`` → (M, L)."""
    try:
        m, ell = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--nodes {text!r}: give MxL, e.g. 2x2 (M nodes of L ranks)") from None
    return m, ell


def param_count(args: argparse.Namespace) -> int:
    """Parameters of the compared GPT (built once here with the same --set fields)."""
    from lioncub.train.workloads import make_workload

    overrides: dict = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") else value
    workload = make_workload("gpt", args.size, **overrides)
    model = workload.build_model()
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def nic_bytes(variant: str, d: int, nodes: tuple[int, int]) -> float:
    """Bytes through a node's NIC per step (the busier direction) of the compared run ``variant``
    (``name@topology``, ``name/hH``: per inner step)."""
    from lioncub.names import parse_run_name
    from lioncub.planning import costmodel as cm

    fields = parse_run_name(variant)
    net = cm.Network.from_rate(1e9, 0.0)  # the rates do not change the bytes
    cluster = cm.Cluster(*nodes, net, net)
    p = cm.predict_cluster(
        fields["variant"], d, cluster, fields.get("topology", "flat"), local_steps=fields.get("local_steps")
    )
    return max(p.nic_sent, p.nic_recv)


def amdahl_rows(report_dir: Path, link: str, nodes: tuple[int, int] | None = None, d: int = 0) -> list[dict]:
    from lioncub.units import parse_rate

    summary = json.loads((report_dir / "summary.json").read_text())
    rows = summary["rows"]
    rate = None if link == "loopback" else parse_rate(link) * PAYLOAD_EFFICIENCY / 8  # bytes/s
    ideal = {}
    for r in rows:
        if nodes is not None:
            r["nic_bytes_per_step"] = nic_bytes(r["variant"], d, nodes)
        wire_bytes = r["nic_bytes_per_step"] if nodes is not None else r["bytes_sent_per_step"]
        wire = wire_bytes / rate if rate else 0.0
        ideal[r["variant"]] = r["compute_s"] + wire
    base = next((r for r in rows if r["variant"] == "32bit"), None)
    out = []
    for r in rows:
        ideal_speedup = ideal["32bit"] / ideal[r["variant"]] if base else None
        out.append(
            {
                **r,
                "link": link,
                "ideal_step_s": ideal[r["variant"]],
                "ideal_speedup": ideal_speedup,
                "fraction_of_ideal": (r["speedup"] / ideal_speedup) if base and r["speedup"] else None,
                "val_loss_vs_32bit": (
                    r["val_loss_equal_step"] / base["val_loss_equal_step"] - 1
                    if base and r["val_loss_equal_step"] and base["val_loss_equal_step"]
                    else None
                ),
            }
        )
    return out


def markdown(rows: list[dict]) -> str:
    nodes = any(r.get("nic_bytes_per_step") is not None for r in rows)  # flat runs' summaries hold None
    lines = [
        "| link | variant | step ms | compute ms | comm ms | MB/step/rank | "
        + ("NIC MB/step/node | " if nodes else "")
        + "speedup | ideal (Amdahl) | of ideal | val loss (step) | vs 32bit | time to target s |",
        "|---|---|---:|---:|---:|---:|" + ("---:|" if nodes else "") + "---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:

        def f(v: float | None, spec: str) -> str:
            return "—" if v is None else format(v, spec)

        nic = f"{r['nic_bytes_per_step'] / 1e6:.3f} | " if nodes else ""
        lines.append(
            f"| {r['link']} | {r['variant']} | {r['step_s'] * 1e3:.0f} | {r['compute_s'] * 1e3:.0f} | "
            f"{r['comm_s'] * 1e3:.0f} | {r['bytes_sent_per_step'] / 1e6:.3f} | {nic}"
            f"{f(r['speedup'], '.2f')}× | "
            f"{f(r['ideal_speedup'], '.2f')}× | {f(r['fraction_of_ideal'], '.0%')} | "
            f"{f(r['val_loss_equal_step'], '.4f')} ({r['equal_step']}) | "
            f"{f(r['val_loss_vs_32bit'], '+.2%')} | "
            f"{f(r['time_to_target_s'], '.0f')} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", default="100mbit,1gbit")
    ap.add_argument("--variants", default="32bit,16bit,1bit,4bit,8bit")
    ap.add_argument("--size", default="small")
    ap.add_argument("--set", action="append", default=[], help="workload field, e.g. n_embd=256")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--out", default="runs/bench-train")
    ap.add_argument("--plots", help="copy the PNGs to PLOTS/<link>/")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--nodes", help="MxL: M emulated nodes of L ranks, one NIC each (replaces --nproc)")
    ap.add_argument("--report-only", action="store_true", help="rebuild the tables from the runs in --out")
    args = ap.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)
    nodes = parse_nodes(args.nodes) if args.nodes else None
    d = param_count(args) if nodes else 0
    rows: list[dict] = []
    for link in args.links.split(","):
        report_dir = run_compare(args, link)
        rows += amdahl_rows(report_dir, link, nodes, d)
        if args.plots:
            dest = Path(args.plots) / link
            dest.mkdir(parents=True, exist_ok=True)
            for png in report_dir.glob("*.png"):
                shutil.copy(png, dest / png.name)
    wall = datetime.datetime.now(datetime.timezone.utc) - started
    import torch

    print(
        f"# bench_train {started:%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}; gpt {args.size} {' '.join(args.set)}, "
        f"{f'{args.nodes} nodes x ranks ({d:,} parameters)' if nodes else f'{args.nproc} ranks'}, "
        f"{args.steps} steps, "
        f"eval every {args.eval_every}; wall {wall.total_seconds() / 60:.1f} min"
    )
    print(markdown(rows))


if __name__ == "__main__":
    main()
