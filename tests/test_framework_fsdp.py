"""The frameworks' FSDP paths (issue 46, item 4) on 2 replicas × 2 shards of gloo ranks: one worker-pool call
(``tests/fsdp_framework_jobs.py``) whose 4 ranks run every case and return what they saw.

* Lightning's :class:`~lioncub.integrations.lightning.LionCubFSDPStrategy`: a ``Trainer.fit`` of 2 steps, a
  ``trainer.save_checkpoint``, then a module of other initial weights fitted from that checkpoint to step 4
  equals, bit for bit on every rank (parameter shards, momenta and every state tensor), docs/shards.md's own
  loop stepped on the same rows — for a 1-bit vote and for 8-bit local steps saved inside a window. Each rank
  got its own batches: the rows of torch's ``DistributedSampler`` for its rank of the world, epoch by epoch.
* Refusals: that strategy with a module that does not shard; LionCub over FSDP1's parameters (what
  Lightning's ``FSDPStrategy`` hands ``configure_optimizers``); accelerate's FSDP plugin on CPU processes,
  where accelerate wraps the model in DDP instead.
"""

from __future__ import annotations

from typing import Any

import pytest

import fsdp_framework_jobs as jobs

from processes import run_workers

pytest.importorskip("lightning", reason="the lightning extra (docs/install.md)")
pytest.importorskip("accelerate", reason="the hf extra (docs/install.md)")

WORLD = jobs.REPLICAS * jobs.SHARDS
CASES = ["1bit", "8bit h=4"]


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of the 4 ranks saw, in rank order."""
    out = tmp_path_factory.mktemp("fsdp_frameworks")
    return run_workers(jobs.worker, WORLD, str(out), CASES, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_lightning_fsdp_resumed_fit_is_the_users_own_loop_bit_for_bit(
    seen: list[dict[str, Any]], case: str
) -> None:
    for rank, got in enumerate(seen):
        fit = got[f"lightning {case}"]
        assert fit["differences"] == [], f"rank {rank}: {fit['differences']}"
        # the weights of the three layers moved from their initial values (a 1-element bias may not: its
        # 1-bit votes can tie and alternate); the reference above is what pins their values
        assert all(fit["moved"][0::2]), f"rank {rank}: {fit['moved']}"


@pytest.mark.slow
def test_lightning_fsdp_gives_every_rank_its_own_batches(seen: list[dict[str, Any]]) -> None:
    """The rows each rank trained on: in the first fit its ``DistributedSampler`` share of epoch 0, in order;
    after the resume, batches of its own share of a later epoch (Lightning's resumed loop decides which);
    at every step the 4 ranks' batches are disjoint."""
    b, per_epoch = jobs.BATCH, jobs.STEPS_PER_EPOCH

    def own_batches(rank: int) -> list[list[int]]:
        return [jobs.sampled(rank, WORLD, e)[k * b : (k + 1) * b] for e in range(4) for k in range(per_epoch)]

    for case in CASES:
        rows = [got[f"lightning {case}"]["rows"] for got in seen]
        for rank, mine in enumerate(rows):
            assert len(mine) == 2 * per_epoch, (case, rank, mine)
            assert [r for batch in mine[:per_epoch] for r in batch] == jobs.sampled(rank, WORLD, 0), (
                case,
                rank,
            )
            assert all(batch in own_batches(rank) for batch in mine), (case, rank, mine)
        for step in range(2 * per_epoch):
            every = [r for mine in rows for r in mine[step]]
            assert len(set(every)) == WORLD * b, (case, step, every)


@pytest.mark.slow
def test_lightning_fsdp_warns_once_of_a_fit_that_ends_inside_a_window(seen: list[dict[str, Any]]) -> None:
    warned = {case: [got[f"lightning {case}"]["warnings"] for got in seen] for case in CASES}
    assert warned["1bit"] == [[], [], [], []]
    first, *others = warned["8bit h=4"]
    assert len(first) == 1 and "max_steps=2 is not a multiple of local_steps h=4" in first[0], first
    assert others == [[], [], []]  # rank 0 only


@pytest.mark.slow
def test_fsdp_paths_that_cannot_vote_are_refused(seen: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(seen):
        unsharded = got["lightning unsharded"]
        assert unsharded.startswith("refused: LionCubFSDPStrategy"), (rank, unsharded)
        assert "fully_shard" in unsharded and "LionCubStrategy" in unsharded, unsharded
        fsdp1 = got["fsdp1"]
        assert fsdp1.startswith("refused: ") and "FSDP1" in fsdp1 and "fully_shard" in fsdp1, (rank, fsdp1)
        acc = got["accelerate-cpu"]
        assert acc.startswith("MULTI_CPU, DistributedDataParallel: refused: "), (rank, acc)
        assert "fsdp_plugin" in acc and "docs/shards.md" in acc, acc


def test_an_fsdp1_parameter_is_refused_by_name() -> None:
    """In process: a tensor FSDP1 marked as its own (``_fsdp_flattened``, set on its FlatParameter and on
    each view of it under ``use_orig_params=True``) is refused, with where it is and what to use; the same
    tensor unmarked is taken."""
    import torch

    from lioncub.optim import LionCub

    p = torch.nn.Parameter(torch.zeros(4))
    LionCub([p], lr=0.1, variant="1bit")
    p._fsdp_flattened = True  # type: ignore[attr-defined]  # what FSDP1's _set_fsdp_flattened sets
    with pytest.raises(TypeError, match=r"params'\]\[0\] is a parameter of FSDP1 .*fully_shard"):
        LionCub([p], lr=0.1, variant="1bit")
