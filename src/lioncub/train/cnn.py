"""A small ResNet for grayscale images (28x28 Fashion-MNIST, 8x8 digits).

``stem`` (3x3 conv, BatchNorm, ReLU) -> stages of basic residual blocks (two 3x3 convs with
BatchNorm; the first block of every stage after the first halves the resolution and its shortcut is a
1x1 conv + BatchNorm) -> global average pool -> ``fc`` (linear classifier). The same layout works for
any input size >= 4x4, since the head pools globally.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ResNet", "io_parameter_names", "param_groups"]


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """``forward(x) -> logits``: ``x`` is ``(B, in_channels, H, W)`` float, logits ``(B, num_classes)``.

    Args:
        widths: channels of each stage; stage ``i > 0`` starts with a stride-2 block.
        blocks_per_stage: residual blocks in every stage.
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        widths: tuple[int, ...] = (16, 32, 64),
        blocks_per_stage: int = 1,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        c = widths[0]
        for i, w in enumerate(widths):
            for j in range(blocks_per_stage):
                blocks.append(BasicBlock(c, w, stride=2 if i > 0 and j == 0 else 1))
                c = w
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(c, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(x.mean(dim=(2, 3)))


def io_parameter_names(model: nn.Module) -> list[str]:
    """Names (as in ``model.named_parameters()``) of the input layer (``stem.*``: conv and its BatchNorm)
    and the output layer (``fc.weight``, ``fc.bias``); a DDP wrapper's ``module.`` prefix is kept."""
    return [n for n, _ in model.named_parameters() if n.removeprefix("module.").startswith(("stem.", "fc."))]


def param_groups(model: nn.Module, lr: float, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: ``"weights"`` (conv and linear matrices, with ``weight_decay``) and ``"scalars"``
    (BatchNorm gains/shifts and biases, no weight decay), both at ``lr``."""
    weights = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    scalars = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [
        {"name": "weights", "params": weights, "lr": lr, "weight_decay": weight_decay},
        {"name": "scalars", "params": scalars, "lr": lr, "weight_decay": 0.0},
    ]
