"""Checkpoints of the denoising state (``runtime.resume``): a job stopped after k steps and resumed
from its checkpoint on a freshly loaded pipeline renders the same frames, bit for bit, as a job
that never stopped, in every family (Wan's and Cosmos3's multistep UniPC history, CogVideoX's
DPM generator and previous prediction, MiniMax-H3's soundtrack); a checkpoint of another format,
model or request, cut short, or not fitting the job is refused saying why; and a checkpoint
holds the latents, not the weights.

Single process on the CPU, as ``test_pipeline_tiny`` and ``test_pipeline_diffusers`` build their
pipelines (kiln-tiny by name, tiny random diffusers models in a temporary directory).
"""

from __future__ import annotations

import json
import pickle
import shutil
import struct

import pytest
import torch
from diffusers import CogVideoXDPMScheduler
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from runtime.models.synthetic import SyntheticSpec, make_checkpoint
from runtime.models.tiny import TRAINED_WEIGHTS
from runtime.pipelines.base import VideoRequest
from runtime.pipelines.registry import load_diffusers
from runtime.pipelines.tiny import TinyPipeline
from runtime.resume import (
    FORMAT,
    IncompatibleCheckpoint,
    model_fingerprint,
    request_digest,
    restore,
    snapshot,
)
from storage.outputs import checkpoint_key

# kiln-tiny's size and length (64x64, 9 frames), 6 steps: stopped after 3.
TINY_REQUEST = VideoRequest(prompt="a red circle moving left", negative_prompt="blurry",
                            num_inference_steps=6, seed=3)
SPECS = {
    "wan": SyntheticSpec(family="wan"),
    "wan22": SyntheticSpec(family="wan", num_experts=2, boundary_ratio=0.6),
    "cogvideox": SyntheticSpec(family="cogvideox"),
    "cosmos3": SyntheticSpec(family="cosmos3"),
    "minimax-h3": SyntheticSpec(family="minimax-h3"),
}
REQUEST = VideoRequest(prompt="a red circle moving left", negative_prompt="blurry", width=64,
                       height=64, num_frames=9, num_inference_steps=6, seed=0,
                       guidance_scale=5.0)
# MiniMax-H3: 5 s at the least on sizes of 32, no guidance; 6 steps are 5 forwards.
REQUESTS = {"minimax-h3": VideoRequest(prompt="a red circle moving left", width=64, height=32,
                                       num_frames=124, num_inference_steps=6, seed=0,
                                       guidance_scale=1.0)}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: make_checkpoint(root / name, spec) for name, spec in SPECS.items()}


def stopped_and_resumed(load, request, k, fingerprint):
    """(frames, checkpoint, resumed state at k) of a job that runs k steps on one pipeline and
    its remaining steps on another, loaded afresh, from the checkpoint alone."""
    pipe = load()
    try:
        state = pipe.prepare(request)
        for _ in range(k):
            pipe.step(state)
        blob = snapshot(pipe, state, model_fingerprint=fingerprint)
    finally:
        pipe.close()
    fresh = load()
    try:
        state = restore(fresh, request, blob, model_fingerprint=fingerprint)
        assert state.step_index == k
        at_k = state
        while not state.done:
            fresh.step(state)
        return fresh.decode(state), blob, at_k
    finally:
        fresh.close()


def uninterrupted(load, request):
    pipe = load()
    try:
        return pipe.generate(request)
    finally:
        pipe.close()


# ---- the same video, bit for bit ----------------------------------------------------------


@pytest.mark.parametrize("k", [0, 3, 6])
def test_kiln_tiny_resumed_after_k_steps_renders_the_same_frames_bit_for_bit(k):
    fingerprint = model_fingerprint("kiln-tiny")
    frames, _, _ = stopped_and_resumed(TinyPipeline.load, TINY_REQUEST, k, fingerprint)
    assert torch.equal(frames, uninterrupted(TinyPipeline.load, TINY_REQUEST))


def test_kiln_tiny_preview_of_a_resumed_job_is_the_one_it_had_when_it_stopped():
    # The preview reads the last step's velocity, which the checkpoint carries.
    pipe, fresh = TinyPipeline.load(), TinyPipeline.load()
    try:
        state = pipe.prepare(TINY_REQUEST)
        for _ in range(3):
            pipe.step(state)
        fingerprint = model_fingerprint("kiln-tiny")
        blob = snapshot(pipe, state, model_fingerprint=fingerprint)
        resumed = restore(fresh, TINY_REQUEST, blob, model_fingerprint=fingerprint)
        assert torch.equal(fresh.preview(resumed), pipe.preview(state))
    finally:
        pipe.close()
        fresh.close()


@pytest.mark.parametrize("name", list(SPECS))
def test_a_diffusers_family_resumed_after_3_of_6_steps_renders_the_same_frames_bit_for_bit(
        model_dirs, name):
    request = REQUESTS.get(name, REQUEST)

    def load():
        return load_diffusers(model_dirs[name])

    fingerprint = model_fingerprint(str(model_dirs[name]))
    frames, _, _ = stopped_and_resumed(load, request, 3, fingerprint)
    expected = uninterrupted(load, request)
    assert expected.std() > 0.01  # a real picture
    torch.testing.assert_close(frames, expected, rtol=0, atol=0)


