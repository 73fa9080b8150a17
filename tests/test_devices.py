"""Device discipline, checked on the CPU (CI has no GPU): every tensor the library makes follows the
parameters' device; every thread that launches kernels sets its device; checkpoints and consolidated states
travel on the CPU; a ``Comm`` finds the backend for its device (``init_process_group()`` without a backend,
``"cpu:gloo,cuda:nccl"``); NCCL waits carry no host-blocking timeout and keep no finished work; a GPU step's
phase times and its quantizer read nothing on the host that would synchronize it; ``--device cuda`` is
refused behind emulated links and with ``--fault-tolerant`` (whose replica groups run on the CPU, and
refuse parameters off it), as are more ranks than GPUs; the GradScaler agrees on the device its group's
backend serves; and at world size 1 the votes can run their collectives
(``exchange_when_alone``), exactly as the N-worker simulation says (what ``benchmarks/gpu_check.sh``
runs on a GPU). Where a GPU is needed the CUDA calls are replaced by recorders (``monkeypatch``).
"""

from __future__ import annotations

import ast
import datetime
import importlib.util
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import sources
from lioncub.collectives import Backend, Comm, exchange_when_alone
from lioncub.collectives.base import Handle, backend_for_device

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "lioncub"

_spec = importlib.util.spec_from_file_location("gpu_path", ROOT / "benchmarks" / "gpu_path.py")
assert _spec is not None and _spec.loader is not None
gpu_path = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_path)


# ----------------------------------------------------------------------------- structural guards


#: torch factories that make a tensor from nothing (``*_like`` and ``new_*`` follow their input)
FACTORIES = {
    "arange", "zeros", "ones", "empty", "full", "tensor", "randn", "rand", "randint", "randperm",
    "linspace", "logspace", "eye", "as_tensor", "empty_strided", "scalar_tensor", "from_numpy", "frombuffer",
}  # fmt: skip

#: (module, function, factory) made on the host by design, with the reason
HOST_SIDE = {
    ("ops/kernels.py", "_f32", "tensor"): "a Python float rounded to float32 on the host",
    ("ops/native.py", "_probe", "randn"): "probes the CPU kernels (CPU only)",
    ("ops/native.py", "_table", "tensor"): "a lookup table of the CPU kernels (CPU only)",
    ("ops/packing.py", "_spread_table", "arange"): "built on the host, then moved to the device and cached",
    ("ops/packing.py", "_lane_table", "arange"): "built on the host, then moved to the device and cached",
    ("ops/packing.py", "_lane_table", "tensor"): "built on the host, then moved to the device and cached",
    ("ops/packing.py", "count_votes", "from_numpy"): "the numpy path, taken for CPU tensors only",
    ("ops/packing.py", "pack_majority", "from_numpy"): "the numpy path, taken for CPU tensors only",
    ("ops/update.py", "apply_update_converting_", "empty"): "the CPU path's scratch (CPU parameters only)",
    ("collectives/dense.py", "_contribute_fused", "tensor"): "the fused CPU path's peak (CPU only)",
    ("collectives/signvote.py", "_contribute_fused", "tensor"): "the fused CPU path's peak (CPU only)",
    ("collectives/signvote.py", "_swap_storage", "empty"): "the fused CPU path (CPU only)",
    ("collectives/protocol.py", "<module>", "zeros"): "Ballot.peak's placeholder, replaced by contribute",
    ("optim/lion.py", "_foreach_scale_", "tensor"): "a 0-dim CPU scalar for CPU tensors only",
    ("optim/replicas.py", "check_same_parameters", "tensor"): "a host hash, moved to the comm's device",
    ("collectives/base.py", "all_gather_object", "frombuffer"): "a host pickle, moved to the comm's device",
    ("optim/replicas.py", "_int_view", "empty"): "an empty tensor asked for its element size",
    ("optim/step_check.py", "check_step", "tensor"): "host words, moved to the comm's device",
    ("optim/local_steps.py", "window_flag", "ones"): "a 0-dim flag on the host: only its presence is read",
    ("integrations/group_shares.py", "agree_on_heal", "tensor"): "a flag over a replica group's gloo ranks "
    "(replica groups run on the CPU)",
    ("train/replica_group.py", "node_bytes", "tensor"): "byte counts over a replica group's gloo ranks "
    "(replica groups run on the CPU)",
    ("train/checkpoint.py", "_rng_state", "from_numpy"): "numpy's generator state, saved from the host",
    ("train/data.py", "__init__", "from_numpy"): "a dataset held on the host; its batches move to the device",
    ("train/data.py", "indices", "randint"): "a sampler's indices into a dataset on the host",
    ("train/data.py", "indices", "randperm"): "a sampler's indices into a dataset on the host",
    ("train/data.py", "windows", "arange"): "offsets into the corpus on the host",
    ("train/data.py", "get_batch", "randint"): "window starts into the corpus on the host",
    ("train/data.py", "eval_starts", "linspace"): "window starts into the corpus on the host",
    ("train/workloads.py", "_load_data", "arange"): "example ids into a dataset on the host",
    ("train/workloads.py", "evaluate", "arange"): "example ids into a dataset on the host",
}

