#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py): kernel correctness and bandwidth; the whole vote path
# (benchmarks/gpu_path.py: votes, presets, overlap, local steps, consolidation, a checkpoint round trip,
# host syncs and Triton launches per step and per bucket, LionCub on FSDP2's shards over a mesh of one)
# on the GPU over NCCL against gloo, at world size 1 with the votes' collectives on and on one process
# per GPU when there are several; the LionCub step overhead on a 350M-parameter set. More in
# docs/benchmarks/gpu-check.md.
#
#   benchmarks/gpu_check.sh [--out FILE]             on a machine with NVIDIA GPUs (exit 2 without CUDA)
#   benchmarks/gpu_check.sh --dry-run [--ranks 2]    the same code paths on the CPU, small sizes (Triton
#                                                    interpreter; --ranks: the vote path on K gloo ranks too)
#
# The interpreter, printed with its torch version before the check starts:
#   1. $PYTHON, when set;
#   2. with --dry-run: the project's .venv/bin/python (CPU torch, the Triton interpreter), else python3;
#   3. else the project's .venv/bin/python if its torch sees a CUDA GPU (torch.cuda.is_available()),
#      else the machine's python3 if its torch does, else the first of the two that imports torch (it
#      then says it sees no CUDA GPU and exits 2). On a lent GPU machine the project's .venv is the CPU
#      wheel of constraints.txt and there is no network: the machine's own torch (and triton) run it.
# Runs from the repository root and installs nothing.
#
# Each section runs under a guard: one that raises is a FAIL row (its traceback printed and kept) and the
# next section runs; the table is printed last and written to FILE (default: gpu_check_<date>_<time>.txt
# under $OUT if set, else the repository root), rewritten after every section. Exit 1 when a section or
# a correctness check failed. Bounded under 8 minutes: after 450 s ($GPU_CHECK_TIMEOUT_S) the check gets
# SIGABRT (faulthandler dumps every thread's stack), 15 s later SIGKILL; this script then prints the table
# as far as it got.
set -uo pipefail
cd "$(dirname "$0")/.."

dry=0 out="" prev=""
for arg in "$@"; do
    case $arg in
        --dry-run) dry=1 ;;
        --out=*) out=${arg#--out=} ;;
    esac
    [[ $prev == --out ]] && out=$arg
    prev=$arg
done
if [[ -z $out ]]; then
    out="${OUT:-.}/gpu_check_$(date +%Y-%m-%d_%H%M%S).txt"
    set -- "$@" --out "$out"
fi

has_torch() { "$1" -c 'import torch' >/dev/null 2>&1; }
has_cuda() {
    timeout 120 "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}
venv=.venv/bin/python
[[ -x $venv ]] || venv=""
if [[ -n ${PYTHON:-} ]]; then
    PY=$PYTHON why='$PYTHON'
elif ((dry)); then
    PY=${venv:-python3} why="--dry-run: the project's .venv"
    [[ -n $venv ]] || why="--dry-run, no .venv"
else
    PY="" why=""
    for cand in $venv python3; do
        if has_cuda "$cand"; then
            PY=$cand why="its torch sees a CUDA GPU"
            break
        fi
    done
    if [[ -z $PY ]]; then
        for cand in $venv python3; do
            if has_torch "$cand"; then
                PY=$cand why="no interpreter's torch sees a CUDA GPU"
                break
            fi
        done
    fi
    [[ -n $PY ]] || PY=python3 why="no interpreter imports torch"
fi
version=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null ||
    "$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo "not importable")
echo "gpu_check.sh: interpreter $(command -v "$PY" || echo "$PY") (torch $version; $why)"

export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
limit=${GPU_CHECK_TIMEOUT_S:-450}
timeout -k 15 -s ABRT "$limit" "$PY" benchmarks/gpu_check.py "$@"
rc=$?
if ((rc >= 124)); then
    echo "gpu_check.sh: the check was stopped (exit $rc: 124 = timed out after $limit s, every thread's" \
        "stack dumped above; 137 = killed; 128 + N = signal N)"
    if [[ -f $out ]]; then
        echo "gpu_check.sh: the table as far as it got ($out):"
        cat "$out"
    fi
fi
exit "$rc"
