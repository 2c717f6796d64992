"""A replica at its own pace leaves a step part-way for orders that want it
(`runtime.rank_loop._Interrupt`): the orders wait for the loop, the blocks the step computed are
given back when it is taken again (`runtime.step_replay`; a caching job's step runs again
whole), and the job's frames equal an uninterrupted render's, bit for bit, however many of its
steps were left, in kiln-tiny (exact and caching) and in a tiny Wan streamed from a rank-local
copy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime.pipelines.base import VideoRequest
from runtime.platform import get_platform
from runtime.rank_loop import RankLoop, StepPlan, Ticket, _Interrupt
from runtime.render import frames_to_uint8

pytestmark = pytest.mark.unit


class Orders:
    """A mailbox whose replica-0 queue yields ``plan`` at looks number ``at`` (counted from 1)."""

    def __init__(self, plan: StepPlan, at: set[int]) -> None:
        self.plan, self.at, self.looks = plan, at, 0

    def orders(self, replica: int, wait: float = 0.0) -> list[Any]:
        self.looks += 1
        return [self.plan] if self.looks in self.at else []


def _render(loop: RankLoop, request: VideoRequest,
            orders: Orders | None) -> tuple[np.ndarray, int]:
    """``request``'s frames through ``loop``, its steps left wherever ``orders`` says, and how
    many steps were left."""
    interrupt = _Interrupt(loop, orders) if orders is not None else None  # type: ignore[arg-type]
    if interrupt is not None:
        interrupt.LOOK_SECONDS = 0.0  # look at every module
    try:
        ticket = Ticket(job_id=f"j{id(orders)}", attempt_token="t", request=request)
        loop.apply(StepPlan(assign={0: ticket}))
        job = loop.current
        assert job is not None
        interrupted = 0
        while not job.state.done:
            step = job.state.step_index
            if interrupt is not None:
                interrupt.arm(job.ticket)
            loop.step()
            if interrupt is not None:
                interrupt.disarm()
                taken = interrupt.take()
                if job.state.step_index == step:  # left part-way: the orders wait for the loop
                    assert orders is not None and taken == [orders.plan]
                    interrupted += 1
        assert job.interrupted_steps == interrupted
        return frames_to_uint8(loop.pipe.decode(job.state)).numpy(), interrupted
    finally:
        if interrupt is not None:
            interrupt.close()


def _loop(pipe: Any) -> RankLoop:
    return RankLoop(0, pipe, lambda *a, **k: None, get_platform("cpu"))  # type: ignore[arg-type]


def test_kiln_tiny_left_part_way_renders_the_uninterrupted_frames() -> None:
    from runtime.pipelines.tiny import TinyPipeline

    loop = _loop(TinyPipeline.load(device="cpu"))
    request = VideoRequest(prompt="a red circle moving left", width=64, height=64,
                           num_frames=9, num_inference_steps=6, seed=3)
    try:
        plain, _ = _render(loop, request, None)
        # A hold at looks 3, 20 and 41: in the first block, a later block, a later step.
        held, interrupted = _render(loop, request, Orders(StepPlan(hold=[0]), {3, 20, 41}))
        replayed = loop.pipe.blocks_replayed
        # An order for another replica leaves no step.
        other, none = _render(loop, request, Orders(StepPlan(hold=[1]), {3, 20}))
    finally:
        loop.close()
    assert interrupted == 3 and none == 0
    # The two steps left past their first block took back what they had computed.
    assert replayed >= 2 and loop.pipe.blocks_replayed == replayed
    assert np.array_equal(held, plain) and np.array_equal(other, plain)


def test_a_caching_job_left_part_way_renders_the_uninterrupted_frames() -> None:
    """Its step cache is put back as it was before the step it left: the job skips what it
    would have skipped, and its frames and computed blocks are the uninterrupted render's."""
    from runtime.pipelines.tiny import TinyPipeline

    loop = _loop(TinyPipeline.load(device="cpu"))
    request = VideoRequest(prompt="waves at dusk", width=64, height=64, num_frames=9,
                           num_inference_steps=12, seed=1, step_cache=0.2)
    try:
        plain, _ = _render(loop, request, None)
        plain_blocks = loop.pipe.step_caches[0].num_blocks_computed
        held, interrupted = _render(loop, request, Orders(StepPlan(hold=[0]), {3, 30, 60, 90}))
    finally:
        loop.close()
    assert interrupted == 4 and loop.pipe.blocks_replayed == 0
    assert np.array_equal(held, plain)
    assert plain_blocks < 12 * 4


def test_a_streamed_wan_left_part_way_renders_the_uninterrupted_frames(tmp_path: Path) -> None:
    """Rank-local, every block streamed through the two slots from the rank's own copy: a step
    left in the middle of a block leaves the engine ready for the next forward; a step left in
    its second block takes the first one's output back."""
    from runtime.models.synthetic import SyntheticSpec, make_checkpoint
    from runtime.pipelines.registry import load_diffusers

    model = make_checkpoint(tmp_path / "wan", SyntheticSpec(family="wan"))
    pipe = load_diffusers(model, device="cpu", use_allgather=False, device_budget=None,
                          weights_dtype="bf16")
    loop = _loop(pipe)
    request = VideoRequest(prompt="a red ball", width=64, height=64, num_frames=9,
                           num_inference_steps=3, seed=0)
    try:
        assert pipe.handles[0].streamed_blocks == pipe.handles[0].num_blocks
        plain, _ = _render(loop, request, None)
        held, interrupted = _render(loop, request, Orders(StepPlan(hold=[0]), {5, 45}))
    finally:
        loop.close()
    assert interrupted == 2 and pipe.blocks_replayed >= 1
    assert np.array_equal(held, plain)
