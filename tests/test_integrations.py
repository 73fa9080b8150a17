"""``lioncub.integrations`` with the real frameworks: Hugging Face Trainer, accelerate, Lightning.

A launch of 2 gloo ranks per framework (``tests/framework_jobs.py``; every framework's launches in one
job started in the background when collection ends) runs every scenario; each rank writes what it saw,
and the tests here compare: for 1bit and 8bit, plain and overlapped — the gradients LionCub gets are each
rank's own (they differ across ranks), the replicas end identical, the framework's lr schedule sets the lr
LionCub applies, gradient accumulation 2 gives the gradient of the same samples in one batch, and a run
resumed through the framework's own resume path from a checkpoint after 3 of 6 steps is bitwise the
uninterrupted run on every rank (parameters and that rank's momenta). Plus the refusals, the examples and
the README's blocks.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import framework_jobs as jobs

from processes import context

REPO = Path(__file__).resolve().parents[1]
NEEDS = jobs.NEEDS
EXTRA = {"hf": "hf", "accelerate": "hf", "lightning": "lightning"}
RUNS = [f"{v}-{m}" for v in ("1bit", "8bit") for m in ("plain", "overlap")]


#: one sequence of launched jobs per framework (shared with tests/test_framework_guards.py), all in one job
#: started in the background when collection ends
BACKGROUND = jobs.BACKGROUND
_LOADED: dict[str, dict[str, list[dict[str, Any]]]] = {}


def results(framework: str) -> dict[str, list[dict[str, Any]]]:
    """scenario -> [what rank 0 saw, what rank 1 saw] (fails with the job's output if it failed)."""
    if framework in _LOADED:
        return _LOADED[framework]
    missing = jobs.missing(framework)
    if missing:
        pytest.skip(f"{missing} not installed (the {EXTRA[framework]} extra, docs/install.md)")
    loaded = jobs.sequence_results(framework)
    _LOADED[framework] = loaded
    return loaded


def scenario(framework: str, name: str) -> list[dict[str, Any]]:
    got = results(framework)
    assert name in got, f"{framework}: no result for scenario {name!r} (has {sorted(got)})"
    assert "error" not in got[name][0], got[name][0].get("error")
    return got[name]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ (or are missing on one side)."""
    return sorted(n for n in a.keys() | b.keys() if n not in a or n not in b or not torch.equal(a[n], b[n]))


def _marks(framework: str) -> list[Any]:
    return [pytest.mark.slow, pytest.mark.background(jobs.KEY)]


def _cases(runs: list[str] = RUNS) -> list[Any]:
    return [pytest.param(f, run, marks=_marks(f), id=f"{f}-{run}") for f in NEEDS for run in runs]


# -- the runs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("framework", "run"), _cases())
def test_local_gradients_vote_and_replicas_agree(framework: str, run: str) -> None:
    r0, r1 = scenario(framework, run)
    # DDP's allreduce did not run: the gradients LionCub got are each rank's own
    assert _equal(r0["first_grads"], r1["first_grads"]) == sorted(r0["first_grads"])
    assert _equal(r0["params"], r1["params"]) == []  # identical replicas after the votes
    assert _equal(r0["momenta"], r1["momenta"]) != []  # each rank keeps its own momentum
    assert r0["opt_step"] == r1["opt_step"] == jobs.STEPS
    assert r0["overlapping"] is r1["overlapping"] is run.endswith("overlap")
    if run.endswith("overlap"):
        assert r0["overlapped_s"] > 0  # the votes ran in the backward pass


@pytest.mark.parametrize(("framework", "run"), _cases())
def test_the_framework_schedule_sets_the_lr(framework: str, run: str) -> None:
    """Every framework's schedule is lr·(1 − k/6) at optimizer step k; the largest change of an undecayed
    parameter in that step is the lr LionCub applied (|Δp| = lr·|u|, with some |u| = 1)."""
    for r in scenario(framework, run):
        expected = [jobs.LR * (1 - k / jobs.STEPS) for k in range(jobs.STEPS)]
        assert [lrs[0] for lrs in r["lrs"]] == pytest.approx(expected, rel=1e-9)
        assert all(len(set(lrs)) == 1 for lrs in r["lrs"])  # both param groups
        assert r["deltas"] == pytest.approx(expected, rel=2e-3)


@pytest.mark.parametrize(("framework", "run"), _cases())
def test_resume_through_the_framework_is_bitwise(framework: str, run: str) -> None:
    full, resumed = scenario(framework, run), scenario(framework, f"{run}-resume")
    for rank in (0, 1):
        assert resumed[rank]["opt_step"] == full[rank]["opt_step"] == jobs.STEPS
        assert _equal(full[rank]["params"], resumed[rank]["params"]) == [], f"rank {rank}"
        assert _equal(full[rank]["momenta"], resumed[rank]["momenta"]) == [], f"rank {rank}"
        assert len(full[rank]["momenta"]) == len(full[rank]["params"])
        assert resumed[rank]["lrs"] == full[rank]["lrs"][jobs.SAVE_AT :]


@pytest.mark.parametrize("framework", [pytest.param(f, marks=_marks(f)) for f in NEEDS])
def test_local_steps_through_the_framework_resume_in_the_middle_of_a_window(framework: str) -> None:
    """``local_steps={"h": 2, "inner_momentum": "keep"}``: after the window of steps 5–6 the replicas are
    one again, each rank's inner momentum its own; the checkpoint after step 3 (mid-window: the framework
    saved rank 0's replica as the model) resumes bitwise on every rank, its own replica restored from its
    optimizer state."""
    full, resumed = scenario(framework, "local"), scenario(framework, "local-resume")
    assert _equal(full[0]["first_grads"], full[1]["first_grads"]) == sorted(full[0]["first_grads"])
    assert _equal(full[0]["params"], full[1]["params"]) == []
    assert _equal(full[0]["momenta"], full[1]["momenta"]) != []
    for rank in (0, 1):
        assert resumed[rank]["opt_step"] == full[rank]["opt_step"] == jobs.STEPS
        assert _equal(full[rank]["params"], resumed[rank]["params"]) == [], f"rank {rank}"
        assert _equal(full[rank]["momenta"], resumed[rank]["momenta"]) == [], f"rank {rank}"
    if framework == "accelerate":  # save_state in the window's middle wrote θ of step 2, not a replica
        for r in full:
            assert sorted(r["saved_model"]) == sorted(r["before_save"])
            assert _equal(r["saved_model"], r["before_save"]) == []


@pytest.mark.parametrize("framework", [pytest.param(f, marks=_marks(f)) for f in NEEDS])
def test_accumulation_keeps_every_micro_batch(framework: str) -> None:
    """One step of 2 accumulated micro-batches against one batch of the same samples (per rank or, where
    the framework shards batch by batch, over both ranks): the no-sync micro-batch kept its gradient."""
    accumulated, big = scenario(framework, "accum"), scenario(framework, "big")
    names = sorted(accumulated[0]["first_grads"])
    assert names == sorted(big[0]["first_grads"])
    for name in names:
        a = accumulated[0]["first_grads"][name] + accumulated[1]["first_grads"][name]
        b = big[0]["first_grads"][name] + big[1]["first_grads"][name]
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
        assert not torch.equal(accumulated[0]["first_grads"][name], accumulated[1]["first_grads"][name])


@pytest.mark.slow
@pytest.mark.background(jobs.KEY)
@pytest.mark.parametrize("run", RUNS)
def test_trainer_weight_decay_split(run: str) -> None:
    """LionCub's groups are the Trainer's: ``args.weight_decay`` on get_decay_parameter_names (matrices),
    none on biases and norms."""
    r0 = scenario("hf", run)[0]
    (decayed, wd), (plain, no_wd) = r0["groups"]
    assert (wd, no_wd) == (jobs.WEIGHT_DECAY, 0.0)
    assert set(decayed) == set(r0["decay"]) & set(r0["params"])
    assert set(plain) == set(r0["params"]) - set(decayed)
    assert plain and all(r0["params"][n].ndim == 1 for n in plain)


@pytest.mark.slow
@pytest.mark.background(jobs.KEY)
def test_trainer_logs_the_bytes_per_step() -> None:
    for run in RUNS:
        for r in scenario("hf", run):
            assert len(r["logs"]) == jobs.STEPS
            for log in r["logs"]:
                assert log["lioncub_bytes_sent_per_step"] == r["bytes_last"] > 0
                assert log["lioncub_skipped_steps"] == 0


# -- refusals, examples, README -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.background(jobs.KEY)
def test_trainer_refusals() -> None:
    for r in scenario("hf", "refusals"):
        assert "max_grad_norm=1.0" in r["overlap_clip"] and "max_grad_norm=0" in r["overlap_clip"]
        assert "lr=" in r["lr_option"] and "learning_rate" in r["lr_option"]


@pytest.mark.slow
@pytest.mark.background(jobs.KEY)
def test_trainer_optimizer_factory_both_ways() -> None:
    for r in scenario("hf", "factory"):
        (decayed, wd, betas), (plain, no_wd, _) = r["by_model"]
        assert (wd, no_wd, betas) == (jobs.WEIGHT_DECAY, 0.0, (0.9, 0.99)) and decayed and plain
        assert r["by_groups"] == [(decayed + plain, 0.5, jobs.LR)]
        assert r["variants"] == ["8bit", "8bit"]


@pytest.mark.slow
@pytest.mark.background(jobs.KEY)
def test_accelerate_refuses_a_callable_comm_hook() -> None:
    for r in scenario("accelerate", "comm_hook"):
        message = r["message"]
        assert message.startswith("ValueError: lioncub.integrations.accelerate.prepare")
        assert "comm_hook=<function" in message and "silently ignored" in message
        assert "DDPCommunicationHookType" in message


@pytest.mark.slow
@pytest.mark.background(jobs.KEY)
def test_lightning_refusals() -> None:
    for r in scenario("lightning", "refusals"):
        assert "gradient_clip_val=1.0" in r["overlap_clip"]
        assert "ddp_comm_hook=" in r["comm_hook"]


@pytest.mark.parametrize("framework", [pytest.param(f, marks=_marks(f)) for f in NEEDS])
@pytest.mark.parametrize("what", ["example", "readme"])
def test_examples_and_readme_blocks_run(framework: str, what: str) -> None:
    """``examples/*.py`` (2 steps) and the README's ``python hf|accelerate|lightning`` blocks, on 2 ranks."""
    for r in scenario(framework, what):
        assert r["ran"]


@pytest.mark.parametrize("framework", [pytest.param(f, marks=_marks(f)) for f in NEEDS])
def test_the_examples_command_sequences_run_in_order(framework: str) -> None:
    """Each example's docstring commands, run in order in the job (``--steps`` shrunk to 2, the resume to
    4): the second writes into its own ``--out``, the third resumes the first's and ends at step 4 (the
    HF Trainer's checkpoint-4, accelerate's step.txt, Lightning's last.ckpt)."""
    for r in scenario(framework, "example"):
        first, second, third = r["outs"]
        assert second != first and third == first
        assert r["final_step"] == jobs.RESUMED_STEPS


@pytest.mark.slow
@pytest.mark.background(jobs.KEY)
def test_the_readme_lightning_recipe_resumes_when_run_again() -> None:
    """The README's Lightning block run twice in one directory: the first trains its 2 epochs from no
    checkpoint; the second starts from the first's checkpoints/last.ckpt and reads no sample (with a
    logger, each run writes to a new lightning_logs/version_N/ and ``ckpt_path="last"`` finds nothing)."""
    runs = zip(scenario("lightning", "readme"), scenario("lightning", "readme-again"), strict=True)
    for first, again in runs:
        assert first["ckpt_path"] is None
        assert first["reads"] == 2 * first["samples"] // 2  # 2 epochs of this rank's half
        assert again["ckpt_path"].endswith("runs/lightning/checkpoints/last.ckpt")
        assert again["reads"] == 0 and again["global_step"] == first["global_step"] > 0


def test_every_tagged_readme_block_is_run_by_a_framework_job() -> None:
    """tests/test_readme.py runs the untagged ```python blocks; the tagged ones run in the jobs here."""
    tags = re.findall(r"```python (\S+)\n", (REPO / "README.md").read_text())
    assert sorted(tags) == sorted(NEEDS)


# -- without the frameworks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "hidden", "extra"),
    [
        ("lioncub.integrations.hf", "transformers", "hf"),
        ("lioncub.integrations.accelerate", "accelerate", "hf"),
        ("lioncub.integrations.lightning", "lightning", "lightning"),
    ],
)
def test_a_missing_framework_names_the_extra(
    module: str, hidden: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    importlib.import_module("lioncub.integrations")  # the package itself imports no framework
    importlib.import_module("lioncub.integrations.common")
    monkeypatch.setitem(sys.modules, hidden, None)  # `import hidden` raises ImportError
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=re.escape(
        f"pip install '.[{extra}]' in a clone of lioncub, or its wheel with [{extra}]"
    )) as err:
        importlib.import_module(module)
    assert repr(hidden) in str(err.value)
    monkeypatch.delitem(sys.modules, module, raising=False)


@pytest.mark.slow
def test_the_package_imports_no_framework(tmp_path: Path) -> None:
    """In a new process forked from the worker pool's fork server (``processes.context``: torch imported,
    neither lioncub nor a framework; a fresh interpreter costs ~2 CPU-s more and imports the same before
    lioncub), importing ``lioncub.integrations`` and its ``common`` imports no framework."""
    got = tmp_path / "frameworks.json"
    code = (
        "import json, sys, lioncub.integrations, lioncub.integrations.common\n"
        "frameworks = ('transformers', 'accelerate', 'lightning')\n"
        f"open({str(got)!r}, 'w').write(json.dumps([m for m in frameworks if m in sys.modules]))\n"
    )
    proc = context().Process(target=exec, args=(code,))  # a builtin: the fork imports nothing more
    proc.start()
    proc.join(60)
    if proc.is_alive():
        proc.kill()
    assert proc.exitcode == 0 and json.loads(got.read_text()) == []
