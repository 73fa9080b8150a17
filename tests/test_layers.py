"""The package's shape: layers that import only downwards, no import cycles, no private name used across
modules, CLI subcommands that never import each other, a constructor a reader can hold in their head, the
step engine speaking to the votes only through their protocol (no dispatch on string kinds), modules and
functions a reader holds in one sitting, and ``python -m lioncub`` (the README's "Layout" section states
the same).

Read from the source with :mod:`ast` (every import, including those inside functions), not by importing.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
from pathlib import Path

import pytest

import background
import sources

from processes import python, python_cmd

SRC = Path(__file__).resolve().parents[1] / "src"

#: the layer of every package and top-level module; an import may only go to the same module's package
#: or to a lower layer (packages on the same layer may not import each other)
LAYERS = {
    "lioncub._validate": -1,  # the shared argument checks: below every layer (transports reads them)
    "lioncub.units": 0,
    "lioncub.env": 0,  # every LIONCUB_* environment variable, in one table (standard library only)
    "lioncub.transports": 0,
    "lioncub.rundir": 0,  # run directories: the record, locks, survey, removal, atomic writes (no torch)
    "lioncub.ops": 1,
    "lioncub.collectives": 2,
    "lioncub.optim": 3,
    "lioncub.planning": 4,
    "lioncub.names": 4,  # run names and config.json's settings (no torch: the choice lists of optim.config)
    "lioncub.integrations": 4,  # LionCub in transformers / accelerate / Lightning (imports optim only)
    "lioncub.launch": 5,
    "lioncub.train": 6,
    "lioncub.report": 6,
    "lioncub.cli": 7,
    "lioncub.__main__": 8,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted((SRC / "lioncub").rglob("*.py"))}


def _unit(module: str) -> str:
    """The key of :data:`LAYERS` a module belongs to."""
    return next(k for k in sorted(LAYERS, key=len, reverse=True) if module == k or module.startswith(k + "."))


def _imports(module: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every ``lioncub`` import of ``module``."""
    out = []
    for node in sources.nodes(MODULES[module]):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("lioncub")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lioncub"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in MODULES:  # `from lioncub.train import checkpoint`: the submodule
                    out.append((sub, [], node.lineno))
                else:
                    out.append((node.module, [alias.name], node.lineno))
    return out


def _edges() -> dict[str, set[str]]:
    return {
        m: {target for target, _, _ in _imports(m) if target in MODULES} for m in MODULES if m != "lioncub"
    }


def test_every_module_has_a_layer() -> None:
    assert [
        m for m in MODULES if m != "lioncub" and not any(m == k or m.startswith(k + ".") for k in LAYERS)
    ] == []


def test_imports_go_only_downwards() -> None:
    wrong = []
    for module in MODULES:
        if module == "lioncub":
            continue  # the package's lazy exports name every layer
        here = _unit(module)
        for target, _, line in _imports(module):
            if target == "lioncub" or _unit(target) == here:
                continue
            if LAYERS[_unit(target)] >= LAYERS[here]:
                wrong.append(f"{MODULES[module].relative_to(SRC)}:{line} imports {target}")
    assert wrong == []


def test_no_import_cycles() -> None:
    edges = _edges()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_no_private_name_crosses_a_module_boundary() -> None:
    wrong = []
    for module in MODULES:
        for target, names, line in _imports(module):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and target != module:
                wrong.append(f"{module}:{line} imports {private} from {target}")
        tree = sources.nodes(MODULES[module])
        aliases = {  # local names bound to lioncub modules
            (a.asname or a.name): f"{node.module}.{a.name}"
            for node in tree
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lioncub")
            for a in node.names
            if f"{node.module}.{a.name}" in MODULES
        }
        for node in tree:
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                wrong.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert wrong == []


def test_subcommands_do_not_import_each_other() -> None:
    from lioncub.cli import COMMANDS

    commands = {module for module, _ in COMMANDS.values()}
    wrong = [(m, t) for m in commands for t, _, _ in _imports(m) if t in commands and t != m]
    assert wrong == []


