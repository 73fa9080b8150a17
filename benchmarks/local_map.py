"""The map of where local steps win: ``lioncub compare --time-budget`` per link, and the schedule rule.

    python benchmarks/local_map.py --links 2mbit,100mbit --budgets 2mbit=530,100mbit=85 \\
        --variants 1bit,1bit/h4,1bit/h16 --target-loss 2.388 --out runs/local-map

For every link (4 ranks, each behind its own shaped link; root), every row trains for the same seconds of
training (its pilot plans its steps; its lr schedule spans them) and the report gives its validation loss
at the budget and its time to the target loss. Then, per link:

* m/c, the ratio of one vote's communication to a step's compute, from the per-step ``1bit`` row (its
  median communication and compute per step);
* f(H) measured: the steps a row took to the target over the steps ``1bit`` took (each its time to the
  target over its mean step time), the factor :mod:`lioncub.planning.schedule` predicts with;
* the schedule rule's choice (``choose_schedule`` with the measured c and m and the library's
  ``STEPS_FACTOR``: the first 1-bit row of the H it picks) and its time to the target against the best
  row's.

Prints markdown for BENCHMARKS.md / ``docs/findings.md`` §9 and, with ``--plots DIR``, copies each link's
``val_loss_vs_time.png`` to ``DIR/local-map-<link>.png``. ``--report-only`` rebuilds the tables from
every run in ``--out``. ``--nodes MxL`` runs M emulated nodes of L ranks instead (one shaped NIC per node).
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


def parse_budgets(text: str, links: list[str]) -> dict[str, float]:
    """``"2mbit=530,100mbit=85"`` → seconds per link; every link needs one."""
    budgets = {}
    for item in text.split(","):
        link, _, seconds = item.partition("=")
        try:
            budgets[link.strip()] = float(seconds)
        except ValueError:
            raise SystemExit(f"--budgets {text!r}: give LINK=SECONDS, comma-separated") from None
    missing = [link for link in links if link not in budgets]
    if missing:
        raise SystemExit(f"--budgets {text!r}: no budget for {', '.join(missing)}")
    return budgets


def run_compare(args: argparse.Namespace, link: str, budget: float) -> Path:
    out = Path(args.out) / link
    cmd = [sys.executable, "-m", "lioncub.cli", "compare", "--workload", "gpt", "--size", args.size]
    for item in args.set:
        cmd += ["--set", item]
    if not args.report_only:  # a report of the runs in OUT takes them all
        cmd += ["--variants", args.variants]
    cmd += ["--seed", str(args.seed), "--out", str(out), "--no-progress"]
    if args.target_loss is not None:
        cmd += ["--target-loss", str(args.target_loss)]
    if args.nodes:
        m, _, ell = args.nodes.lower().partition("x")
        cmd += ["--nnodes", m, "--nproc-per-node", ell]
    else:
        cmd += ["--nproc", str(args.nproc)]
    if link != "loopback":
        cmd += ["--link", link]
    if args.report_only:
        cmd.append("--report-only")
    else:
        cmd += ["--time-budget", f"{budget:g}"]
    print(f"[map] {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    return out


def link_rows(report_dir: Path, link: str) -> list[dict]:
    """The report's rows with the measured steps to the target and the schedule rule's view."""
    from lioncub.names import parse_run_name
    from lioncub.planning.schedule import choose_schedule

    rows = json.loads((report_dir / "summary.json").read_text())["rows"]
    for r in rows:
        r["link"] = link
        name = r["variant"]  # the row auto: "auto (1bit/h16)"
        r["h"] = parse_run_name(name[6:-1] if name.startswith("auto (") else name).get("local_steps") or 1
        ttt, mean_step = r["time_to_target_s"], r["budget"]["wall_s"] / max(1, r["steps"])
        r["steps_to_target"] = None if ttt is None else ttt / mean_step
    per_step = next((r for r in rows if r["variant"] == "1bit"), None)
    if per_step is None:
        return rows
    compute_s, vote_s = per_step["compute_s"], per_step["comm_s"]
    choice = choose_schedule(compute_s, vote_s)
    chosen_h = choice.local_steps or 1  # the first row of that H (a 1-bit vote) is the rule's
    ones = [r["variant"] for r in rows if r["h"] == chosen_h and r["variant"].startswith("1bit")]
    chosen = ones[0] if ones else None
    hits = [r["time_to_target_s"] for r in rows if r["time_to_target_s"] is not None]
    best = min(hits) if hits else None
    for r in rows:
        r["m_over_c"] = vote_s / compute_s
        r["f_measured"] = (
            r["steps_to_target"] / per_step["steps_to_target"]
            if r["steps_to_target"] is not None and per_step["steps_to_target"]
            else None
        )
        r["chosen"] = r["variant"] == chosen
        r["vs_best"] = r["time_to_target_s"] / best if best and r["time_to_target_s"] is not None else None
    return rows


def markdown(rows: list[dict]) -> str:
    def f(v: float | None, spec: str) -> str:
        return "—" if v is None else format(v, spec)

    lines = [
        "| link | m/c | row | pilot ms/step | steps | MB/step/rank | val loss at budget | time to target s | "
        "vs best | f(H) measured | rule's choice |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        b = r["budget"]
        lines.append(
            f"| {r['link']} | {f(r.get('m_over_c'), '.2f')} | {r['variant']} | "
            f"{b['pilot_step_s'] * 1e3:.0f} | {r['steps']} | {r['bytes_sent_per_step'] / 1e6:.3f} | "
            f"{f(b.get('loss'), '.4f')} | {f(r['time_to_target_s'], '.0f')} | "
            f"{f(r.get('vs_best'), '.2f')}× | {f(r.get('f_measured'), '.2f')} | "
            f"{'**chosen**' if r.get('chosen') else ''} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", default="2mbit,5mbit,20mbit,100mbit")
    ap.add_argument("--budgets", required=True, help="LINK=SECONDS for every link, comma-separated")
    ap.add_argument("--variants", default="1bit,1bit/h4,1bit/h16")
    ap.add_argument("--size", default="small")
    ap.add_argument("--set", action="append", default=[], help="workload field (default batch_size=8)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--nodes", help="MxL: M emulated nodes of L ranks, one NIC each (replaces --nproc)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-loss", type=float)
    ap.add_argument("--out", default="runs/local-map")
    ap.add_argument("--plots", help="copy each link's val_loss_vs_time.png to PLOTS/local-map-<link>.png")
    ap.add_argument("--report-only", action="store_true", help="rebuild the tables from the runs in --out")
    args = ap.parse_args()
    args.set = args.set or ["batch_size=8"]
    links = args.links.split(",")
    budgets = parse_budgets(args.budgets, links)
    started = datetime.datetime.now(datetime.timezone.utc)
    rows: list[dict] = []
    for link in links:
        report_dir = run_compare(args, link, budgets[link])
        rows += link_rows(report_dir, link)
        if args.plots:
            Path(args.plots).mkdir(parents=True, exist_ok=True)
            shutil.copy(report_dir / "val_loss_vs_time.png", Path(args.plots) / f"local-map-{link}.png")
    wall = datetime.datetime.now(datetime.timezone.utc) - started
    import torch

    layout = f"{args.nodes} nodes x ranks" if args.nodes else f"{args.nproc} ranks"
    print(
        f"# local_map {started:%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}; gpt {args.size} {' '.join(args.set)}, {layout}, seed {args.seed}, budgets "
        f"{args.budgets}, target {args.target_loss}; wall {wall.total_seconds() / 60:.1f} min"
    )
    print(markdown(rows))


if __name__ == "__main__":
    main()
