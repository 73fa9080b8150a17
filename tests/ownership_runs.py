"""The launched runs of tests/test_run_ownership.py and tests/test_rundir.py, one after the other in ONE
interpreter (one zygote for every launch's ranks): tests/compare_runs.py's, after its first comparison (the
background job ``compares``, started when collection ends: tests/background.py), or alone:

    python tests/ownership_runs.py OUT

1. ``OUT/finished``: the ranks of ``lioncub launch --nproc 2 --preload ... -- -m lioncub.cli train``
   (:data:`FINISHED`, no driver) prepare a run of the tiny GPT: 3 steps, checkpoints at 2 and 3;
2. ``OUT/again/run``: a copy of it, with the user's ``OUT/again/outside/thesis.tex``; the same launch again
   (which must be refused, writing nothing);
3. ``OUT/resumed/run``: another copy, with the user's files ``checkpoints/exported_best.pt`` and
   ``checkpoints/step_00000002/notes.txt`` and ``OUT/resumed/outside/thesis.tex``; the same launch with
   ``--resume --steps 5``.

Each launch's exit code and output (stdout and stderr together) are in ``OUT/launches.json``.

Then, in ``OUT/rundir``, tests/test_rundir.py's two runs (:data:`RUNDIR_RUNS`, ``lioncub train``):
``part``, a 1-rank run stopped at step 2 of 4; ``x``, a 2-rank run whose rank 1 SIGKILLs itself after the
backward of step 2 (tests/kill_rank.py); each run's exit status and stderr in ``OUT/rundir/runs.json``.

Last, the launches of ``python -c CODE`` ranks of other modules, forked from the same zygote
(:data:`PRELOAD`, the same environment and directory): in ``OUT/forked``, tests/test_launch.py's
(:func:`forked_launches`; ``NAME.pickle`` holds launch ``NAME``'s (result, stdout, stderr), or
``NAME.error`` the traceback of the launcher's exception); in ``OUT/draws``, tests/test_preload.py's
(:func:`draw_runs`; ``OUT/draws.error`` the traceback if they raised). The exit status is 0 once the first
five have run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import sys
import textwrap
import traceback
from pathlib import Path

from lioncub.launch import LaunchConfig, launch
from lioncub.launch.preload import MODULES

import processes
from processes import PY

RUN = ["--workload", "gpt", "--size", "tiny", "--set", "batch_size=4", "--eval-every", "0", "--no-progress"]
FINISHED = [*RUN, "--steps", "3", "--checkpoint-every", "1", "--diagnostics-every", "1"]
#: the bytes of every file of the user's that the runs must leave alone
THESIS = b"irreplaceable\n"
#: what the zygote of every launch here imports: ``lioncub train``'s modules (lioncub.train.driver), which
#: tests/compare_runs.py's comparisons before these launches forked their ranks from
PRELOAD = (*MODULES, "lioncub.train.loop")


def launch_argv(out: Path, *extra: str) -> list[str]:
    """``lioncub launch --nproc 2 --preload ... -- -m lioncub.cli train FINISHED --out OUT EXTRA``: the
    ranks (forks of one interpreter that imported torch and the training loop once) run ``lioncub train``."""
    return ["launch", "--nproc", "2", "--preload", ",".join(PRELOAD), "--", "-m", "lioncub.cli", "train",
            *FINISHED, "--out", str(out), *extra]  # fmt: skip


def _launch(argv: list[str]) -> dict[str, object]:
    """``lioncub ARGV`` in this process, its file descriptors 1 and 2 (the launcher's and the ranks'
    output) on one temporary file: its exit code and that output."""
    from lioncub import cli

    return processes.output_captured(lambda: cli.main(argv))


def _copy_with_user_files(finished: Path, root: Path) -> Path:
    run = root / "run"
    shutil.copytree(finished, run, symlinks=True)
    (root / "outside").mkdir()
    (root / "outside" / "thesis.tex").write_bytes(THESIS)
    return run


#: tests/test_rundir.py's runs: ``(name, argv, kill_rank spec)``
RUNDIR_RUNS = [
    ("part", ["train", "--nproc", "1", "--steps", "4", "--stop-at", "2", "--eval-every", "0", "--set",
              "batch_size=4", "--no-progress"], None),
    ("x", ["train", "--nproc", "2", "--steps", "3", "--no-progress"], "1:2"),
]  # fmt: skip


def rundir_runs(out: Path) -> None:
    """:data:`RUNDIR_RUNS` into ``out`` (``lioncub.cli.main`` in this process): ``out/runs.json`` holds each
    run's exit status and stderr."""
    import kill_rank
    from lioncub import cli

    done = {}
    for name, argv, spec in RUNDIR_RUNS:
        err = io.StringIO()
        killing = kill_rank.launches(spec) if spec else contextlib.nullcontext()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), killing:
            code = cli.main([*argv, "--out", str(out / name)])
        done[name] = {"returncode": code, "stderr": err.getvalue()}
    (out / "runs.json").write_text(json.dumps(done))


