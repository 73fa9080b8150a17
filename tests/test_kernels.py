"""lioncub.ops.kernels: the Triton kernels (in Triton's interpreter, in a subprocess) bit for bit against the
torch backend, the torch backend against the reference functions, the backend choice, and the CPU mode
of benchmarks/gpu_check.py."""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

import background
import kernels_interp
from kernel_steps import STEP_PRESETS, worker_lioncub_kernels
from lioncub.ops import kernels, native, packing, quantize, triton_launch
from lioncub.optim.lion import apply_update_, update_momentum_

ROOT = Path(__file__).resolve().parent.parent
HAVE_TRITON = importlib.util.find_spec("triton") is not None
NO_TRITON = "triton is not installed (pip install -c constraints.txt -e .[dev] brings it)"
INTERP_CASES = [
    "quantize_l1_float32",
    "quantize_l1_bfloat16",
    "quantize_l1_halfway",
    "majority_pack",
    "apply_float32",
    "apply_bfloat16",
    "hypothesis_agreement",
]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def _in_background(cmd, timeout: float):  # type: ignore[no-untyped-def]
    """``subprocess.run(cmd(workdir), capture_output=True, text=True, timeout=timeout, check=False)`` with the
    project's ``src`` on the path, as a background job (tests/background.py), if triton is installed."""
    return lambda: background.Subprocess(cmd, timeout, _env()) if HAVE_TRITON else None


#: the sections of gpu_check's dry run that fail by its test hook (--fail-section): one of gpu_check.py,
#: one of gpu_path.py (at N = 1 and on both ranks of --ranks 2)
GPU_CHECK_INJECTED = ("bandwidth", "overlap hook")

#: the subprocesses of this module, started when collection ends (they run on the core left idle)
BACKGROUND = {
    # every case of tests/kernels_interp.py in one interpreter, with tests/test_launches.py's
    "kernels_interp": kernels_interp.job,
    # with a failure injected at the end of two sections (after their work: every row is still there)
    "gpu_check_dry_run": _in_background(
        lambda workdir: [
            "bash",
            str(ROOT / "benchmarks" / "gpu_check.sh"),
            *("--dry-run", "--ranks", "2", "--out", str(workdir / "table.txt")),
            *(arg for section in GPU_CHECK_INJECTED for arg in ("--fail-section", section)),
        ],
        280,
    ),
}


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, dict]:
    if not HAVE_TRITON:
        pytest.skip(NO_TRITON)
    return kernels_interp.records(background.result("kernels_interp", BACKGROUND["kernels_interp"]))


@pytest.mark.slow
@pytest.mark.background("kernels_interp")
@pytest.mark.parametrize("case", INTERP_CASES)
def test_triton_interpreter_equals_torch(interpreter_results, case):
    record = interpreter_results.get(case)
    assert record is not None, f"case {case} did not report"
    assert record["ok"], record["error"]


# ----------------------------------------------------------------------------- torch backend = reference


def test_quantize_torch_is_the_reference():
    x = torch.randn(300)
    out = kernels.quantize_l1(x, 63, segments=[100, 0, 200], chunk_size=64, backend="torch")
    want = torch.cat(
        [
            quantize.quantize("l1", x[:100], 63, chunk_size=64),
            quantize.quantize("l1", x[100:], 63, chunk_size=64),
        ]
    )
    assert torch.equal(out, want)


def test_majority_and_apply_torch_are_the_reference():
    rows = torch.randint(0, 256, (5, 12), dtype=torch.uint8)
    for tie in (True, False):
        want = packing.pack_majority(packing.count_votes(rows, 96), 5, tie)
        assert torch.equal(kernels.majority_pack(rows, tie, backend="torch"), want)
    p, m, g = torch.randn(4, 10), torch.randn(4, 10), torch.randn(4, 10)
    votes = torch.randint(-1, 2, (4, 10), dtype=torch.int8)
    pa, ma = p.clone(), m.clone()
    kernels.apply_votes_(
        pa, votes, lr=1e-3, weight_decay=0.1, exp_avg=ma, grad=g, beta2=0.99, backend="torch"
    )
    assert torch.equal(pa, apply_update_(p.clone(), votes.float(), lr=1e-3, weight_decay=0.1))
    assert torch.equal(ma, update_momentum_(m.clone(), g, 0.99))


def test_l1_divisors_is_pass_one_of_quantize():
    x = torch.randn(1000) * 1e-3
    x[:64] = 1e-41  # a denormal chunk: its normaliser is no normal float32, so pass 2 works in float64
    x[64:128] = 0.0
    x[130] = float("nan")
    divisor, wide = quantize.l1_divisors(x, 127, chunk_size=64)
    assert divisor.dtype == torch.float64 and divisor.numel() == 16 and bool(wide)
    assert divisor[1] == 1.0 and divisor[2] == float("inf")  # all zeros: 1; NaN: +Inf (levels 0)
    assert float(divisor[3]) == pytest.approx(float(x[192:256].double().abs().mean()), rel=1e-6)
    divisor, wide = quantize.l1_divisors(x[192:], 127)
    assert divisor.numel() == 1 and not bool(wide)


