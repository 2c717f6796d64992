"""The backoff rule: doubling from the first wait, capped, each wait spread over its upper half."""

from __future__ import annotations

from common.retry import backoff, ceiling


def test_the_ceiling_doubles_from_the_first_wait_up_to_the_cap() -> None:
    assert [ceiling(n, first=1.0, cap=30.0) for n in range(8)] == [0, 1, 2, 4, 8, 16, 30, 30]
    assert ceiling(10_000, first=0.5, cap=10.0) == 10.0  # no overflow after a long outage


def test_each_wait_lies_in_the_upper_half_of_its_ceiling_and_they_spread() -> None:
    assert backoff(3, first=1.0, cap=30.0, rand=lambda: 0.0) == 2.0
    assert backoff(3, first=1.0, cap=30.0, rand=lambda: 0.5) == 3.0
    waits = [backoff(3, first=1.0, cap=30.0) for _ in range(200)]
    assert all(2.0 <= w < 4.0 for w in waits)
    assert max(waits) - min(waits) > 1.0  # retries that failed together come back apart
    assert backoff(0, first=1.0, cap=30.0) == 0.0
