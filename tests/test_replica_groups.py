"""Votes between replica groups whose members change (issue 35): :class:`lioncub.collectives.GroupComm`,
the comm that issues every operation as a process-group object's own methods (torchft's reconfigurable
groups are objects ``torch.distributed`` does not know).

The oracle of the parity tests is the plain path: the same optimizer on the same rank-dependent gradients
with ``torch.distributed``'s own collectives (:class:`~lioncub.collectives.Comm`), bit for bit —
parameters, momenta, bytes counted.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import background
from lioncub.collectives import GroupComm
from lioncub.optim import PRESETS, Checks, LionCub

from processes import python_cmd, read_results, run_workers

STEPS = 4
#: the steps of the runs on torchft's lighthouse without failures: two windows of H = 4 (a window's sync,
#: then the steps after it from the synced anchors), every step a quorum with H = 1
CLEAN_STEPS = 8


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)  # the same initial values on every rank
    shapes = [(37, 24), (24,), (40, 24), (3,)]  # some shorter than a 1-bit vote's 8·N padding
    return [torch.nn.Parameter(torch.randn(s)) for s in shapes]


def _steps(opt: LionCub, params: list[torch.nn.Parameter], rank: int) -> None:
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
            if step == 2:
                p.grad[..., :2] = 0.0  # exact zeros on every rank: ties, the zero rule
        opt.step()


def _parity(rank: int, world_size: int, variant: str, exchange: str, local_steps: int | None) -> dict:
    """The same optimizer over the default group through :class:`Comm` and through :class:`GroupComm`
    on the default group's object."""
    out = {}
    for name in ("plain", "group"):
        params = _params()
        group = (
            GroupComm(dist.group.WORLD, rank=rank, world_size=world_size, exchange=exchange)
            if name == "group"
            else None
        )
        opt = LionCub(
            params,
            lr=0.01,
            weight_decay=0.1,
            variant=variant,
            process_group=group,
            local_steps=local_steps,
            checks=Checks(broadcast_init=False),  # a GroupComm runs nothing collective at construction
        )
        if name == "plain":
            opt.comm.exchange = exchange
        before = opt.comm.counter.bytes_sent
        _steps(opt, params, rank)
        out[name] = {
            "params": [p.detach().clone() for p in params],
            "momenta": [opt.state[p]["exp_avg"].clone() for p in params],
            "sent": opt.comm.counter.bytes_sent - before,
        }
    return out


@pytest.mark.parametrize(
    ("variant", "exchange", "local_steps"),
    [
        *[(v, "p2p", None) for v in PRESETS],
        ("1bit", "native", None),
        ("8bit", "native", None),
        ("1bit", "p2p", 2),
        ("32bit", "p2p", 2),
    ],
)
def test_group_comm_votes_bitwise_as_the_plain_comm(
    variant: str, exchange: str, local_steps: int | None
) -> None:
    for r, result in enumerate(run_workers(_parity, 3, variant, exchange, local_steps)):
        plain, group = result["plain"], result["group"]
        for what in ("params", "momenta"):
            for i, (a, b) in enumerate(zip(plain[what], group[what], strict=True)):
                assert torch.equal(a, b), (variant, r, what, i)
        assert plain["sent"] == group["sent"] > 0, (variant, r)


def _exchanges(rank: int, world_size: int) -> list:
    """Each exchange of a :class:`GroupComm` on 3 ranks, and the object collectives (pickled objects of
    different sizes)."""
    comm = GroupComm(dist.group.WORLD, rank=rank, world_size=world_size)
    objects = comm.all_gather_object({"rank": rank, "text": "x" * (rank * 100)}, "objects")
    gathered = comm.gather_object(("step", rank), 1, "gather")
    out = torch.zeros(world_size, 2)
    comm.all_gather(out, torch.full((2,), float(rank)), "rows").wait()
    total = torch.tensor([float(rank + 1)])
    comm.all_reduce(total, "sum").wait()
    root = torch.tensor([float(rank)])
    comm.broadcast(root, 2, "root").wait()
    return [objects, gathered, out, total, root]


def test_group_comm_exchanges_and_objects() -> None:
    results = run_workers(_exchanges, 3)
    for r, (objects, gathered, out, total, root) in enumerate(results):
        assert objects == [{"rank": j, "text": "x" * (j * 100)} for j in range(3)]
        assert gathered == ([("step", j) for j in range(3)] if r == 1 else None)
        assert torch.equal(out, torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]))
        assert total.item() == 6.0 and root.item() == 2.0


def test_group_comm_refuses_a_rank_outside_its_size() -> None:
    with pytest.raises(ValueError, match="need 0 <= rank < world_size"):
        GroupComm(object(), rank=3, world_size=3)
    with pytest.raises(ValueError, match="exchange='fast'"):
        GroupComm(object(), rank=0, world_size=1, exchange="fast")  # type: ignore[arg-type]


def _broadcast_init_on_a_group_comm(rank: int, world_size: int) -> str:
    comm = GroupComm(dist.group.WORLD, rank=rank, world_size=world_size)
    try:
        LionCub(_params(), variant="1bit", process_group=comm)
    except ValueError as err:
        return str(err)
    return "built"


