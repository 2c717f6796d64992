"""``kiln render`` on kiln-tiny: the MP4 it writes, seeds, dp=2, and user mistakes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from kiln.cli import app
from runtime.launch import rank_threads
from storage.video import read_video

ARGS = ["render", "--model", "kiln-tiny", "--prompt", "a red circle moving left", "--size",
        "64x48", "--frames", "9", "--steps", "2", "--seed", "0"]


def _render(tmp_path, name, *extra):
    out = tmp_path / name
    result = CliRunner().invoke(app, [*ARGS, "--out", str(out), *extra])
    assert result.exit_code == 0, result.output
    return out


def test_render_writes_an_mp4_with_the_requested_frames_and_size_and_a_thumbnail(tmp_path):
    out = _render(tmp_path, "a.mp4")
    assert read_video(out).shape == (9, 48, 64, 3)
    assert out.with_suffix(".png").is_file()


def test_render_without_size_or_length_renders_at_the_model_familys_defaults(tmp_path):
    import av

    from common.families import family_of

    d = family_of("kiln-tiny").defaults
    out = tmp_path / "d.mp4"
    result = CliRunner().invoke(app, ["render", "--model", "kiln-tiny", "--prompt",
                                      "a red circle moving left", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert read_video(out).shape == (d.num_frames, d.height, d.width, 3)
    with av.open(str(out)) as c:
        assert c.streams.video[0].average_rate == d.fps


def test_render_with_the_same_seed_gives_the_same_frames(tmp_path):
    a, b = read_video(_render(tmp_path, "a.mp4")), read_video(_render(tmp_path, "b.mp4"))
    c = read_video(_render(tmp_path, "c.mp4", "--seed", "1"))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.slow
def test_render_on_two_ranks_with_sharded_weights_writes_the_same_video(tmp_path):
    # Same CPU threads as each of the two ranks: kernels split reductions by thread count.
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads(2))
    try:
        one = _render(tmp_path, "one.mp4")
    finally:
        torch.set_num_threads(threads)
    two = _render(tmp_path, "two.mp4", "--dp", "2", "--prompt", "a blue square")
    assert two.read_bytes() == one.read_bytes()  # rank 0 renders the first prompt
    second = read_video(tmp_path / "two-1.mp4")  # rank 1 renders the second
    assert second.shape == (9, 48, 64, 3) and not np.array_equal(second, read_video(one))


def test_render_refuses_a_size_the_model_cannot_render(tmp_path):
    """By the admission rules the API holds requests to, every problem at once, each with the
    nearest valid value, before anything loads (no rank is started, no progress line)."""
    result = CliRunner().invoke(app, [*ARGS[:5], "--size", "60x64", "--frames", "10", "--out",
                                      str(tmp_path / "a.mp4")])
    assert result.exit_code == 2
    assert "width: must be a multiple of 16, got 60; nearest: 48 or 64" in result.output
    assert "num_frames: must be 1 + a multiple of 4 frames" in result.output
    assert "loading" not in result.output
    assert not (tmp_path / "a.mp4").exists()


def test_render_refuses_a_bad_input_file_before_loading(tmp_path):
    clip = tmp_path / "start.mp4"  # checked as an upload is: the bytes are no video
    clip.write_bytes(b"no video in here")
    result = CliRunner().invoke(app, [*ARGS[:5], "--video", str(clip), "--out",
                                      str(tmp_path / "a.mp4")])
    assert result.exit_code == 2
    assert "start.mp4" in result.output and "loading" not in result.output
    both = CliRunner().invoke(app, [*ARGS[:5], "--video", str(clip), "--image", str(clip),
                                    "--out", str(tmp_path / "a.mp4")])
    assert both.exit_code == 2 and "not both" in both.output


def test_render_starts_kiln_tiny_from_an_image_where_the_image_has_its_shape(tmp_path):
    pixels = np.full((64, 64, 3), 80, np.uint8)
    pixels[24:40, 36:52] = (220, 40, 40)  # a red square centred at (44, 32), grey around it
    image = tmp_path / "start.png"
    Image.fromarray(pixels).save(image)
    out = tmp_path / "a.mp4"
    result = CliRunner().invoke(app, ["render", "--model", "kiln-tiny", "--prompt",
                                      "a red square moving left", "--image", str(image),
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    first = read_video(out)[0].astype(np.int32)
    red = (first[..., 0] > 150) & (first[..., 1] < 100)
    ys, xs = np.nonzero(red)
    assert abs(xs.mean() - 43.5) < 2 and abs(ys.mean() - 31.5) < 2  # pixel centres


def test_make_checkpoint_writes_a_diffusers_model_that_kiln_render_loads(tmp_path):
    model = tmp_path / "wan"
    made = CliRunner().invoke(app, ["make-checkpoint", "--family", "wan", "--layers", "2",
                                    "--width", "64", "--head-dim", "32", "--out", str(model)])
    assert made.exit_code == 0, made.output
    assert (model / "model_index.json").is_file()
    assert sorted(p.name for p in (model / "transformer").iterdir()) == [
        "config.json", "diffusion_pytorch_model.safetensors"]
    out = tmp_path / "wan.mp4"
    result = CliRunner().invoke(app, ["render", "--model", str(model), "--prompt", "a red ball",
                                      "--size", "64x64", "--frames", "5", "--steps", "2",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert read_video(out).shape == (5, 64, 64, 3)


def test_render_names_what_model_accepts_when_the_directory_is_not_a_model(tmp_path):
    result = CliRunner().invoke(app, [*ARGS[:1], "--model", str(tmp_path), *ARGS[3:],
                                      "--out", str(tmp_path / "a.mp4")])
    assert result.exit_code == 2
    assert "kiln-tiny" in result.output and "model_index.json" in result.output


@pytest.mark.slow
def test_a_user_mistake_on_two_ranks_is_reported_plainly_and_stops_every_rank(tmp_path):
    result = CliRunner().invoke(app, [*ARGS, "--frames", "8", "--dp", "2", "--out",
                                      str(tmp_path / "a.mp4")])
    assert result.exit_code == 2
    # Refused before any rank starts (common.admission), with the nearest valid counts.
    assert "must be 1 + a multiple of 4 frames" in result.output
    assert "nearest: 5 or 9" in result.output and "Traceback" not in result.output
