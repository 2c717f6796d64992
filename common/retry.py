"""One backoff rule for every retry in the service: doubling, capped, with jitter.

The wait after the n-th failure in a row lies between half and all of ``first * 2 ** (n - 1)``,
capped at ``cap``. The doubling spares a server that is out; the random half spreads the retries
of the many ranks, worker groups and webhook deliveries that one outage failed together, so they
do not all come back at the same instant. Half of the ceiling stays as a floor ("equal jitter"
rather than a full jitter from zero): a retry never follows its failure at once.
"""

from __future__ import annotations

import random
from collections.abc import Callable

# 2 ** 64 times any first wait is past every cap; beyond it the float would overflow.
_MAX_DOUBLINGS = 64


def ceiling(failures: int, *, first: float, cap: float) -> float:
    """The longest wait after ``failures`` failures in a row (none after none)."""
    if failures < 1:
        return 0.0
    return min(cap, first * 2.0 ** min(failures - 1, _MAX_DOUBLINGS))


def backoff(failures: int, *, first: float, cap: float,
            rand: Callable[[], float] = random.random) -> float:
    """Seconds to wait after ``failures`` failures in a row: between half and all of
    `ceiling`. ``rand`` draws from [0, 1)."""
    top = ceiling(failures, first=first, cap=cap)
    return top * (0.5 + 0.5 * rand())
