"""The kiln-tiny pipeline: DLO equals resident, seeds, the forwards-per-step contract, and its
preview frames (the predicted clean video, no effect on the render)."""

from __future__ import annotations

import pytest
import torch

from common.families import TINY
from runtime.pipelines.base import VideoRequest
from runtime.pipelines.tiny import TinyPipeline
from storage.video import float_to_uint8

REQUEST = VideoRequest(prompt="a red circle moving left", width=64, height=64, num_frames=9,
                       num_inference_steps=4, seed=0)


@pytest.fixture(scope="module")
def dlo_pipe():
    pipe = TinyPipeline.load()
    yield pipe
    pipe.close()


def test_render_has_requested_frames_and_size_in_unit_range(dlo_pipe):
    frames = dlo_pipe.generate(REQUEST)
    assert frames.shape == (9, 64, 64, 3)
    assert frames.min() >= 0 and frames.max() <= 1 and frames.std() > 0.01


def test_dlo_streamed_render_equals_resident_render_bit_for_bit(dlo_pipe):
    resident = TinyPipeline.load(offload=False)
    assert torch.equal(dlo_pipe.generate(REQUEST), resident.generate(REQUEST))


def test_same_seed_same_frames_and_another_seed_or_prompt_differs(dlo_pipe):
    a = dlo_pipe.generate(REQUEST)
    assert torch.equal(a, dlo_pipe.generate(REQUEST))
    other_seed = VideoRequest(prompt=REQUEST.prompt, seed=1)
    other_prompt = VideoRequest(prompt="a blue square", seed=0)
    assert not torch.equal(a, dlo_pipe.generate(other_seed))
    assert not torch.equal(a, dlo_pipe.generate(other_prompt))


def _count_forwards(pipe):
    counts = {"forward": 0}
    hook = pipe.model.transformer.register_forward_pre_hook(
        lambda *_: counts.__setitem__("forward", counts["forward"] + 1))
    return counts, hook


@pytest.fixture(scope="module")
def unbatched_pipe():
    pipe = TinyPipeline.load(cfg_batch=False)
    yield pipe
    pipe.close()


@pytest.mark.parametrize(("cfg_batch", "guidance", "forwards"),
                         [(True, 5.0, 1), (True, 1.0, 1), (False, 5.0, 2), (False, 1.0, 1)])
def test_every_step_gathers_forwards_per_step_forwards_whatever_it_computes(
        dlo_pipe, unbatched_pipe, cfg_batch, guidance, forwards):
    pipe = dlo_pipe if cfg_batch else unbatched_pipe
    assert pipe.forwards_per_step == (1 if cfg_batch else 2)
    handle = pipe.handles[0]
    counts, hook = _count_forwards(pipe)
    try:
        state = pipe.prepare(VideoRequest(prompt="a cat", guidance_scale=guidance,
                                          num_inference_steps=2))
        before = handle.num_acquired
        assert counts["forward"] == 0  # prepare runs no streamed forward
        pipe.step(state)
    finally:
        hook.remove()
    assert counts["forward"] == forwards
    assert handle.num_acquired - before == pipe.forwards_per_step * handle.num_blocks


def test_cfg_as_one_batch_2_forward_matches_two_batch_1_forwards(dlo_pipe, unbatched_pipe):
    # Not bit for bit: a batch-1 forward's timestep embedding and modulation are one-row
    # matmuls, which take the matrix-vector kernel, a batch-2 one the matrix-matrix kernel, and
    # the two sum in different orders. Measured (CPU, fp32): 7.8e-6 max abs over these frames
    # (64x64x9, 4 steps), 1.4e-5 at 256x256x17; frames are in [0, 1], one uint8 level is 3.9e-3.
    batched, unbatched = dlo_pipe.generate(REQUEST), unbatched_pipe.generate(REQUEST)
    torch.testing.assert_close(batched, unbatched, rtol=0, atol=1e-4)


