"""What the type checker sees (issue 45, item 3): the optimizer's parts take typed inputs, never the whole
optimizer as ``Any``; no module outside ``optim/lioncub.py`` writes into an optimizer's parts; the lazy
top-level names are visible to a type checker; ``py.typed`` ships; mypy's configuration has no blanket
ignores. mypy itself runs in ``./run test`` (the README's test command), not here.

Read from the source (with :mod:`ast`) and from ``pyproject.toml``'s text, not by importing.
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path

import pytest

import sources

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "lioncub"

#: the optimizer's parts (``LionCub.round`` …) and its own state that only ``optim/lioncub.py`` sets
PARTS = {"round", "engine", "policy", "window"}
OWN_STATE = {"applied_scale"}
OPTIMIZER = SRC / "optim" / "lioncub.py"


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _targets(node: ast.AST) -> list[ast.expr]:
    """Every expression ``node`` assigns to (or deletes), tuples and starred targets unpacked."""
    if isinstance(node, (ast.Assign, ast.Delete)):
        stack = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        stack = [node.target]
    else:
        return []
    out = []
    while stack:
        t = stack.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            stack += t.elts
        elif isinstance(t, ast.Starred):
            stack.append(t.value)
        else:
            out.append(t)
    return out


def _chain(target: ast.expr) -> tuple[list[str], ast.expr]:
    """The attribute names of ``target`` from the outermost in (``a.round.x[0]`` -> ``["x", "round"]``)
    and the expression they hang from (``a``)."""
    names = []
    while isinstance(target, (ast.Attribute, ast.Subscript)):
        if isinstance(target, ast.Attribute):
            names.append(target.attr)
        target = target.value
    return names, target


def _writes_into_a_part(target: ast.expr) -> bool:
    """``target`` is ``X.round.y`` (into a part, whoever ``X`` is), ``X.applied_scale``, or ``X.round`` with
    ``X`` not ``self`` (a class may hold a part of its own: ``self.round = rnd``)."""
    names, base = _chain(target)
    if not names:
        return False
    own = isinstance(base, ast.Name) and base.id == "self" and len(names) == 1
    return bool(PARTS & set(names[1:])) or names[0] in OWN_STATE or (names[0] in PARTS and not own)


def _writes_into_parts(path: Path) -> list[str]:
    """``path:line: target`` for each assignment into an optimizer's parts."""
    return [
        f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(target)}"
        for node in sources.nodes(path)
        for target in _targets(node)
        if _writes_into_a_part(target)
    ]


