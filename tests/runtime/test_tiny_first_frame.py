"""kiln-tiny renders from a given first frame (``Conditioning.image``): the video starts with the
shape where the frame has it, in its colour, and moves the way the prompt says; the condition's
weights load as zero from a checkpoint that predates them; DLO, resident and a split replica
render a conditioned job alike, and one resumed from a checkpoint renders what it would have."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.families import TINY, TINY_MODEL
from runtime.models.shapes import COLOURS, describe, prompt_for, sample_clips
from runtime.models.tiny import build_tiny, first_frame_condition, load_weights
from runtime.pipelines.base import Conditioning, VideoRequest
from runtime.pipelines.tiny import TinyPipeline
from runtime.render import generate_on_ranks
from runtime.resume import model_fingerprint, restore, snapshot

# Every colour twice, every shape four times, every direction three times (other pairings than
# the text-only test's).
CASES = [
    ("red", "square", "left"), ("red", "triangle", "down"),
    ("green", "circle", "up"), ("green", "square", "left"),
    ("blue", "square", "right"), ("blue", "triangle", "left"),
    ("yellow", "triangle", "up"), ("yellow", "circle", "right"),
    ("purple", "circle", "down"), ("purple", "triangle", "right"),
    ("cyan", "circle", "up"), ("cyan", "square", "down"),
]
# Where the rendered first frame's shape may sit from the given one's: centroids of the pixels
# far from the background, in pixels of a 64x64 frame (the shapes have radii of 9 to 12), each
# case and on average. For scale: decoding the given frame's own latents, with no model, moves it
# up to 0.94 px (the decoder draws soft edges); a render that ignores the image (the text-only
# weights) starts 4.2 px away on average, 6.4 at most. And how far the shape must travel the
# prompt's way over the clip (the training clips travel 20 to 28).
CENTROID_TOLERANCE = 2.0
MEAN_CENTROID_TOLERANCE = 1.2
MIN_TRAVEL = 8.0


def first_frames() -> list[tuple[torch.Tensor, str]]:
    """For every case, the first frame (uint8 [64, 64, 3]) of the first clip of a seeded stream
    of training-like clips that has its colour, shape and motion, with the clip's prompt."""
    gen = torch.Generator().manual_seed(11)
    found: dict[tuple[str, str, str], tuple[torch.Tensor, str]] = {}
    while len(found) < len(CASES):
        clips = sample_clips(64, gen)
        for i, key in enumerate(zip(clips.colour, clips.shape, clips.motion, strict=True)):
            if key in CASES and key not in found:
                frame = ((clips.video_BNHW3[i, 0] + 1) * 127.5).round().to(torch.uint8)
                found[key] = (frame, clips.prompts[i])
    return [found[case] for case in CASES]


def foreground(frame_HW3: torch.Tensor) -> torch.Tensor:
    """Pixels far from the background, the median of the frame's border (as ``describe``)."""
    rgb = frame_HW3.float() * 255
    border = torch.cat([rgb[0], rgb[-1], rgb[:, 0], rgb[:, -1]])
    return (rgb - border.median(dim=0).values).norm(dim=-1) > 60


def centroid(mask_HW: torch.Tensor) -> torch.Tensor:
    ys, xs = torch.meshgrid(torch.arange(mask_HW.shape[0], dtype=torch.float32),
                            torch.arange(mask_HW.shape[1], dtype=torch.float32), indexing="ij")
    w = mask_HW.float()
    return torch.stack([(xs * w).sum(), (ys * w).sum()]) / w.sum()


@pytest.fixture(scope="module")
def pipe():
    pipe = TinyPipeline.load()
    yield pipe
    pipe.close()


def render_cases(pipe: TinyPipeline) -> list[dict[str, object]]:
    """Each case rendered with the request defaults from its first frame, and what the frames
    show: the first frame's colour and centroid offset from the given one's, and the shape's
    travel along and across the prompt's direction from the first frame to the last."""
    axes = {"left": (0, -1), "right": (0, 1), "up": (1, -1), "down": (1, 1)}
    results = []
    for seed, ((_, _, direction), (image, prompt)) in enumerate(
            zip(CASES, first_frames(), strict=True)):
        request = VideoRequest(prompt=prompt, seed=seed, conditioning=Conditioning(image=image))
        frames = pipe.generate(request)
        given = centroid(foreground(image.float() / 255))
        first, last = (centroid(foreground(frames[i])) for i in (0, -1))
        axis, sign = axes[direction]
        travel = last - first
        results.append({"prompt": prompt, "colour": describe(frames[:1])[0],
                        "offset": float((first - given).norm()),
                        "along": float(sign * travel[axis]), "across": float(travel[1 - axis]),
                        "direction": describe(frames)[1]})
    return results


