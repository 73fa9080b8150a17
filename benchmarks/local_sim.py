"""N simulated workers with local steps in one process: validation loss against inner steps and against
bytes, for H local Lion steps per outer step and the outer rules of ``lioncub.optim.local_steps``.

One process plays N workers training the tiny GPT workload (``gpt``/``tiny`` of ``lioncub train``: its
model, param groups with their lrs and weight decay, per-rank data, validation and lr schedule). Every
worker r holds its own parameters θ_r and inner Lion momentum; each inner step it draws its own batch
(rank r of N: ``--data-mode random`` samples the whole text, ``shard`` its contiguous 1/N) and takes a
Lion step alone, without weight decay. Every H steps the outer step combines the pseudo-gradients
Δ_r = θ_t − θ_r, then the window's weight decay D = Π(1 − lr·λ) over its inner steps scales θ:

* ``vote-1bit``: 1-bit majority of ``c_r = β1ᵒ·M_r + (1−β1ᵒ)·Δ_r`` (zeros split by rank and step parity,
  ties by the alternating rule), ``θ ← (θ_t − ηᵒ·u)·D``, ``ηᵒ = outer_lr · H · lr``;
* ``vote-8bit``: the sign of the sum of the workers' L1 levels of ``c_r`` (budget ⌊127/N⌋ per tensor);
* ``dsm``: the same sign step on the mean Δ̄ with one shared outer momentum (fp32);
* ``diloco``: Nesterov SGD on Δ̄ (``v ← μv + Δ̄``, ``θ ← (θ_t − ηᵒ(Δ̄ + μv))·D``, ηᵒ = outer_lr).

and the per-step baselines ``1bit`` (a 1-bit vote every step) and ``lion`` (global Lion on the mean
gradient: ``32bit``). The workers, their steps and the outer rules are the N-worker oracle's
(``tests/oracles.py``: ``simulate_local_steps``, ``simulate_steps``), the one ``tests/test_local_steps.py``
holds the optimizer to bit for bit. Bytes per inner step and parameter: 1/H bit (vote-1bit), 8/H
(vote-8bit), 32/H (dsm, diloco fp32), 1 (1bit), 32 (lion). With one model copy per worker, one thread,
the step-keyed samplers and the seeded init, every run is a function of its settings.

    .venv/bin/python benchmarks/local_sim.py --n 4 --rules vote-1bit,diloco --h 16 --outer-lr 0.5,1 \\
        --seeds 0 --steps 256 --out runs/local_sim/results.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lioncub.train.workloads import make_workload

sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))  # the N-worker oracle, tests/oracles.py
from oracles import WorkloadWorkers, simulate_local_steps, simulate_steps

RULES = ("vote-1bit", "vote-8bit", "dsm", "diloco", "1bit", "lion")
#: bits per parameter one outer exchange of a rule sends (per-step rules: per step)
BITS = {"vote-1bit": 1, "vote-8bit": 8, "dsm": 32, "diloco": 32, "1bit": 1, "lion": 32}
#: the oracle's (variant, outer rule) of each local rule, and its preset of each per-step rule
LOCAL = {"vote-1bit": ("1bit", "vote"), "vote-8bit": ("8bit", "vote"), "dsm": ("32bit", "dsm"),
         "diloco": ("32bit", "diloco")}  # fmt: skip
PER_STEP = {"1bit": "1bit", "lion": "32bit"}


def simulate(
    n: int,
    rule: str,
    *,
    h: int,
    outer_lr: float,
    seed: int,
    steps: int,
    data_mode: str = "random",
    inner_momentum: str = "keep",
    lr_scale: float = 1.0,
    eval_every: int = 32,
) -> dict[str, Any]:
    """Train the tiny GPT with ``n`` simulated workers, ``rule`` and ``h`` inner steps per outer step (the
    per-step rules ignore ``h``), every param group's lr times ``lr_scale``, on the oracle's workers
    (``oracles.simulate_local_steps``, the per-step rules ``oracles.simulate_steps``); returns the run's
    record (validation losses, bytes)."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    wl = make_workload("gpt", "tiny", rank=0, world_size=n, seed=seed, data_mode=data_mode)
    model = wl.build_model()
    workers = WorkloadWorkers(wl, model, n, seed=seed, data_mode=data_mode, steps=steps, lr_scale=lr_scale)
    per_step = rule in PER_STEP
    h = 1 if per_step else h
    record: dict[str, Any] = {"evals": [], "losses": []}

    def after(step: int, theta: list[Tensor]) -> None:
        """The step's mean training loss; the validation loss of θ (after an outer step) when due."""
        record["losses"].append(workers.step_loss())
        if (step % eval_every == 0 or step == steps) and step % h == 0:
            workers.load(theta)
            record["evals"].append({"step": step, "val_loss": wl.evaluate(model)["val_loss"]})

    theta = [p.detach().clone() for p in workers.params]
    if per_step:
        simulate_steps(
            PER_STEP[rule], n, theta, steps, workers.grads, workers.hyper, betas=wl.betas, alone=False,
            on_step=lambda step, th, _c, _u: after(step, th),
        )  # fmt: skip
    else:
        variant, outer = LOCAL[rule]
        simulate_local_steps(
            variant, outer, n, h, outer_lr, theta, steps, workers.grads, workers.hyper, betas=wl.betas,
            inner_momentum=inner_momentum, on_step=lambda step, anchor, _: after(step, anchor),
        )  # fmt: skip
    bits = BITS[rule] / (1 if per_step else h)
    tail = statistics.mean(record["losses"][-max(1, steps // 10) :])
    record.update(
        n=n, rule=rule, h=h, outer_lr=outer_lr, seed=seed, steps=steps, data_mode=data_mode,
        inner_momentum=inner_momentum, lr_scale=lr_scale, bits_per_param_step=bits,
        params=sum(p.numel() for p in workers.params), final_val_loss=record["evals"][-1]["val_loss"],
        seconds=time.perf_counter() - t0, train_loss_tail=tail,
    )  # fmt: skip
    return record


def verify(tmp: Path) -> bool:
    """At N = 2, H = 4 and 8 steps (inner momenta kept, outer lr 1), the validation loss after the last
    outer step against `lioncub train --local-steps 4` (2 gloo ranks on loopback): equal for ``vote-1bit``
    (``--variant 1bit``) and ``dsm`` (``--variant 32bit --outer dsm``)."""
    ok = True
    for rule, args in (
        ("vote-1bit", ["--variant", "1bit"]),
        ("dsm", ["--variant", "32bit", "--outer", "dsm"]),
    ):
        out = tmp / rule
        cmd = [
            sys.executable,
            "-m",
            "lioncub.cli",
            "train",
            "--workload",
            "gpt",
            "--size",
            "tiny",
            "--nproc",
            "2",
        ]
        cmd += ["--local-steps", "4", "--steps", "8", "--eval-every", "8", "--inner-momentum", "keep", *args]
        subprocess.run([*cmd, "--out", str(out), "--no-progress"], check=True, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
        real = [r["val_loss"] for r in records if r.get("kind") == "eval"][-1]
        sim = simulate(2, rule, h=4, outer_lr=1.0, seed=0, steps=8, inner_momentum="keep")["final_val_loss"]
        ok &= real == sim
        print(f"{rule:9s} vs lioncub train {' '.join(args)}: val loss {sim!r} against {real!r}")
    return ok


def summary(runs: list[dict[str, Any]]) -> str:
    """A markdown table: final validation loss (mean ± std over seeds) per setting."""
    keys = _group(runs)
    lines = [
        "| N | data | rule | H | lr × | outer lr | inner m | bits/param/step | val loss | seeds |",
        "|---:|---|---|---:|---:|---:|---|---:|---|---:|",
    ]
    for (n, mode, rule, h, scale, olr, im), group in sorted(keys.items()):
        vals = [r["final_val_loss"] for r in group]
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        bits = group[0]["bits_per_param_step"]
        lines.append(
            f"| {n} | {mode} | {rule} | {h} | {scale:g} | {olr:g} | {im} | {bits:.4g} | "
            f"{statistics.mean(vals):.4f} ± {sd:.4f} | {len(vals)} |"
        )
    return "\n".join(lines)


def _group(runs: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """Runs by setting (all but the seed)."""
    keys: dict[tuple, list[dict[str, Any]]] = {}
    for run in runs:
        key = (run["n"], run["data_mode"], run["rule"], run["h"], run.get("lr_scale", 1.0), run["outer_lr"],
               run["inner_momentum"])  # fmt: skip
        keys.setdefault(key, []).append(run)
    return keys


def best(runs: list[dict[str, Any]], seeds: int = 1) -> dict[tuple, list[dict[str, Any]]]:
    """Per (N, data, rule, H, inner momentum): the runs of the lr setting (``lr_scale``, ``outer_lr``) with
    the lowest mean final validation loss among the settings run with at least ``seeds`` seeds."""
    chosen: dict[tuple, list[dict[str, Any]]] = {}
    for (n, mode, rule, h, _scale, _olr, im), group in _group(runs).items():
        if len(group) < seeds:
            continue
        key = (n, mode, rule, h, im)
        mean = statistics.mean(r["final_val_loss"] for r in group)
        if key not in chosen or mean < statistics.mean(r["final_val_loss"] for r in chosen[key]):
            chosen[key] = group
    return chosen


def plot(runs: list[dict[str, Any]], n: int, mode: str, path: Path, seeds: int) -> None:
    """Validation loss against inner steps and against bits sent per parameter (log), mean over seeds, of
    the best lr setting per rule and H (inner momentum ``keep``) at ``n`` workers and data ``mode``."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.6))
    by_step, by_bits = fig.subplots(1, 2)
    colors = {"vote-1bit": "C0", "vote-8bit": "C1", "dsm": "C2", "diloco": "C3", "1bit": "k", "lion": "0.5"}
    styles = {1: ":", 4: "-.", 16: "-", 64: "--"}
    for (n_, mode_, rule, h, im), group in sorted(best(runs, seeds).items()):
        if (n_, mode_, im) != (n, mode, "keep"):
            continue
        steps = [e["step"] for e in group[0]["evals"]]
        losses = [statistics.mean(r["evals"][i]["val_loss"] for r in group) for i in range(len(steps))]
        bits = [group[0]["bits_per_param_step"] * s for s in steps]
        label = rule if rule in ("1bit", "lion") else f"{rule} H={h}"
        style = dict(color=colors[rule], linestyle="-" if rule in ("1bit", "lion") else styles.get(h, "-"))
        by_step.plot(steps, losses, label=label, **style)
        by_bits.plot(bits, losses, label=label, **style)
    by_step.set(xlabel="inner step", ylabel="validation loss", title=f"N = {n}, {mode} data: loss vs steps")
    by_bits.set(xlabel="bits sent per parameter so far (log)", title="loss vs bits sent", xscale="log")
    for ax in (by_step, by_bits):
        ax.grid(alpha=0.3)
        ax.set_ylim(top=min(3.2, ax.get_ylim()[1]))
    by_bits.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", default="4", help="worker counts, comma-separated")
    ap.add_argument("--rules", default="vote-1bit,vote-8bit,dsm,diloco,1bit,lion")
    ap.add_argument("--h", default="16", help="inner steps per outer step, comma-separated")
    ap.add_argument("--outer-lr", default="1", help="outer lrs, comma-separated (per rule meaning)")
    ap.add_argument("--inner-momentum", default="keep", help="keep, reset, average (comma-separated)")
    ap.add_argument("--lr-scale", default="1", help="multipliers of the workload's lrs, comma-separated")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--data-mode", default="random", help="random, shard (comma-separated)")
    ap.add_argument("--out", default="runs/local_sim/results.json")
    ap.add_argument("--table", action="store_true", help="print the table of --out (comma-separated files)")
    ap.add_argument("--plot", metavar="PNG", help="plot the best settings of --out at --n and --data-mode")
    ap.add_argument(
        "--min-seeds", type=int, default=1, help="--plot/--table: settings run with this many seeds"
    )
    ap.add_argument(
        "--verify", action="store_true", help="compare with `lioncub train` at N = 2, H = 4, 8 steps"
    )
    args = ap.parse_args()
    if args.verify:
        with tempfile.TemporaryDirectory() as tmp:
            sys.exit(0 if verify(Path(tmp)) else 1)
    if args.table or args.plot:
        runs = [r for path in args.out.split(",") for r in json.loads(Path(path).read_text())]
        if args.plot:
            plot(runs, int(args.n), args.data_mode, Path(args.plot), args.min_seeds)
        else:
            print(summary([r for g in _group(runs).values() if len(g) >= args.min_seeds for r in g]))
        return
    out = Path(args.out)
    runs = json.loads(out.read_text()) if out.exists() else []
    done = {json.dumps(_key(r), sort_keys=True) for r in runs}
    for n in map(int, args.n.split(",")):
        for mode in args.data_mode.split(","):
            for rule in args.rules.split(","):
                if rule not in RULES:
                    sys.exit(f"unknown rule {rule!r}: {RULES}")
                for h in [1] if rule in ("1bit", "lion") else map(int, args.h.split(",")):
                    lrs = ["1"] if rule in ("1bit", "lion") else args.outer_lr.split(",")
                    for olr in map(float, lrs):
                        for im, scale, seed in itertools.product(
                            args.inner_momentum.split(","),
                            map(float, args.lr_scale.split(",")),
                            map(int, args.seeds.split(",")),
                        ):
                            spec = dict(n=n, rule=rule, h=h, outer_lr=olr, seed=seed, steps=args.steps,
                                        data_mode=mode, inner_momentum=im, lr_scale=scale)  # fmt: skip
                            if json.dumps(_key(spec), sort_keys=True) in done:
                                continue
                            run = simulate(**spec)  # type: ignore[arg-type]
                            runs.append(run)
                            out.parent.mkdir(parents=True, exist_ok=True)
                            out.write_text(json.dumps(runs))
                            said = f"N={n} {mode} {rule} H={h} lr×{scale:g} outer {olr:g} {im} seed={seed}"
                            loss, seconds = run["final_val_loss"], run["seconds"]
                            print(f"{said}: val {loss:.4f} ({seconds:.0f} s)", flush=True)
    print(summary(runs))


def _key(run: dict[str, Any]) -> dict[str, Any]:
    keys = ("n", "rule", "h", "outer_lr", "seed", "steps", "data_mode", "inner_momentum")
    return {**{k: run[k] for k in keys}, "lr_scale": run.get("lr_scale", 1.0)}


if __name__ == "__main__":
    main()
