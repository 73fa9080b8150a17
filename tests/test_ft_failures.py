"""Failures of a fault-tolerant job, each bounded and reported, nothing deleted (issue 47): the job's exit
status (:func:`lioncub.train.fault_tolerant.job_status`), the launcher watching the lighthouse (stand-in
groups, lioncub's torch-free lighthouse program), a rejoin that died at its start not waited for, a
straggler alone after the others finished, a failed heal sitting its step out (never voting unhealed),
:meth:`ReplicaGroup.finish`'s agreement, and the network namespaces of a launcher killed with SIGKILL.

The end-to-end straggler run (group 1 SIGSTOPped past ``--collective-timeout``) is one of
tests/ft_runs.py's background runs, tested in tests/test_replica_groups_cli.py."""

from __future__ import annotations

import datetime
import io
import json
import select
import signal
import socket
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lioncub.launch import LaunchConfig, groups
from lioncub.launch.groups import launch_groups, probe_lighthouse
from lioncub.launch.result import LaunchResult
from lioncub.optim import Checks, LionCub
from lioncub.train.fault_tolerant import SURVIVORS_RC, UNEQUAL_RC, job_status

from processes import python_cmd


def _result(code: int, failed: int | None = None, **kw: Any) -> LaunchResult:
    return LaunchResult(
        returncode=code, rank_returncodes=[], failed_rank=failed, message=kw.pop("message", "m"), wall_s=1.0,
        restarts=0, timed_out=kw.pop("timed_out", False), interrupted_by=kw.pop("interrupted_by", None),
        launch_id="lcb00000", traffic=None,
    )  # fmt: skip


def _entry(finished: list[int], equal: bool) -> dict[str, Any]:
    return {"groups_finished": finished, "replicas_equal": equal}


@pytest.mark.parametrize(
    ("result", "entry", "code"),
    [
        (_result(0), _entry([0, 1, 2], True), 0),
        (_result(1, 1, message="group 1 exited with code 1"), _entry([0, 2], True), SURVIVORS_RC),
        (_result(137, 1), _entry([0], True), SURVIVORS_RC),  # a group SIGKILLed: not the launcher's 137
        (_result(0), _entry([0, 1], False), UNEQUAL_RC),
        (_result(1, 1), _entry([0, 2], False), UNEQUAL_RC),
        (_result(124, timed_out=True), _entry([0], True), 124),  # the timeout stays the timeout
        (_result(130, interrupted_by="SIGINT"), _entry([0, 1], True), 130),
        (_result(1, message="the torchft lighthouse at u was killed by SIGKILL"), None, 1),
        (_result(0), None, 1),  # no group finished: never 0
    ],
)
def test_the_exit_status_says_the_jobs_truth(result: LaunchResult, entry: dict | None, code: int) -> None:
    assert job_status(result, entry)[0] == code
    assert SURVIVORS_RC not in (0, 1, 2, 124, 128 + 9) and UNEQUAL_RC not in (0, 1, 2, 124, SURVIVORS_RC)


def test_the_job_status_message_names_the_survivors() -> None:
    message = "group 1 exited with code 1"
    assert job_status(_result(1, 1, message=message), _entry([0], True))[1] == f"{message}; group 0 finished"
    assert job_status(_result(1, 1, message=message), _entry([0, 2], True))[1] == (
        f"{message}; groups 0, 2 finished with equal replicas"
    )


# ----------------------------------------------------------------------------------- the lighthouse


def test_a_lighthouse_url_where_nothing_listens_is_refused_at_once() -> None:
    started = time.monotonic()
    why = probe_lighthouse("http://127.0.0.1:1")
    assert why is not None and "ConnectionRefusedError" in why, why
    assert time.monotonic() - started < 3