def test_a_group_comm_refuses_the_broadcast_at_construction() -> None:
    for message in run_workers(_broadcast_init_on_a_group_comm, 2):
        assert "Checks(broadcast_init=False)" in message and "GroupComm" in message


# ------------------------------------------------------------------ replica groups on torchft's lighthouse


def _settings(min_groups: int) -> dict[str, int]:
    """The tests' lighthouse: a quorum of at least ``min_groups`` groups, a group dropped after 1 s
    without heartbeats."""
    return {
        "min_replicas": min_groups,
        "join_timeout_ms": 500,
        "quorum_tick_ms": 20,
        "heartbeat_timeout_ms": 1000,
    }


def _lighthouse(min_groups: int) -> Any:
    """torchft's lighthouse in this process (:func:`_settings`)."""
    pytest.importorskip("torchft", reason="torchft is not installed: the ft extra, docs/install.md")
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="[::]:0", **_settings(min_groups))


def _host(workdir: Path, settings: dict[str, int] | None, ranks: int) -> None:
    """The lighthouse of a background job, its URL written to ``workdir/lighthouse``: torchft's server in
    this process (``settings``), kept until the job kills this process; or (None) lioncub's lighthouse
    program (what ``lioncub train --fault-tolerant`` starts: torchft's server without importing torch) in a
    process of its own, SIGKILLed 0.2 s after ``workdir/stepping`` appears (the groups have a quorum and
    step; or when the ``ranks`` ranks have written their results, or after 60 s)."""
    import os
    import select
    import signal
    import subprocess

    if settings is not None:
        from torchft.coordination import LighthouseServer

        server = LighthouseServer(bind="[::]:0", **settings)
        url = server.address()
    else:
        port = _free_port()
        lighthouse = subprocess.Popen(
            python_cmd("-m", "lioncub.launch.groups", "lighthouse", f"[::]:{port}", "1000", "500"),
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert lighthouse.stdout is not None
        started = select.select([lighthouse.stdout], [], [], 60)[0]
        ready = lighthouse.stdout.readline() if started else ""  # it prints "ready URL" once it listens
        if not ready.startswith("ready http://"):
            lighthouse.kill()
            raise AssertionError(f"the lighthouse did not start within 60 s: {ready!r}")
        url = f"http://localhost:{port}"
    (workdir / "lighthouse.tmp").write_text(url)
    os.replace(workdir / "lighthouse.tmp", workdir / "lighthouse")
    if settings is not None:
        time.sleep(600)
        return
    deadline = time.monotonic() + 60
    while not (workdir / "stepping").exists() and time.monotonic() < deadline:
        if all((workdir / f"rank{r}.pt").exists() for r in range(ranks)):
            break
        time.sleep(0.02)
    time.sleep(0.2)
    lighthouse.send_signal(signal.SIGKILL)
    lighthouse.wait()


def _hosted(
    rank: int, world: int, workdir: Path, settings: dict[str, int] | None, fn: Any, args: tuple
) -> None:
    """A scenario's rank (a fork of :func:`_run_scenarios`' process, which imported what ``fn`` imports:
    the ranks start ``fn`` together, as the pool's warm workers do; a rank still importing torchft when
    another asks for the first quorum is left out of it): rank ``world - 1`` hosts the lighthouse
    (:func:`_host`; its failure to ``workdir/host.pt``); ranks ``0 .. world - 2`` join a gloo group of
    their own (as ``run_workers``' ranks) and write ``{"ok": fn(rank, world - 1, address, *args)}`` (or
    ``{"error": traceback}``) to ``workdir/rank{rank}.pt``."""
    import datetime
    import traceback

    torch.set_num_threads(1)
    address = workdir / "lighthouse"
    if rank == world - 1:
        try:
            _host(workdir, settings, world - 1)
        except BaseException:
            torch.save({"error": traceback.format_exc()}, workdir / "host.pt")
        return
    out = workdir / f"rank{rank}.pt"
    try:
        deadline = time.monotonic() + 60
        while not address.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no lighthouse address in {address} within 60 s")
            time.sleep(0.02)
        dist.init_process_group(
            "gloo", init_method=f"file://{workdir / 'store'}", rank=rank, world_size=world - 1,
            timeout=datetime.timedelta(seconds=60),
        )  # fmt: skip
        dist.barrier()
        try:
            result = fn(rank, world - 1, address.read_text(), *args)
        finally:
            dist.destroy_process_group()
        torch.save({"ok": result}, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)


#: seconds a scenario's ranks may run; then they and the lighthouse's host are SIGKILLed
SCENARIO_TIMEOUT_S = 120.0


def _fork(target: Any, *args: Any) -> int:
    """``target(*args)`` in a fork of this process (exit code 0 once it returned, 1 if it raised), which
    gets SIGTERM if this process dies first (the job killed at its bound or at the session's end); its
    pid."""
    import os
    import sys
    import traceback

    from lioncub.launch.supervisor import pdeathsig_setup

    setup = pdeathsig_setup()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        if setup is not None:
            setup()
        target(*args)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(pids: list[int], wait_for: int, timeout_s: float) -> list[int | None]:
    """The exit codes of the forks ``pids`` once the first ``wait_for`` have exited (within ``timeout_s``);
    the forks still running then are SIGKILLed, their code None."""
    import os
    import signal

    codes: list[int | None] = [None] * len(pids)
    deadline = time.monotonic() + timeout_s
    while any(c is None for c in codes[:wait_for]) and time.monotonic() < deadline:
        for i, pid in enumerate(pids):
            if codes[i] is None and (status := os.waitpid(pid, os.WNOHANG))[0]:
                codes[i] = os.waitstatus_to_exitcode(status[1])
        time.sleep(0.02)
    for i, pid in enumerate(pids):
        if codes[i] is None and not os.waitpid(pid, os.WNOHANG)[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return codes


def _run_scenarios(rank: int, world: int, workdir: Path, names: tuple[str, ...]) -> None:
    """A background job of :data:`JOBS` (``background.Spawned``, one process): its scenarios (``names``, of
    :func:`_scenarios`) in turn, each on ranks forked from this process (:func:`_hosted`), which imported
    torchft and lioncub once for all of them (a fork of the worker pool's fork server has torch; a job of
    its own per scenario imported them in each of its ranks again). A scenario's exit codes (None: still
    running after :data:`SCENARIO_TIMEOUT_S`, killed), the lighthouse's host's last, in
    ``workdir/NAME/codes.json``."""
    import json

    import torchft.checkpointing
    import torchft.coordination
    import torchft.local_sgd  # noqa: F401

    import lioncub.integrations.torchft  # noqa: F401

    scenarios = _scenarios(workdir)
    for name in names:
        settings, fn, n, args = scenarios[name]
        run_dir = workdir / name
        run_dir.mkdir()
        pids = [_fork(_hosted, r, n + 1, run_dir, settings, fn, args) for r in range(n + 1)]
        codes = _reap(pids, n, SCENARIO_TIMEOUT_S)
        (run_dir / "codes.json").write_text(json.dumps(codes))


def _hosted_job(key: str) -> background.Spawned | None:
    """Job ``key`` of :data:`JOBS`: :func:`_run_scenarios` in the background (None without torchft)."""
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        return None
    return background.Spawned(_run_scenarios, 1, (JOBS[key],), timeout=300.0)


def _hosted_results(name: str) -> list:
    """What each rank of scenario ``name`` returned; a rank's failure re-raised here, with its traceback."""
    import json

    pytest.importorskip("torchft", reason="torchft is not installed: the ft extra, docs/install.md")
    key = next(k for k, names in JOBS.items() if name in names)
    (job,) = background.result(key, BACKGROUND[key])
    run_dir = background.workdir(key) / name
    if not (run_dir / "codes.json").exists():
        raise AssertionError(
            f"scenario {name} did not end: the job's exit code {job} (None: killed at 300 s)"
        )
    codes = json.loads((run_dir / "codes.json").read_text())
    host = run_dir / "host.pt"
    errors: list[str] = []
    if host.exists():
        errors.append(f"the lighthouse's host failed:\n{torch.load(host)['error']}")
    missing = f"; None: still running at {SCENARIO_TIMEOUT_S:g} s, killed"
    results = read_results(run_dir, len(codes) - 1, codes, errors, missing)
    if errors:
        raise AssertionError("\n".join(errors))
    return results


def _grads(params: list[torch.nn.Parameter], group: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + group)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


class _KilledInExchange(RuntimeError):
    pass


class _DyingGroup:
    """A replica group's process group that dies during the vote's exchange: it posts one send, then aborts
    (its connections close, as those of a SIGKILLed process) and raises."""

    def __init__(self, pg: Any, sends: int) -> None:
        self.pg, self.sends = pg, sends

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pg, name)

    def send(self, tensors: list, dst: int, tag: int) -> Any:
        work = self.pg.send(tensors, dst, tag)
        self.sends -= 1
        if self.sends > 0:
            return work
        self.pg.abort()
        raise _KilledInExchange("killed during the exchange")


def _group_run(
    rank: int, world_size: int, lighthouse: str, variant: str, steps: int, local_steps: int | None, plan: dict
) -> dict:
    """Replica group ``g{rank}`` trains ``steps`` steps, with the faults of ``plan``: ``rejoin: (g, k,
    pause_s)`` — group g leaves after its step k and starts again (fresh parameters) ``pause_s`` later;
    ``stop: {g: k}`` — group g leaves for good at step k; ``abort: (g, k)`` — group g dies during the vote's
    exchange of step k; ``betas: {g: (b1, b2)}`` — group g's betas (another setting); ``stepping: PATH`` —
    group 0 creates the file PATH once a step was applied."""
    from lioncub.integrations.torchft import ReplicaGroup, ReplicaGroupError

    betas = tuple(plan.get("betas", {}).get(rank, (0.9, 0.99)))

    def build(seed: int) -> tuple[ReplicaGroup, LionCub, list[torch.nn.Parameter]]:
        group = ReplicaGroup(
            lighthouse=lighthouse, index=rank, max_groups=world_size,
            timeout_s=plan.get("timeout_s", 10), quorum_timeout_s=plan.get("quorum_timeout_s", 60),
        )  # fmt: skip
        torch.manual_seed(seed)
        params = [torch.nn.Parameter(torch.randn(s)) for s in ((37, 24), (24,), (40, 24), (3,))]
        opt = LionCub(
            params, lr=0.01, betas=betas, weight_decay=0.1, variant=variant, process_group=group.comm,
            checks=Checks(broadcast_init=False), local_steps=local_steps,
        )  # fmt: skip
        group.attach(opt)
        return group, opt, params

    group, opt, params = build(0)
    log: list[dict] = []
    rejoin = plan.get("rejoin")
    while opt.global_step < steps:
        if rejoin and rank == rejoin[0] and opt.global_step == rejoin[1] and not log[-1].get("rejoined"):
            group.shutdown()
            time.sleep(rejoin[2])
            group, opt, params = build(1)  # another start: the heal must replace all of it
            log.append({"rejoined": True})
        if plan.get("stop", {}).get(rank) == opt.global_step:
            break
        before, heals = opt.global_step, len(group.heals)
        try:
            n = group.begin()
        except ReplicaGroupError as err:
            group.shutdown()
            return {"error": f"{type(err).__name__}: {err}", "log": log}
        step = opt.global_step
        if len(group.heals) > heals:
            log.append({"healed": (before, step)})
        time.sleep(0.04)  # the forward and backward: the others are still training when a group rejoins
        _grads(params, rank, step)
        if plan.get("abort") == (rank, step):
            # the step check's all-gather posts N - 1 sends; the 1-bit vote's all-to-all the next ones
            group.comm.group = _DyingGroup(group.comm.group, sends=n + 1)
            assert group.step() is False  # its own exchange raised: put back, and it dies here
            group.shutdown()
            return {"killed": step, "log": log}
        ok = group.step()
        log.append(
            {"step": step, "n": n, "ok": ok, "sum": float(sum(p.detach().double().sum() for p in params))}
        )
        if ok and rank == 0 and plan.get("stepping"):
            open(plan["stepping"], "a").close()
    group.shutdown()
    return {"params": [p.detach().clone() for p in params], "log": log, "heals": group.heals}


def _plain_run(rank: int, world_size: int, variant: str, steps: int, local_steps: int | None) -> list:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((37, 24), (24,), (40, 24), (3,))]
    opt = LionCub(
        params, lr=0.01, weight_decay=0.1, variant=variant, checks=Checks(broadcast_init=False),
        local_steps=local_steps,
    )  # fmt: skip
    for step in range(steps):
        _grads(params, rank, step)
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "local_steps"), [("1bit", None), ("1bit", 4), ("8bit", None)])
def test_three_groups_without_failures_vote_as_three_ranks(variant: str, local_steps: int | None) -> None:
    """Three replica groups on torchft's lighthouse, none lost: every step has 3 participants and commits,
    and the parameters equal a plain 3-rank vote on the same gradients, bit for bit (:data:`CLEAN_STEPS`)."""
    lighthouse = _lighthouse(3)
    try:
        runs = run_workers(_group_run, 3, lighthouse.address(), variant, CLEAN_STEPS, local_steps, {})
    finally:
        lighthouse.shutdown()
    plain = run_workers(_plain_run, 3, variant, CLEAN_STEPS, local_steps)
    for r, run in enumerate(runs):
        steps = [e for e in run["log"] if "step" in e]  # (the others heal from group 0 at step 0)
        assert [e["n"] for e in steps] == [3] * CLEAN_STEPS and all(e["ok"] for e in steps), r
        for i, (a, b) in enumerate(zip(run["params"], plain[r], strict=True)):
            assert torch.equal(a, b), (r, i)