def test_no_part_takes_the_optimizer_as_any() -> None:
    """``grep -rnE "(optimizer|opt): *Any" src/lioncub/optim`` finds nothing."""
    pattern = re.compile(r"(optimizer|opt): *Any")
    hits = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for path in sorted((SRC / "optim").rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, "a part takes the whole optimizer as Any (give it a typed input):\n" + "\n".join(hits)


@pytest.mark.slow  # over 1 s: the quick loop (-m 'not slow') leaves it to the full suite
def test_no_module_writes_into_the_optimizers_parts() -> None:
    found = [hit for path in _sources() if path != OPTIMIZER for hit in _writes_into_parts(path)]
    assert not found, (
        "only optim/lioncub.py sets the optimizer's parts and applied_scale; ask the part (a method, a "
        "returned value) instead:\n" + "\n".join(found)
    )


def test_the_check_sees_a_write_into_a_part() -> None:
    """The check above finds what it looks for (a write into a part, into ``applied_scale``, a part
    replaced from outside) and lets a class hold a part of its own."""
    cases = {
        "opt.round.gradients_compared = True": True,
        "opt.applied_scale = None": True,
        "self.opt.engine.state.group_index += 1": True,
        "a, opt.window.anchors[0] = 1, 2": True,
        "other.policy = p": True,
        "self.round = rnd": False,
        "self.ctx, self.round = ctx, rnd": False,
        "opt.rounds = 3": False,
    }
    for source, expected in cases.items():
        hits = [t for node in ast.walk(ast.parse(source)) for t in _targets(node) if _writes_into_a_part(t)]
        assert bool(hits) == expected, source


#: the packages whose public names are imported lazily (``_EXPORTS``, ``__getattr__``)
LAZY_PACKAGES = ("__init__.py", "optim/__init__.py", "train/__init__.py")


def _exports(init: str) -> tuple[dict[str, str], dict[str, str]]:
    """A package's lazy names (name -> module, or name -> "" where ``_EXPORTS`` lists names only) and the
    names its ``TYPE_CHECKING`` block imports (name -> module)."""
    tree = ast.parse((SRC / init).read_text())
    lazy: dict[str, str] = {}
    typed: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            lazy = dict(value) if isinstance(value, dict) else dict.fromkeys(value, "")
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module, ast.unparse(imp)
                for alias in imp.names:
                    # `import X as X`: an explicit re-export (mypy's no_implicit_reexport)
                    assert alias.asname == alias.name, ast.unparse(imp)
                    typed[alias.name] = imp.module
    return lazy, typed


@pytest.mark.parametrize("init", LAZY_PACKAGES)
def test_the_lazy_names_are_visible_to_a_type_checker(init: str) -> None:
    lazy, typed = _exports(init)
    assert lazy, f"{init}: no _EXPORTS found"
    assert set(typed) == set(lazy), f"the TYPE_CHECKING block of {init} must import exactly _EXPORTS"
    assert all(not module or typed[name] == module for name, module in lazy.items()), init


@pytest.mark.parametrize("package", ["lioncub", "lioncub.optim", "lioncub.train"])
def test_dir_lists_the_lazy_names(package: str) -> None:
    """``dir()`` (completion in a REPL or an IDE) lists the public names a package imports lazily."""
    module = importlib.import_module(package)
    assert set(module.__all__) <= set(dir(module)), sorted(set(module.__all__) - set(dir(module)))


def test_py_typed_ships() -> None:
    assert (SRC / "py.typed").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()
    package_data = pyproject.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^"lioncub" = \[.*"py\.typed".*\]', package_data, re.M), package_data


def test_mypy_has_no_blanket_ignores() -> None:
    """No ``ignore_errors``; ``ignore_missing_imports`` only per named package (never globally); each
    ``# type: ignore`` names its code and says why (the test below)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    mypy = pyproject[pyproject.index("[tool.mypy]") :]
    assert "ignore_errors" not in mypy
    glob = mypy.split("[[tool.mypy.overrides]]", 1)[0]
    assert "ignore_missing_imports" not in glob, glob
    for block in mypy.split("[[tool.mypy.overrides]]")[1:]:
        if "ignore_missing_imports" in block:
            modules = re.search(r"module = \[(.*?)\]", block, re.S)
            assert modules and '"*"' not in modules.group(1), block


#: a ``type: ignore`` comment, and one as it must be: its error codes, then a comment saying why
#: (``# type: ignore[attr-defined]  # torch.cuda.Event has no stubs``)
IGNORE = re.compile(r"#\s*type:\s*ignore\b")
EXPLAINED = re.compile(r"#\s*type:\s*ignore\[[a-z-]+(,\s*[a-z-]+)*\]\s*#\s*\S")


def _unexplained(source: str) -> list[tuple[int, str]]:
    """(line, comment) of each ``type: ignore`` comment in ``source`` without an error code or a reason
    after it (comments only: a string that mentions one is not one)."""
    return [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and IGNORE.search(tok.string) and not EXPLAINED.search(tok.string)
    ]


def test_every_type_ignore_names_its_code_and_says_why() -> None:
    found: dict[str, list[str]] = {}
    for path in _sources():
        name = str(path.relative_to(ROOT))
        source = path.read_text()
        if IGNORE.search(source) is None:  # no comment holds one (a comment is a piece of the source)
            continue
        for line, comment in _unexplained(source):
            found.setdefault(name, []).append(f"{name}:{line}: {comment}")
    wrong = [hit for name, hits in found.items() for hit in hits]
    assert not wrong, (
        "a `# type: ignore` names its error code and says why after it, or is replaced by a fix (a narrower "
        "type, a check, a cast with a reason):\n" + "\n".join(wrong)
    )


def test_the_check_sees_an_unexplained_ignore() -> None:
    cases = {
        "x = f()  # type: ignore": False,
        "x = f()  # type: ignore  # no code": False,
        "x = f()  # type: ignore[attr-defined]": False,
        "x = f()  # type: ignore[attr-defined]  #": False,
        "x = f()  #type:ignore[arg-type]": False,
        "x = f()  # type: ignore[attr-defined]  # torch.cuda.Event has no stubs": True,
        "x = f()  # type: ignore[method-assign, assignment]  # for this one load": True,
        "x = f()  # noqa: E501  # type: ignore[misc]  # why": True,
        "x = '# type: ignore'": True,
    }
    for source, explained in cases.items():
        assert (not _unexplained(source + "\n")) == explained, source


def _mypy_follow(pyproject: str) -> dict[str, str]:
    """Each module pattern of ``pyproject.toml``'s ``[[tool.mypy.overrides]]`` blocks that set
    ``follow_imports``, mapped to that setting (``"transformers.*"`` -> ``"skip"``)."""
    mypy = pyproject[pyproject.index("[tool.mypy]") :]
    follow: dict[str, str] = {}
    for block in mypy.split("[[tool.mypy.overrides]]")[1:]:
        setting = re.search(r'^follow_imports = "(\w+)"', block, re.M)
        modules = re.search(r"^module = \[(.*?)\]", block, re.M | re.S)
        if setting and modules:
            follow.update(dict.fromkeys(re.findall(r'"([\w.*]+)"', modules.group(1)), setting.group(1)))
    return follow


def _followed(name: str, follow: dict[str, str]) -> str:
    """The ``follow_imports`` mypy applies to the module of ``name`` (a module, or a name in one): the most
    specific pattern's, from the longest prefix of ``name`` down (an exact module name, then ``a.b.*``,
    which matches ``a.b`` and everything under it), else ``"normal"``."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        for pattern in (prefix, prefix + ".*"):
            if pattern in follow:
                return follow[pattern]
    return "normal"


