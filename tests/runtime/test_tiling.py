"""Request tiling: tile sizes from free memory, one clear before the loop, exact results."""

from __future__ import annotations

import pytest
import torch

from runtime.models.tiny import build_tiny
from runtime.pipelines.base import VideoRequest
from runtime.pipelines.tiny import TinyPipeline
from runtime.tiling import map_tiles, plan_tiles


def test_tile_is_the_share_of_free_memory_divided_by_bytes_per_item():
    plan = plan_tiles(100, 1000, fraction=0.5, free_bytes=10_000)
    assert (plan.tile, plan.budget_bytes, plan.num_tiles) == (5, 5000, 20)
    assert plan_tiles(3, 1000, free_bytes=10**9).tile == 3  # never more than the items
    assert plan_tiles(3, 10**12, free_bytes=10**9).tile == 1  # never less than one item
    assert [(s.start, s.stop) for s in plan_tiles(5, 1, free_bytes=4).slices()] == [
        (0, 2), (2, 4), (4, 5)]


def test_tile_follows_the_memory_free_right_now(monkeypatch):
    from runtime import platform

    monkeypatch.setattr(platform.Platform, "mem_get_info", lambda self: (8000, 10**9))
    assert plan_tiles(100, 1000).tile == 4
    monkeypatch.setattr(platform.Platform, "mem_get_info", lambda self: (2000, 10**9))
    assert plan_tiles(100, 1000).tile == 1


@pytest.mark.parametrize("kwargs", [dict(num_items=-1, bytes_per_item=1),
                                    dict(num_items=1, bytes_per_item=0),
                                    dict(num_items=1, bytes_per_item=1, fraction=1.5)])
def test_plan_refuses_nonsense(kwargs):
    with pytest.raises(ValueError):
        plan_tiles(**kwargs, free_bytes=100)


def test_map_tiles_clears_the_output_once_so_no_tile_erases_an_earlier_one():
    items = torch.arange(6.0)
    out = torch.full((6,), float("nan"))
    calls = []

    def double(x):
        calls.append(out.clone())  # what the buffer holds when each tile starts
        return 2 * x

    map_tiles(double, items, out, plan_tiles(6, 1, free_bytes=4))
    assert out.tolist() == [0, 2, 4, 6, 8, 10]
    assert calls[0].tolist() == [0] * 6  # cleared before the loop, not left as garbage
    assert calls[2][:4].tolist() == [0, 2, 4, 6]  # earlier tiles survive later ones


def test_map_tiles_refuses_a_plan_for_another_item_count():
    with pytest.raises(ValueError, match="plan is for 3 items"):
        map_tiles(lambda x: x, torch.zeros(4), torch.zeros(4), plan_tiles(3, 1, free_bytes=9))


@pytest.mark.parametrize("tile", [1, 2, 5])
def test_tiny_decoder_tiled_equals_one_pass_bit_for_bit(tile):
    decoder = build_tiny().decoder
    z = torch.randn(7, decoder.cfg.latent_channels, 8, 12)
    whole = decoder(z)
    per = decoder.bytes_per_item(64, 96)
    tiled = map_tiles(decoder, z, torch.empty_like(whole),
                      plan_tiles(7, per, fraction=1.0, free_bytes=tile * per))
    assert torch.equal(tiled, whole)


def test_pipeline_decode_with_little_free_memory_equals_decode_with_plenty():
    pipe = TinyPipeline.load(offload=False)
    state = pipe.prepare(VideoRequest(prompt="a cat", num_frames=17,
                                       num_inference_steps=2))
    while not state.done:
        pipe.step(state)
    roomy = pipe.decode(state)
    assert pipe.last_decode_plan.num_tiles == 1
    pipe.decode_free_bytes = 1  # forces one latent frame per tile
    tight = pipe.decode(state)
    assert pipe.last_decode_plan.tile == 1 and pipe.last_decode_plan.num_tiles == 5
    assert torch.equal(tight, roomy)