@pytest.mark.slow
@pytest.mark.parametrize(
    "local_steps", [pytest.param(h, marks=pytest.mark.background("hosted_1")) for h in (None, 4)]
)
def test_a_group_that_leaves_and_rejoins_heals_and_the_replicas_agree(local_steps: int | None) -> None:
    """Group 1 leaves after step 8 and starts again (other initial values) 0.8 s later: the others go on
    with 2 participants, it heals from a live peer at a boundary and joins; at the end every group holds
    the same parameters, bit for bit, and the committed steps of the survivors are each step once."""
    runs = _hosted_results(f"rejoin_{local_steps}")  # 3 groups, 40 steps: _scenarios
    for r in (1, 2):
        for i, (a, b) in enumerate(zip(runs[0]["params"], runs[r]["params"], strict=True)):
            assert torch.equal(a, b), (r, i)
    for r, run in enumerate(runs):  # each step once in each life of a group: committed, or brought by a heal
        ends = [8, 40] if r == 1 else [40]
        assert _lives(run["log"]) == [list(range(end)) for end in ends], r
    survivor = [e for e in runs[0]["log"] if "step" in e]
    ns = [e["n"] for e in survivor]
    assert 3 in ns[:8] and 2 in ns[8:] and ns[-1] == 3, ns  # (a slow start may miss the first quorum)
    assert len(runs[1]["heals"]) >= 1 and runs[1]["heals"][-1].source in ("g0", "g2")


