"""Suite-wide setup.

* The hypothesis profile (``tests/profiles.py``): ``ci`` when ``$CI`` is set (today's example counts),
  else the smaller ``dev``.
* Background jobs (``tests/background.py``): long, self-contained parts of tests marked
  ``@pytest.mark.background(KEY)`` start one at a time once collection ends, on the core that the mostly
  single-threaded tests leave idle.
* The ranks of ``processes.run_workers`` run in a session-wide pool of worker processes
  (``tests/processes.py``), forks of a fork server that has imported torch, started when collection
  ends if a selected test's module uses the pool (when the suite runs as a whole, before collection).
* Once collected, the objects the imports and the collection made are frozen (``gc.freeze``): the full
  collections of the tests' garbage skip them.
* Tests marked ``@pytest.mark.root`` build emulated networks: skipped, saying what is missing, where this
  process cannot (``emulated_network.netns_missing``).
* The ``one_rank`` fixture: a one-rank gloo group in the test's process.
* The ``run_cli`` fixture: ``lioncub ARGV`` in-process with launching refused (``tests/cli_stub.py``).

The map of the suite: tests/README.md. The quick local loop: ``./run test -m "not slow"``; everything:
``./run test``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

import background
from cli_stub import cli_runner
from emulated_network import netns_missing
from profiles import selected_profile

import processes

settings.load_profile(selected_profile())


def pytest_report_header() -> str:
    return f"hypothesis profile: {selected_profile()} (ci when $CI is set, else dev: tests/profiles.py)"


#: modules whose jobs are queued early (in name order) but whose tests run after every other module's:
#: the readers of the early jobs (``compares``, ``calibrations``, ``node_runs``, ``kernels_interp``), which
#: otherwise reach them before they end and wait (~55 s in all, once the fork server started before the
#: collection)
READ_LATE = ("test_cli_output.py", "test_costmodel_nodes.py", "test_fsdp_cli.py", "test_launches.py")
#: modules whose tests wait on the longest background jobs (the frameworks' 2-rank jobs, the Triton
#: interpreter, gpu_check): they run after those, so that their jobs have the rest of the suite to finish in
RUN_LAST = ("test_framework_guards.py", "test_integrations.py", "test_kernels.py")
#: modules whose tests run after those, while their job keeps its place in the queue: the fault-tolerant
#: end-to-end runs (~75 s, started in the middle of the suite), read at the end instead of waited for
READ_LAST = ("test_replica_groups_cli.py",)


def _order(name: str) -> int:
    return 3 if name in READ_LAST else 2 if name in RUN_LAST else int(name in READ_LATE)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: _order(item.path.name))  # stable: each module's order is kept
    for item in items:
        if item.get_closest_marker("root") is not None and (missing := netns_missing()) is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs network namespaces: {missing}"))


def pytest_configure(config: pytest.Config) -> None:
    # one intra-op thread in the pytest process: the background jobs hold the other core, and two threads
    # of a test that share a core with a job's ranks wait on each other (the tests that measure threads set
    # their own count and put it back)
    import torch

    torch.set_num_threads(1)
    # the suite run as a whole (no paths given: ./run test) uses the worker pool: its fork server imports
    # torch on the core that the collection leaves idle, instead of after it (the first test of the pool
    # waited ~3 s for it); a run given paths starts it once the collection found a test that needs it
    if config.args_source is pytest.Config.ArgsSource.TESTPATHS and not config.option.collectonly:
        processes.start_fork_server()


def pytest_collection_finish(session: pytest.Session) -> None:
    # what the imports and the collection made stays: the full collections of the tests' garbage skip
    # it (torch's objects alone take a large part of a second per full collection)
    gc.collect()
    gc.freeze()
    if not session.config.option.collectonly:
        if any(getattr(getattr(item, "module", None), "run_workers", None) for item in session.items):
            processes.start_fork_server()  # the worker pool's processes fork from it
        # the jobs queued in the order of their tests, but a READ_LATE or READ_LAST module's where collection
        # put it (the modules in name order, each one's tests in theirs)
        queued = sorted(session.items, key=lambda item: (item.path.name in RUN_LAST, item.path.name))
        background.start_for(queued)


def pytest_runtest_logfinish() -> None:
    background.pump()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """With ``-v`` (or ``--durations``): when each background job ran and how long tests waited for it."""
    config = terminalreporter.config
    if (config.option.verbose > 0 or config.option.durations is not None) and (lines := background.timings()):
        terminalreporter.write_sep("=", "background jobs (tests/background.py)")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_unconfigure() -> None:  # after the terminal summary, which reports the jobs
    background.stop_all()


@pytest.fixture
def run_cli(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[[list[str]], tuple[int, str]]:
    """``lioncub ARGV`` in-process: (exit code, stderr); -1 if the command reached the launcher (nothing is
    launched)."""
    return cli_runner(capsys, monkeypatch)


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo group in this process (the default group), destroyed after the test."""
    import datetime

    import torch.distributed as dist

    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()
