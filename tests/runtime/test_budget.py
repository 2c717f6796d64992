"""The device budget for resident blocks: what the commands take, and what a rank gets."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from runtime.budget import AUTO, EVERYTHING, activation_bytes, parse_budget, resolve_budget
from runtime.pipelines.base import VideoRequest
from runtime.pipelines.tiny import TinyPipeline
from runtime.step_replay import KEEP_MAX_BYTES


@dataclass
class FakeAccelerator:
    free: int
    is_accelerator: bool = True

    def mem_get_info(self) -> tuple[int, int]:
        return self.free, 2 * self.free


def test_budgets_are_auto_none_or_a_size():
    assert parse_budget("auto") == AUTO
    assert parse_budget("none") is None and parse_budget("0") is None
    assert parse_budget("12GiB") == 12 * 2**30
    assert parse_budget("512MB") == 512 * 10**6
    assert parse_budget("1.5g") == 1_500_000_000
    assert parse_budget("4096") == 4096
    with pytest.raises(ValueError, match="'auto', 'none' or a size"):
        parse_budget("12XB")


def test_auto_on_the_cpu_maps_every_block_or_none_and_a_device_keeps_what_is_free():
    cpu = FakeAccelerator(free=10**9, is_accelerator=False)
    assert resolve_budget(AUTO, cpu, activations=0) is None  # a resident block: a private copy
    # Rank-local from a checkpoint: a resident block is the shared mapping, so all of them.
    assert resolve_budget(AUTO, cpu, activations=0, maps_checkpoint=True) == EVERYTHING
    assert resolve_budget(None, cpu, activations=0, maps_checkpoint=True) is None
    # Free memory less the activations and what two steps left part-way may keep of their blocks.
    gpu = FakeAccelerator(free=10 * 2**30 + 2 * KEEP_MAX_BYTES)
    assert resolve_budget(AUTO, gpu, activations=2 * 2**30) == 8 * 2**30
    assert resolve_budget(AUTO, gpu, activations=2 * 2**30, parts=2) == 4 * 2**30  # two experts
    assert resolve_budget(AUTO, gpu, activations=20 * 2**30) == 0  # no room: stream all
    assert resolve_budget(3000, gpu, activations=10**12) == 3000  # a size given is a size
    assert resolve_budget(None, gpu, activations=0) is None


def test_the_activation_reserve_grows_with_the_tokens_and_the_guidance_pair():
    one = activation_bytes(1000, 128, 384, 4, batch=1)
    assert activation_bytes(2000, 128, 384, 4, batch=1) == 2 * one
    assert activation_bytes(1000, 128, 384, 4) == 2 * one  # CFG as a batch-2 forward


def test_a_budget_for_every_block_keeps_kiln_tiny_whole_and_its_video_the_same():
    streamed = TinyPipeline.load(device="cpu", device_budget=None)
    resident = TinyPipeline.load(device="cpu", device_budget=2**30)
    try:
        assert streamed.handles[0].stats()["resident_blocks"] == 0
        stats = resident.handles[0].stats()
        assert stats["resident_blocks"] == stats["num_blocks"] == 4
        assert resident.handles[0].streamed_blocks == 0
        request = VideoRequest(prompt="a red circle", num_inference_steps=2)
        a, b = streamed.generate(request), resident.generate(request)
        assert b.equal(a)
        assert resident.handles[0].stats()["num_gathers"] == 0  # nothing streamed
    finally:
        streamed.close()
        resident.close()
