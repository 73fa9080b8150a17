"""Options that ``lioncub train`` and ``lioncub compare`` share, and how they become a
:class:`~lioncub.train.config.TrainConfig`."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import Any

__all__ = ["OPTION_OF_FIELD", "add_run_arguments", "config_from_args", "parse_set", "sync_spec", "train_run"]

#: options whose name differs from their TrainConfig field (the others are spelt alike)
OPTION_OF_FIELD = {"warmup_steps": "warmup"}


def whole_number(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number >= ``minimum``."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {value}")
        return value

    return convert


def real_number(
    allowed: str, low: float, high: float = math.inf, *, low_open: bool
) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in ``(low, high]`` (``low_open``) or ``[low, high]``;
    ``allowed`` words the range in the messages (e.g. ``"a number in (0, 1]"``)."""

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        inside = (value > low if low_open else value >= low) and value <= high and math.isfinite(value)
        if not inside:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    return convert


def add_run_arguments(parser: argparse.ArgumentParser, *, variant: bool = True) -> None:
    """Options shared by ``train`` and ``compare`` (all default to None: see :func:`config_from_args`)."""
    from lioncub.train.workloads import workload_names

    names = workload_names()
    parser.add_argument("--workload", choices=sorted(names), help="gpt (default) or cnn")
    parser.add_argument("--size", help=f"model/data size (default tiny): {names}")
    if variant:
        parser.add_argument("--variant", help="optimizer variant (default 8bit), see below")
    parser.add_argument("--nproc", type=int, metavar="N", help="ranks (default 1)")
    parser.add_argument(
        "--max-nproc",
        type=int,
        metavar="N",
        help="allow up to N ranks (default: as many as 80%% of the available memory holds)",
    )
    parser.add_argument("--link", metavar="RATE", help="shape every rank's link, e.g. 1gbit (root)")
    parser.add_argument(
        "--nnodes",
        type=int,
        metavar="M",
        help="instead of --nproc: M emulated nodes of --nproc-per-node ranks, one --link NIC per node, "
        "started by a multi-node torchrun (root)",
    )
    parser.add_argument("--nproc-per-node", type=int, metavar="L", help="with --nnodes: ranks on each node")
    parser.add_argument(
        "--intra-link", metavar="RATE", help="with --nnodes: shape each node's loopback (default unshaped)"
    )
    parser.add_argument("--steps", type=int, help="optimizer steps (default 200)")
    parser.add_argument(
        "--warmup", type=int, metavar="STEPS", help="lr warm-up (default 10%% of steps, ≤ 100)"
    )
    parser.add_argument(
        "--min-lr-ratio", type=float, help="end of the cosine, fraction of peak (default 0.1)"
    )
    parser.add_argument("--eval-every", type=int, metavar="STEPS", help="validation interval (default 50)")
    parser.add_argument("--checkpoint-every", type=int, metavar="STEPS", help="default 0: at the end only")
    parser.add_argument("--seed", type=int, help="model init and data order (default 0)")
    parser.add_argument("--data-mode", choices=["random", "shard"], help="per-rank data (default random)")
    parser.add_argument("--bucket-mb", type=float, help="LionCub bucket size in MiB (default 25)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default auto")
    parser.add_argument(
        "--momentum-sync",
        type=sync_spec,
        metavar="WHICH",
        help="average momenta over the ranks: none (default), all, io, or comma-separated name patterns",
    )
    parser.add_argument("--sync-every", type=int, metavar="STEPS", help="momentum sync interval (default 10)")
    parser.add_argument("--quantizer", help="with --variant 8bit: l1 (default), l0, linf, lp, qsgd or log")
    parser.add_argument(
        "--topology",
        help="the vote over nodes: flat (default), hierarchical (exact) or node-majority (1bit only)",
    )
    parser.add_argument(
        "--diagnostics-every",
        type=int,
        metavar="STEPS",
        help="vote diagnostics (match/flip, ties, momentum spread, update shape) every STEPS (0: off)",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="change a workload field"
    )
    parser.add_argument(
        "--nonfinite",
        choices=["skip", "raise"],
        help="NaN/Inf gradients on any rank: skip the step on every rank (default) or stop with an error",
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        default=None,
        help="LionCub variants: start each DDP bucket's vote during the backward pass (bitwise the same "
        "result)",
    )
    parser.add_argument(
        "--zero-vote",
        choices=["split", "plus"],
        help="one-bit votes: an exact zero votes + on half the ranks (split, default) or always (plus: the "
        "papers' rule)",
    )
    if variant:  # compare names them in --variants (1bit/h16, diloco/h16/lr0.7)
        parser.add_argument(
            "--local-steps",
            type=whole_number(1),
            metavar="H",
            help="H local Lion steps per rank, then one outer step (docs/local-steps.md)",
        )
        parser.add_argument(
            "--outer",
            choices=["vote", "dsm", "diloco"],
            help="with --local-steps: vote (the variant's vote; default), dsm or diloco (32bit/16bit)",
        )
        parser.add_argument(
            "--outer-lr",
            type=real_number("a number > 0", 0.0, low_open=True),
            metavar="X",
            help="with --local-steps: vote/dsm: X·H·lr per outer step (default 1); diloco: X (default 0.7)",
        )
    parser.add_argument(
        "--inner-momentum",
        choices=["keep", "reset", "average"],
        help="with local steps: each rank's inner momentum at an outer step (default reset)",
    )
    parser.add_argument("--timeout", type=float, default=7200.0, metavar="SECONDS", help="per run")
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="a collective that gets no answer for this long fails the job, naming the rank, operation and "
        "step (default 600)",
    )
    parser.add_argument(
        "--restarts",
        type=int,
        default=0,
        metavar="K",
        help="after a rank fails, restart every rank from the last checkpoint, up to K times (default 0)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def sync_spec(text: str) -> str | list[str]:
    return text if text in ("none", "all", "io") else [t for t in text.split(",") if t]


def parse_set(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set batch_size=8")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


def node_layout(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """``(nnodes, nproc)`` from ``--nnodes M --nproc-per-node L`` (``(None, None)`` when not given), or a
    ``ValueError`` naming the option: --nnodes needs --nproc-per-node and excludes --nproc."""
    nnodes, per_node = getattr(args, "nnodes", None), getattr(args, "nproc_per_node", None)
    if nnodes is None:
        if per_node is not None:
            raise ValueError(
                f"--nproc-per-node {per_node}: applies only with --nnodes M (M emulated nodes of L ranks); "
                "for N ranks, each with its own link, use --nproc N"
            )
        return None, None
    if per_node is None:
        raise ValueError(f"--nnodes {nnodes}: needs --nproc-per-node L, the ranks on each node")
    if args.nproc is not None:
        raise ValueError(
            f"--nproc {args.nproc} with --nnodes {nnodes}: give either --nproc N (N ranks, each its own "
            "node) or --nnodes M --nproc-per-node L (M nodes of L ranks)"
        )
    for option, value in (("--nnodes", nnodes), ("--nproc-per-node", per_node)):
        if value < 1:
            raise ValueError(f"{option} {value} must be an integer >= 1")
    return nnodes, nnodes * per_node


def config_from_args(args: argparse.Namespace, base: Any = None) -> Any:
    """A :class:`~lioncub.train.config.TrainConfig`: ``base`` (or the defaults) with every given option
    (``--nnodes M --nproc-per-node L`` become ``nnodes = M``, ``nproc = M·L``; with ``--local-steps H`` and
    no ``--eval-every``, the evaluation interval is the multiple of H nearest the default 50)."""
    from lioncub.train.config import JSON_KEYS, RunConfig, TrainConfig

    nnodes, nproc = node_layout(args)
    if nnodes is not None:
        args = argparse.Namespace(**{**vars(args), "nproc": nproc})
    doc = base.to_json() if base is not None else {}
    if nnodes is None and args.nproc is not None:  # --nproc N: one node per rank, whatever base had
        doc.pop("nnodes", None)
        doc.pop("intra_link", None)
    for name in JSON_KEYS:
        value = getattr(args, OPTION_OF_FIELD.get(name, name), None)
        if value is not None and name != "overrides":
            doc[name] = value
    if base is None:  # a new run: the current rule (a document without the key ran the papers' rule)
        doc.setdefault("zero_vote", "split")
    h = doc.get("local_steps")
    if (
        h and getattr(args, "eval_every", None) is None and base is None
    ):  # evaluations where the replicas agree
        doc["eval_every"] = h * max(1, round(RunConfig.eval_every / h))
    if args.set:
        doc["overrides"] = {**doc.get("overrides", {}), **parse_set(args.set)}
    return TrainConfig.from_json(doc)


def train_run(
    args: argparse.Namespace, config: Any, run_dir: Any, lock: Any, label: str | None = None
) -> Any:
    """:func:`lioncub.train.driver.run_training` of ``config`` in ``run_dir`` with the launch options of
    ``args`` (``--timeout``, ``--no-progress``, ``--restarts``, ``--collective-timeout``); ``lock``, the run
    directory's writer lock, is released when the run has ended."""
    from lioncub.train.driver import run_training

    try:
        return run_training(
            config,
            run_dir,
            timeout_s=args.timeout or None,
            progress=not args.no_progress,
            label=label,
            restarts=args.restarts,
            collective_timeout_s=args.collective_timeout,
        )
    finally:
        lock.release()