def test_wan_resumes_its_unipc_history_which_changes_the_frames(model_dirs):
    # The control: the same checkpoint with the scheduler's history dropped (a fresh UniPC set to
    # step 3, latents kept) renders another video, so the test above tests the history.
    def load():
        return load_diffusers(model_dirs["wan"])

    fingerprint = model_fingerprint(str(model_dirs["wan"]))
    expected = uninterrupted(load, REQUEST)
    _, blob, _ = stopped_and_resumed(load, REQUEST, 3, fingerprint)
    pipe = load()
    try:
        state = restore(pipe, REQUEST, blob, model_fingerprint=fingerprint)
        scheduler = state.extra["scheduler"]
        assert scheduler.lower_order_nums > 0 and scheduler.last_sample is not None
        assert all(m is not None for m in scheduler.model_outputs)
        bare = pipe.prepare(REQUEST).extra["scheduler"]
        bare._step_index = scheduler._step_index
        state.extra["scheduler"] = bare
        while not state.done:
            pipe.step(state)
        frames = pipe.decode(state)
    finally:
        pipe.close()
    assert not torch.equal(frames, expected)


def test_cogvideox_with_dpm_resumes_its_generator_and_previous_prediction(model_dirs):
    # CogVideoXDPMScheduler draws noise in each step from the job's generator (in step_kwargs)
    # and takes the previous step's prediction.
    def load():
        pipe = load_diffusers(model_dirs["cogvideox"])
        pipe.pipe.scheduler = CogVideoXDPMScheduler.from_config(pipe.pipe.scheduler.config)
        return pipe

    fingerprint = model_fingerprint(str(model_dirs["cogvideox"]))
    frames, blob, state = stopped_and_resumed(load, REQUEST, 3, fingerprint)
    assert state.extra["dpm"]
    names = set(load_tensors(blob))
    assert "extra.old_pred" in names and "extra.step_kwargs.generator" in names
    torch.testing.assert_close(frames, uninterrupted(load, REQUEST), rtol=0, atol=0)


# ---- what a checkpoint holds --------------------------------------------------------------


def test_a_kiln_tiny_checkpoint_holds_the_latents_not_the_weights():
    request = VideoRequest(prompt="a red circle moving left")  # kiln-tiny's defaults
    pipe = TinyPipeline.load()
    try:
        state = pipe.prepare(request)
        pipe.step(state)
        blob = snapshot(pipe, state, model_fingerprint=model_fingerprint("kiln-tiny"))
    finally:
        pipe.close()
    assert set(load_tensors(blob)) == {"latents", "extra.velocity"}
    latent_bytes = state.latents.numel() * state.latents.element_size()  # 9 KiB
    assert len(blob) < 2 * latent_bytes + 4096
    assert len(blob) < TRAINED_WEIGHTS.stat().st_size / 100


def test_a_checkpoint_is_read_without_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint must never be unpickled")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    fingerprint = model_fingerprint("kiln-tiny")
    frames, _, _ = stopped_and_resumed(TinyPipeline.load, TINY_REQUEST, 2, fingerprint)
    assert frames.shape == (9, 64, 64, 3)


def test_request_digest_is_the_request_and_the_checkpoint_key_its_job():
    assert request_digest(TINY_REQUEST) == request_digest(VideoRequest(**{
        f: getattr(TINY_REQUEST, f) for f in TINY_REQUEST.__dataclass_fields__}))
    assert request_digest(TINY_REQUEST) != request_digest(
        VideoRequest(prompt=TINY_REQUEST.prompt, negative_prompt="blurry",
                     num_inference_steps=6, seed=3, guidance_scale=4.0))
    assert checkpoint_key("0f3a9c") == "checkpoints/0f3a9c.ckpt"
    with pytest.raises(ValueError):
        checkpoint_key("../etc")


# ---- model fingerprints -------------------------------------------------------------------


