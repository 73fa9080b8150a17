"""Text for a terminal of any width: tables whose cells are never cut or split, and prose wrapped between
phrases, never inside a number or a name.

* :func:`console` -- a rich :class:`~rich.console.Console`: a terminal's own width; else ``COLUMNS`` when
  it is set; else :data:`LOG_WIDTH` (a log or a pipe keeps its lines whole).
* :func:`print_table` -- a table whose every column is as wide as its widest cell (no cell wraps, nothing
  is cut to ``…``); the headers wrap between words. When the columns do not fit the width, they are printed
  in groups, each repeating the key columns (the run's or variant's name); when not even one column fits
  beside the keys, one block per row (``header: value`` lines).
* :func:`wrap` -- a paragraph as lines of at most ``width`` cells: broken first at ``. ``, then ``; ``, then
  ``, `` outside parentheses, then the same inside them, then at spaces -- never between a number and its unit
  (``41.8 Gbit/s``) and never inside a word; a word longer than the width stands alone on its line.

No torch is imported here.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Collection, Sequence
from typing import TextIO

from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

__all__ = ["LOG_WIDTH", "console", "print_table", "print_wrapped", "table_groups", "wrap"]

#: the width without a terminal and without ``COLUMNS``: wide enough that a comparison's table is one table
LOG_WIDTH = 160
#: what a column of a rich table takes beside its cells: a space of padding each side and its left rule
COLUMN_EXTRA = 3


def console(file: TextIO | None = None) -> Console:
    """A rich console for ``file`` (default stdout): a terminal's width; else ``COLUMNS`` if set; else
    :data:`LOG_WIDTH`."""
    out = Console(file=file)
    if out.is_terminal or os.environ.get("COLUMNS", "").strip().isdigit():
        return out
    return Console(file=file, width=LOG_WIDTH)


def _plain_len(cell: str) -> int:
    """Terminal cells of ``cell`` as printed (rich markup such as ``[bold]`` takes none)."""
    return Text.from_markup(cell).cell_len


def _longest_word(text: str) -> int:
    return max((cell_len(w) for w in text.split()), default=0)


def _needs(headers: Sequence[str], rows: Sequence[Sequence[str]], columns: Sequence[int]) -> list[int]:
    """The width each of ``columns`` needs: its widest cell, and its header's longest word."""
    return [max([_longest_word(headers[i]), *(_plain_len(r[i]) for r in rows)]) for i in columns]


def _table_width(widths: Sequence[int]) -> int:
    return sum(widths) + COLUMN_EXTRA * len(widths) + 1


def table_groups(
    headers: Sequence[str], rows: Sequence[Sequence[str]], width: int, keys: int = 1
) -> list[list[int]] | None:
    """The columns of each table :func:`print_table` prints within ``width``: the ``keys`` first columns
    in every group, the others in order, as many as fit; ``None`` when not even one more column fits
    beside the keys (one block per row then)."""
    need = _needs(headers, rows, range(len(headers)))
    key_cols = list(range(keys))
    groups: list[list[int]] = []
    for i in range(keys, len(headers)):
        if groups and _table_width([need[j] for j in (*groups[-1], i)]) <= width:
            groups[-1].append(i)
        elif _table_width([need[j] for j in (*key_cols, i)]) <= width:
            groups.append([*key_cols, i])
        else:
            return None
    return groups or [key_cols]


def _header_lines(header: str, width: int) -> int:
    """The lines ``header`` takes in a column ``width`` cells wide, wrapped between words."""
    return len(_wrap(header, width, width)) if cell_len(header) > width else 1


def _widen_headers(headers: Sequence[str], widths: list[int], spare: int) -> None:
    """Give ``spare`` cells to the columns (``widths``, changed in place) whose headers take the most lines,
    one cell at a time, until every header takes one line or nothing is left."""
    while spare > 0:
        lines = [_header_lines(h, w) for h, w in zip(headers, widths, strict=True)]
        if max(lines) == 1:
            return
        widths[lines.index(max(lines))] += 1
        spare -= 1


