"""The frameworks' FSDP paths on 2 replicas × 2 shards of gloo ranks (``tests/test_framework_fsdp.py``): one
worker-pool call whose ranks run every case and return what they saw.

* ``lightning``: :class:`~lioncub.integrations.lightning.LionCubFSDPStrategy` — a ``Trainer.fit`` of 2 steps
  saved with ``trainer.save_checkpoint``, then a new module (other initial weights) fitted to step 4 from
  that checkpoint — against the user's own loop (docs/shards.md's recipe: ``fully_shard`` + ``LionCub``)
  stepped 4 times on the batches torch's ``DistributedSampler`` gives each rank of the world.
* ``fsdp1``: LionCub over FSDP1's parameters (``FullyShardedDataParallel(use_orig_params=True)``, what
  Lightning's ``FSDPStrategy`` wraps the model in before ``configure_optimizers``): whether LionCub refuses.
* ``accelerate-cpu``: ``Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))``
  in a job of several processes, where accelerate wraps the model in DDP: whether
  ``lioncub.integrations.accelerate.prepare`` refuses it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

REPLICAS, SHARDS = 2, 2
BATCH = 3  #: rows per rank and step
STEPS_PER_EPOCH = 2
LR = 0.02


def model(seed: int) -> nn.Sequential:
    """Dim-0 sizes 7, 5, 1 over 2 shards: uneven shards and an empty one."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 1))


def shard(net: nn.Sequential, mesh: DeviceMesh) -> None:
    """docs/shards.md's recipe: each ``Linear``, then the root, over ``mesh["shard"]``."""
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(net, mesh=mesh["shard"])


def dataset(world: int) -> TensorDataset:
    """Rows ``(x, y, index)``: ``STEPS_PER_EPOCH`` batches of ``BATCH`` rows for every rank."""
    g = torch.Generator().manual_seed(7)
    n = world * STEPS_PER_EPOCH * BATCH
    return TensorDataset(torch.randn(n, 13, generator=g), torch.randn(n, 1, generator=g), torch.arange(n))


