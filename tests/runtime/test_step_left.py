"""A lock-step group of ranks that gather weights leaves a step part-way, all together
(`VideoPipeline.leave_steps_when`, `DLOHandle.leave_when`): every rank stops before the same
block, computing or idle, no rank owes another a gather, and each job takes the step again from
its start, so its frames equal an uninterrupted render's bit for bit.

Two CPU ranks over gloo with allgather (`tests.multirank`), each running its own request in
lock-step; rank 0's check says "leave" at the looks listed (counted from 1, one look per block
after a forward's first), rank 1's never does.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import pytest
import torch
import torch.distributed as dist
from multirank import run_ranks

from runtime.dlo import ForwardLeft
from runtime.models.synthetic import SyntheticSpec, make_checkpoint
from runtime.pipelines.base import VideoPipeline, VideoRequest, agree_handles
from runtime.pipelines.registry import load_diffusers
from runtime.pipelines.tiny import TinyPipeline

# Rank 1's job ends after 3 steps: it idles through rank 0's last ones, and leaves them too.
TINY = [VideoRequest(prompt="a red ball", num_inference_steps=6, seed=1, guidance_scale=5.0),
        VideoRequest(prompt="a blue cat", num_inference_steps=3, seed=2, guidance_scale=5.0)]


def _lockstep_leaving(pipe: VideoPipeline, rank: int, requests: list[VideoRequest],
                      leave_at: set[int],
                      within_blocks: bool = False,
                      late: bool = False) -> tuple[np.ndarray, int, list[int]]:
    """``requests[rank]``'s frames rendered in lock-step with the group leaving steps where
    rank 0's looks ``leave_at`` say; the steps left, and each handle's blocks acquired."""
    looks = 0

    def check() -> bool:
        nonlocal looks
        looks += 1
        return rank == 0 and looks in leave_at

    state = pipe.prepare(requests[rank])
    left = 0
    while True:
        busy = torch.tensor([int(not state.done)])
        dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        if not busy.item():
            break
        active = agree_handles(pipe, state)
        step = state.step_index
        pipe.leave_steps_when(check, within_blocks=within_blocks, late=late and rank == 0)
        try:
            if not state.done:
                pipe.step(state, active)
            else:
                pipe.idle_step(active)
        except ForwardLeft:
            assert state.step_index == step  # nothing of the step was kept
        was_left = any(h is not None and h.left for h in pipe.handles)
        pipe.leave_steps_when(None)
        left += was_left
    frames = pipe.decode(state).numpy()
    return frames, left, [h.num_acquired for h in pipe.handles if h is not None]


def _alone(load: Callable[[], VideoPipeline], request: VideoRequest) -> np.ndarray:
    """The uninterrupted render at dp=1, with the one thread each rank computes with
    (`tests.multirank`): lock-step ranks render the frames they would alone."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pipe = load()
    try:
        return pipe.generate(request).numpy()
    finally:
        pipe.close()
        torch.set_num_threads(threads)


def _tiny() -> VideoPipeline:
    return TinyPipeline.load(device="cpu")


def _tiny_rank(rank: int, world: int, leave_at: set[int], within_blocks: bool,
               late: bool = False) -> tuple[np.ndarray, int, list[int]]:
    pipe = _tiny()
    try:
        assert pipe.gathers_weights
        return _lockstep_leaving(pipe, rank, TINY, leave_at, within_blocks, late)
    finally:
        pipe.close()


@pytest.mark.parametrize("within_blocks", [False, True], ids=["at a block", "inside a block"])
def test_kiln_tiny_steps_left_together_render_the_uninterrupted_frames(within_blocks):
    """Inside a block, a computing rank leaves at its next module once the answer is in; an
    idle one, at the next block: both issued the same gathers."""
    # Looks 2 (step 1, early), 9 (a later step) and 16 (after rank 1's job ended: it idles).
    leaving = run_ranks(2, _tiny_rank, {2, 9, 16}, within_blocks)
    (frames0, left0, acquired0), (frames1, left1, acquired1) = leaving
    assert left0 == left1 == 3  # both ranks left the same steps
    assert acquired0 == acquired1  # and issued the same gathers
    # 6 steps of 4 blocks (CFG in one forward) whole, and 3 left before their last block.
    assert acquired0[0] < (6 + 3) * 4
    np.testing.assert_array_equal(frames0, _alone(_tiny, TINY[0]))
    np.testing.assert_array_equal(frames1, _alone(_tiny, TINY[1]))


def test_rank_0s_check_looked_at_late_in_each_block_leaves_the_same_steps_everywhere():
    """Rank 0's check is looked at again and again while each block computes (how often
    depends on the block's time): whichever steps it leaves, every rank leaves them too."""
    (frames0, left0, acquired0), (frames1, left1, acquired1) = run_ranks(
        2, _tiny_rank, {2, 40, 80}, True, True)
    assert left0 == left1 >= 1 and acquired0 == acquired1
    np.testing.assert_array_equal(frames0, _alone(_tiny, TINY[0]))
    np.testing.assert_array_equal(frames1, _alone(_tiny, TINY[1]))


# Wan2.2 with two experts, the low-noise one taking over below t = 600: at step 4 rank 0 needs
# the low-noise expert while rank 1 needs the high-noise one, and computes with it while rank 0
# idles through its gathers first (`VideoPipeline._complete_handles_before`).
WAN22 = SyntheticSpec(family="wan", num_experts=2, boundary_ratio=0.6)
EITHER_SIDE = [VideoRequest(prompt="a red ball", num_inference_steps=4, seed=1),
               VideoRequest(prompt="a blue cat", num_inference_steps=6, seed=2)]


@pytest.fixture(scope="module")
def wan22_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("models") / "wan22", WAN22)


def _wan_rank(rank: int, world: int, model_dir: str,
              leave_at: set[int]) -> tuple[np.ndarray, int, list[int]]:
    pipe = load_diffusers(model_dir, device="cpu")
    try:
        return _lockstep_leaving(pipe, rank, EITHER_SIDE, leave_at)
    finally:
        pipe.close()


def test_a_wan22_step_left_while_a_rank_idles_the_other_expert_renders_the_same(wan22_dir):
    # Looks 1 and 4: in the first step, and in a later one (the synthetic experts have two
    # blocks each: one look per forward of an expert).
    leaving = run_ranks(2, _wan_rank, str(wan22_dir), {1, 4})
    (frames0, left0, acquired0), (frames1, left1, acquired1) = leaving
    assert left0 == left1 == 2 and acquired0 == acquired1
    load = partial(load_diffusers, str(wan22_dir), device="cpu")
    np.testing.assert_array_equal(frames0, _alone(load, EITHER_SIDE[0]))
    np.testing.assert_array_equal(frames1, _alone(load, EITHER_SIDE[1]))
