"""``python -m lioncub SUBCOMMAND ...``: the ``lioncub`` command line."""

import sys

from lioncub.cli import main

sys.exit(main())
