"""Wire bytes per step of a Hugging Face Trainer run, with and without ``lioncub.integrations.hf``.

    python benchmarks/bench_integrations.py --nproc 2 --steps 10

One ``lioncub launch --nproc N`` job (gloo, CPU) in which every rank trains the GPT-2 of
``examples/hf_trainer.py`` (2 layers, 64 wide, 256 byte tokens, 64 positions: 0.12 M parameters; batch 8
per rank, no gradient clipping) with ``transformers.Trainer`` for ``--steps`` steps in each configuration:

* ``DDP + Lion``: ``Trainer(optimizers=(lioncub.Lion(...), None))``, the baseline: DDP's fp32 allreduce;
* ``LionCub, no integration``: ``Trainer(optimizers=(LionCub(..., variant=V), None))``, what a user gets
  without the integration: DDP still allreduces the fp32 gradients, then LionCub votes on the averaged
  ones (LionCub warns at the first step; the warning is reported);
* ``LionCubTrainer``: ``lioncub.integrations.hf.LionCubTrainer(..., lioncub=dict(variant=V))``: DDP's
  allreduce replaced by a no-op hook, only the vote travels.

Bytes are what rank 0 hands to the collectives per optimizer step: DDP's allreduce counted by
:func:`lioncub.optim.ddp.count_gradient_allreduce` (ring: ``2·(N−1)/N`` of the fp32 bucket bytes, as sent
by one rank), LionCub's from ``comm_stats()`` (votes plus the per-step check); the Trainer's own small
collectives (loss logging) are not counted. Prints a markdown table and writes ``--json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    """One rank: every configuration in turn; rank 0 writes the results to ``args.worker``."""
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from lioncub.integrations.hf import LionCubTrainer
    from lioncub.optim import Lion, LionCub
    from lioncub.optim.ddp import GradientTraffic, count_gradient_allreduce

    sys.path.insert(0, str(REPO / "examples"))
    from hf_trainer import byte_blocks

    torch.set_num_threads(1)
    data = byte_blocks()

    class CountDDP(TrainerCallback):
        """Counts DDP's gradient allreduce (registered before the first backward)."""

        def __init__(self) -> None:
            self.trainer: Trainer | None = None
            self.traffic: GradientTraffic | None = None

        def on_train_begin(self, *a: Any, **kw: Any) -> None:
            assert self.trainer is not None
            self.traffic = count_gradient_allreduce(self.trainer.model_wrapped)

    def run(name: str, variant: str | None, integrated: bool, workdir: Path) -> dict[str, Any]:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4))
        targs = TrainingArguments(
            output_dir=str(workdir / name.replace(" ", "_")),
            max_steps=args.steps,
            per_device_train_batch_size=8,
            learning_rate=1e-3,
            max_grad_norm=0.0,
            save_strategy="no",
            logging_steps=args.steps,
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
        )
        count = CountDDP()
        opt: Any = None
        if integrated:
            trainer: Trainer = LionCubTrainer(
                model=model, args=targs, train_dataset=data, lioncub=dict(variant=variant)
            )
        else:
            params = [p for p in model.parameters() if p.requires_grad]
            opt = Lion(params, lr=1e-3) if variant is None else LionCub(params, lr=1e-3, variant=variant)
            trainer = Trainer(
                model=model, args=targs, train_dataset=data, optimizers=(opt, None), callbacks=[count]
            )
            count.trainer = trainer
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        if integrated:
            opt = trainer.lioncub_optimizer  # type: ignore[attr-defined]
        ddp = 0.0 if count.traffic is None else count.traffic.bytes_sent / args.steps
        vote = opt.comm_stats()["total"]["bytes_sent"] / args.steps if isinstance(opt, LionCub) else 0.0
        return {
            "config": name,
            "params": sum(p.numel() for p in model.parameters()),
            "ddp_bytes_per_step": ddp,
            "lioncub_bytes_per_step": vote,
            "warned_identical": any("identical on every rank" in str(w.message) for w in caught),
        }

    configs: list[tuple[str, str | None, bool]] = [("DDP + Lion", None, False)]
    for v in args.variants.split(","):
        configs += [(f"LionCub {v}, no integration", v, False), (f"LionCubTrainer {v}", v, True)]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(name, variant, integrated, Path(tmp)) for name, variant, integrated in configs]
    if dist.get_rank() == 0:
        Path(args.worker).write_text(json.dumps({"world_size": dist.get_world_size(), "rows": rows}))


def table(result: dict[str, Any]) -> str:
    base = result["rows"][0]["ddp_bytes_per_step"]
    lines = [
        "| configuration | DDP allreduce B/step | LionCub B/step | total B/step | × DDP + Lion | warned |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        total = r["ddp_bytes_per_step"] + r["lioncub_bytes_per_step"]
        lines.append(
            f"| {r['config']} | {r['ddp_bytes_per_step']:,.0f} | {r['lioncub_bytes_per_step']:,.0f} | "
            f"{total:,.0f} | {total / base:.3f} | {'yes' if r['warned_identical'] else ''} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variants", default="1bit,8bit")
    parser.add_argument("--json", default=None, help="write the results here too")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "lioncub",
            "launch",
            "--nproc",
            str(args.nproc),
            "--timeout",
            "900",
            "--",
            __file__,
            "--steps",
            str(args.steps),
            "--variants",
            args.variants,
            "--worker",
            str(out),
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    cpu = platform.processor() or platform.machine()
    result.update(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        commit=commit.stdout.strip(),
        machine=f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        steps=args.steps,
    )
    print(
        f"{result['date']}, commit {result['commit']}, {result['machine']}, world size "
        f"{result['world_size']}, {result['steps']} steps, {result['rows'][0]['params']:,} parameters"
    )
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
