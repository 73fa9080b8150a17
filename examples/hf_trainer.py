"""Train a small GPT-2 with the Hugging Face Trainer and LionCub's 1-bit vote on every rank.

    torchrun --nproc-per-node 2 examples/hf_trainer.py                # CPU, gloo
    lioncub launch --nproc 2 -- python examples/hf_trainer.py --variant 8bit --overlap
    lioncub launch --nproc 2 -- python examples/hf_trainer.py --resume   # from the last checkpoint

The model is built from a config (nothing is downloaded) and reads the opening of Pride and Prejudice
(``data/austen_slice.txt.gz``) as bytes. Needs ``pip install 'lioncub[hf]'``.
"""

from __future__ import annotations

import argparse
import gzip
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from lioncub.integrations.hf import LionCubTrainer

TEXT = Path(__file__).resolve().parents[1] / "data" / "austen_slice.txt.gz"


def byte_blocks(block: int = 64) -> list[dict[str, torch.Tensor]]:
    """The text as byte tokens, in blocks of ``block`` (input_ids = labels: the model shifts them)."""
    raw = torch.frombuffer(bytearray(gzip.decompress(TEXT.read_bytes())), dtype=torch.uint8).long()
    n = raw.numel() // block
    return [{"input_ids": x, "labels": x} for x in raw[: n * block].view(n, block)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", default="1bit", help="a LionCub preset (1bit, 4bit, 8bit, ...)")
    parser.add_argument("--overlap", action="store_true", help="vote during the backward pass")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="runs/hf_trainer")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    opts = parser.parse_args()

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
    result = trainer.train(resume_from_checkpoint=get_last_checkpoint(opts.out) if opts.resume else None)
    if args.process_index == 0:
        print(f"train loss {result.training_loss:.3f} after {result.global_step} steps")
        sent = trainer.lioncub_optimizer.comm_stats()["last"]["bytes_sent"]
        print(f"LionCub sent {sent} bytes in the last step")


if __name__ == "__main__":
    main()
