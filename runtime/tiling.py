"""Request tiling: keep the transient memory of a stage under a share of what is free right now.

A stage whose transient memory grows with the number of requests or frames (VAE decode, turning
float frames into bytes, the guidance combination of a long clip) splits its items into tiles.
The tile size is derived at run time, never configured: a fraction of the free memory of the
device the stage runs on (``mem_get_info`` on accelerators, available RAM on the CPU), divided by
the stage's estimate of the bytes one item needs. The output buffer is allocated and cleared once
before the tile loop and every tile writes only its own slice, so no tile can wipe the results of
an earlier one, and the result is bit-identical to one pass for any per-item function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from runtime.platform import get_platform

# Share of the free memory one stage may use for its transients: the rest is headroom for the
# allocator's fragmentation and for whatever else runs at the same time (the DLO prefetch).
DEFAULT_FRACTION = 0.5


@dataclass(kw_only=True, slots=True, frozen=True)
class TilePlan:
    num_items: int  # items the stage processes (requests, or frames of all requests)
    tile: int  # items per tile, 1 <= tile <= max(num_items, 1)
    bytes_per_item: int  # the stage's estimate of one item's transient bytes
    budget_bytes: int  # the share of free memory the tiles must fit in

    @property
    def num_tiles(self) -> int:
        return -(-self.num_items // self.tile)

    def slices(self) -> Iterator[slice]:
        for start in range(0, self.num_items, self.tile):
            yield slice(start, min(start + self.tile, self.num_items))


def plan_tiles(
    num_items: int,
    bytes_per_item: int,
    *,
    fraction: float = DEFAULT_FRACTION,
    free_bytes: int | None = None,
    device: torch.device | str | None = None,
) -> TilePlan:
    """The largest tile whose transients fit in ``fraction`` of the free memory.

    ``free_bytes`` replaces the measurement (a benchmark simulating a smaller device); by default
    the free memory of ``device`` is read now, so the tile follows what other stages left over.
    A tile never drops below one item: one item that does not fit will fail the same way untiled.
    """
    if num_items < 0:
        raise ValueError(f"num_items must be >= 0, got {num_items}")
    if bytes_per_item <= 0:
        raise ValueError(f"bytes_per_item must be > 0, got {bytes_per_item}")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if free_bytes is None:
        free_bytes = get_platform(device).mem_get_info()[0]
    budget = int(free_bytes * fraction)
    tile = max(1, min(max(num_items, 1), budget // bytes_per_item))
    return TilePlan(num_items=num_items, tile=tile, bytes_per_item=bytes_per_item,
                    budget_bytes=budget)


def map_tiles(
    fn: Callable[[torch.Tensor], torch.Tensor],
    items: torch.Tensor,
    out: torch.Tensor,
    plan: TilePlan,
) -> torch.Tensor:
    """``out[i] = fn(items[i:j])`` tile by tile along dim 0; returns ``out``.

    ``fn`` must treat items independently (so any tiling gives the same bits). ``out`` is cleared
    here, once, before the loop: a stage that cleared its buffer per call would erase the tiles
    already written.
    """
    if items.shape[0] != plan.num_items or out.shape[0] != plan.num_items:
        raise ValueError(f"plan is for {plan.num_items} items, got {items.shape[0]} inputs and "
                         f"{out.shape[0]} output rows")
    out.zero_()
    for s in plan.slices():
        out[s].copy_(fn(items[s]))
    return out
