"""The README's Python examples run as written: every ```python block, in order and in one namespace (as a
reader follows them), on 2 gloo ranks in the environment ``lioncub launch`` gives them. The only names the
test supplies are the reader's own: ``build_model()`` and ``my_shard_of_the_data``."""

from __future__ import annotations

import os
import re
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

import background

README = Path(__file__).resolve().parents[1] / "README.md"

PRELUDE = '''
import os
import torch
from torch import nn


def build_model() -> nn.Module:
    """The reader's model: a token embedding (an "input layer") and a linear head (the "output layer")."""
    torch.manual_seed(int(os.environ["RANK"]))  # different on every rank: LionCub broadcasts rank 0's
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))


_g = torch.Generator().manual_seed(int(os.environ["RANK"]))
my_shard_of_the_data = [
    (torch.randint(0, 16, (4,), generator=_g), torch.randint(0, 16, (4,), generator=_g)) for _ in range(3)
]
'''


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_examples() -> None:
    blocks = python_blocks()
    assert len(blocks) >= 4
    assert any("LionCub(" in b for b in blocks)


def _master_port(rank: int, workdir: Path, timeout_s: float = 60.0) -> int:
    """A free port that rank 0 picks now (as the launcher picks one when it starts the ranks) and writes to
    ``workdir/port``; the other ranks read it from there (waiting up to ``timeout_s``)."""
    import time

    from lioncub.launch.environment import free_port

    path = workdir / "port"
    if rank == 0:
        (workdir / "port.part").write_text(str(free_port()))
        (workdir / "port.part").rename(path)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 wrote no {path} in {timeout_s:.0f} s")
        time.sleep(0.01)
    return int(path.read_text())


def _run_the_examples(rank: int, world: int, workdir: Path) -> None:
    """One of the 2 ranks that run the examples (the blocks in order, in one namespace, after
    :data:`PRELUDE`) in ``workdir``, what it prints in ``workdir/output.r<rank>``; exits with its exit
    status. A fork of the worker pool's fork server (``background.Spawned``: torch imported, not lioncub;
    the blocks import what they use, checked below), in the environment ``lioncub launch --nproc 2`` gives
    a rank (``lioncub.launch.environment.rank_env``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR``/``MASTER_PORT``, ...; rank 0 hosts the store). Not a launch: its zygote imported torch
    and lioncub again for these 2 ranks (~2 CPU-s), and what the blocks do does not depend on how the
    ranks started."""
    import traceback

    import torch

    from lioncub.launch.environment import rank_env

    port = _master_port(rank, workdir)
    env = rank_env(rank, world, master_addr="127.0.0.1", master_port=port, ifname="lo", launch_id="readme")
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # what OMP_NUM_THREADS gives a fresh rank
    os.chdir(workdir)
    body = "\n".join(
        f"# --- README block {i}\n{block}\nprint('README block {i} ran', flush=True)\n"
        for i, block in enumerate(python_blocks())
    )
    code = PRELUDE + "\n" + body + "\ntorch.distributed.destroy_process_group()\n"
    with open(workdir / f"output.r{rank}", "w") as output, redirect_stdout(output), redirect_stderr(output):
        try:
            exec(compile(code, "README.md examples", "exec"), {"__name__": "__main__"})
        except BaseException:
            traceback.print_exc()
            sys.exit(1)


#: the 2 ranks, started in the background when collection ends (tests/background.py)
BACKGROUND = {"readme_examples": lambda: background.Spawned(_run_the_examples, 2, timeout=180)}


@pytest.mark.slow
@pytest.mark.background("readme_examples")
def test_readme_examples_run_as_written() -> None:
    blocks = python_blocks()
    exits = background.result("readme_examples", BACKGROUND["readme_examples"])
    outputs = [background.workdir("readme_examples") / f"output.r{rank}" for rank in (0, 1)]
    printed = [path.read_text(errors="replace") if path.exists() else "" for path in outputs]
    assert exits == [0, 0], "\n".join(f"[r{rank}] {text[-4000:]}" for rank, text in enumerate(printed))
    for text in printed:  # on both ranks, in order
        ran = [line for line in text.splitlines() if line.startswith("README block ")]
        assert ran == [f"README block {i} ran" for i in range(len(blocks))], text


#: the names the README's blocks leave to the reader: their model and data (tests supply them), and what an
#: earlier block or the framework recipe's text made (``model``, ``dataset``, ``loader``)
READER_NAMES = {"build_model", "my_shard_of_the_data", "model", "dataset", "loader"}


def free_names(code: str) -> set[str]:
    """The names ``code`` reads but neither binds, imports nor finds among the builtins."""
    import ast
    import builtins

    tree = ast.parse(code)
    bound = set(dir(builtins))
    read = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound


def test_the_readme_blocks_import_what_they_use() -> None:
    """Every python block (tagged ones too) imports what it uses: the only names it takes from outside are
    the reader's model and data (``READER_NAMES``)."""
    blocks = re.findall(r"```python[^\n]*\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 8
    for block in blocks:
        assert free_names(block) <= READER_NAMES, (free_names(block) - READER_NAMES, block[:200])
    assert free_names("import torch\nx = torch.zeros(1)\nprint(y)\n") == {"y"}