#: a stand-in for a replica group that never ends by itself (so that only the lighthouse's loss ends the
#: job); with ``kill``, group 0 SIGKILLs the launcher's lighthouse program (found by its port) first
SLEEPER = textwrap.dedent(
    """
    import os, signal, sys, time
    url = os.environ["LIONCUB_LIGHTHOUSE"]
    if sys.argv[1] == "kill" and os.environ["LIONCUB_GROUP"] == "0":
        port = url.rsplit(":", 1)[1].encode()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
            except OSError:
                continue
            if b"lighthouse" in argv and any(a.endswith(b":" + port) for a in argv):
                os.kill(int(pid), signal.SIGKILL)
    time.sleep(60)
    """
)


@pytest.mark.slow
def test_the_launchers_lighthouse_killed_stops_the_job_at_once_naming_it(tmp_path: Path) -> None:
    pytest.importorskip("torchft", reason="torchft is not installed: the ft extra, docs/install.md")
    script = tmp_path / "group.py"
    script.write_text(SLEEPER)
    config = LaunchConfig(python_cmd(str(script), "kill"), nproc=2, timeout_s=60)
    err = io.StringIO()
    started = time.monotonic()
    result = launch_groups(config, [], lambda g: 0, out=io.StringIO(), err=err)
    assert time.monotonic() - started < 30  # the groups would sleep 60 s: the watch stopped them
    url = next(line.split()[-1] for line in err.getvalue().splitlines() if "torchft lighthouse at" in line)
    assert (result.returncode, result.failed_rank) == (1, None)
    assert result.message == (
        f"the torchft lighthouse at {url} was killed by SIGKILL; the groups cannot form a quorum without it"
    )
    assert f"{result.message}: stopping them" in err.getvalue()


@pytest.mark.slow
def test_a_lighthouse_given_by_url_that_dies_stops_the_job_after_the_grace_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lighthouse given by URL that stops answering ends the job once no probe succeeded for the grace
    period, naming why. The grace period and the probe's interval shortened (5 s, 1 s by default) to 1 s and
    0.2 s: the same rule, 4 s sooner."""
    pytest.importorskip("torchft", reason="torchft is not installed: the ft extra, docs/install.md")
    monkeypatch.setattr(groups, "LIGHTHOUSE_GRACE_S", 1.0)
    monkeypatch.setattr(groups, "PROBE_S", 0.2)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    lighthouse = subprocess.Popen(
        python_cmd("-m", "lioncub.launch.groups", "lighthouse", f"127.0.0.1:{port}"),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert lighthouse.stdout is not None
        ready = lighthouse.stdout.readline() if select.select([lighthouse.stdout], [], [], 60)[0] else ""
        assert ready.startswith("ready http://"), ready
        url = f"http://127.0.0.1:{port}"
        assert probe_lighthouse(url) is None
        script = tmp_path / "group.py"
        script.write_text(SLEEPER)
        config = LaunchConfig(python_cmd(str(script), "sleep"), nproc=2, timeout_s=60)
        lighthouse.send_signal(signal.SIGKILL)
        lighthouse.wait()
        started = time.monotonic()
        result = launch_groups(config, [], lambda g: 0, lighthouse=url, out=io.StringIO(), err=io.StringIO())
        took = time.monotonic() - started
    finally:
        lighthouse.kill()
        lighthouse.wait()
    assert 1.0 <= took < 1.0 + 10, took
    assert result.returncode == 1
    assert result.message.startswith(f"the torchft lighthouse at {url} has not answered for "), result.message
    assert "ConnectionRefusedError" in result.message


# --------------------------------------------------------------------------- the groups' own rules


def test_a_rejoin_that_died_at_its_start_is_not_waited_for(tmp_path: Path) -> None:
    """The groups waiting at a boundary for a group the schedule started again go on at once when the
    driver marked that start ended (it died before it joined); without the mark they wait, bounded."""
    from lioncub.integrations.torchft import ReplicaGroupError
    from lioncub.train.replica_group import _await_rejoins, ended_name

    (tmp_path / "groups").mkdir()
    pending = [(1, 1, 35), (2, 1, 50)]
    with pytest.raises(
        ReplicaGroupError, match=r"group 1 did not start again after --rejoin 1@35 within 0.2 s"
    ):
        _await_rejoins(tmp_path, "http://127.0.0.1:1", pending, 40, 0.2)
    assert pending == [(1, 1, 35), (2, 1, 50)]  # nothing handled
    (tmp_path / ended_name(1, 1)).write_text("1\n")
    started = time.monotonic()
    _await_rejoins(tmp_path, "http://127.0.0.1:1", pending, 40, 30.0)
    assert time.monotonic() - started < 1
    assert pending == [(2, 1, 50)]  # the later rejoin is still to come


def test_a_group_alone_after_another_finished_stops_and_alone_after_kills_trains_on(tmp_path: Path) -> None:
    from lioncub.integrations.torchft import ReplicaGroupError
    from lioncub.train import replica_group
    from lioncub.train.config import TrainConfig

    config = TrainConfig.from_values({"variant": "1bit", "nproc": 3, "fault_tolerant": True, "steps": 60})
    loop = object.__new__(replica_group._GroupLoop)
    loop.config, loop.run_dir, loop.index = config, tmp_path, 1
    loop.position = replica_group._Position(step=21)
    (tmp_path / "groups").mkdir()
    loop.check_alone(1)  # alone while the others are gone (killed, stalled): the job's one live group
    loop.check_alone(2)
    (tmp_path / replica_group.end_name(2)).write_text("{}\n")
    loop.check_alone(2)  # in a quorum with a peer: healed there if behind
    with pytest.raises(
        ReplicaGroupError, match=r"alone in its quorum after its step 21, and group\(s\) 2 fin"
    ):
        loop.check_alone(1)
    loop.position.healed = True  # healed at this quorum (by a group that then finished): not alone
    loop.check_alone(1)


class _Manager:
    """torchft's Manager as a quorum whose heal failed: the source died during the transfer."""

    def __init__(self) -> None:
        self.commits = 0
        self.error: Exception | None = None

    def start_quorum(self, timeout: datetime.timedelta) -> None:
        self.error = ConnectionResetError("the heal's source went away")  # torchft: report_error

    def errored(self) -> Exception | None:
        return self.error

    def num_participants(self) -> int:
        return 3

    def should_commit(self, timeout: datetime.timedelta) -> bool:
        self.commits += 1
        return self.error is None


