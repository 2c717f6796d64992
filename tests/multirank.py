"""Run a test function on N CPU ranks over gloo, with a deadline so a hang fails instead of
blocking.

The launcher is ``runtime.launch.run_ranks``, the one ``kiln render`` and ``kiln worker`` use:
an exception on any rank fails the call (``RankFailure`` with that rank's traceback; a
``ValueError`` comes back as itself) and kills the other ranks at once rather than leaving them
blocked in a collective until the deadline. What this adds: ``fn`` takes
``(rank, world_size, *args)`` (no message queue), and each rank runs one torch thread whatever
the machine, as these tests always have.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime import launch


def _call(ctx: launch.RankContext, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(ctx.rank, ctx.world, *args)


def run_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results
    in rank order. ``fn`` must be importable by name (defined at module level)."""
    return launch.run_ranks(world_size, _call, fn, *args, timeout_s=timeout, threads=1)
