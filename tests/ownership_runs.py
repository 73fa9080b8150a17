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
(``test_launch.forked_launches``; ``NAME.pickle`` holds launch ``NAME``'s (result, stdout, stderr), or
``NAME.error`` the traceback of the launcher's exception); in ``OUT/draws``, tests/test_preload.py's
(``test_preload.draw_runs``; ``OUT/draws.error`` the traceback if they raised). The exit status is 0 once
the first five have run.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import shutil
import sys
import traceback
from pathlib import Path

from lioncub.launch.preload import MODULES

import processes

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


def forked_runs(out: Path) -> None:
    """tests/test_launch.py's launches (``test_launch.forked_launches``, those behind shaped links only where
    network namespaces can be built) into ``out``: ``NAME.pickle`` or ``NAME.error`` each."""
    import test_launch
    from emulated_network import netns_usable
    from lioncub.launch import launch

    out.mkdir()
    for name, config in test_launch.forked_launches(PRELOAD, netns_usable()).items():
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
    import test_preload

    try:
        test_preload.draw_runs(out / "draws", PRELOAD)
    except Exception:
        (out / "draws.error").write_text(traceback.format_exc())
    return 0 if len(launches) == 3 else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