class _Group:
    """A process group that refuses every operation (a vote through it would be one) and records abort."""

    aborted = False

    def abort(self) -> None:
        self.aborted = True

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the group voted ({name}) with a state it did not heal to")


def test_a_group_whose_heal_failed_sits_the_step_out_and_votes_nothing() -> None:
    """The quorum's heal failed: ``begin`` leaves the step (the process group aborted, so that the others'
    exchanges with this group fail at once), ``step`` votes nothing, applies nothing and is not committed;
    the parameters and the optimizer's state are those before the quorum, bit for bit."""
    from lioncub.collectives import GroupComm
    from lioncub.integrations.torchft import ReplicaGroup

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    pg = _Group()
    comm = GroupComm(pg, rank=0, world_size=3)
    opt = LionCub(params, lr=0.1, variant="1bit", process_group=comm, checks=Checks(broadcast_init=False))
    group = object.__new__(ReplicaGroup)
    group.replica_id, group.lighthouse, group.min_groups, group.max_groups = "g1", "http://lh:1", 1, 3
    group.timeout_s = group.quorum_timeout_s = 5.0
    group.manager, group._pg, group.comm, group._optimizer = _Manager(), pg, comm, opt
    group._snapshot, group._healed, group._shares, group.heals = None, None, None, []
    group.participants = group.skipped = group.committed = 0
    group._alone_since, group._rules_checked = None, True
    before = [p.detach().clone() for p in params]
    assert group.begin() == 3
    assert group.left_out == "ConnectionResetError: the heal's source went away" and pg.aborted
    for p in params:
        p.grad = torch.ones_like(p)  # what Lion would step on: any change would show
    assert group.step() is False
    assert (group.skipped, group.committed, group.manager.commits) == (1, 0, 1)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
    assert opt.global_step == 0 and all("exp_avg" not in opt.state.get(p, {}) for p in params)


