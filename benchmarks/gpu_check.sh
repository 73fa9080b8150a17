#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py): kernel correctness and bandwidth, every vote and
# LionCub preset over NCCL (world size 1), and the LionCub step overhead on a 350M-parameter set.
#
#   benchmarks/gpu_check.sh            on a machine with one NVIDIA GPU (exit 2 without CUDA)
#   benchmarks/gpu_check.sh --dry-run  the same code paths on the CPU, small sizes (Triton interpreter)
#
# Runs from the repository root with the project's venv (.venv, or $PYTHON) and installs nothing: on a
# GPU machine that venv must hold a CUDA build of torch and triton (the CPU wheel pinned in
# constraints.txt has no CUDA). Bounded to 9 minutes; the table printed last has every number.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout 540 "$PY" benchmarks/gpu_check.py "$@"
