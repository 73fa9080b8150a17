"""The wheel as a user installs it, for tests/test_wheel.py, in the background (tests/background.py):

    python tests/wheel_runs.py OUT

1. builds lioncub's wheel from a copy of the clone's ``pyproject.toml``, ``README.md``, ``LICENSE`` and
   ``src/`` (setuptools' PEP 517 hook in this interpreter, as ``pip wheel --no-build-isolation`` calls it:
   offline, and nothing written into the clone) into ``OUT/dist``;
2. makes a fresh venv ``OUT/venv`` that sees this venv's site-packages (torch, numpy, ...) through a
   ``.pth`` line, which adds the folder without running its ``.pth`` files (so not the clone's editable
   install), and installs the wheel there with ``pip install --no-deps --no-index``;
3. from ``OUT/outside`` (not in the clone), with no ``PYTHONPATH``: ``lioncub --version``; then, in ONE
   interpreter of the fresh venv (:data:`DRIVER`), its ``lioncub`` console script run as ``__main__``
   for ``lioncub train`` of the tiny GPT and then of the tiny CNN (2 ranks, 4 steps), and a Python
   program that imports the installed package and says where it and its data are. One interpreter: the
   launcher imports torch once and the CNN's ranks fork from the zygote the GPT's started (two fresh
   ``lioncub train`` processes and a fresh probe cost ~6 CPU-s more; what each run and the probe answer
   does not depend on a fresh start: the console script, the package and its data are the venv's).

``OUT/results.json``: per step its command, exit status and the tails of its output; the wheel's file names
and METADATA; the program's answer. The exit status is the number of steps that failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: what the installed package answers (run with the fresh venv's interpreter, from outside the clone)
PROBE = """
import importlib.metadata, json, lioncub
from lioncub.cli import version
from lioncub.train import data, fetch
print(json.dumps({
    "dir": dir(lioncub), "file": lioncub.__file__, "version": version(),
    "metadata_version": importlib.metadata.version("lioncub"), "source_version": lioncub.__version__,
    "package_files": [str(data.package_file(n)) for n in ("austen_slice.txt.gz", "digits.csv.gz")],
    "source_checkout": None if fetch.source_checkout() is None else str(fetch.source_checkout()),
    "data_root": str(fetch.data_root()),
}))
"""
#: ``python -c DRIVER SCRIPT STEPS RESULTS``: each of the JSON ``{key: argv}`` STEPS in this interpreter, in
#: order: SCRIPT (the venv's ``lioncub`` console script) run as ``__main__`` with ``argv``, or with ``argv``
#: ``["-c", CODE]`` the program CODE; its exit status and the tails of what it printed, ``{key: {rc, out,
#: err}}``, written as JSON to the file RESULTS
DRIVER = """
import contextlib, io, json, runpy, sys, traceback
script, steps, path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
results = {}
for key, argv in steps.items():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if argv[0] == "-c":
                exec(compile(argv[1], "<probe>", "exec"), {"__name__": "__main__"})
            else:
                sys.argv = [script, *argv]
                runpy.run_path(script, run_name="__main__")
            rc = 0
        except SystemExit as done:
            rc = done.code if isinstance(done.code, int) else int(done.code is not None)
        except BaseException:
            traceback.print_exc()
            rc = 1
    results[key] = {"rc": rc, "out": out.getvalue()[-3000:], "err": err.getvalue()[-3000:]}
with open(path, "w") as f:
    json.dump(results, f)
"""
#: the runs of issue 48's "done when", on the shipped data
TRAIN = ["train", "--size", "tiny", "--variant", "1bit", "--nproc", "2", "--steps", "4"]
#: each into ``OUT/outside/r-<workload>``
RUNS = {name: [*TRAIN, "--workload", name, "--out", f"r-{name}"] for name in ("gpt", "cnn")}


def build(out: Path) -> Path:
    """The wheel of a copy of the clone's sources, built in this process (setuptools.build_meta)."""
    tree = out / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, tree / name)
    shutil.copytree(REPO / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    cwd = Path.cwd()
    os.chdir(tree)
    try:
        from setuptools import build_meta

        with (
            open(out / "build.log", "w") as log,
            contextlib.redirect_stdout(log),
            contextlib.redirect_stderr(log),
        ):
            name = build_meta.build_wheel(str(out / "dist"))
    finally:
        os.chdir(cwd)
    return out / "dist" / name


def step(results: dict, key: str, cmd: list[str], cwd: Path | None = None, env: dict | None = None) -> None:
    """Run ``cmd`` to its end; record its exit status and the tails of its output under ``key``."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False, cwd=cwd, env=env)
    results[key] = {"cmd": cmd, "rc": done.returncode, "out": done.stdout[-3000:], "err": done.stderr[-3000:]}


def main(out: Path) -> int:
    results: dict = {}
    (out / "dist").mkdir()
    wheel = build(out)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        results["wheel"] = {"name": wheel.name, "files": names, "metadata": z.read(meta).decode()}
    env_dir = out / "venv"
    venv.create(env_dir, with_pip=False, symlinks=True)
    bin_dir = env_dir / "bin"
    purelib = subprocess.run(
        [str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # this venv's packages (torch, numpy, pip, ...) after the fresh venv's own: a plain path line, whose
    # folder's .pth files (the clone's editable install) are not run
    Path(purelib, "dev-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = [str(bin_dir / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    # --ignore-installed: the clone's editable lioncub (in the folder the .pth line adds) is neither
    # taken for this one nor uninstalled
    step(results, "install", [*install, "--ignore-installed", "--disable-pip-version-check", str(wheel)])
    outside = out / "outside"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "LIONCUB_DATA")}
    env |= {"PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", "VIRTUAL_ENV": str(env_dir)}
    if results["install"]["rc"] == 0:  # else the test shows why the install failed
        step(results, "version", [str(bin_dir / "lioncub"), "--version"], cwd=outside, env=env)
        steps = {**RUNS, "probe": ["-c", PROBE]}
        done = out / "driver.json"
        cmd = [str(bin_dir / "python"), "-c", DRIVER, str(bin_dir / "lioncub"), json.dumps(steps), str(done)]
        step(results, "driver", cmd, cwd=outside, env=env)
        if done.exists():  # else the driver's own step shows why
            for key, got in json.loads(done.read_text()).items():
                results[key] = {"cmd": ["lioncub", *steps[key]] if key in RUNS else cmd[:2], **got}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return sum(r["rc"] != 0 for r in results.values() if isinstance(r, dict) and "rc" in r)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
