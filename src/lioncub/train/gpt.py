"""A nanoGPT-style decoder-only transformer (after Karpathy's nanoGPT ``model.py``), in one file.

Pre-LayerNorm blocks of causal self-attention (``F.scaled_dot_product_attention``) and a GELU MLP,
learned token and position embeddings, a final LayerNorm and a linear LM head that is either tied to
the token embedding or separate (``GPTConfig.tie_embeddings``). Weights are initialised as in nanoGPT:
N(0, 0.02) for every linear and embedding matrix, N(0, 0.02 / sqrt(2 * n_layer)) for the residual
projections, zero biases.

:func:`param_groups` splits the parameters the way the paper's GPT runs do (a modded-nanogpt-style
setup): hidden matrices, LM head, embeddings and scalars, each with its own learning rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT", "GPTConfig", "io_parameter_names", "param_groups"]


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`. ``n_embd`` must be divisible by ``n_head``."""

    block_size: int = 128  # maximum context length
    vocab_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # biases in the Linears and LayerNorms, as GPT-2
    tie_embeddings: bool = True  # LM head shares the token-embedding matrix

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (
            t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v)
        )  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``forward(idx, targets=None) -> (logits, loss)``.

    ``idx`` and ``targets`` are ``(B, T)`` int64 token ids with ``T <= block_size``; ``logits`` is
    ``(B, T, vocab_size)`` float; ``loss`` is the mean cross-entropy over all positions (a 0-dim tensor),
    or ``None`` without targets.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            wte = cast(nn.Embedding, self.transformer["wte"])
            wte.weight = self.lm_head.weight  # one matrix, named transformer.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # scaled init of the residual projections (GPT-2)
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        T = idx.size(1)
        if self.config.block_size < T:
            raise ValueError(f"sequence of length {T} is longer than block_size {self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        t = self.transformer
        x = t["drop"](t["wte"](idx) + t["wpe"](pos))
        for block in cast(nn.ModuleList, t["h"]):
            x = block(x)
        logits = self.lm_head(t["ln_f"](x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DistributedDataParallel keeps the model in .module


def io_parameter_names(model: nn.Module) -> list[str]:
    """Names (as in ``model.named_parameters()``) of the input and output layers.

    Token and position embeddings, plus ``lm_head.weight`` when the head is untied (a tied head *is*
    ``transformer.wte.weight``). For a DDP-wrapped model the names carry its ``module.`` prefix.
    """
    prefix = "module." if model is not _unwrap(model) else ""
    names = ["transformer.wte.weight", "transformer.wpe.weight"]
    if not cast(GPT, _unwrap(model)).config.tie_embeddings:
        names.append("lm_head.weight")
    return [prefix + n for n in names]


def param_groups(
    model: nn.Module,
    base_lr: float,
    head_lr: float,
    embed_lr: float,
    scalar_lr: float,
    weight_decay: float,
) -> list[dict[str, Any]]:
    """Optimizer param groups as in the paper's GPT setup; every parameter appears exactly once.

    * ``"hidden"``: the 2-D matrices inside the blocks -- ``base_lr``, ``weight_decay``;
    * ``"head"``: ``lm_head.weight`` if untied -- ``head_lr``, ``weight_decay``;
    * ``"embed"``: token (the tied head too) and position embeddings -- ``embed_lr``, ``weight_decay``;
    * ``"scalar"``: LayerNorm gains and all biases (every parameter with ``ndim < 2``) -- ``scalar_lr``,
      no weight decay.

    Each group is ``{"name", "params", "lr", "weight_decay"}``; empty groups are left out (``"head"``
    when tied, for example). Groups keep the order of ``model.parameters()`` inside them.
    """
    io = set(io_parameter_names(model))
    groups: dict[str, list[Tensor]] = {"hidden": [], "head": [], "embed": [], "scalar": []}
    for name, p in model.named_parameters():  # shared (tied) parameters are listed once
        if not p.requires_grad:
            continue
        if p.ndim < 2:
            groups["scalar"].append(p)
        elif name in io:
            groups["head" if name.endswith("lm_head.weight") else "embed"].append(p)
        else:
            groups["hidden"].append(p)
    lrs = {"hidden": base_lr, "head": head_lr, "embed": embed_lr, "scalar": scalar_lr}
    return [
        {"name": k, "params": ps, "lr": lrs[k], "weight_decay": 0.0 if k == "scalar" else weight_decay}
        for k, ps in groups.items()
        if ps
    ]