# ---------------------------------------------------- other modules' launches of ranks forked from a zygote

#: tests/test_launch.py's launches: 3 ranks on loopback
ALLREDUCE = """
import datetime, os, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print(f"sum={t.item():g} ifname={os.environ['GLOO_SOCKET_IFNAME']} world={dist.get_world_size()}")
print(f"threads={torch.get_num_threads()}")  # the launcher's OMP_NUM_THREADS=1, in a forked rank too
print("no newline at the end", end="")
dist.destroy_process_group()
"""


#: rank 0 also prints every socket listening on the rendezvous port, as (local address, port) in hex
ALLREDUCE_AND_LISTENERS = ALLREDUCE.replace(
    "t = torch.tensor(",
    """port = int(os.environ["MASTER_PORT"])
if dist.get_rank() == 0:
    paths = ("/proc/net/tcp", "/proc/net/tcp6")
    rows = [line.split() for path in paths for line in open(path).readlines()[1:]]
    print("listen", sorted({r[1] for r in rows if r[3] == "0A" and int(r[1].split(":")[1], 16) == port}))
t = torch.tensor(""",
    1,
)


#: tests/test_launch.py's 100 Mbit/s allreduces
TIMED_ALLREDUCE = """
import datetime, time, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
x = torch.ones(1_000_000)  # 4 MB of fp32
times = []
for _ in range(4):  # one warm-up, then 3 timed
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(x)
    times.append(time.perf_counter() - t0)
t = torch.tensor(times[1:], dtype=torch.float64)
dist.all_reduce(t, op=dist.ReduceOp.MAX)
if dist.get_rank() == 0:
    ms = [v * 1e3 for v in t.tolist()]
    print(f"ALLREDUCE_MS={min(ms):.1f} all={[round(v) for v in ms]}")  # the least-disturbed run
dist.destroy_process_group()
"""


LINK_RATE = 100e6  # bits/s of the links of test_allreduce_over_100mbit_links_matches_bandwidth


#: tests/test_launch.py's 1-bit steps behind 1 Gbit/s links
ONE_BIT_STEPS = """
import datetime, torch, torch.distributed as dist
from lioncub import Checks, LionCub
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
torch.manual_seed(0)
p = torch.nn.Parameter(torch.randn(4_000_003))  # not a multiple of 8·N: padding travels too
opt = LionCub([p], lr=1e-3, variant="1bit", checks=Checks(broadcast_init=False))  # same seed: no broadcast
g = torch.Generator().manual_seed(dist.get_rank())
for _ in range(4):
    p.grad = torch.randn(p.shape, generator=g)
    opt.step()
total = opt.comm_stats()["total"]
print(f"ACCOUNTED sent={int(total['bytes_sent'])} recv={int(total['bytes_recv'])}")
dist.destroy_process_group()
"""


def forked_launches(preload: tuple[str, ...], links: bool) -> dict[str, LaunchConfig]:
    """Every launch of this module whose ranks are forked from a zygote (``python -c CODE`` ranks, the
    zygote importing ``preload``), by name: :data:`ALLREDUCE_AND_LISTENERS` on 3 ranks on loopback; with
    ``links`` (where network namespaces can be built), also :data:`TIMED_ALLREDUCE` behind
    :data:`LINK_RATE` links on 2, then on 4 ranks, and :data:`ONE_BIT_STEPS` on 3 ranks behind 1 Gbit/s links.
    :func:`forked_runs` runs them in the background job ``compares`` with :data:`PRELOAD`, the modules of
    its ``lioncub train`` launches: their zygote forks these ranks too (one import of torch for all)."""

    def forked(code: str, nproc: int, link: float | None = None) -> LaunchConfig:
        return LaunchConfig([PY, "-c", code], nproc=nproc, link_rate_bps=link, timeout_s=120, preload=preload)

    launches = {"loopback": forked(ALLREDUCE_AND_LISTENERS, 3)}
    if links:
        for n in (2, 4):
            launches[f"links_{n}"] = forked(TIMED_ALLREDUCE, n, LINK_RATE)
        launches["one_bit"] = forked(ONE_BIT_STEPS, 3, 1e9)
    return launches


