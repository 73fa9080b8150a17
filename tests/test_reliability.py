"""Failure behaviour on several gloo ranks: non-finite gradients are skipped (or raised) on every rank
alike; ranks given different parameter lists fail at construction, naming the first difference; a dead or
stalled rank makes the others fail within the group's timeout, naming the operation and the step;
checkpoints are verified (SHA-256, ``weights_only``) and survive a crash mid-save; a rank killed with
SIGKILL mid-run is restarted from the last checkpoint (``lioncub train --restarts``, ``torchrun
--max-restarts``) and the run ends bitwise equal to an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import background
import kill_rank
import torchrun_runs
from lioncub import cli
from lioncub.optim import Lion, LionCub
from lioncub.optim.lioncub import Checks, NonFiniteGradientError, ReplicaMismatchError
from lioncub.train import checkpoint

from processes import run_workers

SHAPES = [(5, 7), (7,), (3, 3, 2)]
BAD = {2: (1, float("nan")), 4: (2, float("inf")), 5: (0, float("-inf"))}  # step: (rank, value)


def _params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_() for s in SHAPES]


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    grads = [torch.randn(s, generator=gen) for s in SHAPES]
    if step in BAD and BAD[step][0] == rank:
        grads[1][3] = BAD[step][1]  # one element of one tensor
    return grads


def _snapshot(opt: LionCub, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Parameters and momenta (zeros before the first step creates them)."""
    momenta = [opt.state[p].get("exp_avg", torch.zeros_like(p)) for p in params]
    return [t.detach().clone() for t in params + momenta]


def _train_with_bad_steps(rank: int, world_size: int, variant: str) -> dict:
    params = _params()
    opt = LionCub(params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1, variant=variant)
    log = []
    for step in range(1, 7):
        for p, g in zip(params, _grads(rank, step), strict=True):
            p.grad = g
        before = _snapshot(opt, params)
        opt.step()
        after = _snapshot(opt, params)
        stats = opt.comm_stats()["last"]
        log.append(
            {
                "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
                "skipped": stats["skipped_steps"],
                "collectives": stats["collectives"],
            }
        )
    return {
        "log": log,
        "params": [p.detach() for p in params],
        "momenta": [opt.state[p]["exp_avg"] for p in params],
        "total_skipped": opt.comm_stats()["total"]["skipped_steps"],
        "steps": opt.global_step,
    }


VARIANTS = ("1bit", "8bit", "32bit")


def _train_variants(rank: int, world_size: int) -> dict[str, dict]:
    return {v: _train_with_bad_steps(rank, world_size, v) for v in VARIANTS}


def test_nonfinite_gradients_are_skipped_on_every_rank() -> None:
    by_rank = run_workers(_train_variants, 3)
    for variant in VARIANTS:
        results = [r[variant] for r in by_rank]
        for rank, res in enumerate(results):
            for step, entry in enumerate(res["log"], start=1):
                if step in BAD:  # the bad rank and the good ones alike: nothing moved, only the check ran
                    assert entry == {"unchanged": True, "skipped": 1, "collectives": 1}, (variant, rank, step)
                else:
                    assert entry["skipped"] == 0 and not entry["unchanged"], (variant, rank, step)
            assert res["total_skipped"] == len(BAD) and res["steps"] == 6
            assert all(torch.isfinite(t).all() for t in res["params"] + res["momenta"])
            for p, p0 in zip(res["params"], results[0]["params"], strict=True):  # replicas stay identical
                assert torch.equal(p, p0), variant
        if variant != "32bit":  # per-rank momenta differ, but none took the NaN/Inf
            assert not torch.equal(results[0]["momenta"][0], results[1]["momenta"][0])


def _raise_on_bad(rank: int, world_size: int) -> str:
    params = _params()
    opt = LionCub(params, lr=0.01, variant="4bit", checks=Checks(nonfinite="raise"))
    for step in range(1, 3):
        for p, g in zip(params, _grads(rank, step), strict=True):
            p.grad = g
        try:
            opt.step()
        except NonFiniteGradientError as err:
            assert all(torch.isfinite(p).all() for p in params)
            return f"step {step}: {err}"
    return "no error"


