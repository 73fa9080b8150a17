"""Checkpoints of LionCub on shards through ``torch.distributed.checkpoint`` (issue 46, item 3): a user's
loop saves with ``get_state_dict`` + ``dcp.save`` and resumes, in a new model, FSDP2 and optimizer, with
``dcp.load`` + ``set_state_dict`` (:mod:`lioncub.optim.shard_state`, docs/shards.md "Checkpoints").

The oracle: the uninterrupted run. On 2 replicas × 2 shards, with a loss whose gradients depend on the
parameters, train k steps, save, train m more (the reference); then a fresh model (initialised otherwise),
FSDP2 and LionCub load the checkpoint and train the same m steps: every rank's parameter shards, momenta
and the rest of its state equal the reference's bit for bit — a 1-bit vote, a quantized one, qsgd (its
generator), and local steps saved in a window's middle (anchors, replicas, the outer momentum).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lioncub.optim import LionCub
from lioncub.optim.config import resolve_variant
from lioncub.optim.local_steps import LocalSteps
from lioncub.optim.shard_state import state_keys
from lioncub.optim.shards import SHARD_DIMS

from processes import run_workers

#: the options of the checkpoint saved in a window's middle (4 steps of h=3) that 2 × 1 ranks load
RESHARDED = {"variant": "1bit", "local_steps": LocalSteps(h=3)}
#: (name, LionCub options, k steps before the save, m after it, save inside ``shared_parameters()``); their
#: checkpoints (``ROOT/case{i}``) are also what the refusals and the load onto other shards read
CASES: list[tuple[str, dict[str, Any], int, int, bool]] = [
    ("1bit", {"variant": "1bit"}, 2, 2, False),
    ("8bit", {"variant": "8bit"}, 2, 2, False),
    ("1bit local_steps h=3, saved after 4", RESHARDED, 4, 3, False),
]
#: the checkpoints of :data:`CASES` that other tests read: a 1-bit vote's, and one in a window's middle
ONE_BIT, IN_WINDOW = "case0", "case2"
SLOW_CASES: list[tuple[str, dict[str, Any], int, int, bool]] = [
    ("8bit qsgd", {"variant": resolve_variant("8bit", quantizer="qsgd")}, 2, 2, False),
    (
        "8bit local_steps h=3, saved after step 2 in shared_parameters()",
        {"variant": "8bit", "local_steps": LocalSteps(h=3)},
        2,
        3,
        True,
    ),
    (
        "32bit diloco h=2, saved after step 3",
        {"variant": "32bit", "local_steps": LocalSteps(h=2, outer="diloco")},
        3,
        2,
        False,
    ),
    ("1bit, saved before the first step", {"variant": "1bit"}, 0, 2, False),
]


def _sharded(mesh: Any, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    return model


def _train(model: nn.Module, opt: LionCub, steps: range, replica: int, shard: int) -> None:
    """Steps on data that differs per step, replica and shard rank."""
    for step in steps:
        g = torch.Generator().manual_seed(10_000 * step + 100 * replica + shard)
        x, y = torch.randn(6, 13, generator=g), torch.randn(6, 1, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _snapshot(model: nn.Module, opt: LionCub) -> dict[str, torch.Tensor]:
    """This rank's parameter shards and every state tensor, by name."""
    out = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor)
        out[name] = p.to_local().detach().clone()
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor) and key != "window_grad":
                out[f"{name} {key}"] = value.clone()
            elif key == "window_grad":
                out[f"{name} {key}"] = torch.ones(())
    return out


DOCS = Path(__file__).resolve().parent.parent / "docs" / "shards.md"


