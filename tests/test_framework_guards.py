"""Issue 26's framework half, through each framework on gloo ranks (``tests/framework_jobs.py``: the
``*-guards`` scenario sets in the 2-rank launches of tests/test_integrations.py's scenarios, then
``hf-resize`` on 3 ranks from a 2-rank checkpoint).

* A save that a user's callback requests (``should_save`` set in ``on_evaluate``, or by a callback added
  after the Trainer was built) holds every rank's momenta: the resume is bitwise on every rank.
* ``torch.compile`` through the frameworks: ``TrainingArguments(torch_compile=True)`` and
  ``Accelerator(dynamo_backend=...)`` compile around the DDP model (with the ``"eager"`` backend, the
  cheapest that still makes an ``OptimizedModule``: inductor would compile C++ on this CPU).
* Local steps: the Trainer warns of a ``max_steps`` or an ``eval_steps`` that ends or evaluates mid-window.
* Lightning's ``gradient_clip_val`` under ``bf16-mixed`` (no scaler) and ``16-mixed`` (a GradScaler).
* ``allow_world_size_change`` through ``trainer.train(resume_from_checkpoint=...)``; a warning for
  ``TrainingArguments(optim=...)``, which LionCubTrainer ignores; one warning for a resume from a
  ``save_only_model=True`` checkpoint (no optimizer state: zero momenta).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import framework_jobs as jobs

#: one sequence per framework (tests/framework_jobs.py): tests/test_integrations.py's scenarios, then these
BACKGROUND = jobs.BACKGROUND

_LOADED: dict[str, dict[str, list[dict[str, Any]]]] = {}


def scenario(framework: str, name: str) -> list[dict[str, Any]]:
    """What each rank saw in scenario ``name`` (fails with the jobs' output if they failed)."""
    if framework not in _LOADED:
        if jobs.missing(framework):
            pytest.skip(f"{jobs.missing(framework)} not installed")
        _LOADED[framework] = jobs.sequence_results(framework)
    got = _LOADED[framework]
    assert name in got, f"{framework}: no result for scenario {name!r} (has {sorted(got)})"
    assert "error" not in got[name][0], got[name][0]["error"]
    return got[name]


def differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ (or are missing on one side)."""
    return sorted(n for n in a.keys() | b.keys() if n not in a or n not in b or not torch.equal(a[n], b[n]))


def marks(framework: str) -> list[Any]:
    return [
        pytest.mark.slow,
        pytest.mark.background(jobs.KEY),
        pytest.mark.timeout(jobs.JOB_TIMEOUT + 60),
    ]


HF = marks("hf")


@pytest.mark.parametrize("run", [pytest.param("eval-save", marks=HF), pytest.param("late-save", marks=HF)])
def test_a_save_requested_by_a_users_callback_keeps_every_rank(run: str) -> None:
    """``eval-save``: a callback sets ``should_save`` in ``on_evaluate`` (LionCubCallback on a Trainer
    subclass); ``late-save``: one added with ``add_callback`` after LionCubTrainer was built sets it in
    ``on_step_end``. Either way the resume restores each rank's own momenta and ends bitwise equal."""
    full, resumed = scenario("hf", run), scenario("hf", f"{run}-resume")
    assert differ(full[0]["momenta_saved"], full[1]["momenta_saved"]) != []  # each rank has its own
    for rank in (0, 1):
        assert resumed[rank]["opt_step_loaded"] == jobs.SAVE_AT
        assert differ(full[rank]["momenta_saved"], resumed[rank]["momenta_loaded"]) == [], f"rank {rank}"
        assert resumed[rank]["opt_step"] == full[rank]["opt_step"] == jobs.STEPS
        assert differ(full[rank]["params"], resumed[rank]["params"]) == [], f"rank {rank}"
        assert differ(full[rank]["momenta"], resumed[rank]["momenta"]) == [], f"rank {rank}"


@pytest.mark.parametrize("framework", [pytest.param(f, marks=marks(f)) for f in ("hf", "accelerate")])
def test_torch_compile_around_ddp(framework: str) -> None:
    """The framework compiles around the DDP model; the vote is installed on the DDP model inside."""
    r0, r1 = scenario(framework, "compile")
    assert r0["wrapped"] == r1["wrapped"] == "OptimizedModule"
    assert differ(r0["first_grads"], r1["first_grads"]) == sorted(r0["first_grads"])  # no allreduce
    assert differ(r0["params"], r1["params"]) == []
    assert r0["opt_step"] == r1["opt_step"] == jobs.STEPS


@pytest.mark.slow
@pytest.mark.background(jobs.KEY)
@pytest.mark.timeout(jobs.JOB_TIMEOUT + 60)
@pytest.mark.parametrize(("run", "scaler"), [("bf16-clip", "NoneType"), ("16-clip", "GradScaler")])
def test_lightning_clips_under_mixed_precision(run: str, scaler: str) -> None:
    """``gradient_clip_val`` clips each rank's local (unscaled) gradient: its norm is the clip value after
    clipping, and the momenta, averages of clipped gradients, stay within it (a clip of the scaled
    gradients would leave them ~65536 times smaller)."""
    ranks = scenario("lightning", run)
    for r in ranks:
        assert r["scaler"] == scaler and r["opt_step"] == jobs.STEPS
        assert r["clipped"] == pytest.approx([jobs.CLIP] * jobs.STEPS, rel=1e-4)
        norm = float(torch.stack([m.double().norm() for m in r["momenta"].values()]).norm())
        assert 0.01 * jobs.CLIP < norm <= (1 - 0.99**jobs.STEPS) * jobs.CLIP
    assert differ(ranks[0]["params"], ranks[1]["params"]) == []


@pytest.mark.slow
@pytest.mark.background(jobs.KEY)
@pytest.mark.timeout(jobs.JOB_TIMEOUT + 60)
def test_trainer_resumes_on_another_world_size_when_allowed() -> None:
    """A 2-rank checkpoint resumed on 3 ranks: refused, naming the option; with
    ``lioncub=dict(allow_world_size_change=True)``, rank r takes saved rank r mod 2's momenta."""
    for r in scenario("hf", "resize-refused"):
        message = r["message"]
        assert "state of 2 ranks, this job has 3" in message
        assert "LionCubTrainer(..., lioncub=dict(allow_world_size_change=True))" in message
    saved, resized = scenario("hf", "late-save"), scenario("hf", "resize")
    assert len(resized) == 3
    for rank, r in enumerate(resized):
        assert r["opt_step_loaded"] == jobs.SAVE_AT and r["opt_step"] == jobs.STEPS
        assert differ(r["momenta_loaded"], saved[rank % 2]["momenta_saved"]) == [], f"rank {rank}"
        assert differ(r["params"], resized[0]["params"]) == []


@pytest.mark.slow
@pytest.mark.background(jobs.KEY)
@pytest.mark.timeout(jobs.JOB_TIMEOUT + 60)
def test_trainer_warns_that_optim_is_ignored() -> None:
    for r in scenario("hf", "optim-arg"):
        assert r["None"] == []  # the default optim: no warning
        [message] = r["adafactor"]
        assert "TrainingArguments(optim='adafactor') is ignored" in message
        assert "lioncub=dict(" in message


@pytest.mark.slow
@pytest.mark.background(jobs.KEY)
@pytest.mark.timeout(jobs.JOB_TIMEOUT + 60)
def test_a_resume_without_optimizer_state_warns_once() -> None:
    """``save_only_model=True`` checkpoints hold no optimizer state: the resume warns once (rank 0) that
    the momenta start from zero, and LionCub continues at the checkpoint's step (the tie phase keeps its
    place); a resume from a full checkpoint does not warn."""
    resumed = scenario("hf", "only-model-resume")
    warned = [[w for w in r["warned"] if "holds no optimizer state" in w] for r in resumed]
    assert len(warned[0]) == 1 and warned[1] == []
    assert "save_only_model=True" in warned[0][0] and "zero momenta" in warned[0][0]
    assert all(r["opt_step_loaded"] == jobs.SAVE_AT and r["opt_step"] == jobs.STEPS for r in resumed)
    full = scenario("hf", "late-save-resume")
    assert not any("holds no optimizer state" in w for r in full for w in r["warned"])


@pytest.mark.slow
@pytest.mark.background(jobs.KEY)
@pytest.mark.timeout(jobs.JOB_TIMEOUT + 60)
def test_trainer_evaluates_the_shared_parameters_in_a_window_and_warns_of_an_odd_end() -> None:
    """``local_steps=2`` with ``max_steps=3`` and ``eval_steps=1`` (and an evaluation at step 0): rank 0
    warns once that the run ends in a window's middle; the evaluations in a window's middle are of θ of
    its last outer step — step 1's equals step 0's, step 3's equals step 2's — the same on every rank."""
    ranks = scenario("hf", "local-odd")
    ends = [[w for w in r["warned"] if "is not a multiple of local_steps h=2" in w] for r in ranks]
    assert [len(e) for e in ends] == [1, 0] and "max_steps=3" in ends[0][0]
    assert not any("in the middle of a window" in w for r in ranks for w in r["warned"])
    evals = [dict(r["evals"]) for r in ranks]
    assert evals[0] == evals[1] and sorted(evals[0]) == [0, 1, 2, 3]
    assert evals[0][1] == evals[0][0] and evals[0][3] == evals[0][2] != evals[0][0]


@pytest.mark.slow
@pytest.mark.background(jobs.KEY)
@pytest.mark.timeout(jobs.JOB_TIMEOUT + 60)
def test_lightning_validates_and_checkpoints_the_shared_parameters_in_a_window() -> None:
    """``local_steps`` H = 2, validated after every micro-batch (Lightning counts those): a validation in a
    window's middle (after optimizer steps 1, 3, 5) sees θ of the last outer step — the parameters after
    the previous even step, the same on both ranks — and the checkpoint at step 3 holds θ of step 2, not
    rank 0's replica; each rank's replica is back for the next step (the replicas differ after odd steps)."""
    r0, r1 = scenario("lightning", "local-val")
    for r in (r0, r1):
        seen = dict(r["validated"])  # optimizer step -> the parameters its last validation saw
        assert sorted(seen) == list(range(jobs.STEPS + 1))
        for step, params in seen.items():
            shared = r["after"][step - step % 2]  # θ of the last outer step (step itself when even)
            assert all(torch.equal(a, b) for a, b in zip(params, shared, strict=True)), step
        assert all(torch.equal(a, b) for a, b in zip(r["ckpt_model"], r["after"][2], strict=True))
    assert all(
        torch.equal(a, b) for a, b in zip(dict(r0["validated"])[3], dict(r1["validated"])[3], strict=True)
    )
    assert not all(torch.equal(a, b) for a, b in zip(r0["after"][3], r1["after"][3], strict=True))


def test_the_guard_jobs_exist() -> None:
    """Every job named here is a scenario set of tests/framework_jobs.py (``NAME/SCENARIO``: that set's;
    ``NAME+NAME``: those sets), and every set is run."""
    jobs_named = [name.split("/")[0] for runs in jobs.SEQUENCES.values() for name, _ in runs]
    named = {part for name in jobs_named for part in name.split("+")}
    assert named == set(jobs.SCENARIOS)
