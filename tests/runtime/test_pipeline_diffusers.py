"""Real diffusers families through DLO: kiln's video equals diffusers' own pipeline, bit for bit
where kiln runs the same forwards (CogVideoX, Cosmos3, MiniMax-H3; Wan with ``cfg_batch=False``),
to a tolerance where kiln batches Wan's CFG pair that the reference runs as two forwards (see
``WAN_ATOL``).

Each test model is a tiny random diffusers model saved to a temporary directory; kiln loads its
transformer(s) on the meta device and streams the blocks from that directory's safetensors,
while the reference is diffusers' pipeline built from the same in-memory components (MiniMax-H3:
its modular text-to-video workflow).
"""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch

from runtime.launch import rank_threads
from runtime.models.synthetic import (
    SyntheticSpec,
    build_components,
    build_pipeline,
    make_checkpoint,
)
from runtime.pipelines.base import VideoRequest
from runtime.pipelines.minimax_h3 import t2v_blocks
from runtime.pipelines.reference import run_reference
from runtime.pipelines.registry import load_diffusers
from runtime.render import generate_on_ranks

SPECS = {
    "wan": SyntheticSpec(family="wan"),
    "wan22": SyntheticSpec(family="wan", num_experts=2, boundary_ratio=0.6),
    "cogvideox": SyntheticSpec(family="cogvideox"),
    "cosmos3": SyntheticSpec(family="cosmos3"),
    "minimax-h3": SyntheticSpec(family="minimax-h3"),
}
REQUEST = VideoRequest(prompt="a red circle moving left", negative_prompt="blurry",
                       width=64, height=64, num_frames=9, num_inference_steps=3, seed=0,
                       guidance_scale=5.0)
# MiniMax-H3 renders 5 s at the least (124 frames at 24 fps) on sizes of 32, and takes no
# guidance (it is distilled): 3 steps are 2 forwards.
REQUESTS = {"minimax-h3": VideoRequest(prompt="a red circle moving left", width=64, height=32,
                                       num_frames=124, num_inference_steps=3, seed=0,
                                       guidance_scale=1.0)}
SHAPES = {"minimax-h3": (124, 32, 64, 3)}
# The block list each family streams, and its text encoder's (None: it has none).
BLOCKS = {"wan": "blocks", "wan22": "blocks", "cogvideox": "transformer_blocks",
          "cosmos3": "layers", "minimax-h3": "transformer_blocks"}
TEXT_BLOCKS = {"wan": "encoder.block", "wan22": "encoder.block", "cogvideox": "encoder.block",
               "cosmos3": None, "minimax-h3": "model.language_model.layers"}
# kiln runs Wan's CFG pair as one batch-2 forward, WanPipeline as two batch-1 forwards. That
# changes the last bits: a batch-1 forward's timestep embedding is a one-row matmul (the
# matrix-vector kernel), a batch-2 one a two-row matmul (the matrix-matrix kernel), and they sum
# in different orders; the text embedding (512 rows) and attention agree bit for bit. Measured
# (CPU, fp32): 7.7e-7 max abs over REQUEST's frames for "wan", 1.2e-7 for "wan22"; frames are in
# [0, 1], one uint8 level is 3.9e-3. With cfg_batch=False kiln's frames are bit for bit.
WAN_ATOL = 1e-5


def assert_matches_reference(name: str, frames: np.ndarray, ref: np.ndarray) -> None:
    if name.startswith("wan"):
        np.testing.assert_allclose(frames, ref, rtol=0, atol=WAN_ATOL)
    else:
        np.testing.assert_array_equal(frames, ref)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: make_checkpoint(root / name, spec) for name, spec in SPECS.items()}


def reference_frames(name: str, request: VideoRequest | None = None) -> np.ndarray:
    """diffusers' own pipeline on the same request, built from the same in-memory components."""
    spec = SPECS[name]
    if spec.family == "minimax-h3":
        pipe = t2v_blocks().init_pipeline()
        pipe.update_components(**build_components(spec))
    else:
        pipe = build_pipeline(spec)
        pipe.set_progress_bar_config(disable=True)
    return run_reference(pipe, spec.family, request or REQUESTS.get(name, REQUEST))


@pytest.mark.parametrize("name", list(SPECS))
def test_dlo_render_equals_the_diffusers_pipeline_bit_for_bit(model_dirs, name):
    pipe = load_diffusers(model_dirs[name])
    try:
        # The blocks really are streamed: outside a forward they hold no memory.
        for t in pipe.transformers:
            assert all(p.is_meta for p in t.get_submodule(BLOCKS[name]).parameters())
        # The text encoder's are rank-local (a rank encodes its prompt on its own); on the CPU
        # they are bound to the checkpoint's mapping, which every rank shares: no buffer at all.
        if TEXT_BLOCKS[name] is None:
            assert pipe.text_handle is None
        else:
            stats = pipe.text_handle.stats()
            assert stats["mode"] == "rank-local"
            assert stats["mapped_blocks"] == stats["num_blocks"] > 0
            assert stats["device_weight_buffer_bytes"] == 0
        frames = pipe.generate(REQUESTS.get(name, REQUEST)).numpy()
    finally:
        pipe.close()
    ref = reference_frames(name)
    assert frames.shape == ref.shape == SHAPES.get(name, (9, 64, 64, 3))
    assert ref.std() > 0.01  # a real picture, not a constant
    assert_matches_reference(name, frames, ref)


