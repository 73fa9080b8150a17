"""Named training workloads: a model, its optimizer param groups, per-rank data and evaluation.

Interface for a training loop (one :class:`Workload` per rank)::

    wl = make_workload("gpt", "small", rank=rank, world_size=world, seed=0, data_mode="random", device=dev)
    model = wl.build_model()                          # on wl.device; identical on every rank (seeded by seed)
    opt = Lion(wl.param_groups(model), betas=wl.betas)    # every group carries its own lr and weight_decay
    for step in range(start, steps):
        batch = wl.train_batch(step)                  # this rank's batch, on wl.device
        loss = wl.loss(model, batch)                  # 0-dim float tensor, mean over the batch
        loss.backward(); ...
        if step % eval_every == 0:
            metrics = wl.evaluate(model)              # {"val_loss": float} (+ "val_acc" for cnn)
    checkpoint["data"] = wl.state_dict()              # data position: a small dict of ints/strings
    wl.load_state_dict(checkpoint["data"])            # refuses another seed / rank / world size / mode

* ``train_batch(step)`` is a pure function of ``(seed, rank, step)`` and the data mode, so a run resumed
  at step ``s`` reads exactly the batches the uninterrupted run reads from ``s`` on; ``state_dict()`` records
  the next step and the sampling settings, and ``load_state_dict`` checks them.
* ``data_mode="random"``: every rank samples the whole training set in its own random order;
  ``"shard"``: every rank reads only its contiguous ``1/world_size`` of it (:mod:`lioncub.train.data`).
* ``evaluate(model)`` runs locally (no collectives; a DDP wrapper is unwrapped) on a fixed,
  rank-independent validation subset of bounded size, in ``eval()`` mode, and restores the train mode.
* ``param_groups(model)`` returns dicts ``{"name", "params", "lr", "weight_decay"}``: a schedule should
  scale every group's own peak ``lr`` (keep a copy, e.g. ``group.setdefault("initial_lr", group["lr"])``).
* ``io_parameter_names(model)``: names of the input/output layers (embeddings and head, or stem and
  classifier), e.g. for syncing them more often.
* ``info(model)``: metadata -- parameter count, tokens or images per step (per rank and global), shapes.

Sizes (:data:`SIZES`; ``make_workload(..., **overrides)`` changes any field, e.g. ``tie_embeddings=True``):

======  ======  ===============================================  =========  =================
name    size    model                                            params     data
======  ======  ===============================================  =========  =================
gpt     tiny    2 layers, 64 wide, 4 heads, ctx 64, batch 16     0.11 M     Austen slice (committed)
gpt     small   4 layers, 128 wide, 4 heads, ctx 128, batch 32   0.81 M     Shakespeare (.data)
gpt     medium  6 layers, 384 wide, 6 heads, ctx 256, batch 32   10.7 M     Shakespeare + Austen (.data)
cnn     tiny    ResNet widths 16-32-64, batch 64                 0.17 M     digits 8x8 (committed)
cnn     small   ResNet widths 16-32-64, batch 128                0.17 M     Fashion-MNIST (.data)
======  ======  ===============================================  =========  =================
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lioncub.train import cnn, gpt
from lioncub.train.data import (
    CharDataset,
    ImageDataset,
    Mode,
    StepSampler,
    check_files,
    gpt2_files,
    image_files,
    load_digits,
    load_fashion_mnist,
    load_text,
    text_files,
)
from lioncub.train.workload_checks import check_fields

__all__ = [
    "SIZES",
    "CNNWorkload",
    "GPTWorkload",
    "Workload",
    "check_fields",
    "check_workload",
    "make_workload",
    "workload_class",
    "workload_names",
]

Batch = tuple[Tensor, Tensor]


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DistributedDataParallel keeps the model in .module


#: a workload's default device (an immutable value: safe as a dataclass default)
CPU = torch.device("cpu")


@dataclass
class Workload(ABC):
    """Fields shared by every workload; subclasses add the model and data fields and fill the methods.

    ``lr`` is the base learning rate for Lion, ``betas`` and ``weight_decay`` Lion's (decoupled:
    ``p <- p * (1 - lr * wd)``). ``batch_size`` is per rank.
    """

    name: ClassVar[str]
    size: str = "tiny"
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    data_mode: Mode = "random"
    device: torch.device = CPU  # a str is converted
    batch_size: int = 32
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.1

    def __post_init__(self) -> None:
        check_fields(type(self), {f.name: getattr(self, f.name) for f in fields(self)})
        self.device = torch.device(self.device)
        self.sampler: StepSampler = self._load_data()

    @classmethod
    def data_files(cls, values: dict[str, Any]) -> list[tuple[Path, str]]:
        """``(path, what)`` of the files a workload with these field ``values`` reads (nothing is read)."""
        return []

    @classmethod
    def check_data(cls, values: dict[str, Any]) -> None:
        """``ValueError`` naming the field if the data cannot serve these field ``values`` (optional
        packages, sizes); cheap: what the ranks would only find after the launch. Nothing by default."""
        return

    # -- per workload --------------------------------------------------------------------------------
    @abstractmethod
    def _load_data(self) -> StepSampler:
        """Load the data sets; return this rank's training sampler."""

    @abstractmethod
    def _make_model(self) -> nn.Module:
        """A new model (called under the seeded RNG of :meth:`build_model`)."""

    @abstractmethod
    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        """Optimizer param groups with their own ``lr`` / ``weight_decay`` (each parameter once)."""

    @abstractmethod
    def io_parameter_names(self, model: nn.Module) -> list[str]:
        """Names of the input and output layers' parameters, as in ``model.named_parameters()``."""

    @abstractmethod
    def train_batch(self, step: int) -> Batch:
        """This rank's training batch at ``step`` (tensors on :attr:`device`)."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        """Mean training loss of ``batch`` (0-dim float tensor, differentiable)."""

    @abstractmethod
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Validation metrics on the fixed subset: ``{"val_loss": ...}`` (+ ``"val_acc"`` for classifiers)."""

    @abstractmethod
    def info(self, model: nn.Module | None = None) -> dict[str, Any]:
        """Metadata: name, size, params (if ``model`` is given), per-rank and global items per step."""

    # -- shared --------------------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """A fresh model on :attr:`device`, initialised from ``seed`` alone (the same on every rank).

        The global RNG is left untouched (the init runs inside ``torch.random.fork_rng``)."""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.seed)
            model = self._make_model()
        return model.to(self.device)

    def state_dict(self) -> dict[str, Any]:
        """Data position for a checkpoint: ``{"workload", "size", "sampler": {...}}`` (JSON-serialisable)."""
        return {"workload": self.name, "size": self.size, "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Restore the data position; ``ValueError`` if it was saved by another workload, or (``strict``)
        with other sampling settings (seed, rank, world size, mode, batch size). ``strict=False`` is for a
        deliberate change of world size: the step is kept, the new ranks draw their own batches."""
        if (state.get("workload"), state.get("size")) != (self.name, self.size):
            saved = f"{state.get('workload')}/{state.get('size')}"
            raise ValueError(f"data state of {saved} cannot resume {self.name}/{self.size}")
        self.sampler.load_state_dict(state["sampler"], strict=strict)

    def _to(self, *tensors: Tensor) -> Batch:
        nb = self.device.type == "cuda"
        x, y = (t.to(self.device, non_blocking=nb) for t in tensors)
        return x, y