def print_table(
    out: Console,
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    keys: int = 1,
    left: Collection[int] | None = None,
) -> None:
    """Print ``rows`` (cells may hold rich markup) under ``title`` within ``out.width``: see the module
    docstring. The columns at the indices ``left`` (default: the ``keys`` first) are left-aligned, the
    others right-aligned."""
    left = range(keys) if left is None else left
    width = out.width
    print_wrapped(out, title, width=width)
    groups = table_groups(headers, rows, width, keys)
    if groups is None:
        for row in rows:
            print_wrapped(out, " ".join(Text.from_markup(c).plain for c in row[:keys]), width=width)
            for header, cell in zip(headers[keys:], row[keys:], strict=True):
                print_wrapped(out, f"  {header}: {Text.from_markup(cell).plain}", width=width, indent="    ")
        return
    for n, group in enumerate(groups):
        need = _needs(headers, rows, group)
        _widen_headers([headers[i] for i in group], need, width - _table_width(need))
        table = Table(title=None if n == 0 else "(continued)", title_justify="left")
        for k, i in enumerate(group):
            table.add_column(
                escape(headers[i]), justify="left" if i in left else "right", width=need[k], overflow="fold"
            )
        for row in rows:
            table.add_row(*(row[i] for i in group))
        out.print(table)


#: break points of :func:`wrap`, strongest first (outside parentheses, then inside)
BREAKS = (". ", "; ", ", ")
#: a space :func:`wrap` never breaks at: between a number and the word after it (``41.8 Gbit/s``)
GLUED = re.compile(r"(?<=\d) (?=[^\W\d])")


def _pieces(text: str, sep: str, depth: int | None) -> list[str] | None:
    """``text`` cut after each ``sep`` at parenthesis depth ``depth`` (``None``: any depth above 0); None
    if there is no such ``sep``."""
    cuts, level = [], 0
    for i, ch in enumerate(text):
        level += ch in "([{"
        level -= ch in ")]}"
        if text.startswith(sep, i) and (level == depth if depth is not None else level > 0):
            cuts.append(i + len(sep))
    if not cuts:
        return None
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if text[a:b]]


def _words(text: str) -> list[str]:
    """``text`` cut after each space that is not between a number and its unit (:data:`GLUED`)."""
    protected = GLUED.sub("\0", text)
    return [w.replace("\0", " ") for w in re.findall(r"\S+\s*|\s+", protected)]


def _split(text: str) -> list[str] | None:
    """``text`` cut at its strongest break points (see :data:`BREAKS`); None when it has none."""
    for depth in (0, None):
        for sep in BREAKS:
            pieces = _pieces(text, sep, depth)
            if pieces is not None and len(pieces) > 1:
                return pieces
    words = _words(text)
    return words if len(words) > 1 else None


def wrap(text: str, width: int, indent: str = "  ") -> list[str]:
    """``text`` as lines of at most ``width`` terminal cells, the lines after the first indented by
    ``indent`` more than the first (see the module docstring); joined with single spaces the lines give
    ``text`` back (but the indents and the spaces at the breaks)."""
    body = text.lstrip()
    lead = text[: len(text) - len(body)]
    lines = _wrap(body.rstrip(), width - cell_len(lead), width - cell_len(lead + indent))
    return [lead + lines[0], *(lead + indent + line for line in lines[1:])]


def _wrap(text: str, first: int, rest: int) -> list[str]:
    """``text`` as lines, the first at most ``first`` cells wide, the others ``rest``; no indents."""
    pieces = _split(text) if cell_len(text) > first else None
    if pieces is None:  # it fits, or it is one word: it stands alone
        return [text]
    lines: list[str] = []
    line = ""
    for piece in pieces:
        room = first if not lines else rest
        if cell_len((line + piece).rstrip()) <= room:
            line += piece
            continue
        if cell_len(piece.rstrip()) > rest:  # broken anyway: at its own weaker points, from this line on
            left = room - cell_len(line)
            inner = _wrap(piece.strip(), left, rest) if left > 0 else None
            if inner is None or cell_len(inner[0]) > left:
                lines += [line.rstrip()] if line.strip() else []
                inner = _wrap(piece.strip(), rest if lines else first, rest)
                line = ""
            lines += [line + inner[0], *inner[1:-1]] if len(inner) > 1 else []
            line = (inner[-1] if len(inner) > 1 else line + inner[0]) + piece[len(piece.rstrip()) :]
            continue
        lines.append(line.rstrip())
        line = piece
    if line.strip():
        lines.append(line.rstrip())
    return [line for line in lines if line]


def print_wrapped(out: Console, text: str, width: int | None = None, indent: str = "  ") -> None:
    """Print ``text`` through ``out`` as :func:`wrap`'s lines, at most ``width`` (default ``out.width``)
    wide; rich markup in ``text`` is printed as written."""
    width = out.width if width is None else width
    for line in wrap(text, width, indent):
        out.print(line, markup=False, highlight=False, soft_wrap=True)
