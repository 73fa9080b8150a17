"""The syntax trees of the sources that the suite's structural checks read (``test_layers.py``,
``test_devices.py``, ``test_typing.py``, ``test_suite_shape.py``, ``test_phase_clock.py``): each file
parsed once per pytest process, and its nodes listed once, instead of again in every file and test that
reads it.

Read-only: a check walks the trees, never changes them.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path


@functools.cache
def tree(path: Path) -> ast.Module:
    """The syntax tree of the Python file ``path`` (an absolute path)."""
    return ast.parse(path.read_text(), str(path))


@functools.cache
def nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of :func:`tree` of ``path``, in the order of ``ast.walk`` (breadth first)."""
    return tuple(ast.walk(tree(path)))