@dataclass
class GPTWorkload(Workload):
    """Character-level (or GPT-2 BPE) language modelling with :class:`lioncub.train.gpt.GPT`.

    Learning rates (Lion): Lion's sign update has a larger norm than Adam's, so its lr is usually 3-10x
    smaller than AdamW's (Chen et al. 2023). These char-level models are small, so their rates sit at the
    top of that range: ``small`` uses 6e-4 for the hidden matrices (600 steps with warm-up + cosine on
    2 cores, val loss: 3e-4 -> 2.22, 6e-4 -> 2.11, 1e-3 -> 2.15), ``tiny`` 1e-3, ``medium`` 2e-4 (not
    tuned: 13x the parameters of ``small``). As in the paper's GPT setup the embeddings get their own,
    larger lr -- 10x base: a sign step of ``lr`` barely moves embedding rows, which only their own tokens
    update (tiny, 200 steps: val loss 2.99 with 1x, 2.45 with 10x) -- while the head and the scalars
    (LayerNorm gains) keep the base lr. ``weight_decay`` 0.3 on the matrices keeps ``lr * wd`` of the
    order of nanoGPT's AdamW (1e-3 * 0.1).
    Validation: ``eval_windows`` evenly spaced windows of the validation split (the last
    ``val_fraction`` of the text).
    """

    name: ClassVar[str] = "gpt"
    corpus: str = "austen_slice"
    tokenizer: str = "char"
    val_fraction: float = 0.1
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    bias: bool = False
    tie_embeddings: bool = False
    dropout: float = 0.0
    weight_decay: float = 0.3
    head_lr: float = 3e-4
    embed_lr: float = 3e-3
    scalar_lr: float = 3e-4
    eval_windows: int = 256

    @classmethod
    def data_files(cls, values: dict[str, Any]) -> list[tuple[Path, str]]:
        files = text_files(values["corpus"])
        return files + (gpt2_files() if values["tokenizer"] == "gpt2" else [])

    @classmethod
    def check_data(cls, values: dict[str, Any]) -> None:
        if values["tokenizer"] == "gpt2":
            if importlib.util.find_spec("tiktoken") is None:
                raise ValueError(
                    "tokenizer='gpt2' needs the optional package tiktoken (pip install tiktoken); the "
                    "default tokenizer='char' needs nothing"
                )
            return  # the BPE token count is known only after tokenizing the corpus (on the ranks)
        n = len(load_text(values["corpus"]))  # the char tokenizer: one token per character
        n_val = max(1, int(n * values["val_fraction"]))
        for split, tokens in (("train", n - n_val), ("val", n_val)):
            if tokens - values["block_size"] < 1:
                raise ValueError(
                    f"block_size={values['block_size']}: the {split} split of corpus {values['corpus']!r} "
                    f"has {tokens} tokens, not more than one block; use a block_size below {tokens} (or a "
                    "larger corpus / val_fraction)"
                )

    def _load_data(self) -> StepSampler:
        self.data = CharDataset(
            load_text(self.corpus), val_fraction=self.val_fraction, tokenizer=self.tokenizer
        )
        self._eval_starts = self.data.eval_starts(self.block_size, self.eval_windows)
        return self.data.sampler(
            self.batch_size,
            self.block_size,
            rank=self.rank,
            world_size=self.world_size,
            seed=self.seed,
            mode=self.data_mode,
        )

    @property
    def config(self) -> gpt.GPTConfig:
        return gpt.GPTConfig(
            block_size=self.block_size,
            vocab_size=self.data.vocab_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            dropout=self.dropout,
            bias=self.bias,
            tie_embeddings=self.tie_embeddings,
        )

    def _make_model(self) -> nn.Module:
        return gpt.GPT(self.config)

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        """Groups ``hidden`` / ``head`` / ``embed`` / ``scalar``: :func:`lioncub.train.gpt.param_groups`."""
        return gpt.param_groups(
            model, self.lr, self.head_lr, self.embed_lr, self.scalar_lr, self.weight_decay
        )

    def io_parameter_names(self, model: nn.Module) -> list[str]:
        return gpt.io_parameter_names(model)

    def train_batch(self, step: int) -> Batch:
        """``(x, y)``: ``(batch_size, block_size)`` int64 token ids and their next tokens."""
        batch = self.data.windows("train", self.sampler.indices(step), self.block_size)
        self.sampler.position = step + 1
        return self._to(*batch)

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        return model(batch[0], batch[1])[1]

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """``{"val_loss": mean next-token cross-entropy (nats)}`` over ``eval_windows`` fixed windows."""
        net = _unwrap(model)
        was_training = net.training
        net.eval()
        total, count = 0.0, 0
        for starts in self._eval_starts.split(self.batch_size):
            x, y = self._to(*self.data.windows("val", starts, self.block_size))
            total += float(net(x, y)[1]) * y.numel()
            count += y.numel()
        net.train(was_training)
        return {"val_loss": total / count}

    def info(self, model: nn.Module | None = None) -> dict[str, Any]:
        tokens = self.batch_size * self.block_size
        out: dict[str, Any] = {
            "workload": self.name,
            "size": self.size,
            "corpus": self.corpus,
            "tokenizer": self.tokenizer,
            "vocab_size": self.data.vocab_size,
            "train_tokens": len(self.data.train),
            "val_tokens": len(self.data.val),
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_embd": self.n_embd,
            "block_size": self.block_size,
            "batch_size": self.batch_size,
            "tie_embeddings": self.tie_embeddings,
            "tokens_per_step": tokens,
            "global_tokens_per_step": tokens * self.world_size,
        }
        if model is not None:
            out["params"] = sum(p.numel() for p in model.parameters())
        return out


