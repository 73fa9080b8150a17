"""The vote on shards on GPUs, checked on the CPU (docs/gpu.md): which backend carries what, and what a
step keeps. A ``Comm`` of CUDA tensors takes the group's backend for them (NCCL in ``"cpu:gloo,cuda:nccl"``)
and refuses gloo there (the vote between nodes goes over NCCL; nothing is staged on the host); on a 2-D
mesh ``("replicate", "shard")`` the shard group's exchanges (the skip agreement, the quantized vote's
all-gather) and the vote's run on the parameters' device over that rule; the quantized vote on shards
keeps no buffer of the whole tensors between steps. Where a GPU is needed the group's backends are faked
(``monkeypatch`` of ``get_backend_config``), as in tests/test_devices.py.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lioncub.collectives import Comm, exchange_when_alone
from lioncub.optim import topology
from lioncub.optim.config import VoteConfig
from lioncub.optim.shards import SHARD_DIMS, ShardView

GPU = torch.device("cuda", 1)


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Any:
    """A one-rank gloo world (its groups' backends faked per test)."""
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "config",
    [
        "cpu:gloo,cuda:gloo",  # what torch reports for init_process_group("gloo")
        "gloo",
        "cuda:gloo",  # a DeviceMesh dimension with backend_override gloo
    ],
)
def test_cuda_tensors_on_a_gloo_group_are_refused_naming_nccl(
    one_rank_group: Any, monkeypatch: pytest.MonkeyPatch, config: str
) -> None:
    """Gloo's point-to-point sends (lioncub's exchanges on gloo) would be handed device pointers, and its
    collectives stage every tensor through host memory: the votes of CUDA parameters go over NCCL."""
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    with pytest.raises(ValueError, match=r"backend for cuda:1 tensors is gloo .*go over NCCL.*docs/gpu\.md"):
        Comm(device=GPU)


def test_a_cpu_gloo_cuda_nccl_group_carries_cuda_tensors_over_nccl_and_cpu_ones_over_gloo(
    one_rank_group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    gpu, cpu = Comm(device=GPU), Comm()
    assert (gpu.backend, gpu.device, gpu.exchange) == ("nccl", GPU, "native")
    assert (cpu.backend, cpu.device, cpu.exchange) == ("gloo", torch.device("cpu"), "p2p")


def _view(device: torch.device) -> ShardView:
    """The shards' view of an optimizer without parameters on a mesh of one (1 × 1), on ``device``."""
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=SHARD_DIMS)
    owner = SimpleNamespace(param_groups=[], state={}, global_step=0)
    return ShardView(owner, mesh, device)


def test_on_shards_both_groups_run_on_the_parameters_device_over_nccl(
    one_rank_group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA shards under ``"cpu:gloo,cuda:nccl"``: the shard group (the skip agreement, the quantized
    vote's all-gather) and the vote's group (the ``"replicate"`` dimension) are NCCL on the parameters'
    GPU, as LionCub builds them (``ShardView``, then ``topology.vote_groups`` on its vote group)."""
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    view = _view(GPU)
    vote, levels = topology.vote_groups(VoteConfig(), view.vote_group, GPU, broadcast_init=False)
    assert levels is None
    for comm in (view.shard_comm, vote):
        assert (comm.backend, comm.device, comm.exchange) == ("nccl", GPU, "native")


def test_cuda_shards_on_a_gloo_replicate_group_are_refused(
    one_rank_group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mesh whose ``"replicate"`` dimension is gloo for CUDA tensors (``backend_override``): the vote
    between the replicas is refused when LionCub builds its comm, naming NCCL — not a failure inside the
    first step's exchange."""
    view = _view(torch.device("cpu"))  # the shard group over the world's real gloo
    vote_group = view.vote_group
    real = dist.get_backend_config
    monkeypatch.setattr(
        dist,
        "get_backend_config",
        lambda group=None: "cpu:gloo,cuda:gloo" if group is vote_group else "cpu:gloo,cuda:nccl",
    )
    with pytest.raises(ValueError, match="go over NCCL"):
        topology.vote_groups(VoteConfig(), vote_group, GPU, broadcast_init=False)
    monkeypatch.setattr(dist, "get_backend_config", real)
    assert Comm(vote_group).backend == "gloo"  # CPU tensors on it: gloo, as before


def test_the_quantized_vote_on_shards_keeps_no_buffer_of_the_whole_tensors(one_rank_group: Any) -> None:
    """The quantized vote's norms need the whole tensors (a transient all-gather of each bucket over the
    shard group): their levels are not kept between steps — a buffer per bucket would hold the whole
    model's elements on every rank (on a GPU: 1 GB of int8 for a billion parameters, whatever S)."""
    from torch.distributed.fsdp import fully_shard

    from lioncub.optim import LionCub

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=SHARD_DIMS)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 1))
    for layer in model:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    with exchange_when_alone():  # a mesh of one votes (as benchmarks/gpu_check.sh runs it)
        opt = LionCub(model.parameters(), lr=0.01, variant="8bit", process_group=mesh)
        for _ in range(2):
            model(torch.randn(3, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    buffers = opt.engine.vote._buffers
    assert not [key for key in buffers if isinstance(key[0], tuple) and key[0][0] == "whole"], list(buffers)