def test_idle_step_takes_part_in_forwards_per_step_gathers(dlo_pipe):
    handle = dlo_pipe.handles[0]
    before = handle.num_acquired
    counts, hook = _count_forwards(dlo_pipe)
    try:
        dlo_pipe.idle_step()
    finally:
        hook.remove()
    assert counts["forward"] == 0
    assert handle.num_acquired - before == dlo_pipe.forwards_per_step * handle.num_blocks


def test_a_forward_that_raises_still_completes_the_steps_gathers(dlo_pipe, monkeypatch):
    handle = dlo_pipe.handles[0]
    block = dlo_pipe.model.transformer.blocks[2]

    def broken(*args, **kwargs):
        raise RuntimeError("bad activations")

    state = dlo_pipe.prepare(VideoRequest(prompt="a cat", num_inference_steps=2))
    before = handle.num_acquired
    monkeypatch.setattr(block, "forward", broken)
    with pytest.raises(RuntimeError, match="bad activations"):
        dlo_pipe.step(state)
    assert handle.num_acquired - before == dlo_pipe.forwards_per_step * handle.num_blocks
    monkeypatch.undo()
    dlo_pipe.step(state)  # the handle is usable again, in step with the other ranks
    assert state.step_index == 1


def test_stepping_a_finished_job_is_refused(dlo_pipe):
    state = dlo_pipe.prepare(VideoRequest(prompt="a cat", num_inference_steps=1))
    dlo_pipe.step(state)
    assert state.done
    with pytest.raises(ValueError, match="all its 1 steps"):
        dlo_pipe.step(state)


def _middle_frame(pipe, state):
    """The middle frame of ``state``'s latents decoded as they are, uint8."""
    return float_to_uint8(pipe.decode(state))[state.request.num_frames // 2]


def test_a_preview_is_the_middle_frame_as_uint8_and_the_same_every_time(dlo_pipe):
    state = dlo_pipe.prepare(REQUEST)
    dlo_pipe.step(state)
    preview = dlo_pipe.preview(state)
    assert preview.shape == (64, 64, 3) and preview.dtype == torch.uint8
    assert preview.device.type == "cpu"
    assert torch.equal(preview, dlo_pipe.preview(state))
    assert preview.float().std() > 1  # a picture, not a flat frame
    other = dlo_pipe.prepare(VideoRequest(prompt=REQUEST.prompt, seed=1))
    dlo_pipe.step(other)
    assert not torch.equal(preview, dlo_pipe.preview(other))


def test_previews_leave_the_rendered_video_bit_for_bit_as_it_was(dlo_pipe):
    plain = dlo_pipe.generate(REQUEST)
    state = dlo_pipe.prepare(REQUEST)
    dlo_pipe.preview(state)
    while not state.done:
        dlo_pipe.step(state)
        dlo_pipe.preview(state)
    assert torch.equal(dlo_pipe.decode(state), plain)


def test_a_preview_shows_the_predicted_clean_video_and_ends_as_the_videos_middle_frame(
        dlo_pipe):
    # Decoding the noisy latents would show noise fading; the x0 estimate is nearer the final
    # frame at every step (seed 0, 4 steps: 42 vs 69, 24 vs 58, 20 vs 42 levels mean error).
    state = dlo_pipe.prepare(REQUEST)
    estimates, noisy = [], []
    while True:
        dlo_pipe.step(state)
        if state.done:
            break
        estimates.append(dlo_pipe.preview(state).float())
        noisy.append(_middle_frame(dlo_pipe, state).float())
    final = _middle_frame(dlo_pipe, state)
    assert torch.equal(dlo_pipe.preview(state), final)  # the decoder gives the same bits per frame
    for estimate, latents in zip(estimates, noisy, strict=True):
        assert (estimate - final).abs().mean() < (latents - final).abs().mean()


def test_kiln_tiny_previews_and_the_diffusers_families_do_not_as_their_families_say():
    from runtime.pipelines.registry import PIPELINES  # diffusers: only this test

    assert TinyPipeline.can_preview and TINY.previews
    for cls in PIPELINES.values():
        assert not cls.can_preview and not cls.family.previews