#: the packages whose tensor factories :func:`_factory_calls` scans
SCANNED = ("ops", "collectives", "optim", "integrations", "train")


def _factory_calls() -> list[tuple[str, str, str, int]]:
    """(module, enclosing function, factory, line) of every ``torch.FACTORY(...)`` call without ``device=``
    in the packages of :data:`SCANNED`."""
    found = []
    for package in SCANNED:
        for path in sorted((SRC / package).rglob("*.py")):
            enclosing: dict[int, str] = {}  # the outermost function around each node
            for node in sources.nodes(path):  # breadth first: a function before the functions inside it
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(node) not in enclosing:
                    enclosing.update((id(inner), node.name) for inner in ast.walk(node))
            for node in sources.nodes(path):
                func = node.func if isinstance(node, ast.Call) else None
                if (
                    isinstance(func, ast.Attribute)
                    and isinstance(func.value, ast.Name)
                    and func.value.id == "torch"
                    and func.attr in FACTORIES
                    and not any(k.arg == "device" for k in node.keywords)  # type: ignore[union-attr]
                ):
                    module = str(path.relative_to(SRC))
                    found.append((module, enclosing.get(id(node), "<module>"), func.attr, node.lineno))
    return found


@pytest.mark.slow  # over 1 s: the quick loop (-m 'not slow') leaves it to the full suite
def test_every_tensor_factory_names_its_device() -> None:
    """A tensor made in the step's layers lands on the parameters' device (``device=`` given), or is host
    side by design and listed in :data:`HOST_SIDE` with the reason."""
    calls = _factory_calls()
    unlisted = [
        f"{module}:{line} {function}: torch.{factory}(...) without device="
        for module, function, factory, line in calls
        if (module, function, factory) not in HOST_SIDE
    ]
    assert not unlisted, "\n".join(unlisted)
    stale = set(HOST_SIDE) - {(m, f, k) for m, f, k, _ in calls}
    assert not stale, f"HOST_SIDE lists calls that are gone: {sorted(stale)}"


@pytest.mark.slow  # over 1 s: the quick loop (-m 'not slow') leaves it to the full suite
def test_torch_load_is_always_given_map_location() -> None:
    """``torch.load`` without ``map_location`` puts every tensor back on the device it was saved from
    (cuda:K of another rank, or of a GPU this machine lacks)."""
    missing = []
    for path in sorted([*SRC.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]):
        for node in sources.nodes(path):
            func = node.func if isinstance(node, ast.Call) else None
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "load"
                and getattr(func.value, "id", "") == "torch"
            ) and not any(k.arg == "map_location" for k in node.keywords):  # type: ignore[union-attr]
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not missing, missing


def test_the_step_times_its_phases_with_the_phase_clock() -> None:
    """The step's and the training loop's phase times read ``PhaseClock`` (CUDA events in the step, a
    synchronized reading in the loop: ``tests/test_phase_clock.py``), never ``time.perf_counter`` alone; the
    overlap hook's thread times are host times on purpose."""
    offenders = []
    for module in ("optim/lioncub.py", "optim/local_steps.py", "optim/engine.py", "train/loop.py"):
        tree = sources.tree(SRC / module)
        clock = next(
            (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "PhaseClock"), None
        )
        inside = {id(n) for n in ast.walk(clock)} if clock is not None else set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "perf_counter" and id(node) not in inside:
                offenders.append(f"{module}:{node.lineno}")
    assert not offenders, offenders


