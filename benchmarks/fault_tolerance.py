"""Replica groups that die and rejoin, measured: ``lioncub train --fault-tolerant`` against an uninterrupted
run and against today's ``--restarts 1`` from a checkpoint (docs/fault-tolerance.md, BENCHMARKS.md).

    sudo python benchmarks/fault_tolerance.py --out runs/fault-tolerance            # 20 Mbit/s, GPT small

Every row trains GPT small (batch 8) on 4 ranks, each behind its own ``--link`` (root), for ``--steps``
steps. The failure schedule kills group 1 after a third of the steps and starts it again at two thirds.
Rows (seed 0): per-step ``1bit`` without fault tolerance (uninterrupted, and killed at the same step with
``--restarts 1`` and a checkpoint every ``--checkpoint-every`` steps: ``tests/kill_rank.py``), and
``--fault-tolerant`` ``1bit``, ``1bit/h4``, lioncub's ``diloco/h4/keep`` and ``torchft-diloco/h4``, each
uninterrupted and killed and rejoined (``1bit`` also with ``--momentum-on-heal zeros``); with ``--seeds``
more seeds of the per-step ``1bit`` pair. Then the vote's sign match at N = 4 and N = 3 (even and odd)
from ``--diagnostics-every`` runs on loopback.

Printed as markdown: per row the time per step before, during and after the loss (medians), each heal
(step, MB, seconds), the steps per number of participants, the wall time (the launch, measured here), the
bytes per rank per step and the final validation loss against its uninterrupted row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(out: Path, args: argparse.Namespace, name: str, extra: list[str], seed: int, kill: bool) -> dict:
    """``lioncub train`` of one row into ``out/name`` (skipped if it finished before); its summary, the
    launch's wall time and its step records."""
    run_dir = out / name
    wall_file = out / f"{name}.wall_s"  # beside the run directory, which holds only lioncub's files
    if not (run_dir / "summary.json").exists():
        train = ["train", "--workload", "gpt", "--size", args.size, "--set", "batch_size=8", "--nproc", "4"]
        train += ["--link", args.link, "--steps", str(args.steps), "--eval-every", str(args.eval_every)]
        train += ["--seed", str(seed), "--out", str(run_dir), "--no-progress", *extra]
        k, r = args.steps // 3, 2 * args.steps // 3
        cmd = [sys.executable, "-m", "lioncub.cli", *train]
        if "--restarts" in extra:  # rank 1 SIGKILLs itself before its k-th step; the job restarts
            cmd = [sys.executable, str(HERE.parent / "tests" / "kill_rank.py"), "--launches", f"1:{k}",
                   "lioncub.cli", *train]  # fmt: skip
        elif kill:
            cmd += ["--kill", f"1@{k}", "--rejoin", f"1@{r}"]
        t0 = time.monotonic()
        print(
            f"[{datetime.datetime.now():%H:%M:%S}] {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True
        )
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        wall_file.write_text(f"{time.monotonic() - t0:.3f}\n")
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [
        r for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines()) if r["kind"] == "step"
    ]
    return {"summary": summary, "wall_s": float(wall_file.read_text()), "steps": steps}


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def slug(name: str) -> str:
    """A row's directory: ``ft 1bit/h4, killed (seed 1)`` -> ``ft_1bit_h4_killed_seed_1``."""
    return "".join("_" if c in " /" else c for c in name if c not in ",()")


def phases(steps: list[dict], k: int, r: int) -> tuple[float, float, float]:
    """Median step time (ms) of steps 1..k, k+1..r and r+1..; with local steps over whole windows."""

    def med(lo: int, hi: int) -> float:
        return statistics.median(s["step_s"] for s in steps if lo < s["step"] <= hi) * 1e3

    return med(0, k), med(k, r), med(r, 10**9)


def row(name: str, res: dict, base: dict | None, k: int, r: int) -> str:
    s, steps = res["summary"], res["steps"]
    before, during, after = phases(steps, k, r)
    ft = s.get("fault_tolerance") or {}
    heals = "; ".join(
        f"{h['step']}: {h['nbytes'] / 1e6:.1f} MB, {h['seconds']:.2f} s" for h in ft.get("heals", [])
    )
    parts = ", ".join(f"{n}×{c}" for c, n in ft.get("participants", {}).items()) or "4×all"
    loss = s["final"]["val_loss"]
    delta = "" if base is None else f"{(loss / base['summary']['final']['val_loss'] - 1) * 100:+.2f} %"
    bytes_step = statistics.fmean(x["bytes_sent"] for x in steps) / 1e3
    train_s = steps[-1]["time_s"]
    return (
        f"| {name} | {before:.0f} / {during:.0f} / {after:.0f} | {parts} | {heals or '-'} | {train_s:.1f} | "
        f"{res['wall_s']:.1f} | {bytes_step:.1f} | {loss:.4f} | {delta} |"
    )


