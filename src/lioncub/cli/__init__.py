"""Command-line interface: ``lioncub SUBCOMMAND ...`` (also ``python -m lioncub``).

Each subcommand lives in its own module of this package exposing ``add_arguments(parser)`` and
``run(args) -> int``; only the module of the subcommand being run is imported, so ``lioncub --help`` and
the launcher stay fast. Subcommand modules never import each other; what ``train`` and ``compare`` share
is in :mod:`lioncub.cli.options` and :mod:`lioncub.train.driver`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "launch": ("lioncub.cli.launch", "run N ranks like torchrun, each optionally behind a shaped link"),
    "cost": ("lioncub.cli.cost", "predict the time per step of every variant (α–β cost model)"),
    "calibrate": ("lioncub.cli.calibrate", "measure α, β and compute costs on a job for `lioncub cost`"),
    "train": ("lioncub.cli.train", "train a workload with one variant on N ranks (optionally shaped links)"),
    "compare": ("lioncub.cli.compare", "train several variants one after another and report speed and loss"),
    "report": ("lioncub.cli.report", "tables and plots of a run's vote diagnostics (--diagnostics-every)"),
    "data": ("lioncub.cli.data", "prepare the offline data sets of the larger workloads (`data fetch`)"),
}


def version() -> str:
    """The installed ``lioncub`` distribution's version (:mod:`importlib.metadata`), else the source tree's
    ``lioncub.__version__`` (a clone never installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("lioncub")
    except PackageNotFoundError:
        from lioncub import __version__

        return __version__


class _Version(argparse.Action):
    """``--version``: :func:`version` (read only when asked for), printed as ``lioncub VERSION``."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(f"lioncub {version()}")
        parser.exit()


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only ``command``'s own options are loaded (all of them when None, none for a
    name that is not a command)."""
    parser = argparse.ArgumentParser(
        prog="lioncub",
        description="Data-parallel training with the Lion optimizer over slow networks "
        "(Distributed Lion, Lion Cub).",
    )
    parser.add_argument("--version", action=_Version, help="print lioncub's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if command is None or name == command:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    # no command (``--help``, ``--version``) or an unknown one: no subcommand's module is imported
    parser = build_parser(command if command in COMMANDS else "")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)
