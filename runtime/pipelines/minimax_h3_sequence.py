"""Sequence parallelism for diffusers' ``MiniMaxH3Transformer3DModel`` (``runtime.sequence``).

The same seams diffusers' own ``_cp_plan`` for MiniMax-H3 declares, built on kiln's Ulysses
split: the packed sequence (prompt, soundtrack and video rows) is split before the first block
of ``transformer_blocks``, with the rotary tables and each row's modulation index; every block
attends over the whole sequence by trading sequence shards for head shards around the attention
kernel; after the last block the shards are gathered, so the final norm, the two output heads and
the samplers run on the whole sequence as diffusers wrote them. The text refiner and the input
projections run unsplit on every rank (they are small next to the blocks). Within a block only
self-attention needs other rows; the modulation, the norms and the feed-forward are per row.

Why not diffusers' context parallelism itself: it cannot set up on a CPU host (it picks a device
by ``rank % accelerator count``, zero there), it needs the sequence to divide by the degree (its
uneven mode gathers unequal sizes, which gloo refuses), and kiln's replicas need one group each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb

from runtime.sequence import SequenceParallel


@dataclass(slots=True)
class _Forward:
    """What the current forward's blocks share: the whole sequence's length and this rank's
    shards of the rotary tables and of the rows' modulation indices (split once)."""

    length: int = 0
    rotary: Any = None
    adaln: Any = None


def _kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return dispatch_attention_fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)


class _ShardedAttention:
    """``MiniMaxH3Attention``'s processor on this rank's shard of the sequence: its own
    projections, per-head norms and rotary embedding, then attention over every row."""

    def __init__(self, sp: SequenceParallel, forward: _Forward) -> None:
        self.sp = sp
        self.forward = forward

    def __call__(self, attn: Any, hidden_states: torch.Tensor,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("MiniMax-H3 attends over its packed sequence without a mask")
        q, k, v = (proj(hidden_states).unflatten(-1, (attn.heads, -1))
                   for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if rotary_emb is not None:
            q, k = _apply_rotary_emb(q, *rotary_emb), _apply_rotary_emb(k, *rotary_emb)
        out = self.sp.attention(q, k, v, self.forward.length, _kernel)
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def enable_sequence_parallel(model: Any, sp: SequenceParallel) -> None:
    """Split ``model``'s (a ``MiniMaxH3Transformer3DModel``) packed sequence over ``sp``."""
    sp.check_heads(model.config.num_attention_heads, type(model).__name__)
    blocks = model.transformer_blocks
    state = _Forward()

    def split_inputs(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden, temb, adaln, rotary = args[:4]
        if module is blocks[0]:
            state.length = hidden.shape[1]
            state.rotary = tuple(sp.split(t, dim=0) for t in rotary)
            state.adaln = sp.split(adaln, dim=0)  # padding rows take modulation row 0
            hidden = sp.split(hidden, dim=1)
        return (hidden, temb, state.adaln, state.rotary, *args[4:])

    def gather_output(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        state.rotary = state.adaln = None
        return sp.gather(output, state.length, dim=1)

    for block in blocks:
        block.attn.set_processor(_ShardedAttention(sp, state))
        block.register_forward_pre_hook(split_inputs)
    blocks[-1].register_forward_hook(gather_output)
