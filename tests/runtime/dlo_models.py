"""Small models with the awkward shapes DLO must handle, shared by the DLO tests.

Shapes: x_BTD is (batch, tokens, width).
"""

from __future__ import annotations

import torch
from torch import nn

WIDTH = 24


class MLPBlock(nn.Module):
    """A pre-norm MLP block with a persistent buffer and an odd hidden size."""

    def __init__(self, width: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width, dtype=dtype)
        self.up = nn.Linear(width, hidden, dtype=dtype)
        self.down = nn.Linear(hidden, width, bias=False, dtype=dtype)
        self.register_buffer("gate", torch.linspace(0.5, 1.5, width, dtype=dtype))

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return x_BTD + self.gate * self.down(torch.nn.functional.gelu(self.up(self.norm(x_BTD))))


class MixedDtypeBlock(nn.Module):
    """Weights in bf16, norm and scale in fp32: one block, two dtypes."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden, dtype=torch.bfloat16)
        self.down = nn.Linear(hidden, width, dtype=torch.bfloat16)
        self.scale = nn.Parameter(torch.rand(width))

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x_BTD).to(torch.bfloat16))
        return x_BTD + self.scale * self.down(torch.relu(h)).float()


class UnevenNet(nn.Module):
    """Blocks of different sizes; the total parameter count is prime-ish, not divisible by 2..4."""

    HIDDEN = (17, 64, 5, 41, 33)

    def __init__(self, dtype: torch.dtype = torch.float32, width: int = WIDTH,
                 num_blocks: int | None = None) -> None:
        super().__init__()
        hidden = self.HIDDEN if num_blocks is None else (width * 2,) * num_blocks
        self.embed = nn.Linear(7, width, dtype=dtype)
        self.blocks = nn.ModuleList(MLPBlock(width, h, dtype) for h in hidden)
        self.head = nn.Linear(width, 3, dtype=dtype)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = self.embed(x_BTD)
        for block in self.blocks:
            x_BTD = block(x_BTD)
        return self.head(x_BTD)


class TwoListNet(nn.Module):
    """Two block lists run one after the other, like double- then single-stream DiT blocks."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = nn.Linear(7, WIDTH, dtype=dtype)
        self.double_blocks = nn.ModuleList(MLPBlock(WIDTH, h, dtype) for h in (40, 9, 40))
        self.single_blocks = nn.ModuleList(MLPBlock(WIDTH, h, dtype) for h in (13, 13, 71, 2))
        self.head = nn.Linear(WIDTH, 3, dtype=dtype)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = self.embed(x_BTD)
        for block in self.double_blocks:
            x_BTD = block(x_BTD)
        for block in self.single_blocks:
            x_BTD = block(x_BTD)
        return self.head(x_BTD)


class MixedNet(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = nn.Linear(7, WIDTH)
        self.blocks = nn.ModuleList(MixedDtypeBlock(WIDTH, h) for h in (29, 7, 50))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = self.embed(x_BTD)
        for block in self.blocks:
            x_BTD = block(x_BTD)
        return self.head(x_BTD)


class ReversedNet(UnevenNet):
    """Runs its blocks back to front: out of the declared streaming order."""

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = self.embed(x_BTD)
        for block in reversed(self.blocks):
            x_BTD = block(x_BTD)
        return self.head(x_BTD)


class NoBlocksNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, WIDTH)
        self.b = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


MODELS: dict[str, type[nn.Module]] = {
    "uneven": UnevenNet,
    "two_lists": TwoListNet,
    "mixed_dtype": MixedNet,
    "reversed": ReversedNet,
}


def build(name: str, dtype: torch.dtype, *, seed: int = 0, meta: bool = False) -> nn.Module:
    if meta:
        with torch.device("meta"):
            return MODELS[name](dtype).eval()
    torch.manual_seed(seed)
    return MODELS[name](dtype).eval()


def make_input(rank: int, call: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + call)
    x = torch.randn(2, 5, 7, generator=g)
    return x if dtype == torch.float32 else x.to(dtype)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
