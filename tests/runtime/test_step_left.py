"""A lock-step group of ranks that gather weights leaves a step part-way, all together
(`VideoPipeline.leave_steps_when`, `DLOHandle.leave_when`): every rank stops before the same
block, computing or idle, no rank owes another a gather, and each job takes the step again, the
blocks it had computed given back rather than computed again (`runtime.step_replay`), so its
frames equal an uninterrupted render's bit for bit.

Two CPU ranks over gloo with allgather (`tests.multirank`), each running its own request in
lock-step; rank 0's check says "leave" at the looks listed (counted from 1, one look per block
after a forward's first), rank 1's never does.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

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
from runtime.platform import get_platform
from runtime.rank_loop import (
    Ended,
    RankLoop,
    RankMessage,
    RankReport,
    Rendered,
    StepPlan,
    Ticket,
    run_loop,
)
from runtime.render import frames_to_uint8

# Rank 1's job ends after 3 steps: it idles through rank 0's last ones, and leaves them too.
TINY = [VideoRequest(prompt="a red ball", num_inference_steps=6, seed=1, guidance_scale=5.0),
        VideoRequest(prompt="a blue cat", num_inference_steps=3, seed=2, guidance_scale=5.0)]


def _lockstep_leaving(pipe: VideoPipeline, rank: int, requests: list[VideoRequest],
                      leave_at: set[int],
                      within_blocks: bool = False,
                      late: bool = False) -> tuple[np.ndarray, int, list[int], int]:
    """``requests[rank]``'s frames rendered in lock-step with the group leaving steps where
    rank 0's looks ``leave_at`` say; the steps left, each handle's blocks acquired, and the
    block calls given back from a left step (`runtime.step_replay`)."""
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
    return (frames, left, [h.num_acquired for h in pipe.handles if h is not None],
            pipe.blocks_replayed)


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
               late: bool = False) -> tuple[np.ndarray, int, list[int], int]:
    pipe = _tiny()
    try:
        assert pipe.gathers_weights
        return _lockstep_leaving(pipe, rank, TINY, leave_at, within_blocks, late)
    finally:
        pipe.close()


# Leaving at a block is the simpler path (inside a block, every rank leaves at its next block
# too): `make chaos` runs it.
@pytest.mark.parametrize("within_blocks", [pytest.param(False, marks=pytest.mark.chaos), True],
                         ids=["at a block", "inside a block"])
def test_kiln_tiny_steps_left_together_render_the_uninterrupted_frames(within_blocks):
    """Inside a block, a computing rank leaves at its next module once the answer is in; an
    idle one, at the next block: both issued the same gathers."""
    # Looks 2 (step 1, early), 9 (a later step) and 16 (after rank 1's job ended: it idles).
    leaving = run_ranks(2, _tiny_rank, {2, 9, 16}, within_blocks)
    (frames0, left0, acquired0, kept0), (frames1, left1, acquired1, kept1) = leaving
    assert left0 == left1 == 3  # both ranks left the same steps
    assert acquired0 == acquired1  # and issued the same gathers
    # 6 steps of 4 blocks (CFG in one forward) whole, and 3 left before their last block.
    assert acquired0[0] < (6 + 3) * 4
    # Rank 0's job computed blocks in each step left (the third, after rank 1's job ended,
    # too), and took them back: at least the block before each look, once. Rank 1's job was
    # in the first two steps left.
    assert kept0 >= 3 and kept1 >= 2
    np.testing.assert_array_equal(frames0, _alone(_tiny, TINY[0]))
    np.testing.assert_array_equal(frames1, _alone(_tiny, TINY[1]))


@pytest.mark.chaos  # slow: two more ranks; `make chaos`
def test_rank_0s_check_looked_at_late_in_each_block_leaves_the_same_steps_everywhere():
    """Rank 0's check is looked at again and again while each block computes (how often
    depends on the block's time): whichever steps it leaves, every rank leaves them too."""
    leaving = run_ranks(2, _tiny_rank, {2, 40, 80}, True, True)
    (frames0, left0, acquired0, _), (frames1, left1, acquired1, _) = leaving
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
              leave_at: set[int]) -> tuple[np.ndarray, int, list[int], int]:
    pipe = load_diffusers(model_dir, device="cpu")
    try:
        return _lockstep_leaving(pipe, rank, EITHER_SIDE, leave_at)
    finally:
        pipe.close()


@pytest.mark.chaos  # slow: two more ranks on a Wan2.2 pair; `make chaos`
def test_a_wan22_step_left_while_a_rank_idles_the_other_expert_renders_the_same(wan22_dir):
    # Looks 1 and 4: in the first step, and in a later one (the synthetic experts have two
    # blocks each: one look per forward of an expert).
    leaving = run_ranks(2, _wan_rank, str(wan22_dir), {1, 4})
    (frames0, left0, acquired0, kept0), (frames1, left1, acquired1, kept1) = leaving
    assert left0 == left1 == 2 and acquired0 == acquired1
    assert kept0 + kept1 >= 2  # each step left had a computed block to give back
    load = partial(load_diffusers, str(wan22_dir), device="cpu")
    np.testing.assert_array_equal(frames0, _alone(load, EITHER_SIDE[0]))
    np.testing.assert_array_equal(frames1, _alone(load, EITHER_SIDE[1]))


