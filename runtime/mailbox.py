"""Messages between rank 0 and the replicas of a group whose replicas keep their own pace.

In lock-step the orders and the reports ride on collectives (a broadcast, a gather): every rank
waits for every other at each turn. Replicas that share no collective during a step (rank-local
weights, every block resident) need not wait for each other, so their messages go through
queues on the group's key-value store instead (the one ``torch.distributed`` rendezvoused
through: a TCPStore, hosted by rank 0 under our launcher and by the agent under torchrun):

- ``orders/<replica>``: rank 0 -> a replica's first rank, the `StepPlan` parts for it;
- ``inbox``: every rank -> rank 0, what it has to report.

Each message is one pickled list, pushed and popped whole (``queue_push``/``queue_pop``); nobody
blocks in the store: a rank that waits for a message polls (a pop that finds nothing costs one
round trip, tens of microseconds), sleeping 1 ms after the first look, doubling up to
``MAX_POLL_SECONDS``: a message that comes soon is seen at once, and a rank that waits long
looks a hundred times a second. The keys carry a
prefix of the rank set (`open_mailbox`), so a store that outlives a rank set (torchrun's agent
restarting the ranks) never hands one set's orders to the next.
"""

from __future__ import annotations

import pickle
import secrets
import time
from typing import Any

import torch.distributed as dist

# The longest a rank that waits for a message sleeps between two looks.
FIRST_POLL_SECONDS = 0.001
MAX_POLL_SECONDS = 0.01


class Mailbox:
    """The group's queues on ``store`` (keys under a prefix of this rank set)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def clone(self) -> Mailbox:
        """The same queues over a connection of its own (one per thread that uses them)."""
        return Mailbox(self.store.clone())

    def send(self, replica: int, orders: list[Any]) -> None:
        """Orders for the replica whose first rank is ``replica`` (rank 0's coordinator)."""
        self.store.queue_push(f"orders/{replica}", pickle.dumps(orders))

    def orders(self, replica: int, wait: float = 0.0) -> list[Any]:
        """The orders waiting for ``replica``, oldest first; waits up to ``wait`` seconds for
        one when there is none."""
        return self._take(f"orders/{replica}", wait)

    def report(self, messages: list[Any]) -> None:
        """A rank's messages for rank 0."""
        self.store.queue_push("inbox", pickle.dumps(messages))

    def reports(self, wait: float = 0.0) -> list[Any]:
        """Every message the ranks sent since the last call, in the order they were sent;
        waits up to ``wait`` seconds for one when there is none."""
        return self._take("inbox", wait)

    def _take(self, key: str, wait: float) -> list[Any]:
        deadline = time.monotonic() + wait
        out: list[Any] = []
        pause = FIRST_POLL_SECONDS
        while True:
            while True:
                try:
                    blob = self.store.queue_pop(key, block=False)
                except dist.QueueEmptyError:
                    break
                out.extend(pickle.loads(blob))  # noqa: S301 - the group's own messages
            left = deadline - time.monotonic()
            if out or left <= 0:
                return out
            time.sleep(min(pause, left))
            pause = min(MAX_POLL_SECONDS, 2 * pause)


def open_mailbox(rank: int, group: Any = None) -> Mailbox:
    """The group's mailbox: a prefix that rank 0 draws and broadcasts on ``group`` (every rank
    calls this together), over a connection of this rank's own to the default store (a second
    thread that sends or takes messages uses its own: `Mailbox.clone`)."""
    box: list[Any] = [f"kiln/mailbox/{secrets.token_hex(4)}/" if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    default = dist.distributed_c10d._get_default_store()  # noqa: SLF001 - no public one
    store = default.clone()  # type: ignore[attr-defined]  # there, but not in torch's stubs
    return Mailbox(dist.PrefixStore(box[0], store))

