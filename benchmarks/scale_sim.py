"""N simulated workers in one process: how the vote rules behave at 4-128 workers on real gradients.

One process plays N data-parallel workers training the tiny GPT workload (``lioncub.train.workloads``,
``gpt``/``tiny``: the model, the param groups with their lrs and weight decay, the per-rank data and the
validation of ``lioncub train``). Every step, each simulated worker ``r`` draws its own batch (the
sampler of rank ``r`` of ``N``, keyed by ``(seed, r, step)``: ``--data-mode random`` samples the whole
text, ``shard`` only the worker's contiguous ``1/N`` of it), computes its gradient on the shared model,
keeps its own Lion momentum and forms its direction ``c_r = β1·m_r + (1−β1)·g_r``. A *rule* turns the N
directions into one update, which every worker applies (one model copy stands for the identical
replicas), with ``lioncub train``'s warm-up + cosine schedule:

* ``lion``: global full-precision Lion on the mean gradient (one momentum; the reference, = ``32bit``);
* ``1bit``: flat 1-bit majority of the votes ``c_r > 0`` (an exact zero "+" where r + step is even, as
  lioncub's ``zero_vote="split"``), ties +1 on odd steps and −1 on even steps;
* ``nm<L>``: node-majority with L ranks per node (N/L nodes): each node's 1-bit majority with the tie
  rule, then a 1-bit majority of the nodes with the same rule (``topology="node-majority"``);
* ``8bit``: sign of the sum of L1 levels, ``quantize_l1`` per parameter tensor with the budget ⌊127/N⌋
  (``QuantizedVote``; refused beyond 127 workers, as lioncub does);
* ``int16-l1``: the same with the budget ⌊32767/N⌋ of a signed 16-bit sum — *not* a lioncub preset: the
  "wider quantization" the paper recommends for many workers;
* ``avg``: Distributed Lion's average of signs, ``Σ sign(c_r) / N`` (``dlion-avg``).

The workers' steps and the rules are the N-worker oracle's (``tests/oracles.py``: ``simulate_steps`` and its
vote rules), the one the optimizer is tested against bit for bit.

Measured (definitions of ``lioncub.optim.diagnostics``): the tie rate of the 1-bit majority
(``2·#{votes "+"} = N``) and of the sign vote (``Σ sign c_r = 0``); *match* and *flip* of every rule's
update against ``sign(Σ_r c_r)`` — the run's own rule on its own trajectory, and every rule of
``--shadow`` on the same directions (the momenta depend on the trajectory only, so all rules can be
scored on one); the momentum spread per tensor at the end; the mean training loss of the workers and
the validation loss after ``--steps`` steps.

    .venv/bin/python benchmarks/scale_sim.py --n 16,32 --steps 150,100 --seeds 0,1,2 \
        --rules lion,1bit,nm4,8bit,avg --out runs/scale_sim/results.json
    .venv/bin/python benchmarks/scale_sim.py --verify   # against `lioncub train` at N = 4, 2 steps

Finished runs are kept in ``--out`` (JSON) and reused; every run is a function of its settings and seed
(one thread, no random state besides the seeded init and the step-keyed samplers). Prints markdown
tables (mean ± std over the seeds).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lioncub.ops.quantize import level_budget
from lioncub.optim.diagnostics import agreement, momentum_spread
from lioncub.train.workloads import make_workload

sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))  # the N-worker oracle, tests/oracles.py
from oracles import (
    WorkloadWorkers,
    average_of_signs,
    l1_vote,
    majority_1bit,
    node_majority,
    one_bit_votes,
    simulate_steps,
)

IO_TENSORS = ("wte", "wpe", "lm_head")  # input/output layers, as benchmarks/findings.py counts them

# ------------------------------------------------------------------------------------------------ rules
# Every rule maps the directions C (float32, [N, ...]: one row per worker) to the update u; the rules
# themselves are the oracle's (tests/oracles.py), written once.


def rule_levels(rule: str, n: int) -> int | None:
    """The per-worker level budget of a quantized rule (None: not quantized); ``ValueError`` when the
    sum over ``n`` workers has no level left (8bit beyond 127 workers)."""
    if rule == "8bit":
        return level_budget(n, 8, "signed")
    if rule == "int16-l1":
        return level_budget(n, 16, "signed")
    return None


def check_rule(rule: str, n: int) -> str | None:
    """Why ``rule`` cannot run at ``n`` workers (None: it can)."""
    if m := re.fullmatch(r"nm(\d+)", rule):
        per_node = int(m.group(1))
        return None if per_node >= 1 and n % per_node == 0 else f"{n} workers are not nodes of {per_node}"
    if rule not in ("lion", "1bit", "8bit", "int16-l1", "avg"):
        raise ValueError(f"unknown rule {rule!r}: lion, 1bit, nm<L>, 8bit, int16-l1, avg")
    try:
        rule_levels(rule, n)
    except ValueError as e:
        return str(e)
    return None


def tensor_vote(rule: str, C: Tensor, step: int) -> Tensor:
    """The update of a voting rule (everything but ``lion``) from one parameter tensor's directions ``C``:
    ``1bit`` the flat 1-bit majority, ``nm<L>`` node-majority with L ranks per node, ``8bit`` and
    ``int16-l1`` the sign of the summed L1 levels (budget :func:`rule_levels`), ``avg`` the average of
    signs."""
    if rule == "1bit":
        return majority_1bit(C, step)
    if m := re.fullmatch(r"nm(\d+)", rule):
        return node_majority(C, step, int(m.group(1)))
    if rule in ("8bit", "int16-l1"):
        return l1_vote(C, rule_levels(rule, C.shape[0]))  # type: ignore[arg-type]
    if rule == "avg":
        return average_of_signs(C)
    raise ValueError(rule)


def vote(rule: str, C: Tensor, step: int, segments: list[int]) -> Tensor:
    """:func:`tensor_vote` of every parameter tensor of the flattened directions ``C`` ([N, D]; ``segments``:
    the tensors' lengths, in order)."""
    return torch.cat([tensor_vote(rule, piece, step) for piece in C.split(segments, dim=1)])


# ------------------------------------------------------------------------------------------- simulation


def simulate(
    n: int,
    rule: str,
    *,
    seed: int,
    steps: int,
    batch: int,
    data_mode: str = "random",
    diag_every: int = 10,
    shadow: tuple[str, ...] = (),
    corpus: str | None = None,
) -> dict[str, Any]:
    """Train the tiny GPT with ``n`` simulated workers and ``rule`` for ``steps`` steps on the oracle's
    N workers (``oracles.simulate_steps``; ``lion``: its ``32bit``); returns the record of the run (losses,
    diagnostics, final parameters' checksum) and, as ``"model"``, the model."""
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    overrides: dict[str, Any] = {"batch_size": batch}
    if corpus:
        overrides["corpus"] = corpus
    wl = make_workload("gpt", "tiny", rank=0, world_size=n, seed=seed, data_mode=data_mode, **overrides)
    model = wl.build_model()
    workers = WorkloadWorkers(wl, model, n, seed=seed, data_mode=data_mode, steps=steps)
    names = [name for name, _ in model.named_parameters()]
    segments = [p.numel() for p in workers.params]
    losses: list[float] = []
    diags: list[dict[str, Any]] = []

    def diagnose(step: int, _theta: list[Tensor], stacked: list[Any], updates: list[Any]) -> None:
        """The step's mean loss; diagnostics on its directions (before the momenta moved)."""
        losses.append(workers.step_loss())
        if not (step == steps or (diag_every and step % diag_every == 0)):
            return
        C = torch.cat([c.reshape(n, -1) for c in stacked], dim=1)
        u = torch.cat([x.reshape(-1) for x in updates])
        total = C.double().sum(0)  # the full-precision vote Σ c_r
        plus = one_bit_votes(C, step).sum(0)
        match, flip = agreement(u, total)
        diag: dict[str, Any] = {
            "step": step,
            "tie_1bit": float((2 * plus == n).double().mean()),
            "tie_sign": float((torch.sign(C).sum(0, dtype=torch.int32) == 0).double().mean()),
            "match": match,
            "flip": flip,
            "shadow": {},
        }
        for other in shadow:
            if other != "lion" and other != rule and check_rule(other, n) is None:
                diag["shadow"][other] = dict(
                    zip(("match", "flip"), agreement(vote(other, C, step, segments), total), strict=True)
                )
        diags.append(diag)

    run = simulate_steps(
        "32bit" if rule == "lion" else rule,
        n,
        [p.detach().clone() for p in workers.params],
        steps,
        workers.grads,
        workers.hyper,
        betas=wl.betas,
        vote=None if rule == "lion" else lambda _p, cs, step, _n: tensor_vote(rule, torch.stack(cs), step),
        alone=False,
        on_step=diagnose,
    )
    workers.load(run.theta)
    # momentum spread per tensor after the last step: sqrt(max over elements of the variance over workers)
    spread = {}
    for i, name in enumerate(names):
        m = torch.stack([run.momenta[r][i] for r in range(n)]).reshape(n, -1).double()  # type: ignore[misc]
        spread[name] = momentum_spread(m.mean(0), m.square().mean(0))
    tail = max(1, steps // 10)
    return {
        "n": n,
        "rule": rule,
        "seed": seed,
        "steps": steps,
        "batch": batch,
        "data_mode": data_mode,
        "corpus": wl.corpus,  # type: ignore[attr-defined]
        "train_loss_tail": statistics.mean(losses[-tail:]),
        "val_loss": wl.evaluate(model)["val_loss"],
        "losses": losses,
        "diagnostics": diags,
        "spread": spread,
        "seconds": time.perf_counter() - t_start,
        "model": model,
    }


# ----------------------------------------------------------------------------------------- verification


def verify(tmp: Path) -> bool:
    """At N = 4 and 2 steps, the simulator's parameters against `lioncub train` (4 gloo ranks on loopback):
    bitwise for the vote rules, closely for `lion` (DDP sums the gradients in another order)."""
    ok = True
    for rule, variant in (("1bit", "1bit"), ("8bit", "8bit"), ("avg", "dlion-avg"), ("lion", "32bit")):
        out = tmp / variant
        cmd = [sys.executable, "-m", "lioncub.cli", "train", "--workload", "gpt", "--size", "tiny"]
        cmd += ["--variant", variant, "--nproc", "4", "--steps", "2", "--seed", "0", "--eval-every", "0"]
        cmd += ["--set", "batch_size=4", "--out", str(out), "--no-progress"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        real = torch.load(next(out.glob("**/model.pt")), map_location="cpu", weights_only=True)
        sim = simulate(4, rule, seed=0, steps=2, batch=4, diag_every=0)["model"].state_dict()
        worst = max(float((real[k] - sim[k]).abs().max()) for k in real)
        same = all(torch.equal(real[k], sim[k]) for k in real)
        good = same if rule != "lion" else worst < 1e-6
        ok &= good
        print(f"{rule:5s} vs lioncub train --variant {variant}: bitwise equal {same}, max |diff| {worst:.2e}")
    return ok


# ---------------------------------------------------------------------------------------------- tables


def mean_std(values: list[float], digits: int = 4) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def diag_mean(run: dict[str, Any], key: str, skip: int) -> float:
    """Mean of a diagnostic over the diagnosed steps after step ``skip`` (momenta near 0 before)."""
    ds = [d for d in run["diagnostics"] if d["step"] > skip] or run["diagnostics"]
    return statistics.mean(d[key] for d in ds)


def shadow_mean(run: dict[str, Any], rule: str, skip: int) -> float:
    ds = [d for d in run["diagnostics"] if d["step"] > skip] or run["diagnostics"]
    return statistics.mean(d["shadow"][rule]["match"] for d in ds)


def paired_gap(runs: list[dict[str, Any]], rule: str) -> list[float]:
    """Validation loss of ``rule`` minus the reference's, seed by seed (the same data and init)."""
    ref = {r["seed"]: r["val_loss"] for r in runs if r["rule"] == "lion" and "refused" not in r}
    return [r["val_loss"] - ref[r["seed"]] for r in runs if r["rule"] == rule and r["seed"] in ref]


def table(runs: list[dict[str, Any]], skip: int) -> str:
    """One row per rule: 1-bit tie rate, match, flip, training and validation loss, and the validation
    loss minus the reference's, paired by seed (mean ± std over the seeds)."""
    lines = [
        "| rule | tie (1-bit) | match sign(Σc) | flip | train loss (last 10 %) | val loss | Δ val vs lion |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for rule in dict.fromkeys(r["rule"] for r in runs):
        rs = [r for r in runs if r["rule"] == rule]
        if "refused" in rs[0]:
            lines.append(f"| {rule} | refused: {rs[0]['refused'].split(';')[0]} | | | | | |")
            continue
        cells = [
            mean_std([diag_mean(r, "tie_1bit", skip) for r in rs]),
            mean_std([diag_mean(r, "match", skip) for r in rs]),
            mean_std([diag_mean(r, "flip", skip) for r in rs]),
            mean_std([r["train_loss_tail"] for r in rs]),
            mean_std([r["val_loss"] for r in rs]),
            mean_std(paired_gap(runs, rule)) if rule != "lion" else "0",
        ]
        lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def shadow_table(runs: list[dict[str, Any]], skip: int) -> str:
    """Match of every shadow rule on the reference (``lion``) trajectory."""
    ref = [r for r in runs if r["rule"] == "lion" and r["diagnostics"] and r["diagnostics"][0]["shadow"]]
    if not ref:
        return ""
    rules = list(ref[0]["diagnostics"][0]["shadow"])
    lines = ["| on the lion trajectory | " + " | ".join(rules) + " |", "|---|" + "---:|" * len(rules)]
    cells = [mean_std([shadow_mean(r, rule, skip) for r in ref]) for rule in rules]
    lines.append("| match sign(Σc) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def io_and_other(run: dict[str, Any]) -> tuple[float, float]:
    """Mean momentum spread of the input/output tensors and of all the others at the end of a run."""
    io = [v for k, v in run["spread"].items() if any(t in k for t in IO_TENSORS)]
    other = [v for k, v in run["spread"].items() if not any(t in k for t in IO_TENSORS)]
    return statistics.mean(io), statistics.mean(other)


def spread_table(runs: list[dict[str, Any]]) -> str:
    """Momentum spread at the end: the io tensors' mean and the others' mean (as benchmarks/findings.py),
    the largest io tensor over the largest other one, and each io tensor's rank among all tensors (by
    the spread averaged over the seeds; 1 = largest)."""
    lines = [
        "| rule | io tensors: max std of m | other tensors | ratio | largest io / largest other "
        "| ranks of " + ", ".join(IO_TENSORS) + " |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for rule in dict.fromkeys(r["rule"] for r in runs if "refused" not in r):
        rs = [r for r in runs if r["rule"] == rule]
        pairs = [io_and_other(r) for r in rs]
        io, other = [a for a, _ in pairs], [b for _, b in pairs]
        ratio = mean_std([a / b for a, b in pairs], 2)
        top = [
            max(v for k, v in r["spread"].items() if any(t in k for t in IO_TENSORS))
            / max(v for k, v in r["spread"].items() if not any(t in k for t in IO_TENSORS))
            for r in rs
        ]
        mean = {k: statistics.mean(r["spread"][k] for r in rs) for k in rs[0]["spread"]}
        order = sorted(mean, key=lambda k: -mean[k])
        ranks = [str(i + 1) for t in IO_TENSORS for i, k in enumerate(order) if t in k]
        lines.append(
            f"| {rule} | {mean_std(io, 5)} | {mean_std(other, 5)} | {ratio} | {mean_std(top, 2)} "
            f"| {', '.join(ranks)} of {len(order)} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="16,32,64,128", help="worker counts")
    ap.add_argument("--steps", default="150,100,60,40", help="steps for each worker count (or one for all)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rules", default="lion,1bit,nm4,nm8,8bit,int16-l1,avg")
    ap.add_argument(
        "--shadow", default="1bit,nm4,nm8,8bit,int16-l1,avg", help="rules also scored on each run"
    )
    ap.add_argument("--batch", type=int, default=4, help="windows of 64 characters per worker and step")
    ap.add_argument("--data-mode", default="random", choices=["random", "shard"])
    ap.add_argument("--corpus", default=None, help="the GPT workload's corpus (default: the tiny size's)")
    ap.add_argument("--diag-every", type=int, default=5)
    ap.add_argument("--out", default="runs/scale_sim/results.json")
    ap.add_argument("--tables-only", action="store_true", help="print the tables of the finished runs")
    ap.add_argument("--verify", action="store_true", help="compare with `lioncub train` at N = 4, 2 steps")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.verify:
        with tempfile.TemporaryDirectory() as tmp:
            sys.exit(0 if verify(Path(tmp)) else 1)

    ns = [int(x) for x in args.n.split(",")]
    steps_list = [int(x) for x in args.steps.split(",")]
    steps_of = dict(zip(ns, steps_list if len(steps_list) == len(ns) else steps_list * len(ns), strict=True))
    seeds = [int(s) for s in args.seeds.split(",")]
    rules = args.rules.split(",")
    shadow = tuple(args.shadow.split(",")) if args.shadow else ()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}

    for n in ns:
        group = []
        for rule in rules:
            for seed in seeds:
                key = f"{args.data_mode}-{args.corpus or 'default'}-n{n}-{rule}-s{seed}"
                key += f"-t{steps_of[n]}-b{args.batch}"
                if key not in done and not args.tables_only:
                    why = check_rule(rule, n)
                    if why is not None:
                        done[key] = {"n": n, "rule": rule, "seed": seed, "refused": why}
                    else:
                        run = simulate(
                            n,
                            rule,
                            seed=seed,
                            steps=steps_of[n],
                            batch=args.batch,
                            data_mode=args.data_mode,
                            diag_every=args.diag_every,
                            shadow=shadow,
                            corpus=args.corpus,
                        )
                        run.pop("model")
                        done[key] = run
                        print(
                            f"[scale_sim] {key}: val {run['val_loss']:.4f} ({run['seconds']:.0f} s)",
                            file=sys.stderr,
                            flush=True,
                        )
                    out.write_text(json.dumps(done))
                if key in done:
                    group.append(done[key])
        if not group:
            continue
        skip = math.ceil(0.2 * steps_of[n])  # leave out the first 20 % of the steps (momenta near zero)
        print(f"\n### N = {n}, {steps_of[n]} steps, batch {args.batch} per worker, data {args.data_mode}\n")
        print(table(group, skip))
        if shadow_table(group, skip):
            print("\n" + shadow_table(group, skip))
        print("\n" + spread_table(group))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