# ----------------------------------------------------------------------------- backend choice


def test_auto_backend_for_cpu_tensors_without_the_interpreter():
    x = torch.zeros(8)
    cpu = "cpu" if native.available() else "torch"  # the C kernels where they compiled
    want = "triton" if (kernels.HAVE_TRITON and triton_launch.interpreting()) else cpu
    assert kernels.backend_for(x) == want
    assert kernels.backend_for(x, backend="torch") == "torch"
    assert kernels.backend_for(x.double()) == cpu  # float64 is not a Triton kernel dtype, a C one
    assert kernels.backend_for(x.half()) == ("triton" if want == "triton" else "torch")  # no C float16
    assert kernels.backend_for(torch.zeros(4, 4).t()) == "torch"  # non-contiguous
    with pytest.raises(ValueError, match="backend="):
        kernels.backend_for(x, backend="cuda")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter takes CPU tensors")
def test_explicit_triton_on_cpu_says_why():
    with pytest.raises(RuntimeError, match="triton"):
        kernels.majority_pack(torch.zeros(2, 8, dtype=torch.uint8), True, backend="triton")


def test_input_checks():
    with pytest.raises(ValueError, match="beta2"):
        kernels.apply_votes_(torch.zeros(8), torch.zeros(8, dtype=torch.int8), lr=1.0, exp_avg=torch.zeros(8))
    with pytest.raises(ValueError, match="segments"):
        kernels.quantize_l1(torch.zeros(8), 127, segments=[3, 4])
    with pytest.raises(ValueError, match="elements"):
        kernels.apply_votes_(torch.zeros(9), torch.zeros(8, dtype=torch.int8), lr=1.0)
    with pytest.raises(TypeError, match="integer"):
        kernels.apply_votes_(torch.zeros(3), torch.zeros(3), lr=1.0)


# ----------------------------------------------------------------------------- gpu_check CPU mode


#: gpu_check's sections in a dry run with --ranks 2, in order (``--fail-section`` takes these names)
GPU_CHECK_SECTIONS = (
    *("kernels", "half-way rule", "bandwidth", "process group", "gloo group", "votes", "presets"),
    *("overlap hook", "local steps", "consolidation", "host syncs", "CUDA syncs (profiler)", "shards"),
    *("350M step", "several ranks"),
)


def _final_table(stdout: str) -> str:
    """The table gpu_check prints last (from its last header line on)."""
    start = stdout.rfind("\nsection ")
    assert start >= 0, stdout[-4000:]
    return stdout[start:]


