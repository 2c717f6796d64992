"""The procedural clips kiln-tiny learns from, and the image analysis that checks its outputs."""

from __future__ import annotations

import torch

from runtime.models.shapes import DIRECTIONS, describe, sample_clips


def test_same_seed_draws_the_same_clips_and_prompts():
    a = sample_clips(4, torch.Generator().manual_seed(3))
    b = sample_clips(4, torch.Generator().manual_seed(3))
    assert torch.equal(a.video_BNHW3, b.video_BNHW3) and a.prompts == b.prompts
    assert a.video_BNHW3.shape == (4, 9, 64, 64, 3)
    assert a.video_BNHW3.min() >= -1 and a.video_BNHW3.max() <= 1


def test_analysis_reads_back_the_colour_and_direction_every_drawn_clip_was_given():
    clips = sample_clips(96, torch.Generator().manual_seed(1))
    num_checked = 0
    for video, colour, motion, prompt in zip(clips.video_BNHW3, clips.colour, clips.motion,
                                             clips.prompts, strict=True):
        assert colour in prompt and motion in prompt
        got_colour, got_direction = describe((video + 1) / 2)
        assert got_colour == colour
        if motion in DIRECTIONS:
            assert got_direction == motion
            num_checked += 1
    assert num_checked > 60
