"""A step left part-way keeps the blocks it computed: taken again, it computes only the rest.

A step is left part-way for another job: by the whole lock-step group (`VideoPipeline.
leave_steps_when`, `runtime.dlo.ForwardLeft`), or by a replica at its own pace that its orders
want now (`runtime.rank_loop.StepInterrupted`). The job's state is then as before the step and
the step is taken again later. Without more, everything the step had computed is lost: up to a
whole step per preemption, which is why a lock-step group used to leave a step only while less
of it had run than was left.

Here the outputs of the blocks the step ran are kept with the job (`LeftStep`, in
``state.extra``: never in a checkpoint). When the job takes the same step again, each of those
blocks returns its kept output instead of computing (`StepReplay`): the DLO hooks around the
block still acquire and release it, so every rank issues the same gathers as in any other step.
What runs between the blocks (embeddings, modulation, the head) runs again on the same inputs
and gives the same values, so the step's result is the uninterrupted one's, bit for bit
(tests/runtime/test_step_left.py). A preemption then loses at most the block it came inside.

Only for a job that does not cache steps, in a step without the group's cache decision
(`runtime.step_cache`): a deciding step's first block must run. The kept outputs are
references to the tensors the blocks returned, where they are (on the device); at most
``KEEP_MAX_BYTES`` of them a job, the earliest, since a long forward's hidden states add up: a
step left further on computes the rest again. A replica holds at most two jobs (one
suspended with its left step, one whose step keeps outputs as it runs), so an ``auto`` device
budget leaves twice that free (``runtime.budget``). A large video's hidden states pass the bound
after a block or two: its steps keep little.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


class StepLeft(Exception):
    """A step left part-way for another job, to be taken again: the job's state is as before
    it, and the blocks it computed are kept (`LeftStep`) where the pipeline keeps them."""


# Where a job keeps its `LeftStep`, in ``state.extra``.
LEFT_STEP = "left_step"
# The most bytes of block outputs a job keeps for a step it left (the earliest blocks' outputs;
# a step left later computes the blocks past them again).
KEEP_MAX_BYTES = 512 << 20


@dataclass(kw_only=True, slots=True)
class LeftStep:
    """What a job's step left part-way had computed: for step ``step_index`` with the
    transformers ``active``, the outputs of its first block calls, in call order, each with the
    block it came from."""

    step_index: int
    active: tuple[bool, ...]
    outputs: list[tuple[tuple[int, int], Any]] = field(default_factory=list)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


class StepReplay:
    """Keeps and gives back block outputs over every block of a pipeline's streamed
    transformers (``block_lists``: per transformer, its blocks in call order). Each block's
    ``forward`` is wrapped once; outside `begin`/`end` the wrapper only calls it."""

    def __init__(self, block_lists: Iterable[Sequence[nn.Module]],
                 max_bytes: int = KEEP_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._on = False
        self._given = 0  # outputs at the front of ``_outputs`` given back, not computed
        self._outputs: list[tuple[tuple[int, int], Any]] = []
        self._bytes = 0
        self._full = False  # past the byte bound: nothing more is kept this step
        self._calls = 0
        self._kept_at = 0.0  # when the last output was kept (or the step began)
        self.replayed = 0  # block calls given back, since set-up
        for t, blocks in enumerate(block_lists):
            for i, block in enumerate(blocks):
                block.forward = self._wrap((t, i), block.forward)

    def begin(self, kept: LeftStep | None) -> None:
        """A step begins that may be left: keep its blocks' outputs; with ``kept``, the same
        step left before, give its outputs back first."""
        self._on = True
        self._outputs = list(kept.outputs) if kept is not None else []
        self._given = len(self._outputs)
        self._bytes = sum(_nbytes(out) for _, out in self._outputs)
        self._full = False
        self._calls = 0
        self._kept_at = time.perf_counter()

    @property
    def unkept_seconds(self) -> float:
        """How long the step has computed past what it keeps: what leaving it now loses."""
        return time.perf_counter() - self._kept_at

    def end(self) -> list[tuple[tuple[int, int], Any]]:
        """The step is over (done, or left): what it has kept, to be handed to `begin` when the
        step is taken again."""
        outputs, self._outputs = self._outputs, []
        self._on = False
        self._given = self._calls = self._bytes = 0
        return outputs

    def _wrap(self, key: tuple[int, int], forward: Any) -> Any:
        def replayed_forward(*args: Any, **kwargs: Any) -> Any:
            if not self._on:
                return forward(*args, **kwargs)
            call = self._calls
            self._calls += 1
            if call < self._given:
                kept_key, out = self._outputs[call]
                if kept_key != key:
                    # The forward called its blocks in another order than the step left: its
                    # results would not be this step's. Never expected (a forward is the same
                    # code on the same inputs); said loudly rather than rendered wrong.
                    raise RuntimeError(f"block call {call} of the step taken again is block "
                                       f"{key}, not {kept_key} as when it was left")
                self.replayed += 1
                self._kept_at = time.perf_counter()
                return out
            out = forward(*args, **kwargs)
            if not self._full and call == len(self._outputs):
                size = _nbytes(out)
                if self._bytes + size <= self.max_bytes:
                    self._outputs.append((key, out))
                    self._bytes += size
                    self._kept_at = time.perf_counter()
                else:
                    self._full = True
            return out

        return replayed_forward