@pytest.mark.slow
@pytest.mark.background("gpu_check_dry_run")
@pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)
def test_gpu_check_dry_run():
    proc = background.result("gpu_check_dry_run", BACKGROUND["gpu_check_dry_run"])
    # only the injected failures (test_gpu_check_survives_a_failing_section): exit 1, no other section failed
    injected = [*GPU_CHECK_INJECTED, "overlap hook N=2"]
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"gpu_check: 3 section(s) failed: {'; '.join(injected)} (" in proc.stdout, proc.stdout[-4000:]
    assert "all correctness checks passed" in proc.stdout
    assert "gpu_check.sh: interpreter " in proc.stdout and "; --dry-run" in proc.stdout  # and its torch
    for item in (
        "quantize_l1",
        "majority_pack",
        "apply_votes_",
        "plain Lion",
        "LionCub 8bit step (N=1, votes exchanged)",
    ):
        assert item in proc.stdout
    # the per-bucket kernels and the float64 sums, bit for bit (rel. 1e-15 of the exact sum), in the
    # interpreter; their bandwidth rows (a dry run's timings mean nothing: no verdict)
    import re

    for dtype in ("float32", "bfloat16"):
        tag = f"{dtype} emulated fma, 11 tensors"
        for item in (
            f"lion_directions_ {tag}: equal",
            f"lion_directions_ {tag}, negate: equal",
            f"apply_votes_multi_ {tag}, wd=0.0: equal",
            f"apply_votes_multi_ {tag}, wd=0.1: equal",
            f"apply_votes_multi_ {tag}, wd=0.1, momentum: equal",
            f"apply_votes_multi_ {tag}, wd=0.0, momentum, negate_grad: equal",
            f"l1_abs_sums {dtype} 4x4099, exactly summable: equal",
            f"quantize_l1 pass 1 per bucket {dtype}, 12 segments, chunk=None: divisors, work dtypes = per "
            "segment: equal",
        ):
            assert f"[correctness] {item} (target bit-exact) ok" in proc.stdout, item
        assert re.search(rf"\[correctness\] l1_abs_sums {dtype} 2x8203 vs the exact sum: max rel\. diff "
                         r"\S+ \(target rel <= 1e-15\) ok", proc.stdout), dtype  # fmt: skip
    for item in ("float32, 12 segments, chunk=1000", "bfloat16, 12 segments, chunk=None"):
        assert f"[correctness] quantize_l1 pass 1 per bucket {item}: levels: equal" in proc.stdout, item
    for item in (
        "lion_directions_ (16 tensors: m, g -> out)",
        "apply_votes_multi_ (16 tensors, int8)",
        "apply_votes_multi_ + momentum (16 tensors)",
        "l1_abs_sums (fp32 [16, 1024] -> fp64)",
    ):
        pattern = rf"^\[bandwidth\] {re.escape(item)}: \d+ GB/s = \d+ % of copy"
        assert re.search(pattern, proc.stdout, re.M), item
    assert "[bandwidth] quantize_l1 both passes (pass 1: float64 sums of |c| per group" in proc.stdout
    # the whole vote path at world size 1 with the collectives on, and on 2 ranks (--ranks 2)
    for prefix in ("[vote path] ", "[vote path N=2] rank 0/2: ", "[vote path N=2] rank 1/2: "):
        for item in (
            "QuantizedVote(l1, 8), step 2 (gloo vs gloo): equal",
            "LionCub 8bit: 3 steps, parameters and momenta vs gloo: equal",
            "LionCub 1bit: overlap_with vs plain step, 3 steps: equal",
            "LionCub 1bit, local steps h=2 outer=vote: 5 steps vs gloo: equal",
            "1bit, local steps h=2: saved at step 3 and resumed = uninterrupted, 4 steps: equal",
        ):
            assert prefix + item in proc.stdout, prefix + item
    # consolidation checked at N = 1 too: rank 0's own entry (the top level), not an empty list
    assert (
        "[vote path] 8bit: consolidated on rank 0: 1 entries (rank 0's own on cpu, 0 gathered" in proc.stdout
    )
    assert "[vote path N=2] rank 0/2: 8bit: consolidated on rank 0: 2 entries" in proc.stdout
    # host syncs per step and per bucket: on a GPU 8 vs 64 tensors, 1 / 8 / 64 buckets
    for prefix in ("[host syncs] ", "[host syncs N=2] rank 1/2: "):
        assert prefix + "LionCub 1bit step, 4 vs 8 tensors (1 bucket): " in proc.stdout
        assert (
            prefix + "LionCub 8bit step, 8 tensors in 1 / 2 / 8 buckets: host reads per step " in proc.stdout
        )
    assert "(per bucket " in proc.stdout
    # Triton launches per step and per bucket: at N = 1 the interpreter's (a step launches some), on the
    # ranks none (the C kernels)
    for variant in ("1bit", "8bit"):
        launches = re.search(
            rf"^\[host syncs\] LionCub {variant} step, Triton launches: 4 vs 8 tensors \(1 bucket\): (\d+), "
            r"(\d+); 8 tensors in 1 / 2 / 8 buckets: per step \d+ / \d+ / \d+ \(per bucket ",
            proc.stdout,
            re.M,
        )
        assert launches and int(launches[1]) > 0 and launches[1] == launches[2], variant
        none = f"[host syncs N=2] rank 0/2: LionCub {variant} step, Triton launches: 4 vs 8 tensors"
        none += " (1 bucket): 0, 0;"
        assert none in proc.stdout, variant
    # LionCub on FSDP2's shards = the unsharded LionCub on the same gradients: a mesh of one at N = 1,
    # the vote between replicas (2x1) and one replica of 2 shards (1x2) on the ranks; one more host read
    cases = [("", "", "1x1")] + [(" N=2", f"rank {r}/2: ", m) for r in (0, 1) for m in ("2x1", "1x2")]
    for section, who, mesh in cases:
        for preset in ("1bit", "8bit"):
            label = f"{who}LionCub {preset} on FSDP2 shards, mesh {mesh}"
            for item in ("3 steps = unsharded, parameters and momenta", "shards and momenta on cpu"):
                line = f"[vote path{section}] {label}: {item}: equal (target bit-exact) ok"
                assert line in proc.stdout, line
            reads = rf"^\[host syncs{section}\] {re.escape(label)}: host reads per step: (\d+) on shards, "
            found = re.search(reads + r"(\d+) unsharded", proc.stdout, re.M)
            assert found and int(found[1]) == int(found[2]) + 1, (section, label)


