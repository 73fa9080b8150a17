"""Memory per rank with FSDP2 inside each node against DDP inside it (issue 46, item 6).

    nice -n 19 .venv/bin/python benchmarks/fsdp_memory.py --out runs/fsdp-memory          # the pairs
    nice -n 19 .venv/bin/python benchmarks/fsdp_memory.py --largest --out runs/fsdp-largest
    .venv/bin/python benchmarks/fsdp_memory.py --quick --out /tmp/fsdp-quick               # a smoke run

Every run is ``lioncub train --workload gpt --size tiny --set ... --variant 1bit --nnodes 2
--nproc-per-node L --link 1gbit --max-nproc 2L`` (root: network namespaces) in a subprocess under
``nice -n 19``, with and without ``--fsdp``. The model is the tiny workload's corpus (Austen, 74
characters) with a wider and deeper GPT (``--set n_layer=..,n_embd=..``) so that its bytes stand out of
torch's ~300 MB per process.

**Pairs** (default): for each L (``--ls``, default 2,4) and each repeat, the DDP-inside run and the
``--fsdp`` run back to back, their order alternating between repeats. Per run, from ``summary.json``:
``memory`` (parameter, gradient and optimizer-state bytes and peak RSS, each the largest over the ranks),
the median step time and final validation loss; from ``log.jsonl``: the median bytes through a node's
NIC per step (``nic_bytes``) and over its loopback (``intra_bytes``).

**Largest** (``--largest``): a ladder of widths at ``--depth`` layers, L = 4 (8 ranks), ``--steps 2``,
with and without ``--fsdp``. Before each launch the run's cost to the machine, the drop of MemAvailable,
is predicted: from the kind's rungs that completed (:func:`predict_drop`), or before the first from the
resident bytes :func:`predict` gives (an over-estimate: the ranks are forked from a preloaded interpreter
and share its pages, which the sum of their RSS counts once per rank). A rung predicted to drop
MemAvailable by more than ``--budget-gib``, or below the watchdog's floor from where it stands, is not
launched, and a kind (with or without ``--fsdp``) stops climbing there or at its first run that does
not complete.

**Memory safety**: a watchdog thread reads ``/proc/meminfo`` every 0.5 s and SIGKILLs every process of
the run (its descendants, tracked by parent pid and start time, except the network's guard, which then
removes the namespaces) when MemAvailable drops below ``--min-available-gib`` (default 4): recorded as
"does not fit (killed at MemAvailable < 4 GiB)". The same kill ends a run past ``--timeout``. The
watchdog also records the lowest MemAvailable, the largest sum of the run's processes' RSS and each
process's peak RSS (``VmHWM``, sampled: a peak in its last half second can be missed).

**The allocator** (``--malloc-mmap-threshold B``): glibc's malloc serves an allocation above its mmap
threshold with its own mapping, returned to the OS when freed; the threshold rises with every such block
freed, up to 32 MiB, and smaller blocks then come from heaps that keep what was freed. FSDP2's all-gather
and reduce-scatter buffers, a block's bytes each, come and go every step: below 32 MiB they can stay in the
heaps, and the peak RSS does not show what the ranks hold. This option sets ``MALLOC_MMAP_THRESHOLD_``
(a fixed threshold, which does not rise) for the runs.

Prints markdown tables and writes ``results.json`` in ``--out``; each run's directory is removed after it
is read unless ``--keep``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
MIB = 1 << 20
VOCAB = 74  # the tiny workload's corpus (austen_slice): characters
#: what the ranks of a node hold besides the model, per process (torch, the data, gloo): measured ~316 MB
RANK_BASE = 400 * MIB
#: the launcher, one torchrun agent per node, the zygotes and the network's guard, all together
RUN_BASE = 1536 * MIB
#: a rank's peak RSS over torch's, in fp32 copies of the model, measured on the 8x512 pairs (25 M
#: parameters, 8 steps): DDP inside 5.2-6.1, --fsdp 5.1 (2 steps) to 6.8: the largest ladder starts there
COPIES = {False: 6.5, True: 7.0}
#: a rank's peak RSS with a negligible model (gpt/tiny, 0.1 M parameters): 316 MB
TORCH_RSS = 316 * MIB


@dataclass(frozen=True)
class Shape:
    """A GPT's shape: ``n_layer`` blocks of width ``n_embd``, ``n_head`` heads, context ``block_size``,
    ``batch_size`` sequences per rank and step, ``eval_windows`` validation windows."""

    n_layer: int
    n_embd: int
    n_head: int = 8
    block_size: int = 64
    batch_size: int = 4
    eval_windows: int = 16

    def params(self) -> int:
        """Parameters of the workload's GPT (no biases, untied head): blocks of 12·d² + 2·d (two
        LayerNorms), token and position embeddings, the final LayerNorm, the head."""
        d = self.n_embd
        return self.n_layer * (12 * d * d + 2 * d) + VOCAB * d + self.block_size * d + d + VOCAB * d

    def sets(self) -> list[str]:
        """``--set`` arguments."""
        fields = ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "eval_windows")
        return [a for f in fields for a in ("--set", f"{f}={getattr(self, f)}")]

    def label(self) -> str:
        return f"{self.n_layer}x{self.n_embd}"


def predict(shape: Shape, per_node: int, fsdp: bool, copies: float, nnodes: int = 2) -> dict[str, int]:
    """Predicted bytes of one run: ``rank`` (a rank's peak) and ``total`` (the machine's), fp32.

    A rank's peak is :data:`RANK_BASE` plus the larger of ``copies`` (measured: :data:`COPIES`, then the
    last rung's) and the structural count of fp32 copies of the model's ``p`` bytes, plus activations
    (~40 floats per token and layer, forward and backward). Structurally, DDP inside the node: the
    parameters, their gradients, DDP's flat bucket copy of them, the momenta and a vote's work buffers
    (5 copies); FSDP2: each rank builds the whole model before sharding it (1 copy), then holds 1/L of the
    parameters, gradients and momenta, a block gathered in the forward and its gradient in the backward;
    the final checkpoint gathers the whole model on one rank (1 copy)."""
    p = 4 * shape.params()
    tokens = shape.batch_size * shape.block_size
    act = 2 * 4 * tokens * (40 * shape.n_embd * shape.n_layer + 2 * VOCAB)
    block = 4 * 12 * shape.n_embd**2
    structural = 1 + max(1, (3 * p + 2 * block) / per_node / p) if fsdp else 5.0
    rank = RANK_BASE + int(max(copies, structural) * p) + act
    return {"rank": rank, "total": RUN_BASE + nnodes * per_node * rank}


# ---------------------------------------------------------------------------------------------- watchdog


def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            out[key] = int(parts[0]) * 1024
    return out


def _stat(pid: int) -> tuple[int, int] | None:
    """``(ppid, starttime)`` of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[19])