def test_finish_agrees_only_with_an_equal_quorum_of_several() -> None:
    from lioncub.integrations.torchft import Agreement, params_digest

    a, b = params_digest([torch.zeros(3)]), params_digest([torch.ones(3)])
    assert a == params_digest([torch.zeros(3)]) and a != b and a != params_digest([torch.zeros(4)])
    assert Agreement("g0", {"g0": a, "g1": a, "g2": a}, 3).agrees
    assert not Agreement("g0", {"g0": a, "g1": b, "g2": a}, 3).agrees
    assert "differ from those of g1" in Agreement("g0", {"g0": a, "g1": b, "g2": a}, 3).describe()
    alone = Agreement("g1", {"g1": a}, 3)
    assert not alone.agrees and "ran alone" in alone.describe()
    assert Agreement("g0", {"g0": a}, 1).agrees  # a job of one group: nobody to disagree with
    lost = Agreement("g0", {"g0": a}, 3, error="CollectiveError: timed out")
    assert not lost.agrees and "did not arrive" in lost.describe()


# --------------------------------------------------------------------------------- network namespaces


def test_the_sudo_hint_names_this_lioncub_by_its_path(tmp_path: Path) -> None:
    from lioncub.launch.netns import sudo_hint

    prog = tmp_path / "venv" / "bin" / "lioncub"
    prog.parent.mkdir(parents=True)
    prog.write_text("#!/bin/sh\n")
    prog.chmod(0o755)
    assert sudo_hint(str(prog)).startswith(f"sudo {prog} ...; sudo resets PATH")
    assert sudo_hint("/usr/lib/python3/x/__main__.py").startswith('sudo "$(command -v lioncub)" ...')


#: a launcher's emulated network, then a wait to be SIGKILLed
HOLD_A_NETWORK = textwrap.dedent(
    """
    import time
    from lioncub.launch.netns import EmulatedNetwork
    net = EmulatedNetwork(2, None, hosts_file=False).up()
    print(net.launch_id, flush=True)
    time.sleep(60)
    """
)


def _namespaces(launch_id: str) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in names.splitlines() if line.startswith(launch_id)]