def test_nonfinite_raise_names_the_rank_on_every_rank() -> None:
    messages = run_workers(_raise_on_bad, 3)
    for rank, msg in enumerate(messages):
        assert msg.startswith("step 2: ") and f"rank {rank}:" in msg, msg
        assert "at step 2 on rank(s) [1]" in msg and "nonfinite='raise'" in msg


def _mismatched(rank: int, world_size: int, kind: str) -> str:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)]
    if rank == 1 and kind == "shape":
        layers[1] = torch.nn.Linear(8, 3)
    if rank == 2 and kind == "extra":
        layers.append(torch.nn.Linear(2, 2))
    if rank == 1 and kind == "dtype":
        layers[0] = layers[0].double()
    model = torch.nn.Sequential(*layers)
    try:
        LionCub(model.parameters(), variant="1bit", model=model)
    except ReplicaMismatchError as err:
        return str(err)
    return "constructed"


MISMATCHES = {
    "shape": [
        "rank 1 has 4;",
        "'group 0 1.weight (2, 8) float32'",
        "rank 1 'group 0 1.weight (3, 8) float32'",
    ],
    "extra": ["rank 2 has 6;", "position 4", "rank 0 '(no parameter)'", "rank 2 'group 0 2.weight (2, 2)"],
    "dtype": ["first difference at position 0", "rank 1 'group 0 0.weight (8, 4) float64'"],
}


def _all_mismatches(rank: int, world_size: int) -> dict[str, str]:
    return {kind: _mismatched(rank, world_size, kind) for kind in MISMATCHES}


def test_mismatched_models_fail_at_construction_on_every_rank() -> None:
    by_rank = run_workers(_all_mismatches, 3, timeout=90.0)
    for kind, expected in MISMATCHES.items():
        for rank, messages in enumerate(by_rank):
            msg = messages[kind]
            assert msg.startswith(f"rank {rank}: the ranks do not optimize the same parameters"), msg
            for part in expected:
                assert part in msg, (kind, part, msg)


def _one_rank_skip(rank: int, world_size: int) -> tuple[list[float], int, list[float]]:
    p = torch.nn.Parameter(torch.ones(4))
    opt = LionCub([p], lr=0.1, variant="1bit")
    p.grad = torch.tensor([1.0, float("nan"), 1.0, 1.0])
    opt.step()
    skipped = p.detach().tolist(), opt.comm_stats()["total"]["skipped_steps"]
    p.grad = torch.ones(4)
    opt.step()
    return (*skipped, p.detach().tolist())


def test_nonfinite_on_one_rank_and_bad_option() -> None:
    after_nan, skipped, after_good = run_workers(_one_rank_skip, 1)[0]
    assert after_nan == [1.0] * 4 and skipped == 1
    assert after_good == pytest.approx([0.9] * 4)  # the next finite step applies: 1 - lr·sign(1)
    with pytest.raises(ValueError, match=r"nonfinite='ignore': allowed values are \['skip', 'raise'\]"):
        LionCub([torch.nn.Parameter(torch.ones(2))], checks=Checks(nonfinite="ignore"))


# ------------------------------------------------------------------------------------------ a rank dies

PG_TIMEOUT_S = 4.0  # what the stalled case waits for: short, but well above a step's few ms
FAULTS = ("kill", "stall")


