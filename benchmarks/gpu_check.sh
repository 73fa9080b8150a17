#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py): kernel correctness and bandwidth; the whole vote path
# (benchmarks/gpu_path.py: votes, presets, overlap, local steps, consolidation, a checkpoint round trip,
# host syncs) on the GPU over NCCL against gloo, at world size 1 with the votes' collectives on and on one
# process per GPU when there are several; the LionCub step overhead on a 350M-parameter set.
#
#   benchmarks/gpu_check.sh                      on a machine with NVIDIA GPUs (exit 2 without CUDA)
#   benchmarks/gpu_check.sh --dry-run [--ranks 2]  the same code paths on the CPU, small sizes (Triton
#                                                  interpreter; --ranks: the vote path on K gloo ranks too)
#
# Runs from the repository root with the project's venv (.venv, or $PYTHON) and installs nothing: on a
# GPU machine that venv must hold a CUDA build of torch and triton (the CPU wheel pinned in
# constraints.txt has no CUDA). Bounded to 8 minutes; the table printed last has every number.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout 480 "$PY" benchmarks/gpu_check.py "$@"
