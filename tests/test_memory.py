"""``lioncub.train.memory``: the bytes a rank holds (``summary.json``'s ``memory``), counted on plain tensors,
optimizer state and a DTensor's local shard. The runs' ``memory`` is checked in tests/test_train.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lioncub.optim import Lion
from lioncub.train.memory import (
    MEMORY_KEYS,
    gradient_bytes,
    largest_of,
    largest_over_ranks,
    parameter_bytes,
    peak_rss_bytes,
    rank_memory,
    state_bytes,
    tensor_bytes,
)


def test_a_tensor_counts_its_elements_times_their_size() -> None:
    assert tensor_bytes(torch.zeros(3, 5)) == 60
    assert tensor_bytes(torch.zeros(7, dtype=torch.bfloat16)) == 14
    assert tensor_bytes(torch.zeros(9, dtype=torch.int8)) == 9
    assert tensor_bytes(torch.zeros(2, 2, dtype=torch.float64)) == 32
    assert tensor_bytes(torch.zeros(())) == 4
    assert tensor_bytes(torch.zeros(0)) == 0


def test_parameters_gradients_and_state_of_a_model() -> None:
    """Tied parameters count once, a parameter without a gradient counts none, every state tensor counts
    (nested ones too; a tensor held twice once), numbers in the state do not."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 4, bias=False))
    model.append(torch.nn.Linear(3, 4, bias=False))
    model[2].weight = model[1].weight  # tied
    model.append(torch.nn.Linear(2, 2))  # never used: no gradient
    d = 4 * 3 + 3 + 3 * 4 + 2 * 2 + 2
    assert parameter_bytes(model) == 4 * d
    assert gradient_bytes(model) == 0
    x = torch.randn(5, 4)
    (model[1](model[0](x)) + model[2](model[0](x))).sum().backward()
    assert gradient_bytes(model) == 4 * (d - 6)  # the unused Linear(2, 2) has none
    opt = Lion(model.parameters(), lr=1e-3)
    assert state_bytes(opt) == 0
    opt.step()
    assert state_bytes(opt) == 4 * (d - 6)  # one fp32 momentum per parameter stepped; "step" is an int
    p = next(iter(model.parameters()))
    opt.state[p]["nested"] = {"a": [torch.zeros(3, dtype=torch.float64)], "n": 7}
    opt.state[p]["again"] = opt.state[p]["exp_avg"]
    assert state_bytes(opt) == 4 * (d - 6) + 24
    assert state_bytes(opt, opt) == 4 * (d - 6) + 24
    memory = rank_memory(model, [opt], gradients=11, extra_state=5)
    assert tuple(memory) == MEMORY_KEYS
    assert (memory["parameters"], memory["gradients"], memory["optimizer_state"]) == (
        4 * d,
        11,
        4 * (d - 6) + 29,
    )
    assert memory["peak_rss"] > 0


def test_peak_rss_is_in_bytes_and_about_at_least_the_current_rss() -> None:
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("no /proc (the check reads VmRSS)")
    rss = next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("VmRSS:"))
    assert peak_rss_bytes() >= 0.95 * rss * 1024  # the kernel's counters of the peak are approximate
    assert peak_rss_bytes() < 1 << 40  # bytes, not KiB counted twice over


def test_the_largest_over_ranks_and_over_groups(one_rank: None) -> None:
    memory = {"parameters": 1, "gradients": 2, "optimizer_state": 3, "peak_rss": 1 << 33}
    assert largest_over_ranks(memory, torch.device("cpu")) == memory  # one rank: its own
    other = {"parameters": 5, "gradients": 0, "optimizer_state": 3, "peak_rss": 7}
    assert largest_of([memory, other]) == {**memory, "parameters": 5}
    assert largest_of([]) is None


@pytest.mark.slow  # the first import of torch.distributed.tensor takes about a second
def test_a_dtensor_counts_its_local_shard(one_rank: None) -> None:
    """A DTensor, as FSDP2's parameters and gradients are, counts the shard this rank holds, not the whole:
    a (10, 3) tensor of which this rank's shard is (4, 3) counts 48 bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (1,))
    shard = DTensor.from_local(
        torch.zeros(4, 3), mesh, [Shard(0)], run_check=False, shape=torch.Size([10, 3]), stride=(3, 1)
    )
    assert shard.shape == (10, 3) and tensor_bytes(shard) == 48
    param = torch.nn.Parameter(shard)
    param.grad = DTensor.from_local(
        torch.zeros(4, 3), mesh, [Shard(0)], run_check=False, shape=torch.Size([10, 3]), stride=(3, 1)
    )
    module = torch.nn.Module()
    module.register_parameter("w", param)
    assert parameter_bytes(module) == gradient_bytes(module) == 48