def test_one_definition_of_the_shared_checks() -> None:
    defined = {
        m: [n.name for n in sources.nodes(p) if isinstance(n, ast.FunctionDef)] for m, p in MODULES.items()
    }
    twins = [m for m, names in defined.items() if {"_is_int", "_is_number"} & set(names)]
    assert twins == []  # lioncub._validate.is_int / is_number


#: module functions of lioncub.transports that another module also defines at its top level: the same
#: question asked of a VoteConfig (or anything with its fields), answered by the transport's object
CONFIG_ACCESSORS = {"lioncub.optim.config": {"capacity", "lane_bits", "server_down_bits"}}


def _top_functions(module: str) -> set[str]:
    return {n.name for n in sources.tree(MODULES[module]).body if isinstance(n, ast.FunctionDef)}


def test_a_transport_fact_is_stated_once() -> None:
    """Each transport's facts are fields and methods of its object in ``lioncub.transports.FACTS``:
    ``lioncub.transports`` compares no value with a transport's name (no branching on it); outside it, no
    byte formula (a function named ``*bytes*`` or ``*payload*``) compares with or passes a transport's
    name (the votes and the cost model ask the object); and no other module defines a function of the
    same name as one of ``lioncub.transports`` (``level_budget``, ``packed_size``, ``lane_sum_fits``, ...)
    but the accessors of :data:`CONFIG_ACCESSORS`."""
    from lioncub.transports import TRANSPORTS

    def names_a_transport(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value in TRANSPORTS

    wrong = []
    for module, path in MODULES.items():
        tree = sources.nodes(path)
        if module == "lioncub.transports":
            compares = [n for n in tree if isinstance(n, ast.Compare)]
            wrong += [
                f"{module}:{n.lineno} compares with a transport's name"
                for n in compares
                if any(names_a_transport(side) for side in [n.left, *n.comparators])
            ]
            continue
        formulas = [
            f for f in tree if isinstance(f, ast.FunctionDef) and ("bytes" in f.name or "payload" in f.name)
        ]
        for f in formulas:
            for n in ast.walk(f):
                sides = [n.left, *n.comparators] if isinstance(n, ast.Compare) else []
                sides += [*n.args, *(k.value for k in n.keywords)] if isinstance(n, ast.Call) else []
                if any(names_a_transport(side) for side in sides):
                    wrong.append(f"{module}:{n.lineno} {f.name} names a transport")
    facts = _top_functions("lioncub.transports")
    for module in MODULES:
        if module != "lioncub.transports":
            twins = (facts & _top_functions(module)) - CONFIG_ACCESSORS.get(module, set())
            wrong += [f"{module} defines {name} again" for name in sorted(twins)]
    assert wrong == []


#: the protocol the step engine walks every bucket through (lioncub.collectives.protocol.Vote)
PROTOCOL = {"contribute", "post", "advance", "wait", "apply", "update", "discard"}


def test_the_engine_calls_the_votes_only_through_their_protocol() -> None:
    """In ``lioncub.optim`` every call on a vote (``….vote.NAME(…)``) is one of the protocol's methods: the
    engine walks buckets; each vote owns its encode, exchange, decode and apply."""
    wrong = []
    for module, path in MODULES.items():
        if not module.startswith("lioncub.optim"):
            continue
        for node in sources.nodes(path):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == "vote"
                and node.func.attr not in PROTOCOL
            ):
                wrong.append(f"{module}:{node.lineno} calls vote.{node.func.attr}")
    assert wrong == []


