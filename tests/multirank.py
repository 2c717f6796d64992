"""Run a function on N CPU ranks over gloo, with a hard timeout so a hang fails instead of blocking.

The function must be importable by name (defined at module level). Each rank's return value
comes back pickled; an exception on any rank comes back as ``RankError`` text.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.procs import free_port


@dataclass(frozen=True)
class RankError:
    type_name: str
    message: str
    traceback: str


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
           out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            result: Any = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which re-raises
        result = RankError(type(exc).__name__, str(exc), traceback.format_exc())
    out.put((rank, result))


def run_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, out), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, result = out.get(timeout=timeout)
            results[rank] = result
    except queue.Empty:
        raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results))} did not "
                           f"finish within {timeout:.0f} s (a hang)") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]


def raise_on_rank_error(results: list[Any]) -> list[Any]:
    for rank, r in enumerate(results):
        if isinstance(r, RankError):
            raise AssertionError(f"rank {rank} raised {r.type_name}: {r.message}\n{r.traceback}")
    return results
