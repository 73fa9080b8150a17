"""The parameters' device at LionCub's construction, and after it (checked on the CPU: the GPU's part is
faked where needed, as in ``tests/test_devices.py``):

* CPU parameters on a group whose only backend is NCCL are refused at construction, naming the cause (the
  model not yet on its GPU) and both fixes;
* a parameter moved after LionCub was built (its comm and buckets stay on the old device) is named at the
  next ``step()``, with its old and new device and the fix, and ``lioncub.integrations.accelerate.prepare``
  names accelerate's own fix;
* the README's accelerate recipe, ``examples/accelerate_loop.py`` and the integration's docstring move the
  model to ``accelerator.device`` before building LionCub, and prepare after;
* object gathers (consolidation) travel on a gloo side group, in CPU memory, when the comm's group is NCCL
  only, made once, by the group's members only;
* a generator state loaded onto another device (the qsgd quantizer's stream) is accepted;
* the Hugging Face Trainer's resume reads the optimizer file onto the CPU.

A torchrun loop on CPU with rank-dependent initial weights is covered by ``tests/test_lioncub.py``
(``test_native_exchange_matches_simulation``, ``test_every_preset_matches_simulation_on_every_rank``):
each gloo rank starts from its own values, and every rank ends bitwise equal to the simulation started
from rank 0's.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lioncub.collectives import Comm, exchange_when_alone
from lioncub.optim import LionCub
from lioncub.optim.config import resolve_variant

from processes import run_workers

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def moves_keep_parameters() -> Any:
    """``Module.to`` swaps each parameter's contents in place (the parameter objects stay the optimizer's),
    also for a move to "meta" — the CPU's stand-in for a GPU here; ``set_data`` cannot take it."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


# ------------------------------------------------------------------------------------ at construction