def sampled(rank: int, world: int, epoch: int) -> list[int]:
    """The rows torch's ``DistributedSampler`` gives ``rank`` of the world in ``epoch``, shuffled with seed 0
    as Lightning samples a training set."""
    sampler = DistributedSampler(dataset(world), num_replicas=world, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def options(case: str) -> dict[str, Any]:
    """LionCub's options per case."""
    from lioncub.optim.local_steps import LocalSteps

    return {
        "1bit": {"variant": "1bit"},
        "8bit h=4": {"variant": "8bit", "local_steps": LocalSteps(h=4)},  # the save is in the window
    }[case]


def own_loop(world: int, case: str, batches: list[torch.Tensor]) -> tuple[nn.Sequential, Any]:
    """The reference: docs/shards.md's loop, a step on each of ``batches`` (rows of :func:`dataset`)."""
    from lioncub.optim import LionCub
    from lioncub.optim.shards import SHARD_DIMS

    mesh = init_device_mesh("cpu", (REPLICAS, world // REPLICAS), mesh_dim_names=SHARD_DIMS)
    net = model(0)
    shard(net, mesh)
    opt = LionCub(net.parameters(), lr=LR, process_group=mesh, **options(case))
    x_all, y_all, _ = dataset(world).tensors
    for rows in batches:
        nn.functional.mse_loss(net(x_all[rows]), y_all[rows]).backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def lightning_fit(case: str, out: Path) -> tuple[nn.Sequential, Any, list[torch.Tensor], list[str]]:
    """2 steps, a save, then a module of other initial weights fitted from that save to step 4. Returns the
    second module, its LionCub, the rows of each step's batch (both fits) and LionCub's warnings."""
    import warnings

    import lightning.pytorch as pl

    from lioncub.integrations.lightning import LionCubFSDPStrategy
    from lioncub.optim import LionCub

    rows: list[torch.Tensor] = []

    class Module(pl.LightningModule):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.net = model(seed)

        def configure_model(self) -> None:
            shard(self.net, self.trainer.strategy.mesh)  # type: ignore[attr-defined]

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            x, y, index = batch
            rows.append(index)
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> LionCub:
            mesh = self.trainer.strategy.mesh  # type: ignore[attr-defined]
            return LionCub(self.parameters(), lr=LR, process_group=mesh, **options(case))

    def trainer(steps: int) -> pl.Trainer:
        return pl.Trainer(
            strategy=LionCubFSDPStrategy(replicas=REPLICAS), accelerator="cpu", devices=dist.get_world_size(),
            max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=out, num_sanity_val_steps=0,
        )  # fmt: skip

    loader = DataLoader(dataset(dist.get_world_size()), batch_size=BATCH)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = trainer(STEPS_PER_EPOCH)
        first.fit(Module(0), loader)
        first.save_checkpoint(out / "step2")
        second, module = trainer(2 * STEPS_PER_EPOCH), Module(1)
        second.fit(module, loader, ckpt_path=out / "step2")
    strategy = second.strategy
    assert isinstance(strategy, LionCubFSDPStrategy) and strategy.lioncub is not None
    warned = [str(w.message) for w in seen if "lioncub" in str(w.message).lower()]
    return module.net, strategy.lioncub, rows, warned


def lightning_unsharded(out: Path) -> str:
    """``LionCubFSDPStrategy`` with a module that does not shard (LionCub over whole tensors, the default
    group): the refusal's message, or what ``fit`` did."""
    import lightning.pytorch as pl

    from lioncub.integrations.lightning import LionCubFSDPStrategy
    from lioncub.optim import LionCub

    class Whole(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model(0)

        def configure_model(self) -> None:
            pass  # not sharded

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> LionCub:
            return LionCub(self.parameters(), lr=LR, variant="1bit")

    trainer = pl.Trainer(
        strategy=LionCubFSDPStrategy(replicas=REPLICAS), accelerator="cpu", devices=dist.get_world_size(),
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out,
    )  # fmt: skip
    try:
        trainer.fit(Whole(), DataLoader(dataset(dist.get_world_size()), batch_size=BATCH))
    except TypeError as err:
        return f"refused: {err}"
    return "not refused"


def differences(net: nn.Module, opt: Any, ref: nn.Module, ref_opt: Any) -> list[str]:
    """Where this rank's shards and momenta (and, with local steps, every state tensor) differ."""
    out = []
    pairs = zip(net.named_parameters(), ref.parameters(), strict=True)
    for (name, p), r in pairs:
        assert isinstance(p, DTensor) and isinstance(r, DTensor)
        if not torch.equal(p.to_local(), r.to_local()):
            out.append(f"parameter {name}")
        mine, theirs = opt.state[p], ref_opt.state[r]
        if sorted(mine) != sorted(theirs):
            out.append(f"state keys of {name}: {sorted(mine)} != {sorted(theirs)}")
            continue
        for key, value in mine.items():
            if isinstance(value, torch.Tensor) and not torch.equal(value, theirs[key]):
                out.append(f"state {key} of {name}")
    return out


def fsdp1_refused() -> str:
    """LionCub built over FSDP1's parameters (use_orig_params=True, as Lightning's FSDPStrategy): the
    refusal's message, or what a step did when nothing refused."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from lioncub.optim import LionCub

    torch.manual_seed(0)  # one weight of 64 elements: every rank's flat shard is a (16,) tensor
    net = FullyShardedDataParallel(
        nn.Linear(8, 8, bias=False), use_orig_params=True, device_id=torch.device("cpu")
    )
    try:
        opt = LionCub(net.parameters(), lr=LR, variant="1bit")
    except (TypeError, ValueError) as err:
        return f"refused: {err}"
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    net(x).sum().backward()
    opt.step()
    return "not refused: LionCub stepped FSDP1's flat shards as if every rank held the same tensors"


def accelerate_cpu_refused(rank: int, world: int) -> str:
    """accelerate's FSDP plugin in a CPU job of several processes: the refusal's message (or none)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin

    import lioncub.integrations.accelerate as lioncub_accelerate
    from lioncub.optim import LionCub

    try:
        acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        net = model(0)
        opt = LionCub(net.parameters(), lr=LR, variant="1bit")
        net, opt = acc.prepare(net, opt)
        kind = f"{acc.distributed_type.value}, {type(net).__name__}"
        try:
            lioncub_accelerate.prepare(acc, net, opt)
        except ValueError as err:
            return f"{kind}: refused: {err}"
        return f"{kind}: not refused"
    finally:
        AcceleratorState._reset_state(True)


def worker(rank: int, world: int, out: str, cases: list[str]) -> dict[str, Any]:
    """Every case on this rank (``tests/processes.run_workers``)."""
    os.environ.update(
        LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29999",  # unused: joined already
    )  # fmt: skip
    start = time.process_time()
    got: dict[str, Any] = {}
    for case in cases:
        net, opt, rows, warned = lightning_fit(case, Path(out) / case.replace(" ", "_"))
        ref, ref_opt = own_loop(world, case, rows)
        initial = model(0)
        got[f"lightning {case}"] = {
            "differences": differences(net, opt, ref, ref_opt),
            "moved": [
                not torch.equal(p.full_tensor(), q)
                for p, q in zip(net.parameters(), initial.parameters(), strict=True)
            ],
            "rows": [r.tolist() for r in rows],
            "sampled": sampled(rank, world, 0),
            "warnings": warned,
        }
    got["lightning unsharded"] = lightning_unsharded(Path(out) / "unsharded")
    got["fsdp1"] = fsdp1_refused()
    got["accelerate-cpu"] = accelerate_cpu_refused(rank, world)
    got["cpu_s"] = time.process_time() - start
    return got
