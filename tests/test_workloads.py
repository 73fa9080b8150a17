"""Workloads: data sets and samplers, the GPT and ResNet models, param groups, short training runs."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from lioncub.optim import Lion
from lioncub.train import gpt, make_workload
from lioncub.train.data import (
    CharDataset,
    CharTokenizer,
    ImageDataset,
    data_root,
    gpt2_tokenizer,
    load_digits,
    load_fashion_mnist,
    load_text,
)

FETCH = "run `lioncub data fetch`"


@pytest.fixture(scope="module")
def austen() -> str:
    return load_text("austen_slice")


@pytest.fixture(scope="module")
def ds(austen: str) -> CharDataset:
    return CharDataset(austen, val_fraction=0.1)


# ---- text data -------------------------------------------------------------------------------------------


def test_austen_slice_is_committed_and_small(austen: str) -> None:
    assert 150_000 < len(austen) < 250_000
    assert austen.startswith("PRIDE AND PREJUDICE")


def test_char_vocab_round_trip(austen: str, ds: CharDataset) -> None:
    tok = ds.tokenizer
    assert isinstance(tok, CharTokenizer)
    assert tok.vocab_size == len(set(austen)) == ds.vocab_size
    assert tok.chars == sorted(tok.chars)
    sample = austen[1000:3000]
    assert tok.decode(tok.encode(sample)) == sample
    assert tok.decode(torch.cat([ds.train, ds.val])) == austen
    with pytest.raises(KeyError):
        tok.encode("\u2603")


def test_split_sizes(austen: str, ds: CharDataset) -> None:
    n_val = int(len(austen) * 0.1)
    assert len(ds.val) == n_val and len(ds.train) == len(austen) - n_val
    assert ds.tokenizer.decode(ds.val) == austen[-n_val:]  # validation is the end of the text
    with pytest.raises(ValueError):
        CharDataset(austen, val_fraction=1.0)


def test_get_batch_shapes_and_targets(ds: CharDataset) -> None:
    g = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        x, y = ds.get_batch(split, 8, 32, g)
        assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
        assert int(x.min()) >= 0 and int(x.max()) < ds.vocab_size
        assert torch.equal(x[:, 1:], y[:, :-1])
    starts = torch.tensor([0, len(ds.train) - 33])  # first and last valid window
    x, y = ds.windows("train", starts, 32)
    assert torch.equal(x[0], ds.train[:32].long()) and torch.equal(y[1], ds.train[-32:].long())


def test_random_mode_orders_differ_per_rank_and_are_reproducible(ds: CharDataset) -> None:
    def starts(rank: int, seed: int) -> list[torch.Tensor]:
        s = ds.sampler(8, 32, rank=rank, world_size=4, seed=seed, mode="random")
        return [s.next() for _ in range(3)]

    r0, r1 = starts(0, seed=1), starts(1, seed=1)
    assert all(not torch.equal(a, b) for a, b in zip(r0, r1, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(r0, starts(0, seed=1), strict=True))
    assert not torch.equal(r0[0], starts(0, seed=2)[0])
    assert not torch.equal(starts(1, seed=0)[0], starts(0, seed=1)[0])  # not seeded by seed + rank
    n = ds.num_windows("train", 32)
    assert all(int(t.min()) >= 0 and int(t.max()) < n for t in r0 + r1)


def test_shard_mode_covers_disjoint_ranges(ds: CharDataset) -> None:
    world, block = 3, 32
    covered = []
    for rank in range(world):
        s = ds.sampler(64, block, rank=rank, world_size=world, seed=0, mode="shard")
        starts = torch.cat([s.next() for _ in range(50)])
        lo, hi = int(starts.min()), int(starts.max()) + block + 1  # tokens read: [lo, hi)
        assert rank * len(ds.train) // world <= lo and hi <= (rank + 1) * len(ds.train) // world
        covered.append((lo, hi))
    for (_, hi), (lo, _) in itertools.pairwise(covered):
        assert hi <= lo


def test_sampler_state_round_trip(ds: CharDataset) -> None:
    a = ds.sampler(8, 32, rank=1, world_size=2, seed=5)
    for _ in range(7):
        a.next()
    state = json.loads(json.dumps(a.state_dict()))  # plain data
    b = ds.sampler(8, 32, rank=1, world_size=2, seed=5)
    b.load_state_dict(state)
    for _ in range(3):
        assert torch.equal(a.next(), b.next())
    with pytest.raises(ValueError, match="world_size"):
        ds.sampler(8, 32, rank=1, world_size=4, seed=5).load_state_dict(state)


def test_workload_batches_are_a_function_of_the_step_and_resume() -> None:
    a = make_workload("gpt", "tiny", rank=1, world_size=2, seed=3)
    first = [a.train_batch(s) for s in range(4)]
    state = a.state_dict()
    b = make_workload("gpt", "tiny", rank=1, world_size=2, seed=3)
    b.load_state_dict(state)
    assert b.sampler.position == 4
    assert torch.equal(a.train_batch(4)[0], b.train_batch(4)[0])
    assert torch.equal(first[2][0], b.train_batch(2)[0])
    with pytest.raises(ValueError):
        make_workload("cnn", "tiny").load_state_dict(state)


def test_make_workload_checks_names_and_fields() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("rnn", "tiny")
    with pytest.raises(ValueError, match="unknown size"):
        make_workload("gpt", "huge")
    with pytest.raises(TypeError, match="no field"):
        make_workload("gpt", "tiny", n_layers=3)
    with pytest.raises(ValueError, match="data_mode"):
        make_workload("gpt", "tiny", data_mode="sequential")
    wl = make_workload("gpt", "tiny", tie_embeddings=True, n_layer=1, data_mode="shard", rank=1, world_size=2)
    model = wl.build_model()
    assert wl.io_parameter_names(model) == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert [g["name"] for g in wl.param_groups(model)] == ["hidden", "embed", "scalar"]
    info = wl.info(model)
    assert info["tokens_per_step"] == 16 * 64 and info["global_tokens_per_step"] == 2 * 16 * 64
    assert info["params"] == sum(p.numel() for p in model.parameters())


def test_missing_data_error_names_file_and_command(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LIONCUB_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"shakespeare\.txt.*`lioncub data fetch`"):
        load_text("shakespeare")
    with pytest.raises(FileNotFoundError, match="lioncub data fetch"):
        load_fashion_mnist("train")


# ---- GPT ---------------------------------------------------------------------------------------------------


def _gpt(tied: bool, bias: bool = True) -> gpt.GPT:
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(
        block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32, bias=bias, tie_embeddings=tied
    )
    return gpt.GPT(cfg)


@pytest.mark.parametrize("tied", [True, False])
def test_gpt_forward_shapes_and_initial_loss(tied: bool) -> None:
    model = _gpt(tied)
    x, y = torch.randint(50, (2, 4, 16))
    logits, loss = model(x, y)
    assert logits.shape == (4, 16, 50) and logits.dtype == torch.float32
    assert loss is not None and loss.ndim == 0
    assert abs(loss.item() - math.log(50)) < 0.1
    assert model(x[:, :5])[1] is None and model(x[:, :5])[0].shape == (4, 5, 50)
    with pytest.raises(ValueError):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_gpt_is_causal() -> None:
    model = _gpt(tied=False).eval()
    x = torch.randint(50, (1, 16))
    x2 = x.clone()
    x2[0, 10] = (x[0, 10] + 1) % 50
    a, b = model(x)[0], model(x2)[0]
    assert torch.allclose(a[:, :10], b[:, :10]) and not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_gpt_param_groups_partition(tied: bool, bias: bool) -> None:
    model = _gpt(tied, bias)
    groups = gpt.param_groups(model, 1e-4, 2e-4, 3e-4, 4e-4, 0.1)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in model.parameters()}
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == ({"hidden", "embed", "scalar"} if tied else {"hidden", "head", "embed", "scalar"})
    assert {g["name"]: g["lr"] for g in groups} == {
        k: v for k, v in {"hidden": 1e-4, "head": 2e-4, "embed": 3e-4, "scalar": 4e-4}.items() if k in by_name
    }
    assert by_name["scalar"]["weight_decay"] == 0.0 and by_name["hidden"]["weight_decay"] == 0.1
    assert all(p.ndim < 2 for p in by_name["scalar"]["params"])
    assert all(p.ndim == 2 for p in by_name["hidden"]["params"])
    embed = {id(p) for p in by_name["embed"]["params"]}
    assert embed == {id(model.transformer.wte.weight), id(model.transformer.wpe.weight)}
    if tied:
        assert model.lm_head.weight is model.transformer.wte.weight
    else:
        assert [id(p) for p in by_name["head"]["params"]] == [id(model.lm_head.weight)]
    Lion(groups)  # the groups are valid optimizer groups


def test_gpt_io_parameter_names() -> None:
    tied, untied = _gpt(True), _gpt(False)
    embeddings = ["transformer.wte.weight", "transformer.wpe.weight"]
    assert gpt.io_parameter_names(tied) == embeddings
    assert gpt.io_parameter_names(untied) == [*embeddings, "lm_head.weight"]
    for model in (tied, untied):
        names = dict(model.named_parameters())
        assert all(n in names for n in gpt.io_parameter_names(model))


@pytest.mark.slow
def test_gpt_tiny_loss_falls_with_lion() -> None:
    torch.manual_seed(123)  # the workload must not depend on the global RNG
    wl = make_workload("gpt", "tiny", seed=0)
    model = wl.build_model()
    assert 90_000 < wl.info(model)["params"] < 130_000
    opt = Lion(wl.param_groups(model), betas=wl.betas)
    start = wl.evaluate(model)["val_loss"]
    assert abs(start - math.log(wl.data.vocab_size)) < 0.15
    losses = []
    for step in range(40):
        loss = wl.loss(model, wl.train_batch(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    end = wl.evaluate(model)["val_loss"]
    assert np.mean(losses[-5:]) < losses[0] - 0.8 and end < start - 0.8
    assert model.training


def test_build_model_is_seeded_and_leaves_the_global_rng_alone() -> None:
    wl = make_workload("gpt", "tiny", seed=0)
    torch.manual_seed(1)
    a = wl.build_model()
    after = torch.rand(1)
    torch.manual_seed(1)
    b = make_workload("gpt", "tiny", seed=0).build_model()
    assert torch.equal(torch.rand(1), after)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    c = make_workload("gpt", "tiny", seed=1).build_model()
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


# ---- CNN --------------------------------------------------------------------------------------------------


def test_digits_loader() -> None:
    images, labels = load_digits()
    assert images.shape == (1797, 8, 8) and labels.shape == (1797,)
    assert images.max() == 16 and set(labels.tolist()) == set(range(10))
    assert labels[:10].tolist() == list(range(10))


def test_image_sampler_epochs_and_shards() -> None:
    data = ImageDataset(np.zeros((100, 4, 4), np.uint8), np.arange(100) % 10)
    s = data.sampler(10, rank=0, world_size=1, seed=0)
    epoch0 = torch.cat([s.indices(i) for i in range(10)])
    assert sorted(epoch0.tolist()) == list(range(100))
    assert not torch.equal(epoch0, torch.cat([s.indices(i) for i in range(10, 20)]))
    shards = [data.sampler(10, rank=r, world_size=2, seed=0, mode="shard") for r in range(2)]
    seen = [set(torch.cat([sh.indices(i) for i in range(5)]).tolist()) for sh in shards]
    assert seen == [set(range(50)), set(range(50, 100))]


@pytest.mark.slow
def test_cnn_digits_forward_io_and_training() -> None:
    wl = make_workload("cnn", "tiny", seed=0)
    model = wl.build_model()
    x, y = wl.train_batch(0)
    assert x.shape == (64, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert model(x).shape == (64, 10)
    names = wl.io_parameter_names(model)
    assert names == ["stem.0.weight", "stem.1.weight", "stem.1.bias", "fc.weight", "fc.bias"]
    groups = wl.param_groups(model)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    opt = Lion(groups, betas=wl.betas)
    for step in range(60):
        loss = wl.loss(model, wl.train_batch(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = wl.evaluate(model)
    assert metrics["val_acc"] > 0.85 and metrics["val_loss"] < 0.6  # chance: 0.1 and ln 10 = 2.3
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())  # BN stats put back
    assert model.training


# ---- full data sets from the data root (lioncub data fetch) ------------------------------------------------


def _need(*names: str) -> None:
    missing = [n for n in names if not (data_root() / n).is_file()]
    if missing:
        pytest.skip(f"{', '.join(missing)} not in {data_root()}: {FETCH}")


def test_fashion_mnist_loader() -> None:
    _need("fashion-mnist/train-images-idx3-ubyte.gz", "fashion-mnist/t10k-labels-idx1-ubyte.gz")
    x, y = load_fashion_mnist("train")
    assert x.shape == (60000, 28, 28) and x.dtype == np.uint8 and y.shape == (60000,)
    assert y[:10].tolist() == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
    assert np.bincount(y).tolist() == [6000] * 10
    x, y = load_fashion_mnist("test")
    assert x.shape == (10000, 28, 28) and y[:10].tolist() == [9, 2, 1, 1, 6, 1, 4, 6, 5, 7]


def test_shakespeare_and_austen_texts() -> None:
    _need("shakespeare.txt", "austen.txt")
    text = load_text("shakespeare")
    assert len(text) == 5_057_280 and len(set(text)) == 84
    austen = load_text("austen")
    assert 4_000_000 < len(austen) < 4_100_000 and austen.startswith("SENSE AND SENSIBILITY")
    assert len(set(austen)) == 81


def test_gpt2_bpe_when_available() -> None:
    _need("gpt2/encoder.json", "gpt2/vocab.bpe")
    pytest.importorskip("tiktoken", reason="tiktoken is optional")
    assert gpt2_tokenizer().encode("Hello world") == [15496, 995]
