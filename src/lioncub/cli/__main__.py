"""``python -m lioncub.cli SUBCOMMAND ...`` (as ``torchrun -m lioncub.cli train ...`` uses it)."""

import sys

from lioncub.cli import main

sys.exit(main())
