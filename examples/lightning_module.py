"""A LightningModule trained with LionCub's 1-bit vote through ``LionCubStrategy``, with resume.

    torchrun --nproc-per-node 2 examples/lightning_module.py --out runs/pl   # CPU, gloo
    lioncub launch --nproc 2 -- python examples/lightning_module.py --variant 8bit --overlap --out runs/pl8
    lioncub launch --nproc 2 -- python examples/lightning_module.py --out runs/pl --resume --steps 90

The first trains 60 steps into runs/pl (checkpoints every 30 steps in its checkpoints/: no logger, so no
lightning_logs/version_N/), the second the 8-bit vote overlapped with the backward pass in its own
directory, the third continues the first from its last.ckpt (step 60) to step 90 (a resume needs the
variant the checkpoint was trained with: every rank's momenta are its own).

A character-level MLP language model on the opening of Pride and Prejudice (shipped with lioncub:
``lioncub.train.data.package_file``). Needs ``pip install 'lioncub[lightning]'``.
"""

from __future__ import annotations

import argparse
import gzip
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lioncub import LionCub
from lioncub.integrations.lightning import LionCubStrategy
from lioncub.train.data import package_file

CONTEXT = 16


def windows() -> torch.Tensor:
    """int64 ``[n, CONTEXT + 1]``: byte windows of the text (the last byte is the target)."""
    text = package_file("austen_slice.txt.gz").read_bytes()
    raw = torch.frombuffer(bytearray(gzip.decompress(text)), dtype=torch.uint8).long()
    n = raw.numel() // (CONTEXT + 1)
    return raw[: n * (CONTEXT + 1)].view(n, CONTEXT + 1)


class CharModel(pl.LightningModule):
    def __init__(self, variant: str, steps: int) -> None:
        super().__init__()
        self.variant, self.steps = variant, steps
        self.net = nn.Sequential(
            nn.Embedding(256, 32), nn.Flatten(), nn.Linear(32 * CONTEXT, 256), nn.GELU(), nn.Linear(256, 256)
        )

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.net(batch[:, :-1]), batch[:, -1])
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict:
        opt = LionCub(self.parameters(), lr=1e-3, weight_decay=0.1, variant=self.variant)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def arguments() -> argparse.ArgumentParser:
    """The example's options (argparse only: tests/test_docs_run.py parses the docstring's commands)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", default="1bit", help="a LionCub preset (1bit, 4bit, 8bit, ...)")
    parser.add_argument("--overlap", action="store_true", help="vote during the backward pass (no clipping)")
    parser.add_argument("--steps", type=int, default=60, help="train up to this optimizer step")
    parser.add_argument("--out", default="runs/lightning_module", help="the Trainer's default_root_dir")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    return parser


def main() -> None:
    parser = arguments()
    opts = parser.parse_args()
    if opts.resume and not (Path(opts.out) / "checkpoints" / "last.ckpt").is_file():
        parser.error(f"--resume: no checkpoints/last.ckpt in --out {opts.out} (train without --resume first)")

    trainer = pl.Trainer(
        strategy=LionCubStrategy(overlap=opts.overlap),
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),  # without torchrun Lightning starts 2 ranks
        max_steps=opts.steps,
        accumulate_grad_batches=2,
        gradient_clip_val=None if opts.overlap else 1.0,  # overlap: .grad must stay as the backward left it
        # every 30 steps and at the end; the same settings on every run, so that a resumed run keeps
        # writing last.ckpt (other settings would make it a new callback, writing last-v1.ckpt)
        callbacks=[ModelCheckpoint(every_n_train_steps=30, save_last=True)],
        default_root_dir=opts.out,
        enable_progress_bar=False,
        logger=False,
    )
    loader = DataLoader(windows(), batch_size=16, shuffle=True)
    trainer.fit(CharModel(opts.variant, opts.steps), loader, ckpt_path="last" if opts.resume else None)
    opt = trainer.strategy.lioncub
    if trainer.is_global_zero and opt is not None:
        print(
            f"loss {trainer.callback_metrics['loss']:.3f}; "
            f"LionCub sent {opt.comm_stats()['last']['bytes_sent']} "
            "bytes in the last step"
        )


if __name__ == "__main__":
    main()