def _recipe() -> dict[str, Any]:
    """docs/shards.md's checkpoint recipe (the python block of "## Checkpoints"), as written."""
    section = DOCS.read_text().split("\n## Checkpoints\n", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "docs/shards.md: no python block under ## Checkpoints"
    namespace: dict[str, Any] = {"__name__": "checkpoint_recipe"}
    exec(compile(code.group(1), str(DOCS), "exec"), namespace)
    return namespace


_save, _load = _recipe()["save"], _recipe()["load"]


def _whole_state(model: nn.Module, opt: LionCub) -> dict[str, torch.Tensor]:
    """Every replica's whole state (the rows of the ``DTensor`` s ``state_dict()`` gives), by parameter
    name and key."""
    names = [name for name, _ in model.named_parameters()]
    return {
        f"{names[i]} {key}": value.full_tensor()
        for i, entry in opt.state_dict()["state"].items()
        for key, value in entry.items()
    }


def worker_resume(rank: int, world: int, cases: list[Any], root: str, keep: str = "") -> dict[str, Any]:
    """Each case saved to ``root/case{i}`` and resumed against the uninterrupted run: ``{"bad": what
    differs, "saved": every replica's whole state when case ``keep`` was saved (rank 0; else None)}``."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=SHARD_DIMS)
    replica, shard = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()
    bad: list[str] = []
    saved = None
    for case, (name, options, k, m, shared) in enumerate(cases):
        path = f"{root}/case{case}"
        kwargs = dict(lr=0.01, weight_decay=0.1, **options)
        model = _sharded(mesh)
        opt = LionCub(model.parameters(), process_group=mesh, **kwargs)
        _train(model, opt, range(k), replica, shard)
        if shared:
            with opt.shared_parameters():
                _save(model, opt, path)
        else:
            _save(model, opt, path)
        if opt.global_step != k:
            bad.append(f"{name}: get_state_dict stepped the optimizer ({opt.global_step} steps, not {k})")
        if f"case{case}" == keep:
            whole = _whole_state(model, opt)
            saved = whole if rank == 0 else None
        _train(model, opt, range(k, k + m), replica, shard)
        reference = _snapshot(model, opt)

        fresh = _sharded(mesh, seed=1)
        resumed = LionCub(fresh.parameters(), process_group=mesh, **kwargs)
        _load(fresh, resumed, path)
        if resumed.global_step != k:
            bad.append(f"{name}: resumed at step {resumed.global_step}, not {k}")
        _train(fresh, resumed, range(k, k + m), replica, shard)
        got = _snapshot(fresh, resumed)
        if set(got) != set(reference):
            bad.append(f"{name}: state {sorted(set(got) ^ set(reference))} on one side only")
            continue
        bad += [f"{name}: {key}" for key in reference if not torch.equal(got.get(key), reference[key])]
    return {"bad": bad, "saved": saved}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """:data:`CASES` saved and resumed (one run of 4 ranks): their checkpoints' folder and each rank's
    :func:`worker_resume`."""
    root = tmp_path_factory.mktemp("checkpoints")
    return root, run_workers(worker_resume, 4, CASES, str(root), IN_WINDOW, timeout=240)


@pytest.mark.slow  # over 1 s: the quick loop (-m 'not slow') leaves it to the full suite
def test_a_dcp_checkpoint_of_shards_resumes_bit_for_bit(resumed: tuple[Path, list[dict[str, Any]]]) -> None:
    """1-bit, 8-bit and local steps in a window's middle (h=3, saved after step 4, the outer step at 6)."""
    assert [r["bad"] for r in resumed[1] if r["bad"]] == []


@pytest.mark.slow
def test_a_dcp_checkpoint_of_shards_resumes_qsgd_shared_parameters_diloco_and_step_0(tmp_path: Path) -> None:
    """qsgd's generator, a save inside ``shared_parameters()`` (the model file holds θ_t), DiLoCo's outer
    buffer, and a save before the first step (the state exists from construction: no extra step)."""
    results = run_workers(worker_resume, 4, SLOW_CASES, str(tmp_path), timeout=240)
    assert [r["bad"] for r in results if r["bad"]] == []


def _message(make: Any) -> str:
    try:
        make()
    except (Exception, CheckpointException) as exc:  # dcp.load raises the latter (a BaseException)
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def worker_refusals(rank: int, world: int, root: str) -> dict[str, str]:
    """Loads of :data:`CASES`' checkpoints in ``root`` (a 1-bit vote's after 2 steps; one of 1bit, h=3,
    after 4 steps: a window's middle) that are refused."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=SHARD_DIMS)
    saved = {"1bit": f"{root}/{ONE_BIT}", "local": f"{root}/{IN_WINDOW}"}

    def load(path: str, on: Any = mesh, **options: Any) -> None:
        model = _sharded(on)
        _load(model, LionCub(model.parameters(), lr=0.01, process_group=on, **options), path)

    replicas = init_device_mesh("cpu", (4, 1), mesh_dim_names=SHARD_DIMS)
    plain = nn.Linear(3, 2)
    params = list(_sharded(mesh).parameters())
    return {
        "other variant": _message(lambda: load(saved["1bit"], variant="8bit")),
        "local steps, loaded without": _message(lambda: load(saved["local"], variant="1bit")),
        "no local steps, loaded with": _message(lambda: load(saved["1bit"], variant="1bit", local_steps=2)),
        "other h in the window": _message(lambda: load(saved["local"], variant="1bit", local_steps=2)),
        "4 replicas": _message(lambda: load(saved["1bit"], on=replicas, variant="1bit")),
        "whole parameters": _message(
            lambda: LionCub(plain.parameters(), process_group=mesh.get_group("replicate")).load_state_dict(
                LionCub(params, process_group=mesh).state_dict()
            )
        ),
        "consolidate": _message(lambda: LionCub(params, process_group=mesh).consolidate_state_dict()),
    }


@pytest.mark.slow  # over 1 s: the quick loop (-m 'not slow') leaves it to the full suite
def test_a_checkpoint_of_other_settings_or_replicas_is_refused_naming_what_changed(
    resumed: tuple[Path, list[dict[str, Any]]],
) -> None:
    (messages, *_) = run_workers(worker_refusals, 4, str(resumed[0]), timeout=240)
    expected = {
        "other variant": ["written by variant='1bit', this optimizer is variant='8bit'"],
        "local steps, loaded without": ["saved with local steps", "local_steps=None"],
        "no local steps, loaded with": ["Missing key in checkpoint state_dict", "anchor"],
        "other h in the window": ["saved at step 4", "h=3", "(now 2)"],
        "4 replicas": ["Size mismatch", "[2, 7, 13]", "[4, 7, 13]"],
        "whole parameters": ["saved by LionCub on FSDP2's shards"],
        "consolidate": ["torch.distributed.checkpoint"],
    }
    assert set(messages) == set(expected)
    for case, parts in expected.items():
        for part in parts:
            assert part in messages[case], (case, messages[case])


def worker_load_resharded(rank: int, world: int, path: str) -> tuple[int, dict[str, torch.Tensor], int]:
    """2 replicas × 1 shard load the checkpoint of 2 × 2 (DCP reshards), then run 2 steps (the outer step)."""
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=SHARD_DIMS)
    replica = mesh["replicate"].get_local_rank()
    model = _sharded(mesh, seed=1)
    opt = LionCub(model.parameters(), lr=0.01, weight_decay=0.1, process_group=mesh, **RESHARDED)
    _load(model, opt, path)
    loaded = _snapshot(model, opt)
    step = opt.global_step
    _train(model, opt, range(4, 6), replica, 0)
    return replica, loaded, step


def test_a_dcp_checkpoint_of_shards_loads_onto_another_number_of_shards(
    resumed: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Saved by 2 replicas × 2 shards (4 steps, a window of 3 in its middle: :data:`CASES`' ``case2``),
    loaded by 2 × 1 (each rank the whole model): every rank holds its replica's saved parameters (the
    window's replica), momenta, anchors, outer momenta and flags."""
    path, whole = str(resumed[0] / IN_WINDOW), resumed[1][0]["saved"]
    for replica, loaded, step in run_workers(worker_load_resharded, 2, path, timeout=240):
        assert step == 4
        expected = {}
        for name in {key.split(" ")[0] for key in whole}:
            held = int(whole[f"{name} held"][replica])
            for bit, what in enumerate(state_keys(RESHARDED["local_steps"])):
                if not held >> bit & 1:
                    continue
                if what == "window_grad":
                    expected[f"{name} {what}"] = torch.ones(())
                else:  # the window's replica is loaded into the parameter
                    value = whole[f"{name} {what}"][replica]
                    expected[name if what == "replica" else f"{name} {what}"] = value
        assert sorted(loaded) == sorted(expected)
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), key


def worker_flattened(rank: int, world: int, path: str) -> str:
    """``StateDictOptions(flatten_optimizer_state_dict=True)``: refused, naming the option."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=SHARD_DIMS)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model = _sharded(mesh)
    opt = LionCub(model.parameters(), lr=0.01, process_group=mesh, variant="1bit")
    _train(model, opt, range(1), mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank())
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    def load() -> None:
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)

    return _message(load)


def test_flattened_optimizer_state_dicts_are_refused_naming_the_option(tmp_path: Path) -> None:
    for message in run_workers(worker_flattened, 4, str(tmp_path / "flat"), timeout=240):
        assert "flatten_optimizer_state_dict=True" in message, message
