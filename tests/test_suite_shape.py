"""The shape of the test suite: no module under tests/ imports a test module (``test_*``), not even in a
script it runs in a subprocess. What several files share lives in helper modules (``oracles.py``,
``sim_comm.py``, ``processes.py``, ``conftest.py``, ...; tests/README.md has the map). Processes start one
way: only ``processes.py`` starts the interpreter (``run_workers``, ``python``, ``python_cmd``, ``PY``)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

import sources

TESTS = Path(__file__).resolve().parent
#: an import statement inside a string (a script run with ``python -c``)
SCRIPT_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w., ]+))", re.MULTILINE)


def _walk(source: str | Path) -> Iterable[ast.AST]:
    """The nodes of ``source`` (a text, or a file whose tree ``sources.py`` holds) in ``ast.walk``'s order."""
    return ast.walk(ast.parse(source)) if isinstance(source, str) else sources.nodes(source)


def imported_modules(source: str | Path) -> set[str]:
    """Top-level names of the modules ``source`` imports, in its code and in the scripts its strings hold."""
    names: set[str] = set()
    for node in _walk(source):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for found in SCRIPT_IMPORT.finditer(node.value):
                names.update((found.group(1) or found.group(2)).split(","))
    return {name.strip().split(".")[0] for name in names}


def test_imports_in_code_and_in_scripts_are_found() -> None:
    source = "import os.path, test_a\nfrom test_b.c import d\n"
    source += 'S = """\nimport sys\nfrom test_e import f\n"""\n'  # a script for python -c
    assert imported_modules(source) == {"os", "test_a", "test_b", "sys", "test_e"}


def test_no_module_imports_a_test_module() -> None:
    paths = [p for p in sorted(TESTS.glob("*.py")) if p.name != Path(__file__).name]  # not the sample above
    found = {path.name: imported_modules(path) for path in paths}
    offenders = {name: sorted(m for m in modules if m.startswith("test_")) for name, modules in found.items()}
    assert {name: modules for name, modules in offenders.items() if modules} == {}
    assert "oracles" in found["test_lioncub.py"]  # the check reads what the files import


#: the functions of :mod:`subprocess` that start a process
STARTERS = {"run", "Popen", "call", "check_call", "check_output"}


def interpreter_starts(source: str | Path) -> list[int]:
    """Lines of ``source`` that name ``sys.executable`` or hand ``[PY, ...]`` to :mod:`subprocess`: the
    interpreter started other than through ``processes.py``."""
    lines = []
    for node in _walk(source):
        if isinstance(node, ast.Attribute) and node.attr == "executable":
            if isinstance(node.value, ast.Name) and node.value.id == "sys":
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(func := node.func, ast.Attribute):
            argv = node.args[0] if node.args else None
            first = argv.elts[0] if isinstance(argv, ast.List) and argv.elts else None
            owner = func.value.id if isinstance(func.value, ast.Name) else None
            started = owner == "subprocess" and func.attr in STARTERS
            lines += [node.lineno] if started and isinstance(first, ast.Name) and first.id == "PY" else []
    return sorted(lines)


def test_interpreter_starts_are_found() -> None:
    source = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'pass'])\n"
    source += "subprocess.Popen([PY, 'x.py'])\nsubprocess.run(['ip', 'link'])\n"
    source += "subprocess.run(python_cmd('x'))\n"
    assert interpreter_starts(source) == [2, 3]


def test_only_processes_starts_the_interpreter() -> None:
    """A Python program is started through ``processes.py`` (``python``, ``python_cmd``; ``PY`` for what a
    launch starts), N ranks with its ``run_workers``: tests/README.md's "Starting processes"."""
    paths = [p for p in sorted(TESTS.glob("*.py")) if p.name != "processes.py"]
    found = {path.name: interpreter_starts(path) for path in paths}
    assert {name: lines for name, lines in found.items() if lines} == {}
