"""The kiln-tiny pipeline: DLO equals resident, seeds, and the forwards-per-step contract."""

from __future__ import annotations

import pytest
import torch

from runtime.pipelines.base import VideoRequest
from runtime.pipelines.tiny import TinyPipeline

REQUEST = VideoRequest(prompt="a red circle moving left", width=64, height=64, num_frames=9,
                       num_steps=4, seed=0)


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


def _count(pipe, monkeypatch):
    counts = {"forward": 0, "idle": 0}
    handle = pipe.handles[0]
    real_idle = handle.idle_forward

    def idle():
        counts["idle"] += 1
        real_idle()

    monkeypatch.setattr(handle, "idle_forward", idle)
    hook = pipe.model.transformer.register_forward_pre_hook(
        lambda *_: counts.__setitem__("forward", counts["forward"] + 1))
    return counts, hook


@pytest.mark.parametrize(("guidance", "forwards", "idles"), [(5.0, 2, 0), (1.0, 1, 1)])
def test_every_step_runs_forwards_per_step_forwards_idling_the_ones_it_skips(
        dlo_pipe, monkeypatch, guidance, forwards, idles):
    counts, hook = _count(dlo_pipe, monkeypatch)
    try:
        state = dlo_pipe.prepare(VideoRequest(prompt="a cat", guidance_scale=guidance,
                                              num_steps=2))
        assert counts == {"forward": 0, "idle": 0}  # prepare runs no streamed forward
        dlo_pipe.step(state)
        assert counts == {"forward": forwards, "idle": idles}
        assert forwards + idles == dlo_pipe.forwards_per_step
    finally:
        hook.remove()


def test_idle_step_takes_part_in_forwards_per_step_gathers(dlo_pipe, monkeypatch):
    counts, hook = _count(dlo_pipe, monkeypatch)
    try:
        dlo_pipe.idle_step()
    finally:
        hook.remove()
    assert counts == {"forward": 0, "idle": dlo_pipe.forwards_per_step}


def test_stepping_a_finished_job_is_refused(dlo_pipe):
    state = dlo_pipe.prepare(VideoRequest(prompt="a cat", num_steps=1))
    dlo_pipe.step(state)
    assert state.done
    with pytest.raises(ValueError, match="all its 1 steps"):
        dlo_pipe.step(state)