def _rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def _hwm(pid: int) -> int:
    """``pid``'s peak resident set size so far (``VmHWM``) in bytes; 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def _is_guard(pid: int) -> bool:
    """The network's guard (``python -m lioncub.launch.netns guard``): left alive to remove the
    namespaces once the launcher is gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"lioncub.launch.netns" in argv and b"guard" in argv


@dataclass
class Watchdog:
    """Watches the process tree under ``root`` every ``period_s``: kills it (:meth:`kill`) when
    MemAvailable drops below ``min_available`` bytes; records the lowest MemAvailable and the largest sum
    of the tree's RSS."""

    root: int
    min_available: int
    period_s: float = 0.5
    known: dict[int, int] = field(default_factory=dict)  # pid -> starttime
    lowest_available: int = 1 << 62
    peak_tree_rss: int = 0
    hwm: dict[int, int] = field(default_factory=dict)  # pid -> the largest VmHWM seen
    killed_for_memory: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _scan(self) -> None:
        children: dict[int, list[tuple[int, int]]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                st = _stat(int(entry))
                if st is not None:
                    children.setdefault(st[0], []).append((int(entry), st[1]))
        todo = [self.root, *self.known]
        while todo:
            pid = todo.pop()
            for child, start in children.get(pid, []):
                if self.known.get(child) != start:
                    self.known[child] = start
                    todo.append(child)
        root = _stat(self.root)
        if root is not None:
            self.known.setdefault(self.root, root[1])

    def _alive(self) -> list[int]:
        return [pid for pid, start in self.known.items() if (st := _stat(pid)) is not None and st[1] == start]

    def kill(self) -> None:
        """SIGKILL every live process of the run but the network's guard."""
        self._scan()
        for pid in self._alive():
            if not _is_guard(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._scan()
            available = _meminfo()["MemAvailable"]
            self.lowest_available = min(self.lowest_available, available)
            alive = self._alive()
            self.peak_tree_rss = max(self.peak_tree_rss, sum(_rss(pid) for pid in alive))
            for pid in alive:
                self.hwm[pid] = max(self.hwm.get(pid, 0), _hwm(pid))
            if available < self.min_available:
                self.killed_for_memory = True
                self.kill()
                return
            self._stop.wait(self.period_s)

    def start(self) -> Watchdog:
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# -------------------------------------------------------------------------------------------------- runs


def command(shape: Shape, per_node: int, fsdp: bool, steps: int, seed: int, out: Path) -> list[str]:
    """The ``lioncub train`` command of one run (under ``nice -n 19``)."""
    cmd = ["nice", "-n", "19", str(ROOT / ".venv" / "bin" / "lioncub"), "train", "--workload", "gpt"]
    cmd += ["--size", "tiny", *shape.sets(), "--variant", "1bit", "--seed", str(seed), "--steps", str(steps)]
    cmd += ["--eval-every", "0", "--nnodes", "2", "--nproc-per-node", str(per_node), "--link", "1gbit"]
    cmd += ["--fsdp"] if fsdp else []
    # the watchdog stands in for train's bound on the ranks the memory holds, which counts a whole model
    # per rank (24 B per parameter) with --fsdp too and refuses the ladder's upper rungs before they start
    cmd += ["--max-nproc", str(2 * per_node)]
    return [*cmd, "--no-progress", "--out", str(out)]


def run_one(cmd: list[str], out: Path, timeout_s: float, min_available: int, keep: bool) -> dict[str, Any]:
    """Run ``cmd`` under the watchdog; what it measured (``status``: ok, failed (rc), killed-memory,
    timeout)."""
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    available_before = _meminfo()["MemAvailable"]
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    with open(out.parent / f"{out.name}.console.txt", "wb") as console:
        proc = subprocess.Popen(
            cmd, stdout=console, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )
        dog = Watchdog(proc.pid, min_available).start()
        try:
            rc: int | None = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            dog.kill()
            proc.wait()
        dog.stop()
        if dog.killed_for_memory:
            proc.wait()
    wall = time.monotonic() - t0
    res: dict[str, Any] = {
        "command": " ".join(cmd),
        "wall_s": round(wall, 1),
        "available_before": available_before,
        # the machine's 1-minute load average before and after (other users' work shows here)
        "loadavg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "lowest_available": dog.lowest_available,
        "peak_tree_rss": dog.peak_tree_rss,
        "process_hwm": sorted(dog.hwm.values(), reverse=True),
    }
    if dog.killed_for_memory:
        res["status"] = f"does not fit (killed at MemAvailable < {min_available / GIB:g} GiB)"
    elif rc is None:
        res["status"] = f"timeout ({timeout_s:g} s)"
    elif rc != 0 or not (out / "summary.json").exists():
        tail = (out.parent / f"{out.name}.console.txt").read_text(errors="replace")[-600:]
        res["status"] = f"failed (rc {rc})"
        res["tail"] = tail
    else:
        res["status"] = "ok"
        summary = json.loads((out / "summary.json").read_text())
        steps = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
        steps = [s for s in steps if s.get("kind") == "step"]
        res.update(
            params=summary["params"],
            memory=summary["memory"],
            median_step_s=summary["median_step_s"],
            val_loss=summary["final"]["val_loss"],
            nic_bytes=statistics.median(s["nic_bytes"] for s in steps),
            intra_bytes=statistics.median(s["intra_bytes"] for s in steps),
            bytes_sent=summary["median_bytes_sent"],
        )
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return res


def _mb(b: float) -> str:
    return f"{b / MIB:,.1f}"


def pairs(args: argparse.Namespace, shape: Shape) -> list[dict[str, Any]]:
    """The paired runs: per repeat and L, DDP inside then ``--fsdp`` (or the reverse on odd repeats)."""
    results = []
    for rep in range(args.repeats):
        for per_node in args.ls:
            order = [False, True] if rep % 2 == 0 else [True, False]
            for fsdp in order:
                name = f"L{per_node}-{'fsdp' if fsdp else 'ddp'}-r{rep}"
                pred = predict(shape, per_node, fsdp, COPIES[fsdp])
                if pred["total"] > args.budget_gib * GIB:
                    sys.exit(
                        f"{name}: predicted {pred['total'] / GIB:.1f} GiB > --budget-gib {args.budget_gib:g}"
                    )
                cmd = command(shape, per_node, fsdp, args.steps, args.seed, args.out / name)
                res = run_one(cmd, args.out / name, args.timeout, _floor(args), args.keep)
                res.update(name=name, L=per_node, fsdp=fsdp, repeat=rep, shape=shape.label(), predicted=pred)
                print(f"{name}: {res['status']} in {res['wall_s']} s", flush=True)
                results.append(res)
    return results


def pairs_table(results: list[dict[str, Any]]) -> str:
    rows = [
        "| L | run | parameters / gradients / optimizer state per rank (MiB) | peak RSS per rank (MiB; "
        "predicted) | lowest MemAvailable (GiB) | NIC bytes per node per step | loopback bytes per step "
        "| median step (s) | final val loss | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        kind = "1bit+fsdp" if r["fsdp"] else "1bit (DDP inside)"
        if r["status"] != "ok":
            rows.append(f"| {r['L']} | {kind} r{r['repeat']} | {r['status']} |||||||{r['wall_s']} |")
            continue
        m = r["memory"]
        rows.append(
            f"| {r['L']} | {kind} r{r['repeat']} | {_mb(m['parameters'])} / {_mb(m['gradients'])} / "
            f"{_mb(m['optimizer_state'])} | {_mb(m['peak_rss'])} ({_mb(r['predicted']['rank'])}) | "
            f"{r['lowest_available'] / GIB:.1f} | {r['nic_bytes']:,.0f} | {r['intra_bytes']:,.0f} | "
            f"{r['median_step_s']:.2f} | {r['val_loss']:.4f} | {r['wall_s']} |"
        )
    return "\n".join(rows)


def _field(run: dict[str, Any], key: str) -> float:
    """``run[key]``, or ``run["memory"][key]`` for a memory field."""
    return float(run["memory"][key] if key in run["memory"] else run[key])


def pairs_summary(results: list[dict[str, Any]]) -> str:
    """Per L: each kind's median over the repeats of its median step time, the median over the repeats
    of the paired ratio ``--fsdp`` / DDP inside (the two runs of one repeat ran back to back), and the
    ratios of the memory fields and NIC bytes (medians over the repeats; all but the peak RSS are the
    same in every repeat)."""
    rows = [
        "| L | median step, DDP inside (s) | median step, --fsdp (s) | paired ratio fsdp/ddp: median "
        "(each repeat) | parameters | gradients | optimizer state | peak RSS | NIC bytes per step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for per_node in sorted({r["L"] for r in results}):
        by_rep: dict[int, dict[bool, dict[str, Any]]] = {}
        for r in results:
            if r["L"] == per_node and r["status"] == "ok":
                by_rep.setdefault(r["repeat"], {})[r["fsdp"]] = r
        both = [rep for rep in by_rep.values() if len(rep) == 2]
        if not both:
            rows.append(f"| {per_node} | no complete pair |||||||| ")
            continue
        keys = ("parameters", "gradients", "optimizer_state", "peak_rss", "nic_bytes")
        med = {
            (fsdp, key): statistics.median(_field(rep[fsdp], key) for rep in both)
            for fsdp in (False, True)
            for key in ("median_step_s", *keys)
        }
        ratios = [rep[True]["median_step_s"] / rep[False]["median_step_s"] for rep in both]
        each = ", ".join(f"{x:.2f}" for x in ratios)
        cells = " | ".join(f"{med[(True, k)] / med[(False, k)]:.2f}×" for k in keys)
        rows.append(
            f"| {per_node} | {med[(False, 'median_step_s')]:.2f} | {med[(True, 'median_step_s')]:.2f} | "
            f"{statistics.median(ratios):.2f} ({each}) | {cells} |"
        )
    return "\n".join(rows)


def predict_drop(done: list[tuple[int, int]], model_bytes: int) -> int | None:
    """The MemAvailable drop of a run of ``model_bytes`` (fp32 parameters) predicted from ``done``, the
    ``(model bytes, drop)`` of the rungs that completed, smallest first; ``None`` before the first. One
    rung: its drop scaled with the model (an over-estimate: part of the drop does not grow with it); two
    or more: the line through the last two (the proportional scaling where noise makes it fall); 15 %
    over either."""
    if not done:
        return None
    p2, d2 = done[-1]
    linear = d2 * model_bytes / p2
    if len(done) >= 2:
        p1, d1 = done[-2]
        slope = (d2 - d1) / (p2 - p1) if p2 != p1 else 0.0
        if slope > 0:
            linear = d2 + slope * (model_bytes - p2)
    return int(1.15 * linear)


def largest(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Climb the width ladder at ``--depth`` layers, L = ``--largest-l``, each kind until a run does not
    complete or the next is predicted over the budget."""
    results = []
    for fsdp in (False, True):
        copies = COPIES[fsdp]
        done: list[tuple[int, int]] = []  # (model bytes, MemAvailable drop) of the rungs that completed
        for width in args.widths:
            shape = Shape(args.depth, width, block_size=32, batch_size=2, eval_windows=4)
            pred = predict(shape, args.largest_l, fsdp, copies)
            drop = predict_drop(done, 4 * shape.params())
            pred["drop"] = pred["total"] if drop is None else drop
            name = f"largest-L{args.largest_l}-{'fsdp' if fsdp else 'ddp'}-{shape.label()}"
            base: dict[str, Any] = dict(
                name=name,
                L=args.largest_l,
                fsdp=fsdp,
                shape=shape.label(),
                params_predicted=shape.params(),
                predicted=pred,
                copies=copies,
            )
            available = _meminfo()["MemAvailable"]
            if pred["drop"] > args.budget_gib * GIB or available - pred["drop"] < _floor(args):
                over = (
                    f"a drop of {pred['drop'] / GIB:.1f} GiB > --budget-gib {args.budget_gib:g}"
                    if pred["drop"] > args.budget_gib * GIB
                    else f"{available / GIB:.1f} - {pred['drop'] / GIB:.1f} GiB below the floor"
                )
                base.update(status=f"not launched: predicted {over}")
                print(f"{name}: {base['status']}", flush=True)
                results.append(base)
                break
            cmd = command(shape, args.largest_l, fsdp, 2, args.seed, args.out / name)
            res = run_one(cmd, args.out / name, args.timeout, _floor(args), args.keep)
            res.update(base)
            print(
                f"{name}: {res['status']} in {res['wall_s']} s (predicted drop {pred['drop'] / GIB:.1f} "
                f"GiB, MemAvailable {res['available_before'] / GIB:.1f} -> "
                f"{res['lowest_available'] / GIB:.1f} GiB)",
                flush=True,
            )
            results.append(res)
            if res["status"] != "ok":
                break
            done.append((4 * shape.params(), res["available_before"] - res["lowest_available"]))
            # the next rung's prediction: this one's copies of the model in its largest rank, 10 % more
            copies = 1.1 * (max(res["process_hwm"]) - TORCH_RSS) / (4 * shape.params())
    return results


def largest_table(results: list[dict[str, Any]]) -> str:
    rows = [
        "| run | layers × width | parameters | predicted: rank's RSS / MemAvailable drop (GiB) | outcome "
        "| peak RSS per rank (MiB) | sum of the run's RSS (GiB) | MemAvailable before → lowest (GiB) "
        "| median step (s) | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        kind = "1bit+fsdp" if r["fsdp"] else "1bit (DDP inside)"
        pred = f"{r['predicted']['rank'] / GIB:.2f} / {r['predicted']['drop'] / GIB:.1f}"
        shape = r["shape"].replace("x", " × ")
        head = f"| {kind} | {shape} | {r['params_predicted'] / 1e6:.1f} M | {pred} | {r['status']} |"
        if "wall_s" not in r:
            rows.append(head + " | | | | |")
            continue
        peak = _mb(r["memory"]["peak_rss"]) if r["status"] == "ok" else ""
        step = f"{r['median_step_s']:.1f}" if r["status"] == "ok" else ""
        rows.append(
            f"{head} {peak} | {r['peak_tree_rss'] / GIB:.1f} | {r['available_before'] / GIB:.1f} → "
            f"{r['lowest_available'] / GIB:.1f} | {step} | {r['wall_s']} |"
        )
    return "\n".join(rows)


def _floor(args: argparse.Namespace) -> int:
    """The watchdog's MemAvailable floor in bytes."""
    return int(args.min_available_gib * GIB)


def _cpu_model() -> str:
    """``/proc/cpuinfo``'s first model name."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> None:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(
        description=doc.split("\n")[0],
        epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", type=Path, required=True, help="directory of the runs and results.json")
    ap.add_argument("--quick", action="store_true", help="one pair at L=2, a 2x256 GPT, 2 steps (smoke)")
    ap.add_argument("--largest", action="store_true", help="the width ladder instead of the pairs")
    ap.add_argument("--ls", type=_ints, default=[2, 4], help="ranks per node of the pairs (default 2,4)")
    ap.add_argument("--repeats", type=int, default=2, help="pairs per L, order alternating (default 2)")
    ap.add_argument("--steps", type=int, default=8, help="steps of each paired run (default 8)")
    ap.add_argument("--layers", type=int, default=8, help="the pairs' GPT depth (default 8)")
    ap.add_argument("--width", type=int, default=512, help="the pairs' GPT width (default 512)")
    ap.add_argument("--depth", type=int, default=8, help="--largest: the ladder's depth (default 8)")
    widths = [512, 640, 768, 896, 1024, 1152, 1280, 1536, 1792, 2048]
    ap.add_argument("--widths", type=_ints, default=widths, help="--largest: the ladder's widths")
    ap.add_argument("--largest-l", type=int, default=4, help="--largest: ranks per node (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--budget-gib",
        type=float,
        default=14.0,
        help="--largest: the most MemAvailable a run may be predicted to take; the pairs: "
        "their predicted resident bytes (default 14)",
    )
    ap.add_argument("--min-available-gib", type=float, default=4.0, help="the watchdog's floor (default 4)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run (default 900)")
    ap.add_argument("--keep", action="store_true", help="keep each run's directory")
    ap.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        help="bytes: MALLOC_MMAP_THRESHOLD_ of the runs (a fixed threshold; default: glibc's, dynamic)",
    )
    args = ap.parse_args(argv)
    if args.malloc_mmap_threshold is not None:
        if args.malloc_mmap_threshold < 0:
            sys.exit(f"--malloc-mmap-threshold {args.malloc_mmap_threshold}: expected bytes >= 0")
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)  # the runs inherit it
    if os.geteuid() != 0:
        sys.exit("fsdp_memory: lioncub train --link needs root (network namespaces)")
    args.out.mkdir(parents=True, exist_ok=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": head.stdout.strip(),
        "nproc": os.cpu_count(),
        "cpu": _cpu_model(),
        "mem_total_gib": round(_meminfo()["MemTotal"] / GIB, 1),
        "malloc_mmap_threshold": args.malloc_mmap_threshold,
    }
    print(json.dumps(meta), flush=True)
    if args.largest:
        results = largest(args)
        table = largest_table(results)
    else:
        if args.quick:
            args.ls, args.repeats, args.steps, args.layers, args.width = [2], 1, 2, 2, 256
        shape = Shape(args.layers, args.width)
        print(f"GPT {shape.label()}: {shape.params() / 1e6:.2f} M parameters", flush=True)
        results = pairs(args, shape)
        table = pairs_table(results) + "\n\n" + pairs_summary(results)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "runs": results}, indent=1) + "\n")
    print(table)


if __name__ == "__main__":
    main()