@dataclass
class CNNWorkload(Workload):
    """Image classification with :class:`lioncub.train.cnn.ResNet`.

    Learning rate (Lion): 3e-3 for these small BatchNorm ResNets and short runs (Fashion-MNIST, 300
    steps of batch 128 with warm-up + cosine: 81% test accuracy at 1e-3, 87% at 3e-3; the paper's
    ResNet-18 runs use 3e-4 over 100 epochs). Weight decay 0.05 on the conv/linear weights only.
    Validation: the first ``eval_examples`` held-out images (the last 297 of the 1797 digits; the
    Fashion-MNIST test set). With ``recalibrate_bn`` (default), :meth:`evaluate` first recomputes the
    BatchNorm statistics of the current weights on the first ``bn_calibration_examples`` training images
    ("precise BN") and puts the model's own running statistics back afterwards: the metrics then depend on
    the parameters only -- not on the lr (at a high lr the running averages lag the weights: 78% vs 92%
    on digits after 60 steps at 3e-3) nor on the rank (under LionCub every rank keeps its own statistics).
    """

    name: ClassVar[str] = "cnn"
    dataset: str = "digits"
    widths: tuple[int, ...] = (16, 32, 64)
    blocks_per_stage: int = 1
    lr: float = 3e-3
    weight_decay: float = 0.05
    eval_examples: int = 2000
    recalibrate_bn: bool = True
    bn_calibration_examples: int = 1000

    @classmethod
    def data_files(cls, values: dict[str, Any]) -> list[tuple[Path, str]]:
        return image_files(values["dataset"])

    def _load_data(self) -> StepSampler:
        if self.dataset == "digits":
            images, labels = load_digits()
            self.train_set = ImageDataset(images[:1500], labels[:1500], max_value=16.0)
            self.val_set = ImageDataset(
                images[1500:], labels[1500:], max_value=16.0, mean=self.train_set.mean, std=self.train_set.std
            )
        elif self.dataset == "fashion-mnist":
            self.train_set = ImageDataset(*load_fashion_mnist("train"))
            self.val_set = ImageDataset(
                *load_fashion_mnist("test"), mean=self.train_set.mean, std=self.train_set.std
            )
        else:
            raise ValueError(f"unknown dataset {self.dataset!r}; known: digits, fashion-mnist")
        self._eval_ids = torch.arange(min(self.eval_examples, len(self.val_set)))
        return self.train_set.sampler(
            self.batch_size, rank=self.rank, world_size=self.world_size, seed=self.seed, mode=self.data_mode
        )

    def _make_model(self) -> nn.Module:
        return cnn.ResNet(1, self.train_set.num_classes, tuple(self.widths), self.blocks_per_stage)

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        """Groups ``weights`` (with weight decay) and ``scalars`` (BatchNorm, biases; no decay), at ``lr``."""
        return cnn.param_groups(model, self.lr, self.weight_decay)

    def io_parameter_names(self, model: nn.Module) -> list[str]:
        return cnn.io_parameter_names(model)

    def train_batch(self, step: int) -> Batch:
        """``(x, y)``: ``(batch_size, 1, H, W)`` float32 normalised images, ``(batch_size,)`` int64 labels."""
        batch = self.train_set.batch(self.sampler.indices(step))
        self.sampler.position = step + 1
        return self._to(*batch)

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """``{"val_loss", "val_acc"}`` over the first ``eval_examples`` held-out images; the model's
        parameters, buffers and train/eval mode are the same afterwards."""
        net = _unwrap(model)
        was_training = net.training
        bns = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        saved = [(m.momentum, {k: v.clone() for k, v in m.state_dict().items()}) for m in bns]
        if self.recalibrate_bn and bns:
            net.train()
            for m in bns:
                m.reset_running_stats()
                m.momentum = None  # cumulative average over the calibration batches
            for ids in torch.arange(min(self.bn_calibration_examples, len(self.train_set))).split(500):
                net(self._to(*self.train_set.batch(ids))[0])
        net.eval()
        loss, correct = 0.0, 0
        for ids in self._eval_ids.split(500):
            x, y = self._to(*self.val_set.batch(ids))
            logits = net(x)
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(dim=1) == y).sum())
        for m, (momentum, state) in zip(bns, saved, strict=True):
            m.momentum = momentum
            m.load_state_dict(state)
        net.train(was_training)
        n = len(self._eval_ids)
        return {"val_loss": loss / n, "val_acc": correct / n}

    def info(self, model: nn.Module | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "workload": self.name,
            "size": self.size,
            "dataset": self.dataset,
            "image_shape": tuple(self.train_set.images.shape[1:]),
            "num_classes": self.train_set.num_classes,
            "train_images": len(self.train_set),
            "val_images": len(self._eval_ids),
            "widths": tuple(self.widths),
            "batch_size": self.batch_size,
            "images_per_step": self.batch_size,
            "global_images_per_step": self.batch_size * self.world_size,
            "steps_per_epoch": self.sampler.batches_per_epoch,
        }
        if model is not None:
            out["params"] = sum(p.numel() for p in model.parameters())
        return out


SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "gpt": {
        "tiny": dict(
            corpus="austen_slice",
            n_layer=2,
            n_head=4,
            n_embd=64,
            block_size=64,
            batch_size=16,
            lr=1e-3,
            head_lr=1e-3,
            embed_lr=1e-2,
            scalar_lr=1e-3,
            eval_windows=128,
        ),
        "small": dict(
            corpus="shakespeare",
            n_layer=4,
            n_head=4,
            n_embd=128,
            block_size=128,
            batch_size=32,
            lr=6e-4,
            head_lr=6e-4,
            embed_lr=6e-3,
            scalar_lr=6e-4,
            eval_windows=256,
        ),
        "medium": dict(
            corpus="shakespeare+austen",
            n_layer=6,
            n_head=6,
            n_embd=384,
            block_size=256,
            batch_size=32,
            lr=2e-4,
            head_lr=2e-4,
            embed_lr=2e-3,
            scalar_lr=2e-4,
            eval_windows=256,
        ),
    },
    "cnn": {
        "tiny": dict(dataset="digits", widths=(16, 32, 64), batch_size=64, eval_examples=297),
        "small": dict(dataset="fashion-mnist", widths=(16, 32, 64), batch_size=128, eval_examples=2000),
    },
}
_CLASSES: dict[str, type[Workload]] = {"gpt": GPTWorkload, "cnn": CNNWorkload}