def _die_or_stall(rank: int, world_size: int, workdir: Path, how: str) -> None:
    """Rank 1 dies (SIGKILL) or stalls at step 3; the others must fail in a bounded time, naming the
    operation and the step. Writes ``{"error", "elapsed"}`` of this rank to ``workdir/rank{rank}.json``."""
    import datetime
    import os
    import signal
    import time

    import torch.distributed as dist

    from lioncub.collectives import CollectiveError

    torch.set_num_threads(1)
    # the group's own timeout is long; LionCub bounds its waits by $LIONCUB_PG_TIMEOUT (`lioncub launch
    # --collective-timeout` sets it)
    os.environ["LIONCUB_PG_TIMEOUT"] = str(PG_TIMEOUT_S)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group(
        "gloo", init_method=f"file://{workdir / 'store'}", rank=rank, world_size=world_size, timeout=timeout
    )
    params = _params()
    opt = LionCub(params, lr=0.01, variant="1bit")
    t0 = time.monotonic()
    try:
        for step in range(1, 6):
            if rank == 1 and step == 3:
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(600)  # stall: alive, but never joins the vote
            for p, g in zip(params, _grads(rank, step), strict=True):
                p.grad = g
            t0 = time.monotonic()
            opt.step()
    except CollectiveError as err:
        (workdir / f"rank{rank}.json").write_text(
            json.dumps({"error": str(err), "elapsed": time.monotonic() - t0})
        )
        os._exit(3)
    os._exit(0)


@pytest.mark.slow
@pytest.mark.parametrize("how", [pytest.param(h, marks=pytest.mark.background(f"rank_{h}")) for h in FAULTS])
def test_a_dead_or_stalled_rank_makes_the_others_fail_within_the_timeout(how: str) -> None:
    key = f"rank_{how}"
    codes = background.result(key, BACKGROUND[key])
    for r in (0, 2):
        assert codes[r] == 3, f"rank {r} did not fail (exit code {codes[r]})"
        report = json.loads((background.workdir(key) / f"rank{r}.json").read_text())
        assert report["elapsed"] < PG_TIMEOUT_S + 5.0, report  # bounded by the group's timeout
        if how == "stall":  # nothing tells the others but the timeout
            assert report["elapsed"] > PG_TIMEOUT_S - 1.0, report
        # the first collective of step 3 is the non-finite check; the error names it and the step
        assert report["error"].startswith(f"rank {r}/3: step check failed at optimizer step 3")


# ------------------------------------------------------------------------------ checkpoints and restarts


def _save_tiny(run_dir: Path, step: int, barrier=lambda: None) -> None:
    torch.manual_seed(step)
    model = torch.nn.Linear(3, 2)
    opt = Lion(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    checkpoint.save(
        run_dir,
        step=step,
        rank=0,
        world_size=1,
        model=model,
        optimizer=opt,
        data_state={"workload": "gpt", "size": "tiny", "sampler": {"position": step}},
        meta={"variant": "32bit", "workload": "gpt", "size": "tiny", "seed": 0},
        barrier=barrier,
    )


def test_checkpoints_are_verified_and_a_crash_mid_save_keeps_the_previous(tmp_path: Path) -> None:
    _save_tiny(tmp_path, 3)
    np.random.seed(5)
    _save_tiny(tmp_path, 6)
    after_save = np.random.rand(3)
    meta = checkpoint.latest(tmp_path)
    assert meta.step == 6 and set(meta.sha256) == {"model.pt", "rank0.pt"}
    leftovers = [p.name for p in (tmp_path / "checkpoints").rglob("*") if p.suffix in (".part", ".sha256")]
    assert leftovers == [] and not list((tmp_path / "checkpoints").glob(".tmp_*"))
    state = checkpoint.load_rank_state(meta, 0, 1)  # weights_only=True: tensors and plain values only
    checkpoint.restore_rng(state)
    np.testing.assert_array_equal(np.random.rand(3), after_save)  # numpy RNG stored as tensors, exact

    # a crash after the rank files, before meta.json and the rename: "latest" still names step 6
    calls = []

    def crash_on_second_barrier() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        _save_tiny(tmp_path, 9, barrier=crash_on_second_barrier)
    assert checkpoint.latest(tmp_path).step == 6
    assert checkpoint.model_state(checkpoint.latest(tmp_path))["weight"].shape == (2, 3)

    # truncated and altered files: a clear error naming the file and the previous checkpoint
    rank_file, model_file = meta.path / "rank0.pt", meta.path / "model.pt"
    data = rank_file.read_bytes()
    rank_file.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        checkpoint.CorruptCheckpointError, match=r"rank0\.pt is truncated or corrupted"
    ) as err:
        checkpoint.load_rank_state(meta, 0, 1)
    assert "nothing was loaded" in str(err.value) and "previous checkpoint step_00000003" in str(err.value)
    blob = bytearray(model_file.read_bytes())
    blob[len(blob) // 2] ^= 0x01  # one bit
    model_file.write_bytes(bytes(blob))
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"model\.pt is truncated or corrupted"):
        checkpoint.model_state(meta)
    model_file.unlink()
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"cannot read model\.pt"):
        checkpoint.model_state(meta)


