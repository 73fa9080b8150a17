"""Experiments behind docs/findings.md: vote ties, quantizer sign agreement, where the momenta of the
workers differ (tied and untied embeddings), and β2 × momentum sync — on the GPT workload.

    python benchmarks/findings.py --out runs/findings --size tiny --seeds 0,1,2 [--only ties,quantizers,...]

Every run is a ``lioncub train`` (loopback; these are statistics of the optimizer, not of the network)
with ``--diagnostics-every``; finished runs are reused. Prints markdown tables (mean ± std over seeds)
and writes the diagnostics plots of the momentum-spread runs to ``--plots``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

EXPERIMENTS = ("ties", "quantizers", "spread", "sync")


def train(out: Path, args: argparse.Namespace, *sets: str, **options: object) -> Path:
    """``lioncub train`` into ``out`` (reused if finished) with ``--option value`` for every keyword
    (underscores become dashes) and ``--set`` for every positional ``FIELD=VALUE``."""
    if (out / "summary.json").exists():
        return out
    cmd = [sys.executable, "-m", "lioncub.cli", "train", "--workload", "gpt", "--size", args.size]
    cmd += ["--out", str(out), "--no-progress"]
    for name, value in options.items():
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    for item in (*args.set, *sets):
        cmd += ["--set", item]
    print(f"[findings] {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def records(run: Path, kind: str) -> list[dict]:
    lines = (run / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def overall(run: Path, key: str, skip_first: int = 1) -> float:
    """Mean over the diagnosed steps (the first ``skip_first`` left out: momenta still near zero)."""
    diags = records(run, "diag")[skip_first:]
    return statistics.mean(d["overall"][key] for d in diags)


def final_val(run: Path) -> float:
    return records(run, "eval")[-1]["val_loss"]


def ties(args: argparse.Namespace, seeds: list[int]) -> str:
    lines = [
        "| workers | tie rate of the sign vote (mean over steps 20–60) | independent signs C(N,N/2)/2^N |"
    ]
    lines.append("|---:|---:|---:|")
    from math import comb

    for n in (4, 8):
        rates = []
        for s in seeds:
            run = train(
                args.root / f"ties-n{n}-s{s}",
                args,
                variant="8bit-sign",
                nproc=n,
                steps=60,
                seed=s,
                diagnostics_every=10,
                eval_every=0,
            )
            rates.append(overall(run, "tie"))
        lines.append(f"| {n} | {mean_std(rates)} | {comb(n, n // 2) / 2**n:.4f} |")
    return "\n".join(lines)


def quantizers(args: argparse.Namespace, seeds: list[int]) -> str:
    lines = [
        f"| quantizer (8 bit, N = {args.nproc}) | match sign(Σc) | flip | val loss at step 200 |",
        "|---|---:|---:|---:|",
    ]
    for q in ("l1", "l0", "linf", "log", "qsgd"):
        match, flip, val = [], [], []
        for s in seeds:
            run = train(
                args.root / f"q-{q}-s{s}{args.suffix}",
                args,
                variant="8bit",
                quantizer=q,
                nproc=args.nproc,
                steps=200,
                seed=s,
                diagnostics_every=20,
                eval_every=100,
            )
            match.append(overall(run, "match"))
            flip.append(overall(run, "flip"))
            val.append(final_val(run))
        lines.append(f"| {q} | {mean_std(match)} | {mean_std(flip)} | {mean_std(val)} |")
    return "\n".join(lines)


def spread(args: argparse.Namespace, seeds: list[int]) -> str:
    lines = [
        "| embeddings | io tensors: max std of m | other tensors: max std of m | ratio |",
        "|---|---:|---:|---:|",
    ]
    for tied in (False, True):
        io_vals, other_vals = [], []
        for s in seeds:
            run = train(
                args.root / f"spread-tied{int(tied)}-s{s}{args.suffix}",
                args,
                f"tie_embeddings={'true' if tied else 'false'}",
                variant="1bit",
                nproc=args.nproc,
                steps=100,
                seed=s,
                diagnostics_every=25,
                eval_every=0,
            )
            layers = records(run, "diag")[-1]["layers"]
            io = [
                v["momentum_max_std"] for n, v in layers.items() if "wte" in n or "wpe" in n or "lm_head" in n
            ]
            other = [
                v["momentum_max_std"]
                for n, v in layers.items()
                if not ("wte" in n or "wpe" in n or "lm_head" in n)
            ]
            io_vals.append(statistics.mean(io))
            other_vals.append(statistics.mean(other))
            if args.plots and s == seeds[0]:
                from lioncub.report import diagnostics as diag_report

                diag_report.write_plots(run, Path(args.plots) / f"spread-tied{int(tied)}{args.suffix}")
        ratio = [a / b for a, b in zip(io_vals, other_vals, strict=True)]
        label = "tied" if tied else "untied"
        lines.append(f"| {label} | {mean_std(io_vals)} | {mean_std(other_vals)} | {mean_std(ratio)} |")
    return "\n".join(lines)


def sync(args: argparse.Namespace, seeds: list[int]) -> str:
    lines = [
        f"| β2 (N = {args.nproc}, {args.sync_steps} steps) | sync none | sync io (every 10) "
        "| sync all (every 10) |",
        "|---:|---:|---:|---:|",
    ]
    steps_suffix = "" if args.sync_steps == 200 else f"-t{args.sync_steps}"
    for beta2 in (0.95, 0.99):
        cells = []
        for mode in ("none", "io", "all"):
            vals = []
            for s in seeds:
                run = train(
                    args.root / f"sync-b{beta2}-{mode}-s{s}{args.suffix}{steps_suffix}",
                    args,
                    f"betas=[0.9, {beta2}]",
                    variant="1bit",
                    nproc=args.nproc,
                    steps=args.sync_steps,
                    seed=s,
                    momentum_sync=mode,
                    sync_every=10,
                    eval_every=args.sync_steps // 2,
                )
                vals.append(final_val(run))
            cells.append(mean_std(vals))
        lines.append(f"| {beta2} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/findings")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--only", default=",".join(EXPERIMENTS))
    ap.add_argument("--plots", help="write the momentum-spread diagnostics plots here")
    ap.add_argument("--nproc", type=int, default=4, help="workers of the quantizer, spread and sync runs")
    ap.add_argument("--sync-steps", type=int, default=200, help="training steps of the β2 × sync runs")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="for every run")
    ap.add_argument("--tag", default="", help="suffix of the run folders (use with --set)")
    args = ap.parse_args()
    if args.set and not args.tag:
        ap.error("--set needs --tag (the run folders must not be confused with the default runs')")
    args.root = Path(args.out)
    args.suffix = ("" if args.nproc == 4 else f"-n{args.nproc}") + (f"-{args.tag}" if args.tag else "")
    seeds = [int(s) for s in args.seeds.split(",")]
    for name in args.only.split(","):
        print(f"\n### {name}\n")
        print({"ties": ties, "quantizers": quantizers, "spread": spread, "sync": sync}[name](args, seeds))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
