"""The README's Python examples run as written: every ```python block, in order and in one namespace (as a
reader follows them), on 2 gloo ranks started by ``lioncub launch``. The only names the test supplies are
the reader's own: ``build_model()`` and ``my_shard_of_the_data``."""

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


#: what the ranks' interpreter imported before it forked them: torch and lioncub (``lioncub launch
#: --preload``; two fresh interpreters each importing torch cost ~3 CPU-s more, and the examples do not
#: depend on a fresh start: the blocks import what they use, the test checks that below)
PRELOAD = "torch,torch._dynamo,torch.distributed,torch.nn.parallel,lioncub"


def _launch_the_examples(rank: int, world: int, workdir: Path) -> None:
    """Writes the examples' module ``readme_examples`` into ``workdir`` and runs ``lioncub launch --nproc 2
    --preload ... -- -m readme_examples`` there, what it prints in ``workdir/output``; exits with its exit
    status. The launcher is ``lioncub.cli.main`` in this process, a fork of the worker pool's fork server
    (``background.Spawned``: torch imported, where an interpreter of its own imported it again)."""
    from lioncub.cli import main

    blocks = python_blocks()
    script = workdir / "readme_examples.py"
    body = "\n".join(
        f"# --- README block {i}\n{block}\nprint('README block {i} ran', flush=True)\n"
        for i, block in enumerate(blocks)
    )
    script.write_text(PRELUDE + "\n" + body + "\ntorch.distributed.destroy_process_group()\n")
    os.chdir(workdir)  # the ranks' directory: -m readme_examples finds it there
    launch = ["launch", "--nproc", "2", "--timeout", "120", "--preload", PRELOAD]
    with open(workdir / "output", "w") as output, redirect_stdout(output), redirect_stderr(output):
        code = main([*launch, "--", "-m", "readme_examples"])
    sys.exit(code)


#: the launch on 1 process forked from the worker pool's fork server, started in the background when
#: collection ends (tests/background.py)
BACKGROUND = {"readme_examples": lambda: background.Spawned(_launch_the_examples, 1, timeout=180)}


@pytest.mark.slow
@pytest.mark.background("readme_examples")
def test_readme_examples_run_as_written() -> None:
    blocks = python_blocks()
    exits = background.result("readme_examples", BACKGROUND["readme_examples"])
    printed = (background.workdir("readme_examples") / "output").read_text(errors="replace")
    assert exits == [0], printed[-6000:]
    for i in range(len(blocks)):
        assert printed.count(f"README block {i} ran") == 2, printed  # on both ranks


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
