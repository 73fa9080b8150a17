"""A LightningModule trained with LionCub's 1-bit vote through ``LionCubStrategy``, with resume.

    torchrun --nproc-per-node 2 examples/lightning_module.py          # CPU, gloo
    lioncub launch --nproc 2 -- python examples/lightning_module.py --variant 8bit --overlap
    lioncub launch --nproc 2 -- python examples/lightning_module.py --resume   # from the last checkpoint

A character-level MLP language model on the opening of Pride and Prejudice (``data/austen_slice.txt.gz``).
Needs ``pip install 'lioncub[lightning]'``.
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

TEXT = Path(__file__).resolve().parents[1] / "data" / "austen_slice.txt.gz"
CONTEXT = 16


def windows() -> torch.Tensor:
    """int64 ``[n, CONTEXT + 1]``: byte windows of the text (the last byte is the target)."""
    raw = torch.frombuffer(bytearray(gzip.decompress(TEXT.read_bytes())), dtype=torch.uint8).long()
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", default="1bit", help="a LionCub preset (1bit, 4bit, 8bit, ...)")
    parser.add_argument("--overlap", action="store_true", help="vote during the backward pass (no clipping)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="runs/lightning_module")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    opts = parser.parse_args()

    trainer = pl.Trainer(
        strategy=LionCubStrategy(overlap=opts.overlap),
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),  # without torchrun Lightning starts 2 ranks
        max_steps=opts.steps,
        accumulate_grad_batches=2,
        gradient_clip_val=None if opts.overlap else 1.0,  # overlap: .grad must stay as the backward left it
        callbacks=[ModelCheckpoint(every_n_train_steps=max(1, opts.steps // 2), save_last=True)],
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