def _used_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every module and name ``path`` imports (absolute imports), and of every
    attribute chain it reads from ``torch`` (``torch.jit.is_scripting()`` -> ``"torch.jit.is_scripting"``)."""
    used = []
    for node in sources.nodes(path):
        if isinstance(node, ast.Import):
            used += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            used += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Attribute):
            names, base = _chain(node)
            if isinstance(base, ast.Name) and base.id == "torch":
                used.append((node.lineno, ".".join(["torch", *reversed(names)])))
    return used


def test_no_module_uses_what_the_type_checker_skips() -> None:
    """The packages mypy skips (``follow_imports = "skip"``: their names are ``Any``, so nothing is checked
    against them) are ones lioncub does not use: no import from them and no ``torch.<skipped>`` attribute
    in ``src/lioncub``. Using one means reading it back (a ``"normal"`` block naming the module)."""
    follow = _mypy_follow((ROOT / "pyproject.toml").read_text())
    assert "skip" in follow.values() and "torch.fx.*" in follow, sorted(follow)  # the check reads the config
    hits = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in _sources()
        for line, name in _used_modules(path)
        if _followed(name, follow) == "skip"
    ]
    assert not hits, (
        "lioncub uses a module the type checker skips, so its types are Any there: read it back in "
        'pyproject.toml (a follow_imports = "normal" block naming it) or use another API:\n' + "\n".join(hits)
    )


def test_the_skip_check_sees_a_skipped_module() -> None:
    follow = {"torch.fx.*": "skip", "torch._dynamo.*": "skip", "torch._dynamo.eval_frame": "normal"}
    assert _followed("torch.fx", follow) == "skip"
    assert _followed("torch.fx.graph", follow) == "skip"
    assert _followed("torch._dynamo.eval_frame", follow) == "normal"
    assert _followed("torch._dynamo.eval_frame.OptimizedModule", follow) == "normal"
    assert _followed("torch.fx.GraphModule", follow) == "skip"
    assert _followed("torch._dynamo.utils", follow) == "skip"
    assert _followed("torch.nn", follow) == "normal"