def test_no_dispatch_on_a_string_kind() -> None:
    """No wire format is a string code: nothing in ops, collectives or optim compares a ``kind`` with a
    string, and no kernel entry takes a ``kind`` argument (each format is a class with its own methods)."""
    wrong = []
    for module, path in MODULES.items():
        if not module.startswith(("lioncub.ops", "lioncub.collectives", "lioncub.optim")):
            continue
        for node in sources.nodes(path):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                named = [s for s in sides if getattr(s, "attr", getattr(s, "id", None)) == "kind"]
                strings = [s for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
                if named and strings:
                    wrong.append(f"{module}:{node.lineno} compares a kind with a string")
            public = isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
            if public and "kind" in [a.arg for a in node.args.args + node.args.kwonlyargs]:  # type: ignore[union-attr]
                wrong.append(f"{module}:{node.lineno} {node.name}(kind=...)")  # type: ignore[union-attr]
    assert wrong == []


# A module's length is a review question, not a test (docs/architecture.md, "Reviewing a change"): a cap made
# files split where the count fell, not where the concerns part.
#: functions over :data:`FUNCTION_LINES` lines are argparse tables of the CLI only (their names)
FUNCTION_LINES = 80


def test_functions_are_held_in_one_sitting() -> None:
    """No function over :data:`FUNCTION_LINES` lines (docstring included) but the CLI's argument tables."""
    wrong = []
    for module, path in MODULES.items():
        for node in sources.nodes(path):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                table = (
                    module.startswith("lioncub.cli")
                    and node.name.startswith("add_")
                    and "argument" in node.name
                )
                if length > FUNCTION_LINES and not table:
                    wrong.append(f"{module}.{node.name}: {length} lines")
    assert wrong == []


def test_lioncub_constructor_is_small() -> None:
    from lioncub import LionCub

    params = [p for p in inspect.signature(LionCub.__init__).parameters if p != "self"]
    assert len(params) <= 13, params  # local_steps: the 13th, a mode of its own


#: subprocess.run([python, "-m", module, "--help"], capture_output=True, text=True, timeout=60), started in
#: the background when collection ends (tests/background.py)
BACKGROUND = {
    f"python -m {module}": (
        lambda module=module: background.Subprocess(lambda _: python_cmd("-m", module, "--help"), 60)
    )
    for module in ("lioncub", "lioncub.cli")
}

#: ``lioncub report`` on a run directory and ``lioncub cost`` (a table, a plot, nodes), then the comparison
#: report's module imported, in an interpreter where importing torch fails: prints what tried to import it,
#: the exit codes and the plots written (JSON)
WITHOUT_TORCH = """
import json, os, sys
from pathlib import Path

tried = []

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            tried.append(name)
            raise ImportError(f"{name}: blocked")
        return None

sys.meta_path.insert(0, NoTorch())

from lioncub import cli
from lioncub.rundir import claim

work = Path(sys.argv[1])
run = work / "run"
claim(run)  # a run directory of lioncub's, where report writes its plots
layer = {"match": 0.9, "flip": 0.05, "tie": 0.05, "momentum_max_std": 0.01, "max_over_mean": 3, "kurtosis": 4}
diags = [{"kind": "diag", "step": s, "overall": layer, "layers": {"w": layer}} for s in (2, 4)]
(run / "config.json").write_text(json.dumps({"variant": "1bit", "nproc": 2}))
(run / "log.jsonl").write_text("".join(json.dumps(d) + "\\n" for d in diags))
codes = {}
for command in ("report", "cost"):
    try:
        cli.main([command, "--help"])
    except SystemExit as exc:
        codes[command + " --help"] = exc.code
codes["report"] = cli.main(["report", str(run)])
codes["cost"] = cli.main(["cost", "--params", "125M", "--workers", "8", "--bandwidth", "1gbit"])
plot = ["--bandwidth", "100mbit", "--plot", str(work / "cost.png")]
codes["cost --plot"] = cli.main(["cost", "--params", "25M", "--workers", "4", *plot])
nodes = ["--nnodes", "2", "--nproc-per-node", "4", "--bandwidth", "10gbit"]
codes["cost --nnodes"] = cli.main(["cost", "--params", "774M", *nodes])
import lioncub.report.runs  # the comparison report (lioncub compare's, --report-only's)
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
plots = sorted(p.name for p in run.iterdir() if p.suffix == ".png") + [p.name for p in work.glob("*.png")]
print(json.dumps({"tried": tried, "loaded": loaded, "codes": codes, "plots": plots}))
"""
BACKGROUND["without torch"] = lambda: background.Subprocess(
    lambda workdir: python_cmd("-c", WITHOUT_TORCH, str(workdir)), 120
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "module",
    [pytest.param(m, marks=pytest.mark.background(f"python -m {m}")) for m in ("lioncub", "lioncub.cli")],
)
def test_python_dash_m(module: str) -> None:
    key = f"python -m {module}"
    out = background.result(key, BACKGROUND[key])
    assert out.returncode == 0, out.stderr
    for command in ("train", "compare", "launch", "cost", "calibrate", "report"):
        assert command in out.stdout


@pytest.mark.slow
@pytest.mark.background("without torch")
def test_report_and_cost_run_without_torch() -> None:
    """``lioncub report`` (its table and plots written into a run directory, under its lock and record),
    ``lioncub cost`` (a table, a plot, a cluster of nodes) and the comparison report's module
    (``lioncub.report.runs``) where importing torch fails: nothing tries."""
    out = background.result("without torch", BACKGROUND["without torch"])
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tried"] == [] and got["loaded"] == []
    runs = ("report --help", "cost --help", "report", "cost", "cost --plot", "cost --nnodes")
    assert got["codes"] == dict.fromkeys(runs, 0), out.stderr
    assert got["plots"] == ["diag_momentum_std.png", "diag_rates.png", "diag_update_shape.png", "cost.png"]


def test_rundir_imports_only_the_standard_library() -> None:
    """Run directories are read and written without torch (or any package): ``lioncub report`` needs them."""
    wrong = []
    for module, path in MODULES.items():
        if module != "lioncub.rundir" and not module.startswith("lioncub.rundir."):
            continue
        for node in sources.nodes(path):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and not name.startswith("lioncub.rundir"):
                    wrong.append(f"{module}:{node.lineno} imports {name}")
    assert wrong == []


def _environ_key(node: ast.AST) -> ast.expr | None:
    """The key of a read of ``os.environ`` (``.get``, ``.pop``, ``[...]``, ``in``) or ``os.getenv``, else
    None."""

    def is_environ(expr: ast.expr) -> bool:
        attr = isinstance(expr, ast.Attribute) and expr.attr == "environ"
        return attr or (isinstance(expr, ast.Name) and expr.id == "environ")

    if isinstance(node, ast.Call) and node.args and isinstance(node.func, (ast.Attribute, ast.Name)):
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr in ("get", "pop", "setdefault")
            and is_environ(func.value)
        ):
            return node.args[0]
        if getattr(func, "attr", getattr(func, "id", None)) == "getenv":
            return node.args[0]
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_environ(node.value):
        return node.slice
    if isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
        return node.left if is_environ(node.comparators[0]) else None
    return None


