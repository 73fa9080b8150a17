"""Checkpoints of a fault-tolerant job, in-process (issue 47; the launched runs are in
tests/test_replica_groups_cli.py): the schedule seen from a resume (:func:`lioncub.launch.groups.
schedule_after`) against a step-by-step replay of the whole schedule; a checkpoint written in parts by
processes without a barrier (:mod:`lioncub.train.checkpoint`: ``write_part``, ``complete_parts``,
``paths``, ``drop_incomplete``); the groups' files put back to a checkpoint (``rewind``); the steps that
are checkpointed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from lioncub.launch.groups import parse_faults, schedule_after
from lioncub.train import checkpoint
from lioncub.train.config import TrainConfig
from lioncub.train.fault_tolerant import resume_refusal, rewind
from lioncub.train.replica_group import checkpoint_steps, cut_name, end_name, ended_name, log_name, ready_name


def replay(faults: list, groups: int, upto: int) -> tuple[list[int], set[int]]:
    """Each group's number of starts so far (its current life, counting from 0) and the dead ones, event by
    event up to step ``upto`` -- what the launcher does to the groups."""
    starts, dead = [0] * groups, set()
    for f in sorted(faults):
        if f.step > upto:
            break
        if f.kind == "kill":
            dead.add(f.group)
        else:
            starts[f.group] += 1
            dead.discard(f.group)
    return starts, dead


@pytest.mark.parametrize(
    ("kill", "rejoin", "h"),
    [(["1@5", "1@20", "2@7"], ["1@12", "1@30"], None), (["0@3", "2@9"], ["0@6"], 2), ([], [], None)],
)
def test_the_schedule_seen_from_a_resume_continues_the_whole_one(
    kill: list, rejoin: list, h: int | None
) -> None:
    """At every step c: the groups alive then start as the life they have in the whole run, the dead ones
    wait for their next rejoin, whose life is one more; the events after c, carried out from there, leave
    every group as the whole schedule does."""
    faults = parse_faults(kill, rejoin, 3, 40, h)
    for c in range(0, 40):
        resumed = schedule_after(faults, 3, c)
        starts, dead = replay(faults, 3, c)
        assert resumed.absent == dead, c
        assert list(resumed.lives) == [n + (g in dead) for g, n in enumerate(starts)], c
        assert all(f.step > c for f in resumed.pending)
        assert sorted([*resumed.pending, *(f for f in faults if f.step <= c)]) == sorted(faults)
        # the launcher starts life lives[g] + k at the k-th rejoin after c: the whole run's numbering
        later = [sum(1 for f in resumed.pending if f.group == g and f.kind == "rejoin") for g in range(3)]
        final_starts, _ = replay(faults, 3, 40)
        assert [resumed.lives[g] + later[g] - (g in dead) for g in range(3)] == final_starts, c
    resumed = schedule_after(faults, 3, 0)
    assert resumed.lives == (0, 0, 0) and not resumed.absent and list(resumed.pending) == faults


def test_the_checkpoint_of_step_25_after_kill_and_rejoins() -> None:
    """Hand-checked: ``--kill 1@5,1@20,2@7 --rejoin 1@12,1@30``, resumed after step 25: group 1 killed in
    its second life (after its rejoin at 12) waits for its rejoin at 30, its life 2; group 2 stays dead."""
    faults = parse_faults(["1@5", "1@20", "2@7"], ["1@12", "1@30"], 3, 40)
    resumed = schedule_after(faults, 3, 25)
    assert resumed.lives == (0, 2, 1) and resumed.absent == {1, 2}
    assert [f.spec for f in resumed.pending] == ["--rejoin 1@30"]


def _write(run_dir: Path, step: int, ranks: list[int], model: bool = True) -> dict[str, str]:
    sha = {}
    for r in ranks:
        data, sha[f"rank{r}.pt"] = checkpoint.encode({"optimizer": {"momentum": torch.full((3,), float(r))}})
        checkpoint.write_part(run_dir, step, f"rank{r}.pt", data, sha[f"rank{r}.pt"])
    if model:
        data, sha["model.pt"] = checkpoint.encode({"w": torch.arange(4.0) + step})
        checkpoint.write_part(run_dir, step, "model.pt", data, sha["model.pt"])
    return sha


META = {"variant": "1bit", "workload": "gpt", "size": "tiny", "seed": 0}


def test_a_checkpoint_in_parts_is_complete_only_with_every_part(tmp_path: Path) -> None:
    """Ranks 0 and 2 of 3 write their parts (rank 1's group was outside the quorum), the first participant
    completes it: every file's SHA-256 in meta.json, ``latest`` naming it, and every path it made is among
    those :func:`~lioncub.train.checkpoint.paths` records beforehand; the older ones beyond ``keep`` go.
    Without ``model.pt`` or with a part missing nothing is renamed."""
    ft = {"ranks": [0, 2]}
    for step in (4, 8, 12):
        sha = _write(tmp_path, step, [0, 2])
        assert checkpoint.parts_written(tmp_path, step) == [0, 2]
        checkpoint.complete_parts(tmp_path, step, 3, [0, 2], {**META, "fault_tolerant": ft})
    meta = checkpoint.latest(tmp_path)
    assert meta is not None and (meta.step, meta.world_size, meta.extra) == (12, 3, {"fault_tolerant": ft})
    got = {
        n: hashlib.sha256((meta.path / n).read_bytes()).hexdigest()
        for n in ("model.pt", "rank0.pt", "rank2.pt")
    }
    assert meta.sha256 == got == sha
    assert torch.equal(checkpoint.model_state(meta)["w"], torch.arange(4.0) + 12)
    part = checkpoint.load_rank_state(meta, 2, 3)
    assert torch.equal(part["optimizer"]["momentum"], torch.full((3,), 2.0))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        "step_00000008",
        "step_00000012",
    ]
    dirs, files = checkpoint.paths([4, 8, 12], 3)
    made = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")}
    assert made <= {*dirs, *files}
    _write(tmp_path, 16, [0], model=False)
    with pytest.raises(RuntimeError, match=r"no model\.pt was written"):
        checkpoint.complete_parts(tmp_path, 16, 3, [0, 2], META)
    _write(tmp_path, 16, [], model=True)
    with pytest.raises(RuntimeError, match=r"ranks \[2\] wrote no state"):
        checkpoint.complete_parts(tmp_path, 16, 3, [0, 2], META)
    assert checkpoint.latest(tmp_path).step == 12  # type: ignore[union-attr]  # latest() found one above
    checkpoint.drop_incomplete(tmp_path, 3)
    assert not (tmp_path / "checkpoints" / ".tmp_step_00000016").exists()
    _write(tmp_path, 20, [1])
    (tmp_path / "checkpoints" / ".tmp_step_00000020" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="files lioncub did not write"):
        checkpoint.drop_incomplete(tmp_path, 3)
    assert (tmp_path / "checkpoints" / ".tmp_step_00000020" / "notes.txt").read_text() == "mine"


def test_a_launch_over_a_checkpoint_rewinds_the_groups_files(tmp_path: Path) -> None:
    """``rewind`` to step 4: each group's log keeps its records up to 4 (a heal logged at 4 came at the
    quorum after it: cut), the rest goes to ``groups/gG.cut.jsonl``, appended; the earlier launch's marks
    and end records go; an incomplete checkpoint goes."""
    (tmp_path / "groups").mkdir()
    recs = [{"kind": "step", "step": s, "group": 0} for s in range(1, 7)]
    recs += [{"kind": "heal", "step": 3}, {"kind": "heal", "step": 4}, {"kind": "eval", "step": 4}]
    (tmp_path / log_name(0)).write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind": "st')
    for name in (ready_name(0, 0), ended_name(0, 0), ready_name(0, 1), end_name(0), ready_name(1, 2)):
        (tmp_path / name).write_text("1\n")
    _write(tmp_path, 8, [0])
    said: list[str] = []
    rewind(tmp_path, 4, 2, 3, said.append)
    kept = [json.loads(x) for x in (tmp_path / log_name(0)).read_text().splitlines()]
    assert kept == [r for r in recs if r["step"] < 4 or (r["step"] == 4 and r["kind"] != "heal")]
    cut = [json.loads(x) for x in (tmp_path / cut_name(0)).read_text().splitlines()]
    assert sorted(map(json.dumps, kept + cut)) == sorted(map(json.dumps, recs))
    assert sorted(p.name for p in (tmp_path / "groups").iterdir()) == ["g0.cut.jsonl", "g0.jsonl"]
    assert not (tmp_path / "checkpoints" / ".tmp_step_00000008").exists()
    assert said and "is not a whole record" in said[0]
    rewind(tmp_path, 2, 2, 3, said.append)  # again, further back: the cut records are appended
    assert len((tmp_path / cut_name(0)).read_text().splitlines()) == len(recs) - 2


def test_the_steps_that_are_checkpointed() -> None:
    """Every K steps, ``--stop-at`` and the last step; none without either; accepted where they fall at a
    window's end (multiples of H)."""
    config = TrainConfig.from_values(
        {
            "fault_tolerant": True,
            "variant": "1bit",
            "nproc": 3,
            "steps": 40,
            "checkpoint_every": 10,
            "stop_at": 25,
        }
    )
    assert checkpoint_steps(config) == [10, 20, 25, 30, 40]
    assert checkpoint_steps(config.replace(checkpoint_every=0, stop_at=None)) == []
    assert checkpoint_steps(config.replace(checkpoint_every=0)) == [25, 40]
    assert checkpoint_steps(config.replace(local_steps=5)) == [10, 20, 25, 30, 40]  # validated: accepted
    with pytest.raises(ValueError, match=r"^--stop-at 25 with --fault-tolerant --local-steps 2: must be a "):
        config.replace(local_steps=2)