def test_cpu_parameters_on_an_nccl_only_group_are_refused_naming_the_cause(
    one_rank: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``init_process_group("nccl")`` (what accelerate starts on GPUs) has no backend for CPU tensors: a
    LionCub built before the model went to its GPU says so, and how to fix it."""
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    model = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError) as err:
        LionCub(model.parameters(), variant="1bit")
    message = str(err.value)
    for part in (
        "LionCub was built with parameters on cpu",
        "its backend is nccl, for CUDA tensors only (its backends: 'cuda:nccl')",
        "model.to(accelerator.device)",
        "model.cuda()",
        "init the process group with gloo",
    ):
        assert part in message, message
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo")
    with pytest.raises(ValueError, match=r"no backend for cuda tensors \(its backends: 'cpu:gloo'\)"):
        Comm(device=torch.device("cuda", 0))  # the other way round keeps its message


# ------------------------------------------------------------------------------------ after construction


def _voting_lioncub(model: torch.nn.Module, **options: Any) -> LionCub:
    """A LionCub that votes (not Lion's one-process step) on the one-rank group."""
    with exchange_when_alone():
        return LionCub(model.parameters(), lr=1e-3, variant="1bit", model=model, **options)


def test_a_parameter_moved_after_construction_is_named_at_the_next_step(
    one_rank: Any, moves_keep_parameters: Any
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = _voting_lioncub(model, bucket_mb=1e-5)  # a bucket per tensor: the check reads each bucket
    model(torch.randn(5, 4)).sum().backward()
    opt.step()  # on the device it was built for: runs
    assert len(opt.layout.buckets) == 4
    model.to("meta")
    assert all(p.device.type == "meta" for g in opt.param_groups for p in g["params"])
    with pytest.raises(RuntimeError) as err:
        opt.step()
    message = str(err.value)
    assert message.startswith("rank 0: LionCub: parameter '0.weight' moved from cpu to meta after LionCub "
                              "was built"), message  # fmt: skip
    assert "Build the optimizer after moving the model" in message
    assert opt.global_step == 1  # refused before the step counted


def test_accelerate_prepare_names_accelerates_fix(
    one_rank: Any, moves_keep_parameters: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``accelerator.prepare`` moves a model that is not on ``accelerator.device``; the optimizer built
    before stays where it was: :func:`lioncub.integrations.accelerate.prepare` says to build it after."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    import lioncub.integrations.accelerate as lioncub_accelerate

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    model = torch.nn.Linear(4, 3)
    opt = _voting_lioncub(model)
    try:
        accelerator = Accelerator(cpu=True)
        pm, popt = accelerator.prepare(model, opt)
        pm.to("meta")  # as accelerator.prepare does with a model elsewhere than accelerator.device
        with pytest.raises(RuntimeError) as err:
            lioncub_accelerate.prepare(accelerator, pm, popt)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    message = str(err.value)
    assert message.startswith("lioncub.integrations.accelerate.prepare: rank 0: LionCub: parameter 'weight' "
                              "moved from cpu to meta"), message  # fmt: skip
    assert "build LionCub after model = model.to(accelerator.device) (cpu)" in message


# ------------------------------------------------------------------------------------ the recipes


def _order(code: str, where: str) -> None:
    """In ``code``, in this order (the first line of each): the model moved to ``accelerator.device``,
    ``LionCub(`` built, ``accelerator.prepare(`` called."""
    lines = code.splitlines()

    def first(pattern: str) -> int:
        found = [i for i, line in enumerate(lines) if re.search(pattern, line)]
        assert found, f"{where}: no line matches {pattern!r}"
        return found[0]

    moved = first(r"\bmodel\s*=.*\.to\(accelerator\.device\)")
    built = first(r"\bLionCub\(")
    prepared = first(r"\baccelerator\.prepare\(")
    assert moved < built < prepared, f"{where}: lines {moved}, {built}, {prepared}"


def test_the_accelerate_recipes_build_lioncub_after_the_move() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.findall(r"```python accelerate\n(.*?)```", readme, re.S)
    assert len(block) == 1
    _order(block[0], "README.md[python accelerate]")
    example = ast.parse((ROOT / "examples" / "accelerate_loop.py").read_text())
    main = next(n for n in example.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    _order(ast.unparse(main), "examples/accelerate_loop.py main()")
    integration = ast.parse((ROOT / "src" / "lioncub" / "integrations" / "accelerate.py").read_text())
    recipe = re.search(r"::\n\n((?:    .*\n|\n)+)", ast.get_docstring(integration) or "")
    assert recipe is not None, "lioncub.integrations.accelerate's docstring has no recipe"
    _order(recipe.group(1), "lioncub.integrations.accelerate's docstring")


# ------------------------------------------------------------------------------------ consolidation


def test_object_gathers_on_an_nccl_group_use_a_gloo_side_group(
    one_rank: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NCCL would stage every rank's pickle on the gathering rank's GPU: the gather runs on a gloo group
    over the same ranks, with CPU tensors, made once; a group with a CPU backend gathers on itself."""
    made: list[dict[str, Any]] = []
    gathered_on: list[Any] = []
    new_group, gather = dist.new_group, dist.gather_object
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: made.append(k) or new_group(*a, **k))

    def recording_gather(obj: Any, out: Any, dst: int, group: Any) -> None:
        gathered_on.append(group)
        gather(obj, out, dst=dst, group=group)

    monkeypatch.setattr(dist, "gather_object", recording_gather)
    gloo = Comm()  # the real group: gloo for CPU and CUDA tensors
    assert gloo.gather_object({"x": 1}, 0, "test gather") == [{"x": 1}]
    assert gathered_on == [None] and made == []

    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    nccl = Comm(device=torch.device("cuda", 0))
    assert (nccl.backend, nccl.device.type) == ("nccl", "cuda")
    state = {"exp_avg": torch.arange(6.0)}
    for _ in range(2):
        out = nccl.gather_object(state, 0, "consolidate_state_dict(to=0)")
        assert out is not None and torch.equal(out[0]["exp_avg"], state["exp_avg"])
    assert len(made) == 1 and made[0]["backend"] == "gloo" and made[0]["use_local_synchronization"]
    side = gathered_on[1]
    assert side is not None and gathered_on[1:] == [side, side]
    assert dist.get_backend(side) == "gloo"


def worker_side_group_gather(rank: int, world: int) -> dict[str, Any]:
    """3 gloo ranks; ranks 0 and 2 form a group, told it is NCCL only: their object gathers run on a side
    group that rank 1 never joins."""
    pair = dist.new_group([0, 2])  # every rank calls it (torch.distributed's rule for new_group)
    if rank == 1:
        return {}
    real = dist.get_backend_config
    dist.get_backend_config = lambda group=None: "cuda:nccl"  # type: ignore[assignment]
    try:
        comm = Comm(pair, device=torch.device("cuda", 0))
        got = [comm.gather_object({"rank": rank}, to, f"gather to {to}") for to in (1, 0)]
        side = comm._side_group
        return {"got": got, "side": dist.get_backend(side), "size": dist.get_world_size(side)}
    finally:
        dist.get_backend_config = real  # type: ignore[assignment]


def test_the_side_group_is_made_by_the_groups_members_only() -> None:
    out = run_workers(worker_side_group_gather, 3, timeout=120, pg_timeout=30)
    assert out[1] == {}
    assert out[0]["got"] == [None, [{"rank": 0}, {"rank": 2}]]  # group rank 1 is global rank 2
    assert out[2]["got"] == [[{"rank": 0}, {"rank": 2}], None]
    assert out[0]["side"] == out[2]["side"] == "gloo" and out[0]["size"] == 2


class _StateOnAnotherDevice(torch.Tensor):
    """What ``torch.load(map_location="cuda:N")`` gives for a saved generator state, without a GPU: a uint8
    tensor off the CPU (on "meta") whose copy to the CPU holds the saved bytes."""

    saved: torch.Tensor

    @staticmethod
    def __new__(cls, saved: torch.Tensor) -> _StateOnAnotherDevice:
        t = torch.Tensor._make_subclass(cls, torch.empty_like(saved, device="meta"))
        t.saved = saved
        return t

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.Tensor.cpu, torch.Tensor.to):
            target = [*args[1:], *kwargs.values()]
            if func is torch.Tensor.cpu or target in (["cpu"], [torch.device("cpu")]):
                return args[0].saved.clone()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def test_a_generator_state_loaded_onto_another_device_is_accepted() -> None:
    """The qsgd quantizer's stream: ``Generator.set_state`` takes a CPU ByteTensor only; a state mapped
    to a GPU (the Trainer's resume on several GPUs, accelerate's optimizer placement) is moved back."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(40))
    opt = LionCub([p], variant=resolve_variant("8bit", quantizer="qsgd"))
    generator = opt.engine.vote.generator
    assert generator is not None
    sd = opt.state_dict()
    saved = sd["lioncub"]["generator"].clone()
    torch.randn(3, generator=generator)  # the stream moves on
    sd["lioncub"]["generator"] = _StateOnAnotherDevice(saved)
    assert sd["lioncub"]["generator"].device.type == "meta"
    opt.load_state_dict(sd)
    assert torch.equal(generator.get_state(), saved)
    sd["lioncub"]["generator"] = saved.to(torch.int64)
    with pytest.raises(TypeError, match=r"generator state is a Tensor of torch\.int64, not the uint8 tensor"):
        opt.load_state_dict(sd)


@pytest.mark.slow
def test_the_trainer_resume_reads_the_optimizer_onto_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Trainer reads ``optimizer.pt`` with ``map_location=args.device`` on several GPUs (all N ranks'
    momenta on every GPU); lioncub's resume reads it onto the CPU and loads it (faked here: a job of 2
    processes on cuda:0, as the Trainer sees it)."""
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from lioncub.integrations.hf import LionCubTrainer

    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], learning_rate=1e-3)
    model = torch.nn.Linear(4, 3)
    trainer = LionCubTrainer(model=model, args=args, lioncub=dict(variant="1bit"))
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    opt = trainer.lioncub_optimizer
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    opt.continue_at(2)
    torch.save(trainer.optimizer.state_dict(), checkpoint / "optimizer.pt")
    torch.save(trainer.lr_scheduler.state_dict(), checkpoint / "scheduler.pt")
    opt.continue_at(0)

    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
    monkeypatch.setattr(TrainingArguments, "device", property(lambda self: torch.device("cuda", 0)))
    loads: list[tuple[str, Any]] = []
    load = torch.load

    def recording_load(f: Any, *a: Any, map_location: Any = None, **k: Any) -> Any:
        loads.append((Path(f).name, map_location))
        return load(f, *a, map_location="cpu", **k)  # the fake cuda:0 cannot be loaded onto

    monkeypatch.setattr(torch, "load", recording_load)
    trainer._load_optimizer_and_scheduler(str(checkpoint))
    assert ("optimizer.pt", "cpu") in loads, loads
    assert all(location == "cpu" for _, location in loads), loads
    assert opt.global_step == 2  # loaded


def test_a_replica_groups_comm_with_parameters_off_the_cpu_names_the_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A LionCub built over a fault-tolerant replica group's comm (``GroupComm``: gloo, CPU tensors) with
    parameters on a GPU (faked: the optimizer is told its parameters' device is cuda:0) says that
    torchft's groups vote on the CPU, not only that the devices differ."""
    from lioncub.collectives.base import GroupComm
    from lioncub.optim import lioncub

    monkeypatch.setattr(lioncub, "_device_of", lambda groups: torch.device("cuda", 0))
    comm = GroupComm(object(), rank=0, world_size=1)
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=r"on cuda:0.*torchft's replica groups vote over ProcessGroupGloo"):
        LionCub(params, variant="1bit", process_group=comm, checks=lioncub.Checks(broadcast_init=False))