@pytest.mark.parametrize("name", ["wan", "wan22"])
def test_wan_with_two_batch_1_cfg_forwards_equals_the_diffusers_pipeline_bit_for_bit(
        model_dirs, name):
    pipe = load_diffusers(model_dirs[name], cfg_batch=False)
    try:
        assert pipe.forwards_per_step == 2
        frames = pipe.generate(REQUEST).numpy()
    finally:
        pipe.close()
    np.testing.assert_array_equal(frames, reference_frames(name))


def test_cogvideox_refuses_two_batch_1_cfg_forwards(model_dirs):
    with pytest.raises(ValueError, match="one batch-2 forward"):
        load_diffusers(model_dirs["cogvideox"], cfg_batch=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["wan", "cogvideox", "cosmos3", "minimax-h3"])
def test_two_ranks_with_allgather_equal_the_diffusers_pipeline(model_dirs, name):
    # Rank 0 renders, rank 1 only takes part in the gathers (idle steps).
    frames = generate_on_ranks(str(model_dirs[name]), [REQUESTS.get(name, REQUEST)], dp=2)
    assert frames[1] is None
    # CPU kernels split their reductions by thread count, so the reference computes with the
    # threads each rank has to compare bits.
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads(2))
    try:
        ref = reference_frames(name)
    finally:
        torch.set_num_threads(threads)
    assert_matches_reference(name, frames[0], ref)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["allgather", "rank-local"])
@pytest.mark.parametrize("name", ["cosmos3", "minimax-h3"])
def test_two_ranks_each_rendering_a_job_equal_the_diffusers_pipeline(model_dirs, name, mode):
    # Both ranks render, each its own prompt and seed, sharing one copy of the blocks: sharded
    # (allgather), or on the CPU the checkpoint's mapping, bound once (rank-local).
    base = REQUESTS.get(name, REQUEST)
    requests = [base, dataclasses.replace(base, prompt="a blue cat flying over the sea", seed=7)]
    frames = generate_on_ranks(str(model_dirs[name]), requests, dp=2,
                               use_allgather=mode == "allgather")
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads(2))
    try:
        refs = [reference_frames(name, r) for r in requests]
    finally:
        torch.set_num_threads(threads)
    for got, ref in zip(frames, refs, strict=True):
        np.testing.assert_array_equal(got, ref)
    assert not np.array_equal(refs[0], refs[1])


def test_cosmos3_runs_its_cfg_pair_as_two_forwards_and_gathers_both_without_guidance(model_dirs):
    pipe = load_diffusers(model_dirs["cosmos3"])
    try:
        assert pipe.forwards_per_step == 2 and pipe.pipe.safety_checker is None
        assert pipe.pipe.transformer.lm_head is None  # never loaded: video never runs it
        for guidance, computed in ((5.0, 2), (1.0, 1)):
            forwards, acquired = _step_counts(pipe, VideoRequest(prompt="a cat",
                                                                 guidance_scale=guidance))
            assert forwards == [computed]
            assert acquired == [2 * pipe.handles[0].num_blocks]  # the same gathers either way
    finally:
        pipe.close()


def test_minimax_h3_runs_one_forward_per_step_and_one_fewer_than_its_steps(model_dirs):
    pipe = load_diffusers(model_dirs["minimax-h3"])
    try:
        state = pipe.prepare(REQUESTS["minimax-h3"])
        assert pipe.forwards_per_step == 1 and state.num_inference_steps == 2
        encoder = pipe.pipe.text_encoder  # its head and vision tower: never loaded
        assert encoder.lm_head is None and encoder.model.visual is None
        with pytest.raises(ValueError, match="5 \\+ a multiple of 17 frames from 124 to 345"):
            pipe.prepare(dataclasses.replace(REQUESTS["minimax-h3"], num_frames=125))
        with pytest.raises(ValueError, match="a multiple of 32"):
            pipe.prepare(dataclasses.replace(REQUESTS["minimax-h3"], width=48))
    finally:
        pipe.close()


@pytest.mark.parametrize("name", ["cosmos3", "minimax-h3"])
def test_a_directory_missing_a_component_is_refused_naming_it(model_dirs, name, tmp_path):
    copy = tmp_path / name
    shutil.copytree(model_dirs[name], copy)
    shutil.rmtree(copy / "vae")
    with pytest.raises(ValueError, match="lacks vae \\(AutoencoderKL.*downloads nothing"):
        load_diffusers(copy)


