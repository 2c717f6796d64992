"""Sequence parallelism (Ulysses): one job's tokens split over the M ranks of a replica.

Every rank of a replica runs the same job. Each holds one shard of the video token sequence
through the transformer blocks; only self-attention needs the whole sequence, and it gets it by
an all-to-all that trades sequence shards for head shards (each rank then attends over every
token for H/M of the heads) and a second all-to-all back. Everything else in a block (the
projections, the norms, cross-attention to the text, the MLP) is per token and runs on the shard
as it is. After the last block the shards are gathered, so the head and the sampler see the whole
sequence on every rank of the replica, and the replica's latents stay identical on its ranks.

A sequence of L tokens that M does not divide is split as evenly as it goes: every shard holds
``ceil(L / M)`` rows, the first ``L % M`` shards full and the others with one padding row at the
end, so no shard is ever all padding (L >= M is required). Attention drops the padding rows
after the first all-to-all and runs over exactly the L real tokens, which is the computation
the unsplit model does (so the output bits match it), then puts the rows back in place.

Heads must divide by M (a clear error when the model is set up); the all-to-all is
``torch.distributed.all_to_all_single`` on the replica's own process group, which gloo, NCCL
and HCCL all carry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# attention(q, k, v) on [B, L, heads, head_dim] tensors -> [B, L, heads, head_dim]
AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class SequenceSplit:
    """How L tokens sit in M equal shards: shard i holds ``counts[i]`` real rows, then padding."""

    length: int
    degree: int

    def __post_init__(self) -> None:
        if self.degree < 1:
            raise ValueError(f"the sequence-parallel degree must be >= 1, got {self.degree}")
        if self.length < self.degree:
            raise ValueError(f"a sequence of {self.length} tokens cannot be split over "
                             f"{self.degree} ranks (each needs at least one real token)")

    @property
    def shard(self) -> int:
        """Rows per shard, padding included."""
        return -(-self.length // self.degree)

    @property
    def counts(self) -> tuple[int, ...]:
        base, extra = divmod(self.length, self.degree)
        return tuple(base + (1 if i < extra else 0) for i in range(self.degree))

    @property
    def padded(self) -> bool:
        return self.length % self.degree != 0

    def start(self, rank: int) -> int:
        """The first real token of shard ``rank``."""
        return sum(self.counts[:rank])

    def real_rows(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Indices of the real rows in the M * shard padded layout, in token order."""
        rows = [i * self.shard + j for i, n in enumerate(self.counts) for j in range(n)]
        return torch.tensor(rows, dtype=torch.long, device=device)


