"""The wheel as users install it (issue 48, item 1): built from the clone's sources, installed into a fresh
venv, run from outside the clone (``wheel_runs.py``, one background job of ~10 CPU-s: the build, the
install, ``lioncub --version``, then in one interpreter two ``lioncub train`` runs of 2 ranks and a probe of
the installed package); and the commands it
ships for its data and version (``lioncub data fetch|list``, ``lioncub --version``), in this process."""

from __future__ import annotations

import gzip
import json
from email.parser import Parser
from pathlib import Path

import pytest

import background
import wheel_runs
from lioncub.train.fetch import source_checkout

from processes import python_cmd

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "src" / "lioncub" / "train" / "data_files"


def _wheel_runs() -> background.Subprocess:
    return background.Subprocess(lambda workdir: python_cmd(wheel_runs.__file__, str(workdir)), 300)


BACKGROUND = {"wheel": _wheel_runs}


@pytest.fixture(scope="module")
def results() -> dict:
    """``wheel_runs.py``'s ``results.json`` (its job's output when it wrote none)."""
    done = background.result("wheel", BACKGROUND["wheel"])
    path = background.workdir("wheel") / "results.json"
    assert path.exists(), f"exit {done.returncode}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    return json.loads(path.read_text())


def _ok(results: dict, key: str) -> dict:
    """The step ``key`` of the job, asserted to have run and exited 0 (else its output)."""
    assert results["install"]["rc"] == 0, results["install"]
    assert key in results, results.get("driver")  # the driver (wheel_runs.DRIVER) ended before it
    assert results[key]["rc"] == 0, f"{results[key]['cmd']}:\n{results[key]['out']}\n{results[key]['err']}"
    return results[key]


def _source_version() -> str:
    """``lioncub.__version__`` as written in the clone (what pyproject's dynamic version reads)."""
    import lioncub

    return lioncub.__version__


@pytest.mark.slow
@pytest.mark.background("wheel")
def test_wheel_ships_data_types_and_license(results: dict) -> None:
    files = set(results["wheel"]["files"])
    shipped = ("README.md", "austen_slice.txt.gz", "digits.csv.gz")
    assert sorted(p.name for p in DATA.iterdir()) == list(shipped)  # all of the folder, nothing else
    assert {f"lioncub/train/data_files/{name}" for name in shipped} <= files and "lioncub/py.typed" in files
    dist_info = f"lioncub-{_source_version()}.dist-info"
    assert f"{dist_info}/licenses/LICENSE" in files
    meta = Parser().parsestr(results["wheel"]["metadata"])
    assert meta["Version"] == _source_version() and meta["License-Expression"] == "MIT"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc") or f.startswith("tests/")]


@pytest.mark.slow
@pytest.mark.background("wheel")
def test_installed_package_is_the_wheel_not_the_clone(results: dict) -> None:
    venv = background.workdir("wheel") / "venv"
    assert source_checkout() == REPO  # the probe's answer below is not what it is in a clone
    probe = json.loads(_ok(results, "probe")["out"])
    assert Path(probe["file"]).is_relative_to(venv) and not Path(probe["file"]).is_relative_to(REPO)
    assert probe["source_checkout"] is None and not Path(probe["data_root"]).is_relative_to(REPO)
    for path, name in zip(probe["package_files"], ("austen_slice.txt.gz", "digits.csv.gz"), strict=True):
        assert Path(path).is_relative_to(venv) and Path(path).read_bytes() == (DATA / name).read_bytes()
    assert "LionCub" in probe["dir"] and "Lion" in probe["dir"]
    assert probe["version"] == probe["metadata_version"] == probe["source_version"] == _source_version()
    assert _ok(results, "version")["out"] == f"lioncub {_source_version()}\n"


@pytest.mark.slow
@pytest.mark.background("wheel")
@pytest.mark.parametrize("workload", sorted(wheel_runs.RUNS))
def test_installed_wheel_trains_outside_the_clone(results: dict, workload: str) -> None:
    """``lioncub train --size tiny`` of the installed wheel: 4 steps on 2 ranks, on the data it ships (its
    sizes those of the clone's files, read here with the standard library)."""
    _ok(results, workload)
    out = background.workdir("wheel") / "outside" / f"r-{workload}"
    assert not out.is_relative_to(REPO)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_run"] == 4 and summary["world_size"] == 2 and summary["skipped_steps"] == 0
    info = summary["info"]
    if workload == "gpt":
        text = gzip.decompress((DATA / "austen_slice.txt.gz").read_bytes()).decode()
        assert info["train_tokens"] + info["val_tokens"] == len(text)
        assert info["vocab_size"] == len(set(text))
    else:
        rows = gzip.decompress((DATA / "digits.csv.gz").read_bytes()).decode().split()
        assert info["train_images"] + info["val_images"] == len(rows)
    assert summary["final"]["step"] == 4 and summary["final"]["val_loss"] > 0


# ---- the commands the wheel ships, in this process ---------------------------------------------------------

#: the titles of Jane Austen's six novels in publication order (1811-1817; the last two published together),
#: as janeaustenr writes them
NOVELS = ["SENSE AND SENSIBILITY", "PRIDE AND PREJUDICE", "MANSFIELD PARK", "EMMA", "NORTHANGER ABBEY"]
NOVELS += ["Persuasion"]


def test_version_is_the_distribution_s(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    from lioncub import cli

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"lioncub {version('lioncub')}\n"


def test_data_fetch_prepares_from_the_downloaded_packages(tmp_path: Path) -> None:
    """``fetch`` on a data root that holds the janeaustenr package (as a first fetch leaves it) and every
    other data set: only austen.txt is made (dpkg -x, the R data read), nothing is downloaded (pip and
    apt-get would fail: a pip that is ``false``, no apt-get on the path)."""
    import shutil

    from lioncub.train import fetch

    debs = sorted((fetch.data_root() / "deb").glob("r-cran-janeaustenr_*.deb"))
    if not debs or shutil.which("dpkg") is None:
        pytest.skip(f"needs dpkg and the janeaustenr package in {fetch.data_root()}/deb (lioncub data fetch)")
    (tmp_path / "deb").mkdir()
    shutil.copy(debs[0], tmp_path / "deb")
    for name, files in fetch.PREPARED.items():
        for file in files if name != "austen" else ():
            (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / file).write_text("prepared before")
    assert fetch.prepared(tmp_path) == {name: name != "austen" for name in fetch.PREPARED}
    lines: list[str] = []
    fetch.fetch(tmp_path, pip=["false"], log=lines.append)
    assert [line for line in lines if line.startswith("have ")] == [
        f"have {debs[0].name}",
        "have fashion-mnist",
        "have shakespeare",
        "have gpt2",
    ]
    text = (tmp_path / "austen.txt").read_text(encoding="utf-8")
    starts = [text.index(title) for title in NOVELS]
    assert starts == sorted(starts) and starts[0] == 0 and len(set(starts)) == 6
    assert fetch.prepared(tmp_path) == dict.fromkeys(fetch.PREPARED, True)


def test_data_fetch_without_apt_names_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_cli, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))
    code, err = run_cli(["data", "fetch", str(tmp_path / "root")])
    assert code == 1 and "apt-get not found" in err and "LIONCUB_DATA" in err
    from lioncub import cli

    assert cli.main(["data", "list", str(tmp_path / "root")]) == 0
    listed = capsys.readouterr().out
    assert f"data root: {tmp_path / 'root'}" in listed
    assert [line.split()[:2] for line in listed.splitlines()[1:5]] == [
        [name, "missing"] for name in ("austen", "fashion-mnist", "shakespeare", "gpt2")
    ]
