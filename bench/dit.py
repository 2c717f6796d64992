"""A plain DiT-shaped model for the DLO benchmarks: attention + MLP blocks in one ModuleList.

Shapes: x_BTD is (batch, tokens, width). With ``sp`` (`runtime.sequence.SequenceParallel`) the
model runs one input split along its tokens over the sp ranks, attention through the split's
all-to-alls, as a sequence-parallel replica does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.sequence import SequenceParallel

HEAD_DIM = 128


class DiTBlock(nn.Module):
    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = max(1, width // HEAD_DIM)
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False, dtype=dtype)
        self.qkv = nn.Linear(width, 3 * width, dtype=dtype)
        self.proj = nn.Linear(width, width, dtype=dtype)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False, dtype=dtype)
        self.fc1 = nn.Linear(width, 4 * width, dtype=dtype)
        self.fc2 = nn.Linear(4 * width, width, dtype=dtype)

    def forward(self, x_BTD: torch.Tensor, sp: SequenceParallel | None = None,
                length: int = 0) -> torch.Tensor:
        """``sp``: x_BTD is this rank's shard of a sequence of ``length`` tokens."""
        B, T, D = x_BTD.shape
        qkv = self.qkv(self.norm1(x_BTD)).view(B, T, 3, self.num_heads, D // self.num_heads)
        if sp is None:
            q_BHTK, k_BHTK, v_BHTK = qkv.permute(2, 0, 3, 1, 4)
            attn_BTD = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK).transpose(1, 2)
        else:
            q_BTHK, k_BTHK, v_BTHK = qkv.unbind(2)
            attn_BTD = sp.attention(q_BTHK, k_BTHK, v_BTHK, length, _attention_bthk)
        x_BTD = x_BTD + self.proj(attn_BTD.reshape(B, T, D))
        return x_BTD + self.fc2(F.gelu(self.fc1(self.norm2(x_BTD)), approximate="tanh"))


class DiT(nn.Module):
    def __init__(self, width: int, num_blocks: int, dtype: torch.dtype = torch.float32,
                 in_dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(in_dim, width, dtype=dtype)
        self.blocks = nn.ModuleList(DiTBlock(width, dtype) for _ in range(num_blocks))
        self.head = nn.Linear(width, in_dim, dtype=dtype)

    def forward(self, x_BTC: torch.Tensor, sp: SequenceParallel | None = None) -> torch.Tensor:
        """``sp``: every rank of the split passes the whole input and gets the whole output."""
        length = x_BTC.shape[1]
        if sp is not None:
            x_BTC = sp.split(x_BTC)
        x_BTD = self.embed(x_BTC)
        for block in self.blocks:
            x_BTD = block(x_BTD, sp, length)
        out_BTC = self.head(x_BTD)
        return out_BTC if sp is None else sp.gather(out_BTC, length)


def _attention_bthk(q_BTHK: torch.Tensor, k_BTHK: torch.Tensor,
                    v_BTHK: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q_BTHK.transpose(1, 2), k_BTHK.transpose(1, 2), v_BTHK.transpose(1, 2)).transpose(1, 2)


def block_bytes(width: int, dtype: torch.dtype) -> int:
    numel = 12 * width * width + 9 * width  # qkv, proj, fc1, fc2 weights and biases
    return numel * torch.empty((), dtype=dtype).element_size()


def fsdp2_from_checkpoint(model: nn.Module, path: str, rank: int, world: int) -> None:
    """FSDP2 (``fully_shard`` per block and at the root) on a meta-built DiT, loaded with the
    least memory FSDP2 can: every rank copies its own dim-0 shard of each tensor straight from
    the shared mapping of the safetensors file into its local storage."""
    from safetensors.torch import load_file  # only the benchmarks that compare FSDP2 need it
    from torch.distributed.fsdp import fully_shard  # likewise

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    full = load_file(path)
    with torch.no_grad():
        for name, param in model.named_parameters():
            chunks = full[name].chunk(world, dim=0)
            if rank < len(chunks):
                param.to_local()[: chunks[rank].shape[0]].copy_(chunks[rank])