def workload_names() -> dict[str, list[str]]:
    """``{workload: [sizes]}``."""
    return {name: list(sizes) for name, sizes in SIZES.items()}


def workload_class(name: str) -> type[Workload]:
    """The class of workload ``name`` (one of :func:`workload_names`)."""
    return _CLASSES[name]


# ---------------------------------------------------------------------------------------- validation


def check_workload(
    name: str, size: str, overrides: dict[str, Any] | None = None, *, data: bool = True
) -> dict[str, Any]:
    """Validate a workload without building a model: ``name``, ``size``, the field ``overrides`` (names and
    values) and, with ``data``, that every data file exists and is readable and can serve the fields
    (:meth:`Workload.check_data`). Returns every field's value.

    Raises ``ValueError`` naming the field, the value and what is allowed, ``FileNotFoundError`` /
    ``PermissionError`` naming the file and how to get it; cheap enough for a driver to call before it
    starts any rank.
    """
    overrides = dict(overrides or {})
    cls = _workload_class(name, size, overrides)
    known = {f.name: f.default for f in fields(cls)}
    values = {**known, "size": size, **SIZES[name][size], **overrides}
    check_fields(cls, values)
    if data:
        check_files(cls.data_files(values))
        cls.check_data(values)
    return values


def make_workload(name: str, size: str, **overrides: Any) -> Workload:
    """Build workload ``name`` at ``size`` (see :data:`SIZES`); ``overrides`` replace any dataclass field
    (``rank``, ``world_size``, ``seed``, ``data_mode``, ``device``, ``batch_size``, lrs, shapes...).

    Loads the data at once: raises ``FileNotFoundError`` naming the missing file and the fetch command.
    """
    cls = _workload_class(name, size, overrides)
    return cls(size=size, **{**SIZES[name][size], **overrides})


def _workload_class(name: str, size: str, overrides: dict[str, Any]) -> type[Workload]:
    """The class of workload ``name``; ``ValueError`` for an unknown name or size, ``TypeError`` naming
    the fields it does not have among ``overrides``."""
    if name not in SIZES:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(SIZES)}")
    if size not in SIZES[name]:
        raise ValueError(f"unknown size {size!r} for {name}; known: {', '.join(SIZES[name])}")
    cls = _CLASSES[name]
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"{name} workload has no field(s) {unknown}; fields: {sorted(known)}")
    return cls