# ------------------------------------------------ groups of several ranks: DDP inside, the vote between


def _mean_grads(params: list[torch.nn.Parameter], group: int, step: int, size: int) -> None:
    """What DDP gives the ranks of group ``group``: the mean of their own gradients (sum, then ÷ size)."""
    grads = []
    for rank in range(group * size, (group + 1) * size):
        _grads(params, rank, step)
        grads.append([p.grad for p in params])
    for i, p in enumerate(params):
        p.grad = grads[0][i].clone()
        for g in grads[1:]:
            p.grad += g[i]
        p.grad /= size


def _ranks_run(
    rank: int, world_size: int, lighthouse: str, steps: int, local_steps: int | None, plan: dict
) -> dict:
    """Groups of 2 ranks (ranks 2g, 2g+1 are group g): each rank's ``LionCub`` votes on its share of the
    parameters (``VoteMesh(group.comm, pg, broadcast="caller")``), the group's gradient is the mean of its
    ranks' (an all-reduce in the group, as DDP's);
    ``rejoin: (g, k, pause_s)``: group g leaves after its step k and starts again (fresh parameters)."""
    from torch.distributed import TCPStore

    from lioncub.integrations.torchft import ReplicaGroup
    from lioncub.optim import VoteMesh

    size, index, local = 2, rank // 2, rank % 2
    pgs = [dist.new_group([2 * g, 2 * g + 1]) for g in range(world_size // size)]
    pg = pgs[index]

    def build(seed: int) -> tuple[Any, ReplicaGroup, LionCub, list[torch.nn.Parameter]]:
        store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False) if local == 0 else None
        ports = [None, None]
        dist.all_gather_object(ports, store.port if store is not None else None, group=pg)
        group = ReplicaGroup(
            lighthouse=lighthouse, index=index, max_groups=world_size // size, timeout_s=10,
            group_rank=local, group_world_size=size, store=f"localhost:{ports[0]}", group_pg=pg,
        )  # fmt: skip
        torch.manual_seed(seed)
        params = [torch.nn.Parameter(torch.randn(s)) for s in ((37, 24), (24,), (40, 24), (3,))]
        opt = LionCub(
            params, lr=0.01, weight_decay=0.1, variant="1bit",
            process_group=VoteMesh(group.comm, pg, broadcast="caller"),
            checks=Checks(broadcast_init=False), local_steps=local_steps,
        )  # fmt: skip
        if seed == 0:  # refused in a group of several ranks: a plain vote, a broadcast before the commit
            for wrong, why in (
                (group.comm, r"build the optimizer as LionCub\(model.parameters\(\), process_group=VoteMesh"),
                (VoteMesh(group.comm, pg), "broadcast='step'"),
            ):
                plain = LionCub(
                    params, variant="1bit", process_group=wrong, checks=Checks(broadcast_init=False)
                )
                with pytest.raises(ValueError, match=why):
                    group.attach(plain)
            old = LionCub(
                params[:1], variant="1bit", process_group=group.comm, checks=Checks(broadcast_init=False)
            )
            with pytest.warns(DeprecationWarning, match="params is deprecated"), pytest.raises(ValueError):
                group.attach(old, params)  # the earlier form: the optimizer on its share, then params
        group.attach(opt)
        return store, group, opt, params

    store, group, opt, params = build(0)
    log: list[dict] = []
    rejoin = plan.get("rejoin")
    while opt.global_step < steps:
        if rejoin and index == rejoin[0] and opt.global_step == rejoin[1] and {"rejoined": True} not in log:
            group.shutdown()
            time.sleep(rejoin[2])
            store, group, opt, params = build(1)
            log.append({"rejoined": True})
        before, heals = opt.global_step, len(group.heals)
        n = group.begin()
        if len(group.heals) > heals:
            log.append({"healed": (before, opt.global_step)})
        step = opt.global_step
        time.sleep(0.04)
        _grads(params, rank, step)  # this rank's own gradient, then the group's mean
        for p in params:
            dist.all_reduce(p.grad, group=pg)
            p.grad /= size
        log.append({"step": step, "n": n, "ok": group.step()})
        for p in params:
            p.grad = None
    group.shutdown()
    del store
    return {"params": [p.detach().clone() for p in params], "log": log, "heals": group.heals}


def _plain_groups_run(rank: int, world_size: int, steps: int, local_steps: int | None) -> list:
    """The oracle: ``world_size`` plain ranks, rank g with group g's mean gradient, one optimizer over all
    the parameters."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((37, 24), (24,), (40, 24), (3,))]
    opt = LionCub(
        params, lr=0.01, weight_decay=0.1, variant="1bit", checks=Checks(broadcast_init=False),
        local_steps=local_steps,
    )  # fmt: skip
    for step in range(steps):
        _mean_grads(params, rank, step, 2)
        opt.step()
    return [p.detach().clone() for p in params]


def test_share_owners_balance_whole_tensors_alike_everywhere() -> None:
    from lioncub.integrations.group_shares import shard, share_of
    from lioncub.optim.shards import share_owners

    tensors = [torch.empty(s) for s in ((37, 24), (24,), (40, 24), (3,), (24,))]
    assert share_owners(tensors, 2) == [1, 1, 0, 1, 1]  # 960 | 888 + 24 + 24 + 3
    assert share_owners(tensors, 1) == [0] * 5 and share_owners(tensors, 9)[:2] == [1, 2]
    loads = [0, 0]  # tensors added later continue the assignment: 960 | 888 + 24, then 24 + 3 to rank 1
    assert share_owners(tensors[:3], 2, loads) + share_owners(tensors[3:], 2, loads) == [1, 1, 0, 1, 1]
    assert loads == [960, 939]
    with pytest.raises(ValueError, match="parts=0"):
        share_owners(tensors, 0)
    with pytest.warns(DeprecationWarning, match=r"VoteMesh\(group.comm, group_pg, broadcast='caller'\)"):
        assert shard(tensors, 2) == [1, 1, 0, 1, 1]
    with pytest.warns(DeprecationWarning, match="opt.shares"):
        assert share_of(tensors, 2, 0) == [tensors[2]]


@pytest.mark.slow
@pytest.mark.parametrize("local_steps", [None, 4])
def test_groups_of_two_ranks_vote_as_two_ranks_of_their_mean_gradients(local_steps: int | None) -> None:
    """Two groups of two ranks, none lost: every step has 2 participants (the groups, not the ranks) and
    every rank ends with the parameters of a plain 2-rank vote whose rank g has group g's mean gradient,
    bit for bit (each rank stepped and voted its share and received the rest from its group;
    :data:`CLEAN_STEPS`)."""
    lighthouse = _lighthouse(2)
    try:
        runs = run_workers(_ranks_run, 4, lighthouse.address(), CLEAN_STEPS, local_steps, {})
    finally:
        lighthouse.shutdown()
    plain = run_workers(_plain_groups_run, 2, CLEAN_STEPS, local_steps)
    for r, run in enumerate(runs):
        steps = [e for e in run["log"] if "step" in e]
        assert [e["n"] for e in steps] == [2] * CLEAN_STEPS and all(e["ok"] for e in steps), r
        for i, (a, b) in enumerate(zip(run["params"], plain[r // 2], strict=True)):
            assert torch.equal(a, b), (r, i)


@pytest.mark.slow
@pytest.mark.background("hosted_1")
def test_a_group_of_two_ranks_that_rejoins_heals_every_rank() -> None:
    """Group 1 (ranks 2, 3) leaves after step 6 and starts again 1.5 s later with other parameters (the
    lighthouse drops it after 1 s without heartbeats): group 0 goes on
    alone, group 1's ranks heal (each its share from its peer rank, then the shares in the group) and
    every rank of both groups ends bitwise equal."""
    runs = _hosted_results("ranks_rejoin")  # 4 ranks, 48 steps, {"rejoin": (1, 6, 1.5)}: _scenarios
    for r in (1, 2, 3):
        for i, (a, b) in enumerate(zip(runs[0]["params"], runs[r]["params"], strict=True)):
            assert torch.equal(a, b), (r, i)
    for r in (2, 3):
        assert _lives(runs[r]["log"]) == [list(range(6)), list(range(48))], r
        assert runs[r]["heals"] and runs[r]["heals"][-1].source == "g0", r
    assert {e["n"] for e in runs[0]["log"] if "step" in e} == {1, 2}


# ---------------------------------------------------- torchft's own DiLoCo against lioncub's outer="diloco"


def _torchft_diloco(rank: int, world_size: int, lighthouse: str, steps: int, h: int) -> list:
    """torchft's ``DiLoCo``: lioncub's :class:`~lioncub.optim.Lion` as the inner optimizer, Nesterov SGD
    (lr 0.7, momentum 0.9) as the outer; ``init_sync=False`` (identical initial values)."""
    import datetime

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from lioncub.optim import Lion

    port = _free_port()
    store = TCPStore("localhost", port, is_master=True, wait_for_workers=False)
    model = torch.nn.ParameterList(_params())
    inner = Lion(model.parameters(), lr=0.01, weight_decay=0.0)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=datetime.timedelta(seconds=10)), load_state_dict=None, state_dict=None,
        min_replica_size=world_size, use_async_quorum=False, init_sync=False, rank=0, world_size=1,
        store_addr="localhost", store_port=port, lighthouse_addr=lighthouse, replica_id=f"d{rank}",
        timeout=datetime.timedelta(seconds=10),
    )  # fmt: skip
    params = list(model.parameters())
    with DiLoCo(
        manager, [model], inner, outer, sync_every=h, backup_device=torch.device("cpu"), pin_memory=False
    ):
        for step in range(steps):
            _grads(params, rank, step)
            inner.step()
    manager.shutdown(wait=False)
    del store
    return [p.detach().clone() for p in params]


def _lioncub_diloco(rank: int, world_size: int, steps: int, h: int) -> list:
    from lioncub.optim import LocalSteps

    params = _params()
    rule = LocalSteps(h=h, outer="diloco", inner_momentum="keep")
    opt = LionCub(params, lr=0.01, variant="32bit", local_steps=rule, checks=Checks(broadcast_init=False))
    for step in range(steps):
        _grads(params, rank, step)
        opt.step()
    return [p.detach().clone() for p in params]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_torchft_diloco_equals_lioncub_diloco_with_inner_momenta_kept() -> None:
    """Without failures torchft's DiLoCo (Lion inside, Nesterov SGD outside) and lioncub's
    ``outer="diloco"`` with the inner momenta kept take the same steps: 2 groups, H = 4, 16 steps, no weight
    decay (lioncub decays once per window in closed form, docs/local-steps.md; torchft's inner Lion decays
    every step). Both average the pseudo-gradients as a sum divided by N and step torch's Nesterov SGD
    formula, so the parameters agree bit for bit (measured: a difference of exactly 0)."""
    lighthouse = _lighthouse(2)
    try:
        theirs = run_workers(_torchft_diloco, 2, lighthouse.address(), 16, 4)
    finally:
        lighthouse.shutdown()
    ours = run_workers(_lioncub_diloco, 2, 16, 4)
    for r in range(2):
        for i, (a, b) in enumerate(zip(theirs[r], ours[r], strict=True)):
            assert torch.equal(a, b), (r, i, (a - b).abs().max().item())


def _lives(log: list[dict]) -> list[list[int]]:
    """The steps of each life of a group (a rejoin starts another): committed there, or brought by a heal."""
    lives: list[list[int]] = [[]]
    for e in log:
        if "rejoined" in e:
            lives.append([])
        elif "healed" in e:
            lives[-1] += range(*e["healed"])
        elif e["ok"]:
            lives[-1].append(e["step"])
    return lives


def _groups(n: int, min_groups: int, steps: int, plan: dict) -> tuple:
    """The scenario of ``n`` replica groups of :func:`_group_run` (1-bit, ``steps`` steps, ``plan``) on a
    lighthouse of a quorum of ``min_groups``."""
    return _settings(min_groups), _group_run, n, ("1bit", steps, None, plan)


@pytest.mark.slow
@pytest.mark.background("hosted_1")
def test_a_group_killed_during_the_exchange_is_applied_nowhere() -> None:
    """Group 1 dies in the middle of the vote's all-to-all at step 6: the survivors' exchange fails, each
    puts its snapshot back (step 6 applied nowhere), and step 6 runs again with the next quorum, of 2; the
    survivors end bitwise equal, each step once."""
    runs = _hosted_results("killed")  # _groups(3, 2, 16, {"abort": (1, 6), "timeout_s": 2})
    assert runs[1]["killed"] == 6
    for r in (0, 2):
        assert _lives(runs[r]["log"]) == [list(range(16))], r
        attempts = [(e["step"], e["n"], e["ok"]) for e in runs[r]["log"] if "step" in e]
        assert (6, 3, False) in attempts and (6, 2, True) in attempts, attempts
    for a, b in zip(runs[0]["params"], runs[2]["params"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.background("hosted_2")
def test_two_groups_lost_at_once() -> None:
    """Groups 1 and 3 of 4 leave together at step 6: the other two go on with 2 participants, bitwise
    equal, each step once."""
    runs = _hosted_results("two_lost")  # _groups(4, 1, 16, {"stop": {1: 6, 3: 6}, "timeout_s": 2})
    for r in (0, 2):
        assert _lives(runs[r]["log"]) == [list(range(16))], r
        ns = [e["n"] for e in runs[r]["log"] if "step" in e and e["ok"]]
        assert 4 in ns[:6] and ns[-1] == 2, ns
    for a, b in zip(runs[0]["params"], runs[2]["params"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.background("hosted_2")
def test_a_group_with_other_settings_is_refused_and_the_others_go_on() -> None:
    """Group 2 starts with other betas: it is refused when it heals (at the first quorum), with a message
    naming the setting; groups 0 and 1 train on, bitwise equal."""
    runs = _hosted_results("other_settings")  # _groups(3, 2, 12, {"betas": {2: (0.8, 0.99)}, ...})
    assert "SettingsMismatchError" in runs[2]["error"] and "betas" in runs[2]["error"], runs[2]["error"]
    assert "(0.8, 0.99)" in runs[2]["error"] and "(0.9, 0.99)" in runs[2]["error"], runs[2]["error"]
    for r in (0, 1):
        assert _lives(runs[r]["log"]) == [list(range(12))], r
    for a, b in zip(runs[0]["params"], runs[1]["params"], strict=True):
        assert torch.equal(a, b)


def _lighthouse_lost(rank: int, world_size: int, lighthouse: str, stepping: str) -> dict:
    """:func:`_group_run` until its lighthouse is lost, and how long it ran (``elapsed_s``)."""
    started = time.monotonic()
    plan = {"quorum_timeout_s": 2, "stepping": stepping}
    run = _group_run(rank, world_size, lighthouse, "1bit", 10_000, None, plan)
    return {**run, "elapsed_s": time.monotonic() - started}


@pytest.mark.slow
@pytest.mark.background("hosted_2")
def test_the_lighthouse_lost_is_a_clear_error_within_the_quorum_timeout() -> None:
    """The lighthouse (lioncub's lighthouse program: torchft's server, in a process of its own) is SIGKILLed
    once the groups train: every group's next quorum fails within its 2 s timeout with an error naming the
    group, the lighthouse and the timeout."""
    runs = _hosted_results("lighthouse_lost")  # groups 0 and 1 beside lioncub's lighthouse: _scenarios
    url = (background.workdir("hosted_2") / "lighthouse_lost" / "lighthouse").read_text()
    assert url.startswith("http://localhost:"), url
    assert max(run["elapsed_s"] for run in runs) < 30
    for r, run in enumerate(runs):
        assert f"replica group g{r}: no quorum within 2 s" in run["error"], run["error"]
        assert url in run["error"] and run["log"], run


# ------------------------------------------------- the loop of docs/fault-tolerance.md, run as written

#: the lighthouse docs/fault-tolerance.md gives the loop (what `lioncub train --fault-tolerant` starts)
DOCS_LIGHTHOUSE = {
    "min_replicas": 1,
    "join_timeout_ms": 60000,
    "quorum_tick_ms": 20,
    "heartbeat_timeout_ms": 2000,
}


def _docs_loop(rank: int, world_size: int, lighthouse: str, steps: int, restart_after: int | None) -> dict:
    """docs/fault-tolerance.md's loop ("In a training loop"), as written: a linear model on this group's
    data (the gradients depend on the parameters), ``--local-steps 16``, ``finish()`` and ``shutdown()``
    at the end; with ``restart_after`` k, group 1 leaves after its step k and starts again from scratch
    (another seed) half a second later."""
    from lioncub.integrations.torchft import ReplicaGroup

    def build(seed: int) -> tuple[ReplicaGroup, LionCub, torch.nn.Linear]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(24, 3)
        group = ReplicaGroup(lighthouse=lighthouse, index=rank, max_groups=world_size, timeout_s=20,
                             quorum_timeout_s=60)  # fmt: skip
        opt = LionCub(model.parameters(), lr=3e-3, variant="1bit", local_steps=16, process_group=group.comm,
                      checks=Checks(broadcast_init=False))  # fmt: skip
        group.attach(opt)
        return group, opt, model

    group, opt, model = build(0)
    restarted = False
    while opt.global_step < steps:
        if rank == 1 and opt.global_step == restart_after and not restarted:
            group.shutdown()
            time.sleep(0.5)
            group, opt, model = build(1)  # from scratch: the heal must replace all of it
            restarted = True
        group.begin()
        for g in opt.param_groups:
            g["lr"] = 3e-3 * (1 - opt.global_step / steps)
        data = torch.Generator().manual_seed(1000 * opt.global_step + rank)
        x, y = torch.randn(32, 24, generator=data), torch.randn(32, 3, generator=data)
        torch.nn.functional.mse_loss(model(x), y).backward()
        group.step()
        opt.zero_grad()
    agreement = group.finish()
    group.shutdown()
    return {"agreement": agreement, "params": [p.detach().clone() for p in model.parameters()],
            "heals": group.heals}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "restart_after", [pytest.param(k, marks=pytest.mark.background("hosted_2")) for k in (None, 16)]
)
def test_the_docs_loop_and_lighthouse_end_with_equal_replicas(restart_after: int | None) -> None:
    """Three groups run the docs' loop with the docs' lighthouse settings, without a failure and with group
    1 restarted from scratch after step 16 (it heals at the next window): every group's ``finish()`` agrees
    with all three, and their parameters are bitwise equal."""
    runs = _hosted_results(f"docs_{restart_after}")  # 3 groups, 48 steps, DOCS_LIGHTHOUSE: _scenarios
    for r, run in enumerate(runs):
        agreement = run["agreement"]
        assert agreement.agrees and agreement.participants == 3, (r, agreement.describe())
        assert len(set(agreement.digests.values())) == 1
        assert all(torch.equal(a, b) for a, b in zip(run["params"], runs[0]["params"], strict=True)), r
    if restart_after is not None:
        # the first window start its new life reached with the others (16 if they were still at it)
        assert runs[1]["heals"] and runs[1]["heals"][-1].step in (16, 32), runs[1]["heals"]
        assert runs[1]["heals"][-1].source in ("g0", "g2")


def _scenarios(workdir: Path) -> dict[str, tuple[dict[str, int] | None, Any, int, tuple]]:
    """The multi-group runs that mostly wait (heartbeats, quorums, a group's pause before it rejoins), in
    the order of their tests: name -> (the lighthouse's settings, None for lioncub's lighthouse program;
    ``fn``; its ranks; ``fn``'s arguments after the lighthouse's URL) of :func:`_hosted`. ``workdir``: the
    job's directory (each scenario runs in ``workdir/NAME``)."""
    return {
        **{
            f"rejoin_{h}": (_settings(2), _group_run, 3, ("1bit", 40, h, {"rejoin": (1, 8, 0.8)}))
            for h in (None, 4)
        },
        "ranks_rejoin": (_settings(1), _ranks_run, 4, (48, None, {"rejoin": (1, 6, 1.5)})),
        "killed": _groups(3, 2, 16, {"abort": (1, 6), "timeout_s": 2}),
        "two_lost": _groups(4, 1, 16, {"stop": {1: 6, 3: 6}, "timeout_s": 2}),
        "other_settings": _groups(3, 2, 12, {"betas": {2: (0.8, 0.99)}, "timeout_s": 2}),
        # the file that group 0 creates once it stepped: the host then SIGKILLs the lighthouse (:func:`_host`)
        "lighthouse_lost": (None, _lighthouse_lost, 2, (str(workdir / "lighthouse_lost" / "stepping"),)),
        **{f"docs_{k}": (DOCS_LIGHTHOUSE, _docs_loop, 3, (48, k)) for k in (None, 16)},
    }


#: the background jobs (:func:`_run_scenarios`) and their scenarios (:func:`_scenarios`), in the order of the
#: tests: two jobs, so that the first tests need not wait for the last scenarios
JOBS = {
    "hosted_1": ("rejoin_None", "rejoin_4", "ranks_rejoin", "killed"),
    "hosted_2": ("two_lost", "other_settings", "lighthouse_lost", "docs_None", "docs_16"),
}
#: started in the background when collection ends (tests/background.py), in the order of the tests
BACKGROUND = {key: lambda key=key: _hosted_job(key) for key in JOBS}