# ----------------------------------------------------------------------------- Comm: backend per device


def test_backend_for_device_reads_the_groups_backends() -> None:
    assert backend_for_device("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert backend_for_device("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert backend_for_device("cpu:gloo,cuda:gloo", "cuda") == "gloo"
    assert backend_for_device("nccl", "cuda") == "nccl"  # one name for every device type
    with pytest.raises(ValueError, match=r"no backend for cuda tensors \(its backends: 'cpu:gloo'\)"):
        backend_for_device("cpu:gloo", "cuda")
    with pytest.raises(ValueError, match="no backend for cpu tensors"):
        backend_for_device("cuda:nccl", "cpu")
    gloo, nccl = Backend.named("gloo"), Backend.named("nccl")
    assert (gloo.bounded_wait, gloo.keep_finished, gloo.exchange, gloo.batched_p2p) == (
        True,
        True,
        "p2p",
        False,
    )
    assert (nccl.bounded_wait, nccl.keep_finished, nccl.exchange, nccl.batched_p2p) == (
        False,
        False,
        "native",
        True,
    )


@pytest.fixture
def unnamed_group(tmp_path: Path) -> Any:
    """A one-rank group from ``init_process_group()`` without a backend (``get_backend`` says
    ``"undefined"``; torch picks gloo for CPU tensors)."""
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def test_comm_on_a_group_initialised_without_a_backend(unnamed_group: Any) -> None:
    assert dist.get_backend() == "undefined"
    comm = Comm()
    assert (comm.backend, comm.exchange, comm.device) == ("gloo", "p2p", torch.device("cpu"))
    with pytest.raises(ValueError, match="no backend for cuda tensors"):
        Comm(device=torch.device("cuda", 1))


def test_comm_on_a_cpu_gloo_cuda_nccl_group(unnamed_group: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group with gloo for CPU tensors and NCCL for CUDA tensors: a Comm of CUDA parameters works on
    their GPU over NCCL (no host timeouts, no kept works, batched pairs), one of CPU tensors over gloo."""
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    gpu = Comm(device=torch.device("cuda", 1))
    assert (gpu.backend, gpu.device, gpu.exchange, gpu.wire) == (
        "nccl", torch.device("cuda", 1), "native", Backend.named("nccl")
    )  # fmt: skip
    cpu = Comm()
    assert (cpu.backend, cpu.device, cpu.exchange) == ("gloo", torch.device("cpu"), "p2p")


class _Work:
    """A finished collective that records how it was waited for."""

    def __init__(self) -> None:
        self.waits: list[tuple] = []

    def wait(self, *args: Any) -> bool:
        self.waits.append(args)
        return True


def _comm(backend: str, timeout: float | None = 5.0) -> Comm:
    comm = Comm.single()
    comm.backend, comm.wire = backend, Backend.named(backend)
    comm.timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
    return comm


def test_nccl_waits_carry_no_host_timeout_and_keep_no_finished_work() -> None:
    """On NCCL ``Work.wait(timeout)`` blocks the host until the work is done, and a kept work holds its
    output in GPU memory: the NCCL group's own timeout and watchdog bound it. Gloo waits stay bounded."""
    nccl, gloo = _comm("nccl"), _comm("gloo")
    for comm in (nccl, gloo):
        work = _Work()
        Handle([work], "test op", comm).wait()
        expect = [()] if comm is nccl else [(datetime.timedelta(seconds=5.0),)]
        assert work.waits == expect, comm.backend
    assert len(nccl._retired) == 0 and len(gloo._retired) == 1


def test_nccl_point_to_point_pairs_are_posted_as_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Single isend/irecv pairs on NCCL create a two-rank communicator per pair: the pairs go out as one
    ``batch_isend_irecv`` (sends staggered from rank r + 1 as on gloo; a single isend here, without a
    process group, would raise)."""
    calls: list[Any] = []
    monkeypatch.setattr(dist, "P2POp", lambda op, t, peer, group, tag: (op.__name__, peer, t.numel()))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: calls.append(ops) or [_Work()])
    comm = _comm("nccl")
    comm.rank, comm.world_size, comm.group = 1, 3, None
    t = torch.zeros(4)
    comm.exchange_p2p([(0, t), (2, t)], [(0, t), (2, t)], "server gather").wait()
    assert calls == [[("irecv", 0, 4), ("irecv", 2, 4), ("isend", 2, 4), ("isend", 0, 4)]]


# ----------------------------------------------------------------------------- threads, consolidation


@pytest.mark.slow
def test_the_vote_thread_makes_the_parameters_device_current(
    one_rank: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The current CUDA device is per host thread: the overlap hook's vote thread (which launches the
    quantize and majority kernels and the NCCL work) sets it to the votes' device before anything else."""
    from torch.nn.parallel import DistributedDataParallel

    from lioncub.optim import LionCub
    from lioncub.optim.engine import StepEngine
    from lioncub.optim.factory import make_vote
    from lioncub.optim.overlap import OverlapHook, overlap_group

    seen: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append((threading.current_thread().name, d)))
    net = torch.nn.Linear(4, 2)
    with exchange_when_alone():
        opt = LionCub(net.parameters(), variant="1bit")
        model = DistributedDataParallel(net)
        votes = overlap_group(model, opt.comm, None)
    votes.device = torch.device("cuda", 1)  # as a rank whose parameters are on cuda:1
    names = {id(p): n for n, p in net.named_parameters()}
    hook = OverlapHook(model, StepEngine(make_vote(votes, opt.config), opt), next_step=lambda: 1,
                       diagnostics_every=0, names=names)  # fmt: skip
    hook.close()
    assert seen == [("lioncub-overlap-rank0", torch.device("cuda", 1))]


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def test_consolidation_sends_every_tensor_from_the_cpu(
    one_rank: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gather_object`` pickles the states; a CUDA tensor in them is unpickled on its GPU inside the
    gathering rank (another rank's GPU, or one it cannot see): every tensor is moved to the CPU (``.cpu()``)
    before it is handed over. Local steps mid-window, so the replicas travel too."""
    from lioncub.optim import LionCub

    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    with exchange_when_alone():
        opt = LionCub(params, variant="1bit", local_steps=2)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    moved: set[int] = set()
    cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: moved.add(id(t)) or cpu(t, *a, **k))
    handed: list[Any] = []
    gather = dist.gather_object
    monkeypatch.setattr(
        dist, "gather_object", lambda obj, *a, **k: handed.append(obj) or gather(obj, *a, **k)
    )
    opt.consolidate_state_dict(to=0)
    sent = _tensors(handed[0])
    assert len(sent) >= 2 * 4  # momenta, anchors, outer momenta, replicas
    assert all(id(t) in moved and t.device.type == "cpu" for t in sent)


def test_a_cuda_rank_binds_its_gpu_before_nccl_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """``init_process_group`` gets the rank's device (``device_id``: NCCL's communicator on that GPU, not
    cuda:0) and the device is current before it."""
    from lioncub.train import loop, rank
    from lioncub.train.config import TrainConfig

    calls: list[Any] = []
    monkeypatch.setattr(loop, "device_for", lambda config: torch.device("cuda", 3))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(
        dist, "init_process_group", lambda *a, **k: calls.append(("init", a, k.get("device_id")))
    )
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    rank.init_distributed(TrainConfig())
    assert calls == [("set_device", torch.device("cuda", 3)), ("init", ("nccl",), torch.device("cuda", 3))]


# ----------------------------------------------------------------------------- host synchronizations


def test_the_phase_clock_waits_for_the_gpu_only_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from lioncub.optim.engine import PhaseClock

    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: synced.append(d))
    PhaseClock(torch.device("cpu"))()
    assert synced == []
    PhaseClock(torch.device("cuda", 2))()
    assert synced == [torch.device("cuda", 2)]


def test_the_l1_divisors_of_a_gpu_step_read_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pass 1 of the L1 quantizer off the CPU (the Triton path's ``_l1_divisors``) reads no value on the
    host and copies no host data to the device after the first call for a layout — it read a flag per
    2^18-element piece and per tensor, and copied three tables per bucket (each a GPU synchronization).
    Off the CPU it sums in float64: on data whose sums are exact the levels are the CPU's bit for bit, and
    its divisors are the exact means to within float64 rounding."""
    import math

    from lioncub.ops import kernels, normalizers, quantize

    segments = [70_000, 300_000, 5, 0, 1_000]  # 300_000: two of the CPU path's pieces
    x = gpu_path.grid((sum(segments),), 3)
    exact = [60_000, 5, 0, 1_000]  # sums below 2^18 of multiples of 2^-6: exact in float32
    host_divisors = kernels._l1_divisors(x[:61_005], 127, 2.0, None, exact)
    host_levels = quantize.quantize_l1(x[:60_000], 127)
    monkeypatch.setattr(normalizers, "on_host", lambda t: False)  # what a CUDA tensor takes
    for chunk in (None, 4096):
        kernels._l1_divisors(x, 127, 2.0, chunk, segments)  # builds the layout's device tables
        with gpu_path.HostReads() as reads:
            kernels._l1_divisors(x, 127, 2.0, chunk, segments)
        assert reads.count == 0, reads.names
    for a, b in zip(host_divisors, kernels._l1_divisors(x[:61_005], 127, 2.0, None, exact), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(quantize.quantize_l1(x[:60_000], 127), host_levels)
    y = torch.randn(300_000, generator=torch.Generator().manual_seed(4)) * 1e3
    got = float(kernels._l1_divisors(y, 127, 2.0, None, [y.numel()])[0][0])
    exact = math.fsum(abs(v) for v in y.double().tolist()) / y.numel()
    assert got == pytest.approx(exact, rel=1e-15)


# ----------------------------------------------------------------------------- emulated links


def test_cuda_is_refused_behind_emulated_links(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL finds every rank on one host and bypasses the shaped links (P2P/SHM): ``--device cuda`` is
    refused there, and ``auto`` takes the CPU; without links ``auto`` takes ``cuda:LOCAL_RANK``."""
    from lioncub.train import loop
    from lioncub.train.config import ClusterConfig, RunConfig, TrainConfig

    with pytest.raises(ValueError, match=r"--device cuda with --link 50mbit: .*NCCL .*--device cpu"):
        TrainConfig(run=RunConfig(device="cuda"), cluster=ClusterConfig(nproc=2, link="50mbit"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    linked = TrainConfig(cluster=ClusterConfig(nproc=4, link="8mbit", nnodes=2))
    assert loop.device_for(linked) == torch.device("cpu")
    assert loop.device_for(TrainConfig(cluster=ClusterConfig(nproc=2))) == torch.device("cuda", 1)


# ----------------------------------------------------------------------------- fault-tolerant groups


def test_fault_tolerant_runs_refuse_cuda_before_anything_starts() -> None:
    """torchft's replica groups vote over gloo on CPU tensors: ``--device cuda`` with ``--fault-tolerant``
    is refused by the configuration's check (``lioncub train`` and every row of ``lioncub compare``),
    naming CUDA, the option and what to use; ``auto`` and ``cpu`` pass."""
    from lioncub.train.config import TrainConfig

    ft = {"variant": "1bit", "nproc": 2, "fault_tolerant": True, "steps": 4}
    with pytest.raises(ValueError, match=r"--device cuda with --fault-tolerant: .*CPU tensors.*--device cpu"):
        TrainConfig.from_values({**ft, "device": "cuda"})
    for device in ("auto", "cpu"):
        assert TrainConfig.from_values({**ft, "device": device}).run.device == device
    assert TrainConfig.from_values({"variant": "1bit", "nproc": 2, "device": "cuda"}).run.device == "cuda"


def test_lioncub_train_fault_tolerant_cuda_exits_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_cli: Any
) -> None:
    """The command itself (in this process, ``run_cli``: what ``lioncub train`` returns as its exit status,
    without a fresh interpreter's ~3 CPU-s): exit status 2 and the reason on stderr, before the run
    directory (or a lighthouse, a group) exists; starting the groups would raise here."""
    from lioncub.train import fault_tolerant

    def launch_groups(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the groups were launched")

    monkeypatch.setattr(fault_tolerant, "launch_groups", launch_groups)
    out = tmp_path / "run"
    argv = ["--workload", "gpt", "--size", "tiny", "--variant", "1bit", "--nproc", "2", "--steps", "4"]
    argv += ["--no-progress"]
    code, err = run_cli(["train", *argv, "--fault-tolerant", "--device", "cuda", "--out", str(out)])
    assert code == 2, err
    assert "--device cuda with --fault-tolerant" in err and "CUDA" in err, err
    assert not out.exists()


def test_fault_tolerant_auto_says_its_groups_train_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``--device auto`` on a machine with CUDA the run says, before the groups start, that they
    train on the CPU; with ``--device cpu``, without CUDA or without ``--fault-tolerant`` nothing."""
    import io

    from lioncub.train import fault_tolerant
    from lioncub.train.config import TrainConfig
    from lioncub.train.fault_settings import cpu_note

    class _Launched(Exception):
        pass

    def launch_groups(*args: Any, **kwargs: Any) -> Any:
        raise _Launched

    ft = {"variant": "1bit", "nproc": 2, "fault_tolerant": True, "steps": 4}
    assert cpu_note(TrainConfig.from_values(ft)) is None  # no CUDA here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cpu_note(TrainConfig.from_values({**ft, "device": "cpu"})) is None
    assert cpu_note(TrainConfig.from_values({"variant": "1bit", "nproc": 2})) is None
    monkeypatch.setattr(fault_tolerant, "launch_groups", launch_groups)
    err = io.StringIO()
    with pytest.raises(_Launched):
        fault_tolerant.run_fault_tolerant(
            TrainConfig.from_values(ft), tmp_path, timeout_s=None, progress=False, label=None,
            collective_timeout_s=30.0, out=io.StringIO(), err=err,
        )  # fmt: skip
    assert err.getvalue() == (
        "lioncub: --fault-tolerant --device auto: the replica groups train on the CPU (torchft's gloo "
        "process group runs on CPU tensors); this machine's 2 CUDA devices are not used\n"
    )


def test_a_replica_group_refuses_parameters_off_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``ReplicaGroup`` votes on CPU tensors (torchft's gloo): an optimizer whose parameters are on CUDA
    (moved after it was built) is refused at ``attach``, and a parameter moved after ``attach`` at the next
    ``begin``, before the quorum, naming the parameter and its device."""
    pytest.importorskip("torchft", reason="torchft is not installed: the ft extra, docs/install.md")
    from torchft.coordination import LighthouseServer

    from lioncub.integrations.torchft import ReplicaGroup
    from lioncub.optim import Checks, LionCub

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    group = ReplicaGroup(lighthouse=lighthouse.address(), index=0, max_groups=2, timeout_s=5)
    try:
        params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
        opt = LionCub(params, variant="1bit", process_group=group.comm, checks=Checks(broadcast_init=False))
        real = torch._C.TensorBase.device

        def on_cuda(param: torch.Tensor) -> property:  # what Tensor.device says: cuda:1 for param
            return property(lambda t: torch.device("cuda", 1) if t is param else real.__get__(t))

        with monkeypatch.context() as m:  # parameter 1 on cuda:1, as after model.cuda()
            m.setattr(torch.Tensor, "device", on_cuda(params[1]))
            with pytest.raises(
                ValueError, match=r"replica group g0: attach: parameter 1 is on cuda:1; .*gloo.* CPU tensors"
            ):
                group.attach(opt)
        group.attach(opt)  # on the CPU
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "device", on_cuda(params[0]))
            with pytest.raises(ValueError, match=r"replica group g0: begin: parameter 0 is on cuda:1"):
                group.begin()
    finally:
        group.shutdown()
        lighthouse.shutdown()


# ----------------------------------------------------------------------------- ranks per GPU, the scaler


def test_more_ranks_than_gpus_are_refused_before_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank takes ``cuda:LOCAL_RANK``: ``--nproc`` above the GPUs visible under ``--device auto`` or
    ``cuda`` is refused before the launch (it failed in the rank with "invalid device ordinal"), naming
    the option, the GPUs and ``--device cpu``; a rank of a job (torchrun) refuses it too. Runs on the CPU
    are not concerned; ``--device cuda`` without CUDA is refused before the launch."""
    from lioncub.train import loop
    from lioncub.train.config import TrainConfig
    from lioncub.train.driver import check_before_launch

    tiny = {"workload": "gpt", "size": "tiny", "variant": "1bit", "steps": 4}
    with pytest.raises(ValueError, match=r"--device cuda: no CUDA device is available.*--device cpu"):
        check_before_launch(TrainConfig.from_values({**tiny, "nproc": 2, "device": "cuda"}), None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for device in ("auto", "cuda"):
        config = TrainConfig.from_values({**tiny, "nproc": 3, "device": device})
        with pytest.raises(
            ValueError, match=rf"--nproc 3 with --device {device}: .*2 are visible.*--device cpu"
        ):
            check_before_launch(config, None)
        check_before_launch(TrainConfig.from_values({**tiny, "nproc": 2, "device": device}), None)
    check_before_launch(TrainConfig.from_values({**tiny, "nproc": 3, "device": "cpu"}), None)
    check_before_launch(TrainConfig.from_values({**tiny, "nproc": 3, "fault_tolerant": True}), None)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"--nproc-per-node 3 \(this is local rank 2\).*2 are visible"):
        loop.device_for(TrainConfig.from_values({**tiny, "nproc": 3}))
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert loop.device_for(TrainConfig.from_values({**tiny, "nproc": 3})) == torch.device("cuda", 1)


def test_the_scaler_agrees_on_a_device_its_group_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """``lioncub.optim.amp.GradScaler`` all-reduces the overflow flags on a LionCub's comm device; for
    another optimizer (the default group) on a device that group's backend serves: the CPU where it has a
    CPU backend, else the gradients' GPU or the current GPU (an NCCL-only group: it took the CPU there,
    which NCCL cannot all-reduce)."""
    from types import SimpleNamespace

    from lioncub.optim.amp import agreement_device

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    gpu, cpu = torch.device("cuda", 1), torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for config, flags, want in [
        ("cuda:nccl", [gpu], gpu),  # init_process_group("nccl")
        ("cuda:nccl", [], torch.device("cuda", 3)),  # no gradient on this rank
        ("nccl", [gpu], gpu),
        ("cpu:gloo,cuda:gloo", [gpu], cpu),  # init_process_group("gloo")
        ("cpu:gloo", [gpu], cpu),
        ("cpu:gloo,cuda:nccl", [gpu], cpu),
        ("cpu:gloo,cuda:nccl", [], cpu),
    ]:
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None, c=config: c)
        assert agreement_device(sgd, flags) == want, (config, flags)
    lioncub_like = SimpleNamespace(comm=SimpleNamespace(device=torch.device("cuda", 2), group=None))
    assert agreement_device(lioncub_like, [gpu]) == torch.device("cuda", 2)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- the vote path at N = 1


@pytest.mark.slow
def test_the_votes_exchanged_at_world_size_one_equal_the_simulation() -> None:
    """Under ``exchange_when_alone`` a rank alone runs every preset's collectives (step check, encode,
    exchange, decode, apply) instead of Lion's step: bit for bit the N-worker simulation's vote of one
    worker (a 1-bit vote of an exact zero is ±1 by the step's parity, not 0; 16bit rounds through bf16)."""
    from oracles import ALL_PRESETS, simulate, worker_run_presets

    from processes import run_workers

    got = run_workers(worker_run_presets, 1, ALL_PRESETS, 25.0, "auto", "flat", 1, True)[0]
    for preset in ALL_PRESETS:
        assert got[preset]["stats"]["total"]["collectives"] > 0, preset
        want = simulate(preset, 1, alone=False)
        for a, b in zip(got[preset]["params"], want, strict=True):
            assert torch.equal(a, b), preset
    lion = simulate("1bit", 1)  # the shortcut: Lion's step, which differs where c is exactly 0
    assert not all(torch.equal(a, b) for a, b in zip(got["1bit"]["params"], lion, strict=True))


def test_a_device_check_section_that_hangs_dumps_the_stacks_and_an_exit_is_its_failure(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """``benchmarks/gpu_path.py``'s section guard (issue 44, item 4): past its bound a section's threads'
    stacks reach stderr and it goes on; a ``SystemExit`` inside a section fails that section only."""
    failed: list[tuple[str, str]] = []
    sections = gpu_path.Sections(
        lambda name, what, tb: failed.append((name, what)), lambda *_: None, bound_s=0.05
    )
    with sections.run("waits"):
        time.sleep(0.5)
    with sections.run("exits"):
        sys.exit(3)
    with sections.run("after"):
        pass
    err = capfd.readouterr().err
    assert "Timeout (0:00:00.050000)!" in err and "test_a_device_check_section_that_hangs" in err, err
    assert [(name, status) for name, _, status in sections.results] == [
        ("waits", "ok"), ("exits", "FAIL"), ("after", "ok")
    ]  # fmt: skip
    assert failed == [("exits", "SystemExit: 3")], failed
