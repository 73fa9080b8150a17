"""Docs that run as written (issue 48, item 3): every fenced code block of README.md and docs/*.md is either
run by a test or marked as an excerpt, and the API reference builds with warnings as errors.

How each block is covered (``coverage`` below says which for a block; a block that is none of these fails
``test_every_code_block_is_run_or_marked_as_an_excerpt`` naming its file and line):

* ``<!-- excerpt -->`` (or ``<!-- excerpt: why -->``) on the line before the fence: an excerpt, not meant
  to run as it stands (a fragment, a layout, a template with placeholders, a run that needs other machines).
* README.md's ``python`` blocks: tests/test_readme.py runs the untagged ones on 2 gloo ranks, in order;
  tests/test_integrations.py (tests/framework_jobs.py) the ``python hf|accelerate|lightning`` ones.
* docs/*.md's ``python`` blocks: run here, in one process, with the reader's ``build_model()`` and
  ``model`` given (:data:`READER`) — or, for the ones listed in :data:`RUN_ELSEWHERE`, by the test named
  there (which must name the page).
* ``bash`` blocks: NOT run (they train for minutes, need root, or other machines). Each command's flags are
  parsed instead, by the parser that would read them: ``lioncub ...`` by ``lioncub.cli.build_parser()``
  (with ``sudo env PATH="$PATH"`` and ``lioncub launch -- CMD`` followed into CMD), ``torchrun`` by torch's
  own ``torch.distributed.run`` parser, ``examples/*.py`` by the example's ``arguments()``,
  ``benchmarks/*.py`` by the ``add_argument`` calls of the script's parser (read from its source),
  ``./run X`` against the run script's commands, ``pip install .[EXTRAS]`` against pyproject's extras. A
  parse catches a misspelt or removed option, a missing value, a wrong type or choice — not what the
  command would do once it ran (a refusal at validation, a missing file). That is what it checks, no more.

The examples' docstring sequences (``examples/*.py``) are checked the same way here, plus their order (the
second command writes into its own ``--out``, the third resumes the first's with its variant); they are run
in order, shrunk, in tests/framework_jobs.py.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from processes import python

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (tomli is pinned for it)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("docs/api/*.md"))]
EXCERPT = re.compile(r"^<!-- excerpt(?:: .*)? -->$")
FENCE = re.compile(r"^```(\S*)(?: (\S+))?\s*$")

#: docs python blocks another test runs as written: (page, the ## section it is under) -> that test file
RUN_ELSEWHERE = {
    ("docs/shards.md", "## A recipe for your own loop"): "tests/test_shards.py",
    ("docs/shards.md", "## Checkpoints"): "tests/test_shard_checkpoints.py",
}
#: pages whose python blocks are all excerpts, marked here until the page marks each block (the same meaning
#: as ``<!-- excerpt -->`` before the fence): page -> why they cannot run as they stand
PYTHON_EXCERPT_PAGES = {
    "docs/fault-tolerance.md": "a lighthouse, replica groups and the reader's schedule and data",
}

READER = '''
import torch
from torch import nn


def build_model() -> nn.Module:
    """The reader's model: a token embedding (an "input layer") and a linear head (the "output layer")."""
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))