# ---- through the rank loop: a scripted driver leaves a batch turn for an interactive job ------

BATCH_A = VideoRequest(prompt="a red ball", width=64, height=64, num_frames=9,
                       num_inference_steps=6, seed=1)
BATCH_B = VideoRequest(prompt="a blue cat", width=64, height=64, num_frames=9,
                       num_inference_steps=6, seed=2)
SMALL = VideoRequest(prompt="waves at dusk", width=64, height=64, num_frames=5,
                     num_inference_steps=2, seed=3)


class LeavingDriver:
    """Rank 0's driver: batch jobs "a" and "b" on the two replicas, in leavable turns; in the
    third turn it says leave, and the next plan gives "i" to replica 0, "i" alone computing;
    stops once all three are stored. Keeps every turn's plan and messages."""

    def __init__(self) -> None:
        self.turns: list[tuple[StepPlan, list[RankMessage]]] = []
        self.looks = 0
        self.left_in_turn: int | None = None
        self.ended: set[str] = set()

    def start(self, memory: dict[str, Any], *, own_pace: bool = False) -> None:
        pass

    def next_plan(self, stop_requested: bool) -> StepPlan:
        n = len(self.turns)
        rendered = {m.job_id for _, ms in self.turns for m in ms if isinstance(m, Rendered)}
        if self.ended == {"a", "b", "i"}:
            return StepPlan(stop=True)
        if n == 0:
            plan = StepPlan(assign={0: Ticket(job_id="a", attempt_token="ta", request=BATCH_A),
                                    1: Ticket(job_id="b", attempt_token="tb", request=BATCH_B)},
                            leavable=True)
        elif self.left_in_turn == n - 1:
            plan = StepPlan(assign={0: Ticket(job_id="i", attempt_token="ti", request=SMALL)},
                            run={0: "i"})
        elif self.left_in_turn is not None and "i" not in rendered:
            plan = StepPlan(run={0: "i"})
        else:
            plan = StepPlan(run={r: j for r, j in ((0, "a"), (1, "b")) if j not in rendered},
                            leavable=True)
        plan.step = not {"a", "b", "i"} <= rendered
        self.turns.append((plan, []))
        return plan

    def leave_step(self) -> bool:
        self.looks += 1
        if len(self.turns) == 3 and self.left_in_turn is None:
            self.left_in_turn = 2
            return True
        return False

    def record(self, messages: list[RankMessage]) -> None:
        self.turns[-1][1].extend(messages)
        self.ended |= {m.job_id for m in messages
                       if isinstance(m, Ended) and m.outcome == "succeeded"}

    def stop(self, memory: dict[str, Any], *, failed: bool) -> None:
        pass


def _loop_rank(rank: int, world: int) -> tuple[dict[str, np.ndarray], list[Any] | None]:
    platform = get_platform("cpu")
    pipe = _tiny()
    frames: dict[str, np.ndarray] = {}

    def write(rgb: Any, job_id: str, fps: int, *audio: Any) -> tuple[str, str]:
        frames[job_id] = np.asarray(rgb)
        return f"{job_id}.mp4", f"{job_id}.png"

    loop = RankLoop(rank, pipe, write, platform)
    driver = LeavingDriver() if rank == 0 else None
    run_loop(rank, world, loop, driver)
    if driver is None:
        return frames, None
    return frames, [(plan.leavable, [(type(m).__name__, m.job_id, getattr(m, "step", None),
                                      getattr(m, "computed", None))
                                     for m in ms if not isinstance(m, RankReport)])
                    for plan, ms in driver.turns]


def test_a_leavable_batch_turn_is_left_for_an_interactive_job_and_every_video_is_unchanged():
    (frames0, turns), (frames1, _) = run_ranks(2, _loop_rank, timeout=180)
    # The third turn was left: its jobs report the step they had before it, not computed.
    leavable, left = turns[2]
    assert leavable and sorted(left) == [("Progress", "a", 2, False), ("Progress", "b", 2, False)]
    # The next turn gives "i" to replica 0; "a" and "b" wait until it rendered.
    assert ("Progress", "i", 1, True) in turns[3][1]
    assert ("Progress", "a", 2, False) in turns[3][1]
    expected = {"a": BATCH_A, "i": SMALL}
    for job_id, request in expected.items():
        np.testing.assert_array_equal(frames0[job_id], _uint8(request))
    np.testing.assert_array_equal(frames1["b"], _uint8(BATCH_B))


def _uint8(request: VideoRequest) -> np.ndarray:
    return frames_to_uint8(torch.from_numpy(_alone(_tiny, request))).numpy()
