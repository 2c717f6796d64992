"""One gather per block per step: CFG as one batch-2 forward, and only the experts a step needs.

Two CPU ranks over gloo with allgather (`tests.multirank`), each running its own request in
lock-step through ``runtime.render.run_lockstep``; every step's growth of each handle's
``num_acquired`` is recorded on every rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from multirank import run_ranks

from runtime.models.synthetic import SyntheticSpec, make_checkpoint
from runtime.pipelines.base import VideoPipeline, VideoRequest
from runtime.pipelines.registry import load_diffusers
from runtime.pipelines.tiny import TinyPipeline
from runtime.render import run_lockstep

TINY_REQUESTS = [VideoRequest(prompt="a red ball", num_inference_steps=3, seed=1,
                              guidance_scale=5.0),
                 VideoRequest(prompt="a blue cat", num_inference_steps=3, seed=2,
                              guidance_scale=5.0)]


def _record_steps(pipe: VideoPipeline) -> list[list[int]]:
    """Blocks each handle acquires in each step (or idle step) from now on."""
    growth: list[list[int]] = []

    def recorded(fn: Any) -> Any:
        def call(*args: Any) -> None:
            before = [h.num_acquired for h in pipe.handles]
            fn(*args)
            growth.append([h.num_acquired - b for h, b in zip(pipe.handles, before, strict=True)])
        return call

    pipe.step = recorded(pipe.step)  # type: ignore[method-assign]
    pipe.idle_step = recorded(pipe.idle_step)  # type: ignore[method-assign]
    return growth


def _tiny_rank(rank: int, world: int, cfg_batch: bool) -> tuple[list[list[int]], int]:
    pipe = TinyPipeline.load(device="cpu", cfg_batch=cfg_batch)
    try:
        handle = pipe.handles[0]
        assert handle.config.use_allgather and handle.config.world_size == world
        growth = _record_steps(pipe)
        run_lockstep(pipe, rank, TINY_REQUESTS)
        return growth, handle.num_blocks
    finally:
        pipe.close()


@pytest.mark.parametrize(("cfg_batch", "gathers_per_block"), [(True, 1), (False, 2)])
def test_kiln_tiny_with_guidance_gathers_each_block_once_per_step(cfg_batch, gathers_per_block):
    for growth, num_blocks in run_ranks(2, _tiny_rank, cfg_batch):
        assert growth == [[gathers_per_block * num_blocks]] * 3


# Wan2.2 with two experts, the low-noise one taking over below t = 600. 4 steps: t = 999, 900,
# 750, 500; 6 steps: 999, 937, 857, 750, 600, 376.
WAN22 = SyntheticSpec(family="wan", num_experts=2, boundary_ratio=0.6)
SAME_SIDE = [VideoRequest(prompt="a red ball", num_inference_steps=4, seed=1),
             VideoRequest(prompt="a blue cat", num_inference_steps=4, seed=2)]
# Step 3: rank 0 (t = 500) needs the low-noise expert, rank 1 (t = 750) the high-noise one; rank
# 0 idles steps 4-5.
EITHER_SIDE = [SAME_SIDE[0], VideoRequest(prompt="a blue cat", num_inference_steps=6, seed=2)]


@pytest.fixture(scope="module")
def wan22_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("models") / "wan22", WAN22)


def _wan_rank(rank: int, world: int, model_dir: str,
              requests: list[VideoRequest]) -> tuple[list[list[int]], list[int], np.ndarray]:
    pipe = load_diffusers(model_dir, device="cpu")
    try:
        assert all(h.config.use_allgather and h.config.world_size == world
                   for h in pipe.handles)
        growth = _record_steps(pipe)
        frames = run_lockstep(pipe, rank, requests)
        return growth, [h.num_blocks for h in pipe.handles], frames.numpy()
    finally:
        pipe.close()


def _alone(model_dir: str, request: VideoRequest) -> np.ndarray:
    """The dp=1 render, with the one thread each rank computes with (`tests.multirank`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pipe = load_diffusers(model_dir, device="cpu")
    try:
        return pipe.generate(request).numpy()
    finally:
        pipe.close()
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("requests", "experts_per_step"), [
    (SAME_SIDE, [[1, 0], [1, 0], [1, 0], [0, 1]]),
    (EITHER_SIDE, [[1, 0], [1, 0], [1, 0], [1, 1], [1, 0], [0, 1]]),
], ids=["same-side", "either-side"])
def test_wan22_steps_gather_only_the_experts_some_rank_needs(wan22_dir, requests,
                                                             experts_per_step):
    results = run_ranks(2, _wan_rank, str(wan22_dir), requests)
    for rank, (growth, num_blocks, frames) in enumerate(results):
        expected = [[g * n for g, n in zip(step, num_blocks, strict=True)]
                    for step in experts_per_step]
        assert growth == expected, f"rank {rank}"
        np.testing.assert_array_equal(frames, _alone(str(wan22_dir), requests[rank]))