@pytest.mark.slow
@pytest.mark.background("gpu_check_dry_run")
@pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)
def test_gpu_check_survives_a_failing_section():
    """A section that raises (here by the test hook --fail-section, at its end) is a FAIL row with its
    traceback, printed and kept in the table's file; the sections after it run; the whole table is printed
    last and written to --out; the exit code is 1."""
    import re

    proc = background.result("gpu_check_dry_run", BACKGROUND["gpu_check_dry_run"])
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    written = (background.workdir("gpu_check_dry_run") / "table.txt").read_text()
    printed = _final_table(proc.stdout)
    for section in ("bandwidth", "overlap hook"):
        message = f"RuntimeError: failure injected at the end of section {section!r} (--fail-section)"
        # printed when it happened, with its traceback
        assert f"[{section}] FAIL: {message}\nTraceback (most recent call last):" in proc.stdout
        for table in (printed, written):
            assert re.search(
                rf"^{section} +section failed +{re.escape(message)} +runs to its end +FAIL$", table, re.M
            )
            assert re.search(rf"^sections +{section} +[0-9.]+ s +FAIL$", table, re.M)
        # kept in the file
        assert f"--- traceback of section {section}:\nTraceback (most recent call last):" in written
    for r in (0, 1):
        label = f"rank {r}/2: RuntimeError: failure injected at the end of section 'overlap hook'"
        assert re.search(rf"^overlap hook N=2 +section failed +{re.escape(label)}", written, re.M)
    # every section ran, those after the failures too, and their rows are in both tables
    for section in GPU_CHECK_SECTIONS:
        verdict = "FAIL" if section in GPU_CHECK_INJECTED else "ok"
        for table in (printed, written):
            assert re.search(rf"^sections +{re.escape(section)} +[0-9.]+ s +{verdict}$", table, re.M), section
    for section, item in (
        ("vote path", "LionCub 1bit, local steps h=2 outer=vote: 5 steps vs gloo"),  # after overlap hook
        ("vote path N=2", "rank 1/2: 1bit, local steps h=2: saved at step 3 and resumed = uninterrupted"),
        ("350M step", "plain Lion (foreach) step"),
        ("host syncs N=2", "rank 0/2: LionCub 1bit step, 8 tensors in 1 / 2 / 8 buckets"),
    ):
        for table in (printed, written):
            assert re.search(rf"^{re.escape(section)} +{re.escape(item)}", table, re.M), (section, item)
    assert written.startswith("section ") and "still running" not in written


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_gpu_check_without_cuda_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python benchmarks/gpu_check.py`` (no --dry-run) without CUDA: exit 2, saying so. Its ``main`` in
    this process (the script's module loaded as it runs, its ``sys.path`` and ``sys.argv``): it returns
    before it changes anything of the process."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # restored after the test, with the module's
    monkeypatch.setattr(sys, "argv", ["benchmarks/gpu_check.py"])
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    filters = list(warnings.filters)
    assert module.main() == 2
    assert "no CUDA GPU" in capsys.readouterr().out
    assert warnings.filters == filters  # returned before its warnings.simplefilter (and faulthandler)


# -- LionCub with the kernels in its step (what a CUDA run takes), against the plain torch step --------


@pytest.mark.slow
@pytest.mark.background("kernels_interp")
def test_lioncub_step_with_kernels_equals_the_torch_step(interpreter_results: dict[str, dict]) -> None:
    """The 1-bit majority repack, the L1 quantizer and the fused apply + momentum inside LionCub's step
    (2 gloo ranks, Triton's interpreter: case ``lioncub_steps`` of the interpreter job) give bit for bit
    the parameters and momenta of the torch step."""
    from processes import run_workers

    presets = STEP_PRESETS
    record = interpreter_results.get("lioncub_steps")
    assert record is not None and record["ok"], record
    steps = background.workdir("kernels_interp") / kernels_interp.STEPS_FILE
    interp = torch.load(steps, weights_only=False)
    assert interp["backend"] == "triton"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LIONCUB_CPU_KERNELS", "0")  # the ranks take the caller's environment
        plain = run_workers(worker_lioncub_kernels, 2, presets, None)[0]
    assert plain["backend"] == "torch" and plain["calls"] == {}
    # 3 steps × one bucket: 1 contribution and 1 apply each (1bit: + 1 repack; 8bit: + 1 quantize)
    assert interp["calls"] == {
        "majority_pack": 3,
        "quantize_l1": 3,
        "apply_votes_multi_": 9,
        "lion_directions_": 9,
    }
    for preset in presets:
        for key in ("params", "momenta"):
            for a, b in zip(interp[preset][key], plain[preset][key], strict=True):
                assert torch.equal(a, b), f"{preset}: {key} differ between the kernel and torch steps"