class SequenceParallel:
    """One replica's split: its process group, this rank's place in it, the all-to-alls."""

    def __init__(self, group: Any, *, degree: int | None = None, rank: int | None = None) -> None:
        self.group = group
        self.degree = degree if degree is not None else dist.get_world_size(group)
        self.rank = rank if rank is not None else dist.get_rank(group)
        self._real_rows: dict[tuple[int, str], torch.Tensor] = {}

    def check_heads(self, num_heads: int, what: str = "the model") -> None:
        if num_heads % self.degree:
            raise ValueError(f"{what} has {num_heads} attention heads, which sequence "
                             f"parallelism over {self.degree} ranks cannot split evenly; "
                             f"use an sp that divides {num_heads}")

    # ---- the sequence --------------------------------------------------------------------

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shard of ``x`` along ``dim`` (padded with zeros to the shard length)."""
        cut = SequenceSplit(x.shape[dim], self.degree)
        start, count = cut.start(self.rank), cut.counts[self.rank]
        local = x.narrow(dim, start, count)
        if count < cut.shard:
            pad_shape = list(x.shape)
            pad_shape[dim] = cut.shard - count
            local = torch.cat([local, x.new_zeros(pad_shape)], dim=dim)
        return local.contiguous()

    def gather(self, local: torch.Tensor, length: int, dim: int = 1) -> torch.Tensor:
        """The whole sequence of ``length`` tokens from every rank's shard (padding dropped)."""
        cut = SequenceSplit(length, self.degree)
        moved = local.movedim(dim, 0).contiguous()
        out = moved.new_empty((self.degree * moved.shape[0], *moved.shape[1:]))
        dist.all_gather_into_tensor(out, moved, group=self.group)
        if cut.padded:
            out = out.index_select(0, self._rows(cut, out.device))
        return out.movedim(0, dim).contiguous()

    def _rows(self, cut: SequenceSplit, device: torch.device) -> torch.Tensor:
        key = (cut.length, str(device))
        if key not in self._real_rows:
            self._real_rows[key] = cut.real_rows(device)
        return self._real_rows[key]

    # ---- attention -----------------------------------------------------------------------

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, H, D] sequence shard -> [B, M*S, H/M, D] head shard (all-to-all)."""
        b, s, h, d = x.shape
        m = self.degree
        send = x.reshape(b, s, m, h // m, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        # recv[j]: shard j's rows for this rank's heads.
        return recv.permute(1, 0, 2, 3, 4).reshape(b, m * s, h // m, d)

    def _to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[B, M*S, H/M, D] head shard -> [B, S, H, D] sequence shard (all-to-all)."""
        b, ms, hm, d = x.shape
        m = self.degree
        send = x.reshape(b, m, ms // m, hm, d).permute(1, 0, 2, 3, 4).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        # recv[j]: this rank's rows for head group j.
        return recv.permute(1, 2, 0, 3, 4).reshape(b, ms // m, m * hm, d)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int,
                  kernel: AttentionKernel) -> torch.Tensor:
        """Self-attention over the whole sequence from this rank's shards of q, k, v
        ([B, S, H, D]); returns this rank's shard of the output, [B, S, H, D]."""
        cut = SequenceSplit(length, self.degree)
        q, k, v = (self._to_heads(t) for t in (q, k, v))
        if not cut.padded:
            return self._to_sequence(kernel(q, k, v))
        rows = self._rows(cut, q.device)
        out = kernel(*(t.index_select(1, rows) for t in (q, k, v)))
        full = out.new_zeros((out.shape[0], q.shape[1], *out.shape[2:]))
        full.index_copy_(1, rows, out)
        return self._to_sequence(full)


@dataclass(frozen=True, slots=True)
class Layout:
    """A worker group's shape: ``dp`` replicas of ``sp`` ranks. Replica r is ranks
    ``r*sp .. r*sp + sp - 1``; it renders one job at a time, and its first rank (the leader)
    decodes and stores the video and speaks for it. The weights are one copy for all
    ``dp * sp`` ranks (DLO)."""

    dp: int = 1
    sp: int = 1

    def __post_init__(self) -> None:
        if self.dp < 1 or self.sp < 1:
            raise ValueError(f"--dp and --sp must be >= 1, got dp={self.dp}, sp={self.sp}")

    @property
    def world(self) -> int:
        return self.dp * self.sp

    def replica(self, rank: int) -> int:
        return rank // self.sp

    def leader(self, rank: int) -> int:
        """The first rank of ``rank``'s replica."""
        return rank - rank % self.sp

    def is_leader(self, rank: int) -> bool:
        return rank % self.sp == 0

    @property
    def leaders(self) -> list[int]:
        return [r * self.sp for r in range(self.dp)]

    def ranks(self, replica: int) -> list[int]:
        return list(range(replica * self.sp, (replica + 1) * self.sp))

    def __str__(self) -> str:
        return f"dp={self.dp} x sp={self.sp}"


#: One rank rendering its jobs alone (dp=1, sp=1).
SOLO = Layout()


def open_sequence(layout: Layout, backend: str) -> SequenceParallel | None:
    """Every rank of the group calls this, in step: one process group per replica. Returns
    this rank's split (None when sp == 1: a rank renders its job alone)."""
    if layout.sp == 1:
        return None
    if dist.get_world_size() != layout.world:
        raise ValueError(f"a {layout} group needs {layout.world} ranks, the process group has "
                         f"{dist.get_world_size()}")
    rank = dist.get_rank()
    mine = None
    for replica in range(layout.dp):
        # new_group is collective over the whole world: every rank creates every replica's.
        group = dist.new_group(ranks=layout.ranks(replica), backend=backend)
        if replica == layout.replica(rank):
            mine = group
    return SequenceParallel(group=mine, degree=layout.sp, rank=rank % layout.sp)