def test_cosmos3_refuses_sequence_parallelism_saying_which_families_split(model_dirs):
    with pytest.raises(ValueError, match="runs at sp=1; sequence parallelism .* wan, minimax-h3"):
        load_diffusers(model_dirs["cosmos3"], sequence=object())


@pytest.mark.slow
def test_wan22_ranks_in_different_expert_phases_stay_in_step(model_dirs):
    # 4 steps: t = 999, 900, 750, 500; 6 steps: 999, 937, 857, 750, 600, 376. With the boundary
    # at 600, step 3 runs the low-noise expert on rank 0 and the high-noise one on rank 1, and
    # rank 0 idles steps 4-5.
    requests = [VideoRequest(prompt="a red ball", num_inference_steps=4, seed=1),
                VideoRequest(prompt="a blue cat", num_inference_steps=6, seed=2)]
    frames = generate_on_ranks(str(model_dirs["wan22"]), requests, dp=2, timeout_s=120)
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads(2))  # as on each rank
    try:
        refs = [reference_frames("wan22", r) for r in requests]
    finally:
        torch.set_num_threads(threads)
    for got, ref in zip(frames, refs, strict=True):
        assert_matches_reference("wan22", got, ref)


def _step_counts(pipe, request, active=None):
    """(forwards computed, blocks acquired) per transformer, for one step."""
    forwards = [0] * len(pipe.transformers)
    hooks = [t.register_forward_pre_hook(lambda *_, i=i: forwards.__setitem__(i, forwards[i] + 1))
             for i, t in enumerate(pipe.transformers)]
    try:
        state = pipe.prepare(request)
        before = [h.num_acquired for h in pipe.handles]
        pipe.step(state, active)
    finally:
        for h in hooks:
            h.remove()
    return forwards, [h.num_acquired - b for h, b in zip(pipe.handles, before, strict=True)]


@pytest.mark.parametrize("cfg_batch", [True, False])
@pytest.mark.parametrize("guidance", [5.0, 1.0])
def test_a_wan_step_gathers_forwards_per_step_forwards_with_or_without_guidance(
        model_dirs, cfg_batch, guidance):
    pipe = load_diffusers(model_dirs["wan"], cfg_batch=cfg_batch)
    try:
        forwards, acquired = _step_counts(pipe, VideoRequest(prompt="a cat",
                                                             guidance_scale=guidance))
        # Batched, the CFG pair is one forward; unbatched, a step without guidance still
        # gathers the second forward it does not compute.
        assert forwards == [1 if cfg_batch or guidance <= 1 else 2]
        assert acquired == [(1 if cfg_batch else 2) * pipe.handles[0].num_blocks]
    finally:
        pipe.close()


def test_wan22_steps_gather_only_the_active_experts(model_dirs):
    pipe = load_diffusers(model_dirs["wan22"])
    try:
        # t = 999 is above the boundary: the high-noise expert computes.
        assert pipe.handles_needed(pipe.prepare(REQUEST)) == [True, False]
        forwards, acquired = _step_counts(pipe, REQUEST, active=[True, False])
        assert forwards == [1, 0]
        assert acquired == [pipe.handles[0].num_blocks, 0]
        # Another rank of the group needs the low-noise expert: this one only gathers it.
        forwards, acquired = _step_counts(pipe, REQUEST, active=[True, True])
        assert forwards == [1, 0]
        assert acquired == [h.num_blocks for h in pipe.handles]
        # A step whose expert the group does not run is refused, its gathers still issued.
        with pytest.raises(ValueError, match="needs transformer"):
            _step_counts(pipe, REQUEST, active=[False, True])
        assert pipe.handles[1].num_acquired % pipe.handles[1].num_blocks == 0
    finally:
        pipe.close()


def test_decode_in_one_frame_tiles_equals_decode_in_one_pass(model_dirs):
    pipe = load_diffusers(model_dirs["wan"])
    try:
        state = pipe.prepare(VideoRequest(prompt="a cat", num_inference_steps=1))
        pipe.step(state)
        whole = pipe.decode(state)
        assert pipe.last_decode_plan.num_tiles == 1
        pipe.decode_free_bytes = 1  # one frame per tile
        tiled = pipe.decode(state)
        assert pipe.last_decode_plan.num_tiles == 9
    finally:
        pipe.close()
    assert torch.equal(tiled, whole)


def test_unsupported_sizes_are_refused_with_the_rule(model_dirs):
    pipe = load_diffusers(model_dirs["wan"])
    try:
        with pytest.raises(ValueError, match="1 \\+ a multiple of 4 frames"):
            pipe.prepare(VideoRequest(prompt="a cat", num_frames=8))
        with pytest.raises(ValueError, match="a multiple of 16"):
            pipe.prepare(VideoRequest(prompt="a cat", width=72))
    finally:
        pipe.close()
