"""A plain training loop with Hugging Face accelerate and LionCub's 1-bit vote, with save/resume.

    torchrun --nproc-per-node 2 examples/accelerate_loop.py --out runs/acc   # CPU, gloo (GPUs: NCCL)
    lioncub launch --nproc 2 -- python examples/accelerate_loop.py --variant 8bit --overlap --out runs/acc8
    lioncub launch --nproc 2 -- python examples/accelerate_loop.py --out runs/acc --resume --steps 90

The first trains 60 steps into runs/acc (its state saved at step 30 and at its last step), the
second the 8-bit vote overlapped with the backward pass in its own directory, the third continues the first
from its last saved state (step 60) to step 90 (a resume needs the variant the state was trained with:
every rank's momenta are its own).

A character-level MLP language model on the opening of Pride and Prejudice (shipped with lioncub:
``lioncub.train.data.package_file``). Needs ``pip install 'lioncub[hf]'``.
"""

from __future__ import annotations

import argparse
import gc
import gzip
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

import lioncub.integrations.accelerate as lioncub_accelerate
from lioncub import LionCub
from lioncub.train.data import package_file

CONTEXT = 16


def windows() -> torch.Tensor:
    """int64 ``[n, CONTEXT + 1]``: byte windows of the text (the last byte is the target)."""
    text = package_file("austen_slice.txt.gz").read_bytes()
    raw = torch.frombuffer(bytearray(gzip.decompress(text)), dtype=torch.uint8).long()
    n = raw.numel() // (CONTEXT + 1)
    return raw[: n * (CONTEXT + 1)].view(n, CONTEXT + 1)


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Embedding(256, 32), nn.Flatten(), nn.Linear(32 * CONTEXT, 256), nn.GELU(), nn.Linear(256, 256)
    )


def arguments() -> argparse.ArgumentParser:
    """The example's options (argparse only: tests/test_docs_run.py parses the docstring's commands)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", default="1bit", help="a LionCub preset (1bit, 4bit, 8bit, ...)")
    parser.add_argument("--overlap", action="store_true", help="vote during the backward pass (no clipping)")
    parser.add_argument("--steps", type=int, default=60, help="train up to this optimizer step")
    parser.add_argument("--out", default="runs/accelerate_loop", help="where the state is saved")
    parser.add_argument("--resume", action="store_true", help="continue from the state saved in --out")
    return parser


def main() -> None:
    parser = arguments()
    opts = parser.parse_args()
    if opts.resume and not (Path(opts.out) / "step.txt").is_file():
        parser.error(f"--resume: no saved state in --out {opts.out} (train without --resume first)")

    # joins the process group; on CPU accelerate needs cpu=True to run as several processes
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=2)
    # on the device first: LionCub makes its comm and vote buckets on the parameters' device when built
    model = build_model().to(accelerator.device)
    opt = LionCub(model.parameters(), lr=1e-3, weight_decay=0.1, variant=opts.variant)
    # accelerate steps a scheduler once per process and optimizer step
    total = opts.steps * accelerator.num_processes
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / total)
    loader = DataLoader(windows(), batch_size=16, shuffle=True)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    lioncub_accelerate.prepare(accelerator, model, opt, overlap=opts.overlap)

    step, state = 0, Path(opts.out) / "state"
    if opts.resume:
        accelerator.load_state(str(state))  # every rank gets its own momenta back
        step = int((Path(opts.out) / "step.txt").read_text())
    batches = accelerator.skip_first_batches(loader, 2 * step) if step else loader
    for batch in batches:
        with accelerator.accumulate(model):
            loss = nn.functional.cross_entropy(model(batch[:, :-1]), batch[:, -1])
            accelerator.backward(loss)
            if accelerator.sync_gradients and not opts.overlap:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        if not accelerator.sync_gradients:
            continue
        step += 1
        if step % 10 == 0:
            accelerator.print(f"step {step}: loss {loss.item():.3f}")
        if step in (opts.steps // 2, opts.steps):  # halfway and at the end
            accelerator.save_state(str(state))
            if accelerator.is_main_process:
                (Path(opts.out) / "step.txt").write_text(str(step))
        if step >= opts.steps:
            break
    stats = opt.optimizer.comm_stats()
    accelerator.print(f"LionCub sent {stats['last']['bytes_sent']} bytes in the last step")
    accelerator.wait_for_everyone()  # every rank's state (and rank 0's step.txt) is saved
    # The DDP model goes before the process group, not after: a gloo thread that drops a finished
    # collective's tensors may need the GIL, and a group freed last by the DDP model's reducer is joined
    # with the GIL held (torch's deadlock: rank 0 waiting forever at the end, ~1 run in 40 here). Freed
    # by end_training instead, its threads are joined with the GIL released.
    accelerator.free_memory()  # accelerate's references to what it prepared
    del model, opt, sched, loader, batches
    gc.collect()  # and the cycles between them
    accelerator.end_training()


if __name__ == "__main__":
    main()
