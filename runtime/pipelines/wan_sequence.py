"""Sequence parallelism for diffusers' ``WanTransformer3DModel`` (``runtime.sequence``).

Wan's transformer takes the latent video whole; its blocks are where the work is. Hooks on the
block list split the token sequence before the first block (and the rotary tables and, for
Wan2.2 TI2V, the per-token timestep modulation with it), and gather it after the last, so the
head and the sampler run on the whole sequence as diffusers wrote them. In every block the
self-attention (``attn1``) gets a processor that runs Wan's own projections, norms and rotary
embedding on the shard, trades shards for heads around the attention kernel (the same
``dispatch_attention_fn`` diffusers calls), and trades them back; cross-attention to the text
and the feed-forward are per token and run unchanged.

Why not diffusers' own context parallelism (``enable_parallelism`` with a
``ContextParallelConfig(ulysses_degree=...)``): it composes with DLO (on a sequence M divides
it gives the same bits as this), but it cannot set up without an accelerator (it picks a device
by ``rank % accelerator device_count``, zero on a CPU host), it needs the sequence to divide by
M (its uneven mode all-gathers tensors of different sizes, which gloo refuses), and kiln's
replicas need one mesh per replica. One mechanism for kiln-tiny and Wan is also one to keep
exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import _get_qkv_projections

from runtime.sequence import SequenceParallel


@dataclass(slots=True)
class _Forward:
    """What the current forward's blocks share: the whole sequence's length, the shards of the
    rotary tables and of a per-token modulation (split once, used by every block)."""

    length: int = 0
    rotary: Any = None
    temb: Any = None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on [B, S, H, D]: (even, odd) channel pairs turned by the angle
    whose cosine sits in the even channels of ``cos`` and sine in the odd ones of ``sin``."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * c - odd * s
    out[..., 1::2] = even * s + odd * c
    return out.type_as(x)


class _ShardedSelfAttention:
    """``WanAttention`` processor for self-attention on this rank's shard of the sequence."""

    def __init__(self, sp: SequenceParallel, forward: _Forward) -> None:
        self.sp = sp
        self.forward = forward

    @staticmethod
    def _kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dispatch_attention_fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)

    def __call__(self, attn: Any, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:
            query, key = _rotate(query, *rotary_emb), _rotate(key, *rotary_emb)
        out = self.sp.attention(query, key, value, self.forward.length, self._kernel)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def enable_sequence_parallel(model: Any, sp: SequenceParallel) -> None:
    """Split ``model``'s (a ``WanTransformer3DModel``) token sequence over ``sp``'s ranks."""
    sp.check_heads(model.config.num_attention_heads, type(model).__name__)
    blocks = model.blocks
    if any(b.attn1.add_k_proj is not None or b.attn2.add_k_proj is not None for b in blocks):
        raise ValueError("sequence parallelism renders Wan models whose cross-attention reads "
                         "the text alone; this one has image-conditioning projections "
                         "(Wan2.1 I2V)")
    state = _Forward()

    def split_inputs(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden, text, temb, rotary = args
        if module is blocks[0]:
            state.length = hidden.shape[1]
            state.rotary = tuple(sp.split(t, dim=1) for t in rotary)
            # Wan2.2 TI2V modulates every token: [B, L, 6, D]; else one per batch item.
            state.temb = sp.split(temb, dim=1) if temb.ndim == 4 else temb
            hidden = sp.split(hidden, dim=1)
        return hidden, text, state.temb, state.rotary

    def gather_output(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        state.rotary = state.temb = None
        return sp.gather(output, state.length, dim=1)

    for block in blocks:
        block.attn1.set_processor(_ShardedSelfAttention(sp, state))
        block.register_forward_pre_hook(split_inputs)
    blocks[-1].register_forward_hook(gather_output)