def sign_match(out: Path, args: argparse.Namespace) -> list[str]:
    """The 1-bit vote's match with the sign of the mean update at N = 4 and 3 (loopback, diagnostics)."""
    lines = ["| N | vote matches sign of mean update | ties | final val loss |", "|---|---:|---:|---:|"]
    for n in (4, 3):
        run_dir = out / f"diag-n{n}"
        if not (run_dir / "summary.json").exists():
            cmd = [sys.executable, "-m", "lioncub.cli", "train", "--workload", "gpt", "--size", args.size,
                   "--set", "batch_size=8", "--nproc", str(n), "--steps", str(args.diag_steps), "--variant",
                   "1bit", "--diagnostics-every", "8", "--out", str(run_dir), "--no-progress"]  # fmt: skip
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        diags = [
            r
            for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines())
            if r["kind"] == "diag"
        ]
        match = statistics.fmean(d["overall"]["match"] for d in diags)
        ties = statistics.fmean(d["overall"]["tie"] for d in diags)
        loss = json.loads((run_dir / "summary.json").read_text())["final"]["val_loss"]
        lines.append(f"| {n} | {match:.4f} | {ties:.4f} | {loss:.4f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/fault-tolerance")
    ap.add_argument("--link", default="20mbit")
    ap.add_argument("--size", default="small")
    ap.add_argument("--steps", type=int, default=192)
    ap.add_argument("--eval-every", type=int, default=32)
    ap.add_argument("--checkpoint-every", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=3, help="seeds of the per-step 1bit pair (0..SEEDS-1)")
    ap.add_argument("--diag-steps", type=int, default=96)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    k, r = args.steps // 3, 2 * args.steps // 3
    ft = ["--fault-tolerant"]
    checkpoints = ["--checkpoint-every", str(args.checkpoint_every)]
    h4 = ["--local-steps", "4", *ft]
    zeros = ["--variant", "1bit", *ft, "--momentum-on-heal", "zeros"]
    keep = ["--variant", "32bit", "--outer", "diloco", "--inner-momentum", "keep"]  # lioncub's DiLoCo
    rows = [
        ("1bit", ["--variant", "1bit"], False, None),
        ("1bit --restarts 1", ["--variant", "1bit", "--restarts", "1", *checkpoints], True, "1bit"),
        ("ft 1bit", ["--variant", "1bit", *ft], False, None),
        ("ft 1bit, killed", ["--variant", "1bit", *ft], True, "ft 1bit"),
        ("ft 1bit, killed, momenta zeros", [*zeros], True, "ft 1bit"),
        ("ft 1bit/h4", ["--variant", "1bit", *h4], False, None),
        ("ft 1bit/h4, killed", ["--variant", "1bit", *h4], True, "ft 1bit/h4"),
        ("ft diloco/h4/keep", [*keep, *h4], False, None),
        ("ft diloco/h4/keep, killed", [*keep, *h4], True, "ft diloco/h4/keep"),
        ("ft torchft-diloco/h4", ["--variant", "torchft-diloco", *h4], False, None),
        ("ft torchft-diloco/h4, killed", ["--variant", "torchft-diloco", *h4], True, "ft torchft-diloco/h4"),
    ]
    results: dict[str, dict] = {}
    for name, extra, kill, _ in rows:
        results[name] = run(
            out, args, name.replace(" ", "_").replace("/", "_").replace(",", ""), extra, 0, kill
        )
    seeds = {}
    for seed in range(1, args.seeds):
        for name, kill in (("ft 1bit", False), ("ft 1bit, killed", True)):
            key = f"{name} (seed {seed})"
            seeds[key] = run(out, args, slug(key), ["--variant", "1bit", *ft], seed, kill)
    machine = f"{platform.node()} ({platform.processor() or 'cpu'}), {datetime.date.today()}"
    print(f"\n{args.size} GPT, batch 8, 4 ranks behind {args.link} links, {args.steps} steps, group 1 killed "
          f"after step {k} and started again at step {r}; {machine}\n")  # fmt: skip
    print("| row | ms per step before / during / after | steps × groups | heals (step: MB, s) | training s | "
          "wall s | kB/step/rank | final val loss | vs uninterrupted |")  # fmt: skip
    print("|---|---:|---|---|---:|---:|---:|---:|---:|")
    for name, _, _, base in rows:
        print(row(name, results[name], results.get(base) if base else None, k, r))
    for seed in range(1, args.seeds):
        whole = seeds[f"ft 1bit (seed {seed})"]
        print(row(f"ft 1bit (seed {seed})", whole, None, k, r))
        print(row(f"ft 1bit, killed (seed {seed})", seeds[f"ft 1bit, killed (seed {seed})"], whole, k, r))
    print()
    print("\n".join(sign_match(out, args)))


if __name__ == "__main__":
    main()