TINY = torchrun_runs.TINY  # 6 steps, checkpoints at 3 and 6 (the torchrun job's run too)
TINY_RUN = [*TINY, "--nproc", "2"]


def _same_final_model(a: Path, b: Path) -> None:
    ma, mb = checkpoint.latest(a), checkpoint.latest(b)
    assert ma.step == mb.step == 6
    sa, sb = checkpoint.model_state(ma), checkpoint.model_state(mb)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    for r in range(2):
        oa, ob = (checkpoint.load_rank_state(m, r, 2)["optimizer"]["state"] for m in (ma, mb))
        assert all(torch.equal(oa[i]["exp_avg"], ob[i]["exp_avg"]) for i in oa)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "run"
    assert cli.main([*TINY_RUN, "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_killed_rank_restarts_from_the_checkpoint_bitwise(
    uninterrupted: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The first attempt fails on the SIGKILL (that a run without ``--restarts`` then fails, naming the
    rank, is tests/test_rundir.py's ``test_a_failed_new_run_leaves_nothing_in_the_way``); the second
    resumes from step 3 and ends as the uninterrupted run."""
    out = tmp_path / "restarted"
    with kill_rank.launches("1:5"):  # rank 1 SIGKILLs itself after the backward of step 5 (first attempt)
        assert cli.main([*TINY_RUN, "--out", str(out), "--restarts", "1"]) == 0
    printed = capsys.readouterr()
    assert "rank 1 was killed by SIGKILL; stopping rank 0" in printed.err, printed.err
    assert "restarting all ranks (1/1)" in printed.err, printed.err
    assert f"resumed from {out}/checkpoints/step_00000003 at step 3" in printed.out + printed.err
    _same_final_model(uninterrupted, out)
    steps = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["kind"] == "step"] == list(range(1, 7))  # steps 4-5 rewritten


#: started in the background when collection ends (tests/background.py), in the order of the tests: 3 spawned
#: ranks of _die_or_stall per fault (the test waits for ranks 0 and 2; spawning and importing torch included
#: in the 90 s), and tests/torchrun_runs.py's jobs (torchrun's workers; shared with tests/test_topology.py):
#: its ``kill`` job runs ``lioncub.cli train`` through ``tests/kill_rank.py``, every rank forked through
#: lioncub's worker shim, rank 1 of the first attempt SIGKILLing itself after the backward of step 5
BACKGROUND = {
    **{
        f"rank_{how}": lambda how=how: background.Spawned(_die_or_stall, 3, (how,), 90.0, wait_for=(0, 2))
        for how in FAULTS
    },
    "torchruns": torchrun_runs.job,
}


@pytest.mark.slow
@pytest.mark.background("torchruns")
def test_killed_rank_under_torchrun_max_restarts_bitwise(uninterrupted: Path) -> None:
    proc = background.result("torchruns", BACKGROUND["torchruns"])
    done = torchrun_runs.runs(background.workdir("torchruns"), proc)["kill"]
    out = background.workdir("torchruns") / "torchrun"
    assert done["rc"] == 0, done["output"][-3000:]
    # torchrun saw rank 1 die of SIGKILL, then restarted
    assert "exitcode: -9) local_rank: 1" in done["output"]
    _same_final_model(uninterrupted, out)