def test_model_fingerprint_is_stable_and_follows_configs_and_weights(model_dirs, tmp_path):
    assert model_fingerprint("kiln-tiny") == model_fingerprint("kiln-tiny")
    assert model_fingerprint("kiln-tiny").startswith("kiln-tiny:")
    wan = model_fingerprint(str(model_dirs["wan"]))
    assert wan.startswith("wan:") and wan != model_fingerprint(str(model_dirs["wan22"]))
    # Another place, a README and a hub cache's hidden folder: the same model.
    copy = shutil.copytree(model_dirs["wan"], tmp_path / "wan")
    (copy / "README.md").write_text("a note\n")
    (copy / ".cache").mkdir()
    (copy / ".cache" / "download.lock").write_text("")
    assert model_fingerprint(str(copy)) == wan
    # A scheduler setting changes the numbers, and so does a weight (the first of the data).
    config = copy / "scheduler" / "scheduler_config.json"
    original = config.read_text()
    config.write_text(original.replace('"flow_shift": 3.0', '"flow_shift": 5.0'))
    assert original != config.read_text() and model_fingerprint(str(copy)) != wan
    config.write_text(original)
    weights = next((copy / "transformer").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[8 + struct.unpack("<Q", data[:8])[0]] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert model_fingerprint(str(copy)) != wan
    with pytest.raises(ValueError, match="neither kiln-tiny nor a diffusers model directory"):
        model_fingerprint(str(tmp_path / "nothing"))


# ---- refusals -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pipe():
    pipe = TinyPipeline.load()
    yield pipe
    pipe.close()


@pytest.fixture(scope="module")
def tiny_blob(tiny_pipe):
    state = tiny_pipe.prepare(TINY_REQUEST)
    for _ in range(2):
        tiny_pipe.step(state)
    return snapshot(tiny_pipe, state, model_fingerprint=model_fingerprint("kiln-tiny"))


def metadata_of(blob):
    (size,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + size])["__metadata__"]


def rewritten(blob, tensors=None, **metadata):
    """The checkpoint with some tensors or metadata replaced, as another writer would make it."""
    return save_tensors({**load_tensors(blob), **(tensors or {})},
                        metadata={**metadata_of(blob), **metadata})


def refused(pipe, blob, request=TINY_REQUEST, fingerprint=None):
    with pytest.raises(IncompatibleCheckpoint) as caught:
        restore(pipe, request, blob,
                model_fingerprint=fingerprint or model_fingerprint("kiln-tiny"))
    assert isinstance(caught.value, ValueError)
    return str(caught.value)


def test_a_checkpoint_of_another_model_is_refused(tiny_pipe, tiny_blob, model_dirs):
    message = refused(tiny_pipe, tiny_blob, fingerprint=model_fingerprint(str(model_dirs["wan"])))
    assert "model fingerprint differs" in message and "kiln-tiny:" in message


@pytest.mark.parametrize("other", [
    VideoRequest(prompt=TINY_REQUEST.prompt, negative_prompt="blurry", num_inference_steps=6,
                 seed=4),
    VideoRequest(prompt="a blue square", negative_prompt="blurry", num_inference_steps=6, seed=3),
], ids=["seed", "prompt"])
def test_a_checkpoint_of_another_request_is_refused(tiny_pipe, tiny_blob, other):
    message = refused(tiny_pipe, tiny_blob, request=other)
    assert "another request" in message and "seed" in message and "prompt" in message


@pytest.mark.parametrize("cut", [4, 100, -1, -5000])
def test_a_truncated_checkpoint_is_refused(tiny_pipe, tiny_blob, cut):
    message = refused(tiny_pipe, tiny_blob[:cut])
    assert "truncated" in message or "unreadable" in message


def test_a_checkpoint_of_an_older_format_is_refused_naming_both(tiny_pipe, tiny_blob):
    message = refused(tiny_pipe, rewritten(tiny_blob, format="kiln-denoise-state/0"))
    assert f"written by format 'kiln-denoise-state/0', this worker reads {FORMAT!r}" in message


def test_a_step_beyond_the_jobs_steps_is_refused(tiny_pipe, tiny_blob):
    message = refused(tiny_pipe, rewritten(tiny_blob, step_index="7"))
    assert "step 7 is beyond the job's 6 steps" in message


@pytest.mark.parametrize("latents", [torch.zeros(1, 12, 3, 4, 4),
                                     torch.zeros(1, 12, 3, 8, 8, dtype=torch.float16)],
                         ids=["shape", "dtype"])
def test_tensors_unlike_what_prepare_builds_are_refused(tiny_pipe, tiny_blob, latents):
    message = refused(tiny_pipe, rewritten(tiny_blob, tensors={"latents": latents}))
    assert "latents is" in message and "in this job" in message


def test_a_safetensors_file_that_is_no_checkpoint_is_refused(tiny_pipe):
    message = refused(tiny_pipe, save_tensors({"latents": torch.zeros(1)}))
    assert "not a checkpoint" in message


def test_a_checkpoint_cannot_set_anything_but_scheduler_state(model_dirs):
    # Untrusted bytes may only set instance data on the job's scheduler, never a method.
    pipe = load_diffusers(model_dirs["wan"])
    fingerprint = model_fingerprint(str(model_dirs["wan"]))
    try:
        state = pipe.prepare(REQUEST)
        pipe.step(state)
        blob = snapshot(pipe, state, model_fingerprint=fingerprint)
        values = json.loads(metadata_of(blob)["values"])
        values["schedulers"]["extra.scheduler"]["state"]["step"] = 1
        message = refused(pipe, rewritten(blob, values=json.dumps(values)), request=REQUEST,
                          fingerprint=fingerprint)
    finally:
        pipe.close()
    assert "'step' is not scheduler state" in message