def _lioncub_name(key: ast.expr, constants: dict[str, str]) -> str | None:
    """The ``LIONCUB_`` name a key spells (a literal, or a module constant holding one), else None."""
    value = key.value if isinstance(key, ast.Constant) else constants.get(getattr(key, "id", ""))
    return value if isinstance(value, str) and value.startswith("LIONCUB_") else None


def _env_reads() -> tuple[dict[str, set[str]], list[str]]:
    """({variable: modules reading it through lioncub.env's accessors}, the reads of ``os.environ`` for a
    ``LIONCUB_`` name anywhere else, as ``module:line NAME``)."""
    reads: dict[str, set[str]] = {}
    direct = []
    for module, path in MODULES.items():
        if module == "lioncub.env":
            continue
        tree = sources.nodes(path)
        constants = {
            t.id: n.value.value
            for n in sources.tree(path).body
            if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        aliases = {  # local names of the module lioncub.env
            a.asname or a.name
            for n in tree
            if isinstance(n, ast.ImportFrom) and n.module == "lioncub"
            for a in n.names
            if a.name == "env"
        }
        for node in tree:
            key = _environ_key(node)
            if key is not None and (name := _lioncub_name(key, constants)):
                direct.append(f"{module}:{node.lineno} {name}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in aliases
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                reads.setdefault(node.args[0].value, set()).add(module)
    return reads, direct


def test_environment_variables_are_read_through_one_table() -> None:
    """Every ``LIONCUB_*`` variable is read through :mod:`lioncub.env`, by name, by exactly the modules its
    table row says (none: a variable ``lioncub launch`` only sets, whose name a module of lioncub writes);
    nothing else reads one from ``os.environ``; :mod:`lioncub.env` imports only the standard library; the
    README's table names each."""
    from lioncub import env

    reads, direct = _env_reads()
    assert direct == []
    assert sorted(set(reads) - set(env.VARIABLES)) == []  # the accessors also refuse such a name
    rows = {name: set(v.readers) for name, v in env.VARIABLES.items()}
    assert {name: reads.get(name, set()) for name in rows} == rows
    for name, v in env.VARIABLES.items():
        assert all(m in MODULES for m in v.readers), name
        if not v.readers:  # only set: some module of lioncub writes the name, for the command in set_by
            assert v.set_by, name
            writers = [m for m, p in MODULES.items() if m != "lioncub.env" and name in p.read_text()]
            assert writers, name
    tree = sources.nodes(MODULES["lioncub.env"])
    imported = [a.name for n in tree if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module for n in tree if isinstance(n, ast.ImportFrom) and n.module]
    assert [m for m in imported if m.split(".")[0] not in sys.stdlib_module_names] == []
    readme = (SRC.parent / "README.md").read_text()
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    assert [name for name in env.VARIABLES if f"`{name}`" not in section] == []  # the README's table


def test_cost_model_and_configs_do_not_import_torch() -> None:
    code = (
        "import sys, lioncub.planning.costmodel, lioncub.optim.config, lioncub.units, lioncub._validate, "
        "lioncub.transports, lioncub.rundir, lioncub.train.runfiles, lioncub.cli.report, lioncub.cli.cost;"
        "print('torch' in sys.modules)"
    )
    out = python("-c", code, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


#: the owners of the settings' allowed values, ``module:NAME`` (a tuple, or a dict whose keys are the
#: values): every setting's choices (lioncub.train.config.SETTINGS) are one of these or built from one
CHOICE_OWNERS = (
    "lioncub.optim.config:PRESETS",
    "lioncub.optim.config:INNER_MOMENTA",
    "lioncub.optim.outer:OUTER_RULES",
    "lioncub.optim.step_check:NONFINITE_MODES",
    "lioncub.ops.quantize:QUANTIZERS",
    "lioncub.transports:TOPOLOGIES",
    "lioncub.transports:ZERO_VOTES",
    "lioncub.train.data:MODES",
    "lioncub.train.config:CONVERSIONS",
    "lioncub.train.config:CHOSEN_BY",
    "lioncub.train.workloads:SIZES",
    "lioncub.launch.config:DEVICES",
    "lioncub.integrations.torchft:MOMENTA_ON_HEAL",
)


def owned_lists(owners: tuple[str, ...] = CHOICE_OWNERS) -> dict[frozenset[str], str]:
    """The values of each of ``owners`` (as a set), and the owner."""
    import importlib

    lists = {}
    for owner in owners:
        module, name = owner.split(":")
        lists.setdefault(frozenset(getattr(importlib.import_module(module), name)), owner)
    return lists


def choice_lists(owners: tuple[str, ...] = CHOICE_OWNERS) -> dict[frozenset[str], str]:
    """Every list of allowed values of a setting (as a set) and where it is stated: ``owners``, and the
    choices of every setting of ``lioncub train`` / ``compare`` (its owner's collection, or one built from
    it)."""
    lists = owned_lists(owners)
    try:
        from lioncub.train.config import SETTINGS
    except ImportError:  # before the settings had a table
        SETTINGS = {}
    for name, d in SETTINGS.items():
        if d.setting.choices is not None:
            lists.setdefault(frozenset(d.setting.choices), f"the choices of the setting {name}")
    return lists


def written_choice_lists(src: Path, lists: dict[frozenset[str], str]) -> dict[str, list[str]]:
    """``{owner: ["module:line", ...]}``: where a module of ``src`` writes one of ``lists`` out -- a tuple,
    list or set literal (a ``Literal[...]`` too) of exactly its strings, in any order, or a string holding it
    as a Python list (``"allowed values are ['random', 'shard']"``)."""
    reprs = {str(list(order)): v for v in lists for order in _orders(v)}
    found: dict[str, list[str]] = {}
    for path in sorted((src / "lioncub").rglob("*.py")):
        module = _module_name(path)
        for node in sources.nodes(path):
            items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else []
            strings = [e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(strings) == len(items) > 1 and frozenset(strings) in lists:
                found.setdefault(lists[frozenset(strings)], []).append(f"{module}:{node.lineno}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for text, values in reprs.items():
                    if text in node.value:
                        found.setdefault(lists[values], []).append(f"{module}:{node.lineno} {text}")
    return found


def _orders(values: frozenset[str]) -> list[tuple[str, ...]]:
    """The orders a list of ``values`` may be written in: every one of a short list, else sorted."""
    import itertools

    return list(itertools.permutations(sorted(values))) if len(values) <= 4 else [tuple(sorted(values))]


def test_no_setting_s_allowed_values_are_written_twice() -> None:
    """Each setting's allowed values (``--outer``'s, ``--inner-momentum``'s, the presets, ...) are written
    out only in their owner's module (:data:`CHOICE_OWNERS`; a list a setting builds from one, nowhere):
    the flags' choices, the help, the checks and their messages take the owner's collection
    (``choices=INNER_MOMENTA``, ``{list(ZERO_VOTES)}``); and every setting's choices are built from an
    owner's."""
    from lioncub.train.config import SETTINGS

    owned = list(owned_lists())
    unowned = [
        name
        for name, d in SETTINGS.items()
        if d.setting.choices is not None and not any(v <= set(d.setting.choices) for v in owned)
    ]
    assert unowned == []
    found = written_choice_lists(SRC, choice_lists())
    elsewhere = {
        owner: [p for p in places if p.split(":")[0] != owner.split(":")[0]]
        for owner, places in found.items()
    }
    assert {owner: places for owner, places in elsewhere.items() if places} == {}


def test_the_optimizer_core_composes_parts() -> None:
    """``optim/`` composes parts instead of mixins (``docs/architecture.md``): no ``type: ignore``; no class
    with two bases of lioncub's own (a mixin); no module reading a private attribute of another object
    that an ``optim/`` class defines for itself (``optimizer._step``: what the mixins did)."""
    optim = {m: p for m, p in MODULES.items() if m.startswith("lioncub.optim")}
    ignores = [f"{m}:{i}" for m, p in optim.items() for i, line in enumerate(p.read_text().splitlines(), 1)
               if "type: " + "ignore" in line]  # fmt: skip
    assert ignores == [], ignores
    trees = {m: sources.nodes(p) for m, p in optim.items()}
    ours = {n.name for t in trees.values() for n in t if isinstance(n, ast.ClassDef)}
    mixed = [
        f"{m}.{n.name}"
        for m, t in trees.items()
        for n in t
        if isinstance(n, ast.ClassDef)
        and sum(getattr(b, "id", getattr(b, "attr", "")) in ours for b in n.bases) > 1
    ]
    assert mixed == [], mixed
    own = {
        n.attr
        for t in trees.values()
        for n in t
        if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "self" and n.attr.startswith("_")
        and not n.attr.startswith("__")
    }  # fmt: skip
    reaching = [
        f"{m}:{n.lineno} {ast.unparse(n)}"
        for m, t in trees.items()
        for n in t
        if isinstance(n, ast.Attribute)
        and n.attr in own
        and getattr(n.value, "id", "") not in ("self", "cls")
    ]
    assert reaching == [], reaching
