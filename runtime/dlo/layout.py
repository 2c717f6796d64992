"""Where every block tensor lives inside its block's flat byte buffer.

A block's parameters and persistent buffers are packed into one flat byte buffer, grouped by
dtype, every tensor starting on a 64-byte boundary (the alignment the CPU allocator gives a fresh
tensor, so kernels see the same alignment as in the resident model and produce the same bits).
The buffer is padded to a multiple of ``shard_count * 64`` so that it splits into equal,
aligned shards, one per rank.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from torch import nn

ALIGN_BYTES = 64


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a block."""

    name: str  # state_dict key, e.g. "blocks.3.attn.to_q.weight"
    module: nn.Module = field(compare=False, repr=False)  # the module that owns the tensor
    attr: str  # attribute name on that module
    is_param: bool
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset inside the block's flat buffer
    nbytes: int


@dataclass(frozen=True, slots=True)
class BlockLayout:
    index: int  # position in the streaming order, across all block lists
    path: str  # e.g. "transformer_blocks.7"
    entries: tuple[Entry, ...]
    padded_bytes: int  # flat buffer size, a multiple of shard_count * ALIGN_BYTES
    shard_bytes: int  # padded_bytes // shard_count

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_bytes, (rank + 1) * self.shard_bytes


def tensor_nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel * torch.empty((), dtype=dtype).element_size()


def block_tensors(
    prefix: str, block: nn.Module
) -> list[tuple[str, nn.Module, str, bool, torch.Tensor]]:
    """(state_dict key, owner module, attribute, is_param, tensor) for every streamed tensor.

    Parameters and persistent buffers are streamed; non-persistent buffers are not in a
    checkpoint, so they stay resident with the rest of the model.
    """
    out = []
    seen: set[int] = set()
    for mod_name, mod in block.named_modules(prefix=prefix):
        for attr, p in mod._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append((f"{mod_name}.{attr}", mod, attr, True, p))
        for attr, b in mod._buffers.items():
            if b is not None and attr not in mod._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                out.append((f"{mod_name}.{attr}", mod, attr, False, b))
    return out


def build_layout(index: int, path: str, block: nn.Module, shard_count: int) -> BlockLayout:
    tensors = block_tensors(path, block)
    # Group by dtype (stable within a dtype) so each dtype's tensors are contiguous.
    order = {dt: i for i, dt in enumerate(dict.fromkeys(t.dtype for *_, t in tensors))}
    tensors.sort(key=lambda item: order[item[4].dtype])
    entries = []
    offset = 0
    for name, mod, attr, is_param, t in tensors:
        nbytes = tensor_nbytes(t.dtype, tuple(t.shape))
        entries.append(Entry(name, mod, attr, is_param, t.dtype, tuple(t.shape), offset, nbytes))
        offset = _round_up(offset + nbytes, ALIGN_BYTES)
    padded = _round_up(max(offset, 1), shard_count * ALIGN_BYTES)
    return BlockLayout(index, path, tuple(entries), padded, padded // shard_count)


def layout_digest(layouts: list[BlockLayout], shard_count: int) -> str:
    """A digest that differs whenever two ranks would gather different bytes."""
    h = hashlib.sha256(f"shards={shard_count}".encode())
    for lay in layouts:
        h.update(f"|{lay.path}:{lay.padded_bytes}".encode())
        for e in lay.entries:
            h.update(f"|{e.name}:{e.dtype}:{e.shape}:{e.offset}".encode())
    return h.hexdigest()[:16]