def test_twelve_first_frames_start_the_render_where_and_as_given_and_move_as_the_prompt_says(
        pipe):
    assert {c for c, _, _ in CASES} == set(COLOURS)
    results = render_cases(pipe)
    for got in results:
        print(f"{got['prompt']!r}: first frame {got['colour']}, {got['offset']:.2f} px from the "
              f"given; travel {got['along']:+.1f} px the prompt's way, {got['across']:+.1f} "
              f"across ({got['direction']})")
    mean_offset = sum(float(got["offset"]) for got in results) / len(results)
    print(f"mean offset {mean_offset:.2f} px")
    for (colour, _, direction), got in zip(CASES, results, strict=True):
        assert got["colour"] == colour, got
        assert got["offset"] <= CENTROID_TOLERANCE, got
        assert got["along"] >= MIN_TRAVEL and got["direction"] == direction, got
    assert mean_offset <= MEAN_CENTROID_TOLERANCE


def test_the_prompts_are_the_trained_form_and_the_frames_are_the_cases():
    for (colour, shape, direction), (image, prompt) in zip(CASES, first_frames(), strict=True):
        assert prompt == prompt_for(colour, shape, direction)
        assert image.shape == (64, 64, 3) and image.dtype == torch.uint8
        assert describe(image[None].float() / 255)[0] == colour


def test_tiny_declares_the_image_input_and_still_renders_from_text_alone():
    assert TINY.inputs == frozenset({"image", "video"}) and not TINY.needs_input


def test_a_checkpoint_without_the_condition_weights_loads_them_as_zero_the_text_only_model():
    model = build_tiny()
    old = {k: v for k, v in model.state_dict().items() if "cond_embed" not in k}
    fresh = build_tiny(trained=False)
    load_weights(fresh, old)
    assert fresh.transformer.cond_embed.weight.eq(0).all()
    x = torch.randn(1, 12, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(1)) * 2 - 1
    cond = first_frame_condition(fresh.cfg, image, 9)
    text = fresh.text_encoder(*fresh.tokenizer(["a red circle moving left"]))
    t = torch.tensor([500.0])
    assert torch.equal(fresh.transformer(x, t, text, cond), fresh.transformer(x, t, text))
    with pytest.raises(RuntimeError, match="missing.*patch_embed"):
        load_weights(fresh, {k: v for k, v in old.items() if "patch_embed" not in k})


def test_the_condition_holds_the_first_frame_latents_and_the_mask_in_latent_frame_0_only():
    cfg = build_tiny(trained=False).cfg
    image = torch.rand(2, 64, 64, 3, generator=torch.Generator().manual_seed(2)) * 2 - 1
    cond = first_frame_condition(cfg, image, 9, given_B=torch.tensor([True, False]))
    assert cond.shape == (2, 13, 3, 8, 8)
    assert torch.equal(cond[0, -1, 0], torch.ones(8, 8)) and cond[0, :, 1:].eq(0).all()
    # 8x8 block means of the frame, scaled, in every sub-frame of latent frame 0.
    block_means = image[0].reshape(8, 8, 8, 8, 3).mean(dim=(1, 3)) * cfg.latent_scale
    for k in range(cfg.temporal_compression):
        torch.testing.assert_close(cond[0, 3 * k:3 * k + 3, 0], block_means.permute(2, 0, 1))
    assert cond[1].eq(0).all()  # not given: zeros, as a text-only render


def test_a_first_frame_render_is_the_same_streamed_resident_and_split_over_two_ranks(pipe):
    image, prompt = first_frames()[0]
    request = VideoRequest(prompt=prompt, seed=5, conditioning=Conditioning(image=image))
    streamed = pipe.generate(request)
    assert torch.equal(streamed, TinyPipeline.load(offload=False).generate(request))
    text_only = pipe.generate(VideoRequest(prompt=prompt, seed=5))
    assert not torch.equal(streamed, text_only)
    split = generate_on_ranks(TINY_MODEL, [request], dp=1, sp=2)
    np.testing.assert_array_equal(split[0], streamed.numpy())
    np.testing.assert_array_equal(split[1], split[0])


def test_a_first_frame_job_resumed_from_its_checkpoint_renders_the_same_frames(pipe):
    # The checkpoint holds the latents, not the condition: restore's prepare encodes the first
    # frame again from the request.
    image, prompt = first_frames()[1]
    request = VideoRequest(prompt=prompt, seed=2, num_inference_steps=6,
                           conditioning=Conditioning(image=image))
    fingerprint = model_fingerprint(TINY_MODEL)
    state = pipe.prepare(request)
    for _ in range(3):
        pipe.step(state)
    blob = snapshot(pipe, state, model_fingerprint=fingerprint)
    resumed = restore(pipe, request, blob, model_fingerprint=fingerprint)
    while not resumed.done:
        pipe.step(resumed)
    assert torch.equal(pipe.decode(resumed), pipe.generate(request))


@pytest.mark.parametrize("bad", ["last_image", "video", "size"])
def test_inputs_kiln_tiny_does_not_take_are_refused(pipe, bad):
    image = torch.zeros(64, 64, 3, dtype=torch.uint8)
    conditioning = {"last_image": Conditioning(image=image, last_image=image),
                    "video": Conditioning(image=image,
                                          video=image[None].expand(9, -1, -1, -1)),
                    "size": Conditioning(image=image[:32])}[bad]
    with pytest.raises(ValueError, match="first frame"):
        pipe.prepare(VideoRequest(prompt="a red circle", conditioning=conditioning))
