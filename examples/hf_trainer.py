"""Train a small GPT-2 with the Hugging Face Trainer and LionCub's 1-bit vote on every rank.

    torchrun --nproc-per-node 2 examples/hf_trainer.py --out runs/hf      # CPU, gloo (GPUs: NCCL)
    lioncub launch --nproc 2 -- python examples/hf_trainer.py --variant 8bit --overlap --out runs/hf8
    lioncub launch --nproc 2 -- python examples/hf_trainer.py --out runs/hf --resume --steps 90

The first trains 60 steps into runs/hf, the second the 8-bit vote overlapped with the backward pass
in its own directory, the third continues the first from its last checkpoint (step 60) to step 90 (a
resume needs the variant the checkpoint was trained with: every rank's momenta are its own).

The model is built from a config (nothing is downloaded) and reads the opening of Pride and Prejudice as
bytes (shipped with lioncub: ``lioncub.train.data.package_file``). Needs ``pip install 'lioncub[hf]'``.
"""

from __future__ import annotations

import argparse
import gzip
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from lioncub.integrations.hf import LionCubTrainer
from lioncub.train.data import package_file


def byte_blocks(block: int = 64) -> list[dict[str, torch.Tensor]]:
    """The text as byte tokens, in blocks of ``block`` (input_ids = labels: the model shifts them)."""
    text = package_file("austen_slice.txt.gz").read_bytes()
    raw = torch.frombuffer(bytearray(gzip.decompress(text)), dtype=torch.uint8).long()
    n = raw.numel() // block
    return [{"input_ids": x, "labels": x} for x in raw[: n * block].view(n, block)]


def arguments() -> argparse.ArgumentParser:
    """The example's options (argparse only: tests/test_docs_run.py parses the docstring's commands)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", default="1bit", help="a LionCub preset (1bit, 4bit, 8bit, ...)")
    parser.add_argument("--overlap", action="store_true", help="vote during the backward pass")
    parser.add_argument("--steps", type=int, default=60, help="train up to this step")
    parser.add_argument("--out", default="runs/hf_trainer", help="the Trainer's output_dir")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    return parser


def main() -> None:
    parser = arguments()
    opts = parser.parse_args()
    last = get_last_checkpoint(opts.out) if opts.resume and Path(opts.out).is_dir() else None
    if opts.resume and last is None:
        parser.error(f"--resume: no checkpoint-N in --out {opts.out} (train without --resume first)")

    args = TrainingArguments(  # under torchrun this joins the process group
        output_dir=opts.out,
        max_steps=opts.steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        weight_decay=0.1,
        lr_scheduler_type="cosine",
        warmup_steps=opts.steps // 10,
        logging_steps=10,
        save_steps=max(1, opts.steps // 2),
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        max_grad_norm=0.0 if opts.overlap else 1.0,  # overlap: .grad must stay as the backward left it
    )
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4))
    trainer = LionCubTrainer(
        model=model,
        args=args,
        train_dataset=byte_blocks(),
        lioncub=dict(variant=opts.variant, overlap=opts.overlap),
    )
    result = trainer.train(resume_from_checkpoint=last)
    if args.process_index == 0:
        print(f"train loss {result.training_loss:.3f} after {result.global_step} steps")
        sent = trainer.lioncub_optimizer.comm_stats()["last"]["bytes_sent"]
        print(f"LionCub sent {sent} bytes in the last step")


if __name__ == "__main__":
    main()