@pytest.mark.root
def test_a_launcher_killed_with_sigkill_leaves_no_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its guard (a process of its own session that sees the launcher's pipe end) removes them."""
    from lioncub.launch.netns import check_privileges

    try:
        check_privileges()
    except Exception as exc:  # what is missing: the skip says it
        pytest.skip(str(exc))
    monkeypatch.setenv("LIONCUB_STATE_DIR", str(tmp_path / "state"))
    proc = subprocess.Popen(python_cmd("-c", HOLD_A_NETWORK), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        launch_id = proc.stdout.readline().strip() if select.select([proc.stdout], [], [], 60)[0] else ""
        assert len(_namespaces(launch_id)) == 3, launch_id  # the bridge's and two hosts'
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while _namespaces(launch_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _namespaces(launch_id) == []
    assert list((tmp_path / "state").iterdir()) == []  # its state file too


@pytest.mark.root
def test_the_next_launch_removes_a_dead_launchers_leftovers_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lioncub.launch import groups
    from lioncub.launch.netns import EmulatedNetwork, check_privileges
    from lioncub.launch.supervisor import Output

    try:
        check_privileges()
    except Exception as exc:
        pytest.skip(str(exc))
    monkeypatch.setenv("LIONCUB_STATE_DIR", str(tmp_path))
    net = EmulatedNetwork(1, None, hosts_file=False).up()
    assert net._guard is not None
    net._guard.proc.kill()  # as if the guard were gone too: only the next launch can clean up
    net._guard.proc.wait()
    state = json.loads(net.state_path.read_text())
    dead = subprocess.Popen(["true"])
    dead.wait()
    state["pid"], state["pid_start"] = dead.pid, None  # its launcher: a process that ended
    net.state_path.write_text(json.dumps(state))
    err = io.StringIO()
    groups._remove_leftovers(Output(io.StringIO(), err, 1, unit="g"))
    assert _namespaces(net.launch_id) == []
    assert f"removed the leftovers of dead launches {net.launch_id}: network namespaces " in err.getvalue()
    assert f"{net.launch_id}-br" in err.getvalue()
    net._closed = True  # nothing left for it to remove


@pytest.mark.slow
def test_a_heals_transfer_writes_no_access_line(capfd: pytest.CaptureFixture[str]) -> None:
    """torchft's checkpoint server logs every request (``"GET /checkpoint/3/full HTTP/1.1" 200 -``) to
    stderr, a few lines per heal; lioncub's transport keeps them out (the state arrives all the same)."""
    pytest.importorskip("torchft", reason="torchft is not installed: the ft extra, docs/install.md")
    from torchft.checkpointing import HTTPTransport

    from lioncub.integrations.torchft import _transport

    timeout = datetime.timedelta(seconds=10)
    for transport, lines in (
        (HTTPTransport(timeout=timeout, num_chunks=0), 1),
        (_transport("127.0.0.1", timeout), 0),
    ):
        transport.send_checkpoint(dst_ranks=[1], step=3, state_dict={"x": torch.arange(4.0)}, timeout=timeout)
        got = transport.recv_checkpoint(src_rank=0, metadata=transport.metadata(), step=3, timeout=timeout)
        transport.shutdown()
        assert torch.equal(got["x"], torch.arange(4.0))
        assert capfd.readouterr().err.count('"GET /checkpoint/3/full HTTP/1.1" 200') == lines


def test_a_launch_that_cannot_start_is_a_failed_launch_naming_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lighthouse that does not start, an emulated network that cannot be built: a failed launch (exit
    status 1, its message), so that the run is kept and its failure.json says why -- not a traceback."""
    from lioncub.launch.netns import NetnsError
    from lioncub.train import fault_tolerant

    def refuse(*args: Any, **kwargs: Any) -> LaunchResult:
        raise NetnsError("namespaces already exist: lcb12345-br")

    monkeypatch.setattr(fault_tolerant, "launch_groups", refuse)
    err = io.StringIO()
    result = fault_tolerant._launch(
        LaunchConfig(["x"], nproc=2),
        [],
        lambda g: 0,
        lighthouse=None,
        out=None,
        err=err,
        ended=lambda *a: None,
    )
    assert (result.returncode, result.failed_rank) == (1, None)
    assert result.message == "the launch failed: namespaces already exist: lcb12345-br"
    assert job_status(result, None) == (1, result.message)
    assert f"lioncub: {result.message}" in err.getvalue()


def test_a_lighthouse_whose_quorum_can_never_form_is_named() -> None:
    """A lighthouse that needs more groups than the job has (its /status page says min_replicas)."""
    pytest.importorskip("torchft", reason="torchft is not installed: the ft extra, docs/install.md")
    from torchft.coordination import LighthouseServer

    from lioncub.integrations.torchft import lighthouse_status, quorum_rules_problem

    server = LighthouseServer(bind="[::]:0", min_replicas=4, join_timeout_ms=100)
    try:
        status = lighthouse_status(server.address())
    finally:
        server.shutdown()
    assert (status.min_replicas, status.asking, status.heartbeating) == (4, 0, 0)
    assert quorum_rules_problem(status, 4) is None
    problem = quorum_rules_problem(status, 3)
    assert problem is not None and problem.startswith(
        "the lighthouse needs min_replicas 4 groups for a quorum"
    )
    assert quorum_rules_problem(lighthouse_status("http://127.0.0.1:1"), 3) is None  # nothing said: no guess