#: tests/test_preload.py's runs of an unseeded script
DRAWS = textwrap.dedent("""
    import json, os, random, sys
    import numpy, torch
    if sys.argv[1:] == ["seeded"]:
        torch.manual_seed(1), numpy.random.seed(1), random.seed(1)
    print(json.dumps({
        "rank": os.environ["RANK"], "torch": torch.randint(0, 2**62, (4,)).tolist(),
        "numpy": numpy.random.rand(2).tolist(), "random": random.random(), "ppid": os.getppid(),
    }), flush=True)
""")


#: the runs of :data:`DRAWS` (``python -c DRAWS ARGS`` on 2 ranks forked from a zygote that imported torch):
#: twice unseeded (the second from the same zygote), then seeded
DRAW_RUNS: list[tuple[str, ...]] = [(), (), ("seeded",)]


def draw_runs(workdir: Path, modules: tuple[str, ...]) -> None:
    """:data:`DRAW_RUNS`, their ranks forked from a zygote importing ``modules`` (torch among them), by this
    process: :func:`main` runs them in the background job ``compares`` with :data:`PRELOAD`, whose zygote
    (the same modules, environment and directory) forked the ranks of the launches before. Run ``i``'s
    stdout and stderr in ``workdir/out<i>``, ``err<i>``, its exit status and the launcher's pid in
    ``workdir/rc<i>``."""
    assert "torch" in modules
    workdir.mkdir()
    for i, args in enumerate(DRAW_RUNS):
        out, err = io.StringIO(), io.StringIO()
        config = LaunchConfig([PY, "-c", DRAWS, *args], nproc=2, timeout_s=120, preload=modules)
        rc = launch(config, out=out, err=err).returncode
        (workdir / f"out{i}").write_text(out.getvalue())
        (workdir / f"err{i}").write_text(err.getvalue())
        (workdir / f"rc{i}").write_text(f"{rc} {os.getpid()}")


def forked_runs(out: Path) -> None:
    """:func:`forked_launches` (those behind shaped links only where network namespaces can be built) into
    ``out``: ``NAME.pickle`` or ``NAME.error`` each."""
    from emulated_network import netns_usable

    out.mkdir()
    for name, config in forked_launches(PRELOAD, netns_usable()).items():
        printed, errors = io.StringIO(), io.StringIO()
        try:
            result = launch(config, out=printed, err=errors)
        except Exception:
            (out / f"{name}.error").write_text(traceback.format_exc() + errors.getvalue())
            continue
        (out / f"{name}.pickle").write_bytes(pickle.dumps((result, printed.getvalue(), errors.getvalue())))


def main(out: Path) -> int:
    launches = {"finished": _launch(launch_argv(out / "finished"))}
    if launches["finished"]["rc"] == 0:
        again = _copy_with_user_files(out / "finished", out / "again")
        launches["again"] = _launch(launch_argv(again))
        resumed = _copy_with_user_files(out / "finished", out / "resumed")
        (resumed / "checkpoints" / "exported_best.pt").write_bytes(THESIS)
        (resumed / "checkpoints" / "step_00000002" / "notes.txt").write_bytes(THESIS)
        launches["resumed"] = _launch(launch_argv(resumed, "--resume", "--steps", "5"))
    (out / "launches.json").write_text(json.dumps(launches, indent=1))
    (out / "rundir").mkdir()
    rundir_runs(out / "rundir")
    forked_runs(out / "forked")
    try:
        draw_runs(out / "draws", PRELOAD)
    except Exception:
        (out / "draws.error").write_text(traceback.format_exc())
    return 0 if len(launches) == 3 else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