model = build_model()
'''


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    tag: str | None
    code: str
    section: str  # the ## heading above it ("" before the first)
    excerpt: bool


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page (fences at the start of a line)."""
    lines = path.read_text().splitlines()
    found, section, i = [], "", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line.strip()
        m = FENCE.match(line)
        if m is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{path.name}:{i + 1}: a fence that never closes"
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
        code = "\n".join(lines[i + 1 : end]) + "\n"
        found.append(Block(rel, i + 1, m.group(1), m.group(2), code, section, bool(EXCERPT.match(before))))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page)]


# -- what each kind of block is checked by ------------------------------------------------------------


def coverage(block: Block) -> str | None:
    """How ``block`` is run or checked (a phrase), None where it is neither run nor marked."""
    if block.excerpt or (block.lang == "python" and block.page in PYTHON_EXCERPT_PAGES):
        return "an excerpt"
    if block.lang == "bash":
        return "flags parsed (test_bash_commands_parse)"
    if block.lang != "python":
        return None
    if block.page == "README.md":
        return "tests/framework_jobs.py" if block.tag else "tests/test_readme.py"
    elsewhere = RUN_ELSEWHERE.get((block.page, block.section))
    if elsewhere is not None:
        return elsewhere
    return "run here (test_docs_python_blocks_run)"


def test_every_code_block_is_run_or_marked_as_an_excerpt() -> None:
    found = all_blocks()
    assert len(found) > 20 and any(b.page.startswith("docs/") for b in found)
    bare = [f"{b.page}:{b.line} ```{b.lang}" for b in found if coverage(b) is None]
    assert bare == [], "neither run nor marked <!-- excerpt --> on the line before the fence"
    # the registries name blocks and tests that exist
    for (page, section), test in RUN_ELSEWHERE.items():
        assert any(b.page == page and b.section == section and b.lang == "python" for b in found), page
        assert page in (ROOT / test).read_text(), f"{test} does not name {page}"
    for page in PYTHON_EXCERPT_PAGES:
        assert any(b.page == page and b.lang == "python" for b in found), page


def test_the_markers_are_read(tmp_path: Path) -> None:
    """A marker right before a fence makes the block an excerpt; a block without one stays unmarked."""
    text = "# t\n\n<!-- excerpt: a layout -->\n```\nsrc/\n```\n\nprose\n\n```\nsrc/\n```\n"
    page = tmp_path / "marker_probe.md"
    page.write_text(text)
    marked, bare = blocks(page)
    assert (marked.excerpt, bare.excerpt) == (True, False)
    assert coverage(marked) == "an excerpt" and coverage(bare) is None


def test_docs_python_blocks_run() -> None:
    """docs/*.md's python blocks not run elsewhere, each as written in one process (no process group: LionCub
    is then Lion), given only the reader's ``build_model()`` and ``model`` (imports are the block's own)."""
    ran = 0
    for block in all_blocks():
        if block.lang != "python" or block.page == "README.md" or not coverage(block).startswith("run here"):
            continue
        reader: dict[str, Any] = {}
        exec(compile(READER, "<reader>", "exec"), reader)
        # only the reader's two names: a block that uses torch (or anything else) imports it itself
        namespace = {"__name__": "docs_block", "build_model": reader["build_model"], "model": reader["model"]}
        exec(compile(block.code, f"{block.page}:{block.line}", "exec"), namespace)
        ran += 1
    assert ran >= 1


# -- bash: each command's flags through the parser that reads them ------------------------------------


def _lioncub(argv: list[str]) -> None:
    from lioncub.cli import build_parser

    args = build_parser().parse_args(argv)
    if args.command == "launch" and args.cmd:
        inner = args.cmd[1:] if args.cmd[0] == "--" else args.cmd
        _program(inner)


def _program(words: list[str]) -> None:
    """A program as ``lioncub launch --`` or torchrun runs it: ``[python] SCRIPT ARGS`` or ``-m MODULE``."""
    if words[0] in ("python", "python3"):
        words = words[1:]
    if words[0] == "-m":
        assert words[1] == "lioncub.cli", f"a module no parser here knows: {words[1]}"
        return _lioncub(words[2:])
    script, args = words[0], words[1:]
    if script == "train.py":  # the reader's own script: its flags are theirs
        assert args == [], f"train.py is the reader's script: no flags of its own here ({args})"
        return None
    _script_parser(script).parse_args(args)
    return None


def _example_parser(path: Path) -> argparse.ArgumentParser:
    """``examples/X.py``'s ``arguments()``, run alone (it imports argparse only)."""
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "arguments")
    namespace: dict[str, Any] = {"argparse": argparse, "__doc__": ast.get_docstring(tree)}
    exec(compile(ast.Module([fn], []), str(path), "exec"), namespace)
    parser: argparse.ArgumentParser = namespace["arguments"]()
    return parser


def _benchmark_parser(path: Path) -> argparse.ArgumentParser:
    """The parser a ``benchmarks/`` script builds, from its source: the module's constants it can evaluate,
    then the ``NAME = argparse.ArgumentParser(...)`` and ``NAME.add_argument(...)`` statements of the function
    that builds it."""
    tree = ast.parse(path.read_text())
    namespace: dict[str, Any] = {"argparse": argparse, "__doc__": ast.get_docstring(tree) or ""}
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            with contextlib.suppress(Exception):
                exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        made = [
            s
            for s in fn.body
            if isinstance(s, ast.Assign) and "argparse.ArgumentParser(" in ast.unparse(s.value)
        ]
        if not made:
            continue
        name = ast.unparse(made[0].targets[0])
        adds = [s for s in fn.body if isinstance(s, ast.Expr) and ast.unparse(s).startswith(f"{name}.add_")]
        exec(compile(ast.Module([made[0], *adds], []), str(path), "exec"), namespace)
        parser: argparse.ArgumentParser = namespace[name]
        return parser
    raise AssertionError(f"{path}: no argparse.ArgumentParser built in a function")


def _script_parser(script: str) -> argparse.ArgumentParser:
    path = ROOT / script
    assert path.is_file(), f"{script}: no such file in the repository"
    if path.parent.name == "examples":
        return _example_parser(path)
    assert path.parent.name == "benchmarks", f"{script}: a script no parser here knows"
    return _benchmark_parser(path)


def _torchrun(argv: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(argv)
    program = (["-m"] if args.module else []) + [args.training_script, *args.training_script_args]
    _program(program)


def _run_commands() -> set[str]:
    return set(re.findall(r"^  ([a-z][a-z-]*)\)$", (ROOT / "run").read_text(), re.M))


#: pip's options that take a value (the others used in the docs are flags)
PIP_VALUES = {"--index-url", "--extra-index-url", "-c", "-r", "-w", "--wheel-dir"}


def _pip(argv: list[str]) -> None:
    """``pip install|wheel``: lioncub as ``.`` or a built wheel, with extras pyproject has; other packages
    by name (and version)."""
    assert argv[0] in ("install", "wheel"), argv
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    words = iter(argv[1:])
    for word in words:
        if word in PIP_VALUES:
            next(words)
            continue
        if word.startswith("-"):
            continue
        m = re.fullmatch(r"(\.|lioncub|dist/lioncub-[\w.]+-py3-none-any\.whl)(?:\[([\w,-]+)\])?", word)
        if m is None:  # another package, by its name (and version)
            assert re.fullmatch(r"[A-Za-z0-9_.-]+(==[\w.+]+)?", word), f"pip install {word}: not a plain name"
            continue
        assert m.group(1) != "lioncub", f"pip install {word}: lioncub is not on a package index (install '.')"
        asked = set((m.group(2) or "").split(",")) - {""}
        assert asked <= extras, f"pip install {word}: no extra {sorted(asked - extras)} ({sorted(extras)})"


COMMANDS: dict[str, Callable[[list[str]], None]] = {
    "lioncub": _lioncub,
    ".venv/bin/lioncub": _lioncub,
    "torchrun": _torchrun,
    "pip": _pip,
    ".venv/bin/pip": _pip,
}


def commands(code: str) -> list[list[str]]:
    """The block's commands as argv lists: continued lines joined, comments dropped, ``NAME="..."`` lines
    remembered and ``$NAME`` expanded where a command starts with it."""
    variables: dict[str, str] = {}
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if len(words) == 1 and re.fullmatch(r"[A-Z_]+=.*", words[0]):
            name, value = words[0].split("=", 1)
            variables[name] = value
            continue
        if words[0].startswith("$"):
            words = shlex.split(variables[words[0][1:]]) + words[1:]
        out.append(words)
    return out


def check_command(words: list[str]) -> None:
    """Parse one command's flags (module docstring); AssertionError or SystemExit where they do not parse."""
    if words[0] == "sudo":
        words = words[1:]
        if words[0] == "env":
            words = [w for w in words[1:] if "=" not in w or w.startswith("-")]
    if words[0] == "./run":
        assert words[1] in _run_commands(), f"./run {words[1]}: not a command of the run script"
        return
    if words[0] in (".venv/bin/python", "python", "python3"):
        if words[1:3] == ["-m", "torch.distributed.run"]:
            return _torchrun(words[3:])
        return _program(words[1:])
    checker = COMMANDS.get(words[0])
    assert checker is not None, f"{words[0]}: a command no parser here knows (mark the block an excerpt)"
    checker(words[1:])


def _bash_cases() -> list[Any]:
    cases = []
    for block in all_blocks():
        if block.lang == "bash" and not block.excerpt:
            for words in commands(block.code):
                cases.append(pytest.param(words, id=f"{block.page}:{block.line}:{' '.join(words)[:60]}"))
    return cases


@pytest.mark.parametrize("words", _bash_cases())
def test_bash_commands_parse(words: list[str]) -> None:
    """Each command of a bash block parses with the parser that reads it (flags only: nothing runs)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            check_command(words)
    except SystemExit as exc:  # argparse's refusal (or --version/--help: exit 0)
        if exc.code == 0:
            return
        raise AssertionError(f"{' '.join(words)}: {err.getvalue().strip()}") from exc


def test_a_bad_flag_does_not_parse() -> None:
    """The parse refuses what it should: an option no parser has, a value of the wrong type, an unknown run
    command, an extra pyproject does not have, lioncub from an index, an option of a benchmark script."""
    bad = [
        "lioncub train --workload gpt --stepz 3",
        "lioncub launch --nproc 2 -- python examples/hf_trainer.py --no-such-flag",
        "torchrun --nproc-per-node 2 -m lioncub.cli train --steps many",
        "torchrun --nproc-per-node 2 examples/accelerate_loop.py --stepz 3",
        "./run docs",
        "pip install .[gpu]",
        "pip install lioncub[ft]",
        ".venv/bin/python benchmarks/findings.py --no-such-flag",
        "make all",
    ]
    for line in bad:
        with pytest.raises((AssertionError, SystemExit)), contextlib.redirect_stderr(io.StringIO()):
            check_command(shlex.split(line))
    check_command(shlex.split(".venv/bin/python benchmarks/findings.py --only sync --sync-steps 600"))


# -- the examples' command sequences ------------------------------------------------------------------


def example_commands(path: Path) -> list[list[str]]:
    """The options of each command in the example's docstring, in order."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    name = f"examples/{path.name}"
    return [
        (w := shlex.split(line, comments=True))[w.index(name) + 1 :]
        for line in doc.splitlines()
        if f" {name}" in line
    ]


@pytest.mark.parametrize("name", ["hf_trainer.py", "accelerate_loop.py", "lightning_module.py"])
def test_the_examples_command_sequences_are_consistent(name: str) -> None:
    """Three commands: a run, another variant into its own ``--out`` (never the first's checkpoints), and
    the first run resumed — its ``--out``, its variant (a checkpoint of another variant is refused), more
    steps than it trained. Each parses with the example's own parser."""
    parser = _example_parser(ROOT / "examples" / name)
    first, other, resumed = (parser.parse_args(argv) for argv in example_commands(ROOT / "examples" / name))
    assert not first.resume and not other.resume and resumed.resume
    assert other.out != first.out and resumed.out == first.out
    assert resumed.variant == first.variant and resumed.steps > first.steps


# -- the README's shape -------------------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_the_readme_opens_with_the_run_commands_and_the_quick_start() -> None:
    """The first block is ``./run demo`` and ``./run test`` (.ci/run calls the latter); the quick start comes
    next and fits a screen (install, the loop, one command); every #anchor and relative link resolves."""
    text = (ROOT / "README.md").read_text()
    first = blocks(ROOT / "README.md")[0]
    assert [w[:2] for w in commands(first.code)] == [["./run", "demo"], ["./run", "test"]]
    assert "./run test" in (ROOT / ".ci" / "run").read_text().splitlines()[-1]
    headings = re.findall(r"^#{2,3} (.+)$", text, re.M)
    assert headings[0] == "Quick start"
    quick = text.split("## Quick start\n", 1)[1].split("\n## ", 1)[0]
    assert len(quick.splitlines()) <= 45
    assert "pip install" in quick and "LionCub(" in quick and "lioncub train" in quick
    slugs = {_slug(h) for h in headings}
    anchors = set(re.findall(r"\]\(#([^)]+)\)", text))
    assert anchors <= slugs, sorted(anchors - slugs)
    for target in re.findall(r"\]\(((?:docs|examples)/[^)#]+)", text):
        assert (ROOT / target).exists(), target


# -- the API reference ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_api_reference_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    """``mkdocs build --strict`` (mkdocs.yml: the guides and the API reference from the docstrings, read
    statically) into a temporary directory, offline; about 2.5 CPU-s. A docstring griffe cannot parse, a
    broken link or a page missing from the nav fails it."""
    pytest.importorskip("mkdocstrings", reason="the docs extra: pip install '.[docs]'")
    import os

    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = python("-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"), cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    page = (tmp_path / "site" / "api" / "optimizers" / "index.html").read_text()
    assert "LionCub" in page and "local_steps" in page and ":class:" not in page