def test_a_resume_keeps_the_schedule_up_to_its_checkpoint(tmp_path: Path) -> None:
    """The groups' lives at a checkpoint follow from the schedule's events up to it: a resume that changes
    them is refused before anything starts, naming both; events after it may change. A checkpoint of a
    run without ``--fault-tolerant`` (no ``fault_tolerant`` entry) is refused too."""
    ft = {"ranks": [0, 2], "kill": ["1@5"], "rejoin": ["1@12"]}
    _write(tmp_path, 10, [0, 2])
    checkpoint.complete_parts(tmp_path, 10, 3, [0, 2], {**META, "fault_tolerant": ft})
    meta = checkpoint.latest(tmp_path)
    assert meta is not None
    values = {"fault_tolerant": True, "variant": "1bit", "nproc": 3, "steps": 40}

    def refusal(kill: list[str], rejoin: list[str]) -> str | None:
        config = TrainConfig.from_values({**values, "kill": kill, "rejoin": rejoin})
        return resume_refusal(config, parse_faults(kill, rejoin, 3, 40), meta)

    assert refusal(["1@5"], ["1@12"]) is None and refusal(["1@5"], ["1@30"]) is None  # after step 10: free
    assert refusal(["1@5", "2@20"], ["1@12"]) is None
    assert refusal(["1@6"], ["1@12"]) == (
        f"--resume with --kill 1@6: the run of checkpoint {meta.path} carried out --kill 1@5 up to its step "
        "10, and the groups' lives there follow from them: keep those events (the ones after it may change)"
    )
    assert "carried out --kill 1@5 up to" in (refusal([], []) or "")
    _write(tmp_path, 20, [0, 1, 2])
    checkpoint.complete_parts(tmp_path, 20, 3, [0, 1, 2], META)
    plain = checkpoint.latest(tmp_path)
    config = TrainConfig.from_values(values)
    assert "was written by a run without --fault-tolerant" in (resume_refusal(config, [], plain) or "")
