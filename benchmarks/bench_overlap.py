"""Overlapping the vote with the backward pass: step time with and without ``--overlap``, per link.

    python benchmarks/bench_overlap.py --links 100mbit,1gbit,loopback --steps 30 --out runs/bench-overlap

For every link, two ``lioncub compare`` runs on the GPT workload (4 ranks, each behind its own shaped link;
root): ``32bit`` (DDP + Lion, its allreduce overlapped as users run it), ``8bit`` and ``1bit`` at the
default ``--bucket-mb`` (the plain step: the votes start after the backward), and ``8bit+overlap`` and
``1bit+overlap`` with DDP buckets of ``--overlap-bucket-mb`` (the votes start bucket by bucket during the
backward). Per variant: median step time (rank 0), the plain step's communication share, the cut that
overlap brings, and the fraction of the plain step's communication that overlap hid:
``hidden = (step_plain − step_overlap) / comm_plain`` (negative when the overlapped step is slower).
Targets (issue 8): with overlap, 8bit and 1bit are never slower than 32bit on any link, and on 1gbit the
cut is ≥ 20 % wherever communication exceeds 20 % of the plain step. Prints markdown for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

PLAIN = ("32bit", "8bit", "1bit")
OVERLAPPED = ("8bit+overlap", "1bit+overlap")


def run_compare(args: argparse.Namespace, link: str, variants: tuple[str, ...], bucket_mb: float) -> dict:
    out = Path(args.out) / link / ("overlap" if "+overlap" in variants[0] else "plain")
    cmd = [sys.executable, "-m", "lioncub.cli", "compare", "--workload", "gpt", "--size", args.size]
    for item in args.set:
        cmd += ["--set", item]
    cmd += ["--variants", ",".join(variants), "--nproc", str(args.nproc), "--steps", str(args.steps)]
    cmd += ["--eval-every", "0", "--bucket-mb", str(bucket_mb), "--out", str(out), "--no-progress"]
    if link != "loopback":
        cmd += ["--link", link]
    if args.overwrite:
        cmd.append("--overwrite")
    print(f"[bench] {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    rows = json.loads((out / "summary.json").read_text())["rows"]
    return {r["variant"]: r for r in rows}


def table_rows(link: str, rows: dict) -> list[dict]:
    out = []
    base = rows["32bit"]["step_s"]
    for name in ("32bit", "8bit", "8bit+overlap", "1bit", "1bit+overlap"):
        r = rows[name]
        row = {
            "link": link,
            "variant": name,
            "step_s": r["step_s"],
            "compute_s": r["compute_s"],
            "comm_s": r["comm_s"],
            "vs_32bit": r["step_s"] / base,
        }
        if name.endswith("+overlap"):
            plain = rows[name.removesuffix("+overlap")]
            row["plain_comm_share"] = plain["comm_s"] / plain["step_s"]
            row["cut"] = 1 - r["step_s"] / plain["step_s"]
            row["hidden"] = (plain["step_s"] - r["step_s"]) / plain["comm_s"] if plain["comm_s"] else None
            row["not_slower_than_32bit"] = r["step_s"] <= base
            row["cut_target"] = (
                None if link != "1gbit" or row["plain_comm_share"] <= 0.2 else row["cut"] >= 0.2
            )
        out.append(row)
    return out


def markdown(rows: list[dict]) -> str:
    def pct(v: float | None) -> str:
        return "—" if v is None else f"{100 * v:+.0f}%"

    lines = [
        "| link | variant | step ms | compute ms | comm ms | ÷ 32bit | plain comm share | cut by overlap | "
        "comm hidden | ≤ 32bit |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        share = f"{100 * r['plain_comm_share']:.0f}%" if "plain_comm_share" in r else ""
        lines.append(
            f"| {r['link']} | {r['variant']} | {r['step_s'] * 1e3:.0f} | {r['compute_s'] * 1e3:.0f} | "
            f"{r['comm_s'] * 1e3:.0f} | {r['vs_32bit']:.2f} | {share} | "
            f"{pct(r['cut']) if 'cut' in r else ''} | {pct(r['hidden']) if 'hidden' in r else ''} | "
            f"{('yes' if r['not_slower_than_32bit'] else '**no**') if 'cut' in r else ''} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--links", default="100mbit,1gbit,loopback")
    p.add_argument("--size", default="small")
    p.add_argument("--set", action="append", default=[], help="workload fields, as lioncub compare --set")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--overlap-bucket-mb", type=float, default=1.0, help="DDP bucket size of the overlap runs")
    p.add_argument("--plain-bucket-mb", type=float, default=25.0, help="LionCub bucket size of plain runs")
    p.add_argument("--out", default="runs/bench-overlap")
    p.add_argument("--json", help="write the rows here too")
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args()
    if os.geteuid() != 0 and any(link != "loopback" for link in args.links.split(",")):
        print("bench_overlap: shaped links need root (network namespaces and tc)", file=sys.stderr)
        return 2
    rows: list[dict] = []
    for link in args.links.split(","):
        measured = run_compare(args, link, PLAIN, args.plain_bucket_mb)
        measured |= run_compare(args, link, OVERLAPPED, args.overlap_bucket_mb)
        rows += table_rows(link, measured)
    print(
        f"<!-- {datetime.date.today()} {platform.node()} {platform.processor() or platform.machine()} "
        f"{os.cpu_count()} cores, {' '.join(sys.argv[1:])} -->"
    )
    print(markdown(rows))
    for r in rows:
        if "cut" in r:
            target = {None: "n/a (comm ≤ 20 % or not 1gbit)", True: "met", False: "missed"}[r["cut_target"]]
            print(
                f"{r['link']} {r['variant']}: not slower than 32bit: {r['not_slower_than_32bit']}; "
                f"≥ 20 % cut: {target}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
