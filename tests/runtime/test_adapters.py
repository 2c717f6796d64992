"""Per-job LoRA adapters on DLO-streamed transformers (``runtime.adapters``).

kiln adds each adapter's low-rank term on the activation side of the shared block weights; the
reference is diffusers' own pipeline after ``load_lora_weights`` and ``set_adapters``, where peft
wraps every adapted Linear. Both compute ``result + lora_B(lora_A(x)) * scaling`` with the same
float ``scaling`` (``weight * alpha / rank``), so kiln's frames equal the reference's bit for bit
wherever kiln runs the same forwards (Wan with ``cfg_batch=False``), and within the CFG-batching
tolerance otherwise (``WAN_ATOL``: batching the CFG pair changes the last bits of the timestep
embedding, with or without an adapter).

The adapter files are written by diffusers' ``save_lora_weights`` (the ``transformer.``-prefixed
peft layout, with the LoRA config in the safetensors header) from random factors, large enough
that an adapter visibly changes the video.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import diffusers
import numpy as np
import pytest
import torch
from multirank import run_ranks
from test_gathers_per_step import _record_steps
from test_pipeline_diffusers import REQUESTS, WAN_ATOL

from runtime.adapters import (
    LOADERS,
    load_adapter,
    named_transformers,
    remove_adapter_hooks,
    use_adapters,
)
from runtime.models.synthetic import SyntheticSpec, build_components, make_checkpoint
from runtime.pipelines.base import VideoRequest
from runtime.pipelines.minimax_h3 import t2v_blocks
from runtime.pipelines.reference import run_reference
from runtime.pipelines.registry import load_diffusers
from runtime.render import run_lockstep
from runtime.resume import request_digest

WAN = SyntheticSpec(family="wan")
REQUEST = VideoRequest(prompt="a red circle moving left", negative_prompt="blurry",
                       width=64, height=64, num_frames=9, num_inference_steps=3, seed=0,
                       guidance_scale=5.0)
# Modules kiln never loads (Cosmos3's text head), which an adapter cannot name.
UNUSED = ("lm_head",)


def write_adapter(path: Path, transformer: torch.nn.Module, *, rank: int, alpha: float,
                  seed: int, modules: list[str] | None = None,
                  rank_pattern: dict[str, int] | None = None, family: str = "wan") -> Path:
    """A random LoRA over ``modules`` (default: every Linear, in the blocks and outside them),
    written by the family's diffusers loader: ``transformer.<module>.lora_A.weight`` /
    ``lora_B.weight``, and the LoRA config (rank, alpha, per-module ranks) in the header's
    adapter metadata."""
    g = torch.Generator().manual_seed(seed)
    modules = modules or [n for n, m in transformer.named_modules()
                          if isinstance(m, torch.nn.Linear) and n not in UNUSED]
    layers = {}
    for name in modules:
        linear = transformer.get_submodule(name)
        r = (rank_pattern or {}).get(name, rank)
        layers[f"{name}.lora_A.weight"] = (torch.randn(r, linear.in_features, generator=g)
                                           / linear.in_features ** 0.5)
        layers[f"{name}.lora_B.weight"] = torch.randn(linear.out_features, r, generator=g) * 0.3
    config = {"r": rank, "lora_alpha": alpha, "target_modules": modules,
              "rank_pattern": rank_pattern or {}}
    getattr(diffusers.loaders, LOADERS[family]).save_lora_weights(
        path.parent, transformer_lora_layers=layers, weight_name=path.name,
        transformer_lora_adapter_metadata=config)
    return path


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> dict[str, Path]:
    """The tiny Wan checkpoint and two adapters: A (rank 4, alpha 8, every Linear, one at rank
    2 by the config's rank pattern) and B (rank 2, alpha 2, the blocks' attention only)."""
    root = tmp_path_factory.mktemp("adapters")
    transformer = build_components(WAN)["transformer"]
    attention = [n for n, m in transformer.named_modules()
                 if isinstance(m, torch.nn.Linear) and ".attn" in n]
    return {
        "model": make_checkpoint(root / "wan", WAN),
        "a": write_adapter(root / "a.safetensors", transformer, rank=4, alpha=8, seed=1,
                           rank_pattern={"blocks.1.ffn.net.2": 2}),
        "b": write_adapter(root / "b.safetensors", transformer, rank=2, alpha=2, seed=2,
                           modules=attention),
    }


def reference_frames(files: dict[str, Path], weights: dict[str, float],
                     request: VideoRequest = REQUEST) -> np.ndarray:
    """diffusers' WanPipeline with ``weights``' adapters loaded by ``load_lora_weights`` and
    weighted by ``set_adapters``."""
    pipe = diffusers.WanPipeline(**build_components(WAN))
    pipe.set_progress_bar_config(disable=True)
    with warnings.catch_warnings():
        # peft's note that a second adapter joins the first: what this reference means to do.
        warnings.filterwarnings("ignore", "Already found a `peft_config`", UserWarning)
        for name in weights:
            pipe.load_lora_weights(str(files[name]), adapter_name=name)
    if weights:
        pipe.set_adapters(list(weights), list(weights.values()))
    return run_reference(pipe, "wan", request)


def render(pipe: Any, files: dict[str, Path], weights: dict[str, float],
           request: VideoRequest = REQUEST) -> np.ndarray:
    adapters = tuple((load_adapter(files[n], "wan", named_transformers(pipe)), w)
                     for n, w in weights.items())
    return pipe.generate(dataclasses.replace(request, adapters=adapters)).numpy()


def _linears_hooked(pipe: Any) -> int:
    return sum(bool(m._forward_hooks) for t in pipe.transformers for m in t.modules()
               if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("weights", [{"a": 0.7}, {"a": 0.7, "b": 1.5}], ids=["a", "a+b"])
def test_wan_with_adapters_equals_diffusers_load_lora_weights_bit_for_bit(wan, weights):
    pipe = load_diffusers(wan["model"], cfg_batch=False)
    try:
        plain = pipe.generate(REQUEST).numpy()
        assert _linears_hooked(pipe) == 0  # no adapter used yet: no hook at all
        frames = render(pipe, wan, weights)
        assert _linears_hooked(pipe) == 26  # A adapts every Linear of the tiny Wan
        again = pipe.generate(REQUEST).numpy()  # the next job, without adapters
        assert remove_adapter_hooks(pipe) == 26 and _linears_hooked(pipe) == 0
        assert np.array_equal(render(pipe, wan, weights), frames)  # hooked again on use
    finally:
        pipe.close()
    np.testing.assert_array_equal(frames, reference_frames(wan, weights))
    assert np.abs(frames - plain).max() > 0.1  # the adapter really changes the video
    np.testing.assert_array_equal(again, plain)


def test_wan_with_an_adapter_and_batched_cfg_is_within_the_cfg_batching_tolerance(wan):
    pipe = load_diffusers(wan["model"])
    try:
        frames = render(pipe, wan, {"a": 0.7})
    finally:
        pipe.close()
    np.testing.assert_allclose(frames, reference_frames(wan, {"a": 0.7}), rtol=0, atol=WAN_ATOL)


def test_in_bf16_the_low_rank_term_is_peft_s_bit_for_bit(wan):
    # A bf16 transformer: diffusers loads the fp32 factors into bf16 LoRA layers; kiln casts
    # them to the adapted Linear's dtype alike, and adds the term in the same order.
    model = build_components(dataclasses.replace(WAN, dtype=torch.bfloat16))["transformer"]
    hooked = copy.deepcopy(model)
    adapter = load_adapter(wan["a"], "wan", {"transformer": hooked})
    model.load_lora_adapter(str(wan["a"]), prefix="transformer", adapter_name="a",
                            use_safetensors=True)
    model.set_adapters(["a"], [0.7])
    g = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(1, 16, 3, 8, 8, generator=g).bfloat16(),
              "encoder_hidden_states": torch.randn(1, 12, 32, generator=g).bfloat16(),
              "timestep": torch.tensor([500.0]), "return_dict": False}
    pipe = SimpleNamespace(pipe=SimpleNamespace(transformer=hooked))  # what use_adapters reads
    with torch.no_grad(), use_adapters(pipe, [(adapter, 0.7)]):
        out = hooked(**inputs)[0]
    with torch.no_grad():
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, model(**inputs)[0])


def test_wan22_experts_each_take_their_own_adapter_as_diffusers_loads_them(wan, tmp_path):
    # 4 steps: t = 999, 900, 750 on the high-noise expert, 500 on the low-noise one.
    spec = SyntheticSpec(family="wan", num_experts=2, boundary_ratio=0.6)
    request = dataclasses.replace(REQUEST, num_inference_steps=4)
    pipe = load_diffusers(make_checkpoint(tmp_path / "wan22", spec), cfg_batch=False)
    try:
        experts = named_transformers(pipe)
        adapters = ((load_adapter(wan["a"], "wan", experts), 0.7),
                    (load_adapter(wan["b"], "wan", experts, into="transformer_2"), 1.5))
        assert [a.target for a, _ in adapters] == ["transformer", "transformer_2"]
        frames = pipe.generate(dataclasses.replace(request, adapters=adapters)).numpy()
        high_only = pipe.generate(dataclasses.replace(request, adapters=adapters[:1])).numpy()
    finally:
        pipe.close()
    ref = diffusers.WanPipeline(**build_components(spec))
    ref.set_progress_bar_config(disable=True)
    ref.load_lora_weights(str(wan["a"]), adapter_name="high")
    ref.load_lora_weights(str(wan["b"]), adapter_name="low", load_into_transformer_2=True)
    ref.set_adapters(["high", "low"], [0.7, 1.5])
    np.testing.assert_array_equal(frames, run_reference(ref, "wan", request))
    assert np.abs(frames - high_only).max() > 0.01  # the low-noise expert's adapter counts


def _rank(rank: int, world: int, model_dir: str, files: dict[str, Path],
          weights: list[dict[str, float]]) -> tuple[list[list[int]], list[int], np.ndarray]:
    pipe = load_diffusers(model_dir, device="cpu")
    try:
        assert all(h.config.use_allgather and h.config.world_size == world
                   for h in pipe.handles)
        growth = _record_steps(pipe)
        adapters = tuple((load_adapter(files[n], "wan", named_transformers(pipe)), w)
                         for n, w in weights[rank].items())
        requests = [dataclasses.replace(REQUEST, seed=i, adapters=adapters if i == rank else ())
                    for i in range(world)]
        frames = run_lockstep(pipe, rank, requests)
        return growth, [h.num_blocks for h in pipe.handles], frames.numpy()
    finally:
        pipe.close()


def _alone(model_dir: Path, files: dict[str, Path], weights: dict[str, float],
           seed: int) -> np.ndarray:
    """The job rendered at dp=1, with the one thread each rank computes with."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pipe = load_diffusers(model_dir, device="cpu")
    try:
        return render(pipe, files, weights, dataclasses.replace(REQUEST, seed=seed))
    finally:
        pipe.close()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("weights", [
    pytest.param([{"a": 0.7}, {}], id="a-beside-none"),
    pytest.param([{"b": 1.0}, {"a": 0.3}], id="b-beside-a-at-0.3", marks=pytest.mark.slow),
])
def test_two_replicas_run_their_own_adapters_on_the_same_gathers(wan, weights):
    results = run_ranks(2, _rank, str(wan["model"]), wan, weights)
    for rank, (growth, num_blocks, frames) in enumerate(results):
        # One gather per block per step, as without adapters (CFG as one batch-2 forward).
        assert growth == [num_blocks] * REQUEST.num_inference_steps and num_blocks == [2]
        np.testing.assert_array_equal(frames, _alone(wan["model"], wan, weights[rank], rank))


def test_a_file_that_does_not_fit_the_transformer_is_refused_naming_the_first_problem(
        wan, tmp_path):
    pipe = load_diffusers(wan["model"])
    transformers = named_transformers(pipe)
    try:
        unknown = tmp_path / "unknown.safetensors"
        diffusers.WanPipeline.save_lora_weights(tmp_path, weight_name=unknown.name,
                                                transformer_lora_layers={
            "blocks.7.attn1.to_q.lora_A.weight": torch.zeros(2, 64),
            "blocks.7.attn1.to_q.lora_B.weight": torch.zeros(64, 2)})
        with pytest.raises(ValueError, match="unknown key 'blocks.7.attn1.to_q'"):
            load_adapter(unknown, "wan", transformers)
        shape = tmp_path / "shape.safetensors"
        diffusers.WanPipeline.save_lora_weights(tmp_path, weight_name=shape.name,
                                                transformer_lora_layers={
            "blocks.0.attn1.to_q.lora_A.weight": torch.zeros(2, 32),
            "blocks.0.attn1.to_q.lora_B.weight": torch.zeros(64, 2)})
        with pytest.raises(ValueError, match="shape mismatch at 'blocks.0.attn1.to_q'.*64 -> 64"):
            load_adapter(shape, "wan", transformers)
        # rank-2 factors under a config that says rank 4
        diffusers.WanPipeline.save_lora_weights(
            tmp_path, weight_name="rank.safetensors",
            transformer_lora_layers={"proj_out.lora_A.weight": torch.zeros(2, 64),
                                     "proj_out.lora_B.weight": torch.zeros(64, 2)},
            transformer_lora_adapter_metadata={"r": 4, "lora_alpha": 4,
                                               "target_modules": ["proj_out"]})
        with pytest.raises(ValueError, match="wrong rank at 'proj_out'.*says 4.*have 2"):
            load_adapter(tmp_path / "rank.safetensors", "wan", transformers)
        garbage = tmp_path / "garbage.safetensors"
        garbage.write_bytes(b"not a tensor file")
        with pytest.raises(ValueError, match="garbage.safetensors: not a safetensors LoRA file"):
            load_adapter(garbage, "wan", transformers)
        with pytest.raises(ValueError, match="wan-i2v takes no LoRA adapters"):
            load_adapter(wan["a"], "wan-i2v", transformers)
        with pytest.raises(ValueError, match="no transformer_2"):
            load_adapter(wan["a"], "wan", transformers, into="transformer_2")
        # An adapter for a transformer the pipeline does not run fails the step, whose gathers
        # are still issued for the other ranks.
        adapter = load_adapter(wan["b"], "wan", transformers)
        elsewhere = dataclasses.replace(adapter, target="transformer_2")
        state = pipe.prepare(dataclasses.replace(REQUEST, adapters=((elsewhere, 1.0),)))
        with pytest.raises(ValueError, match="is for transformer_2, which this pipeline does "
                                             "not run \\(it runs transformer\\)"):
            pipe.step(state)
        assert pipe.handles[0].num_acquired == pipe.handles[0].num_blocks
    finally:
        pipe.close()


def test_a_request_digest_covers_its_adapters_and_is_unchanged_without(wan):
    pipe = load_diffusers(wan["model"])
    try:
        a = load_adapter(wan["a"], "wan", named_transformers(pipe))
        again = load_adapter(wan["a"], "wan", named_transformers(pipe))
        b = load_adapter(wan["b"], "wan", named_transformers(pipe))
    finally:
        pipe.close()
    plain = request_digest(REQUEST)
    with_a = request_digest(dataclasses.replace(REQUEST, adapters=((a, 0.7),)))
    assert with_a == request_digest(dataclasses.replace(REQUEST, adapters=((again, 0.7),)))
    assert len({plain, with_a,
                request_digest(dataclasses.replace(REQUEST, adapters=((a, 0.5),))),
                request_digest(dataclasses.replace(REQUEST, adapters=((b, 0.7),)))}) == 4
    # A request without adapters digests as it did before they existed.
    fields = {f.name: getattr(REQUEST, f.name) for f in dataclasses.fields(REQUEST)}
    del fields["adapters"], fields["conditioning"]
    legacy = dataclasses.make_dataclass("Legacy", list(fields), slots=True)(**fields)
    assert plain == request_digest(legacy)


def family_reference(family: str, request: VideoRequest, adapter: Path | None = None,
                     weight: float = 1.0) -> np.ndarray:
    """diffusers' pipeline of Cosmos3 or MiniMax-H3 on the tiny checkpoint's components, with
    ``adapter`` (if any) loaded by diffusers' own path and set to ``weight``."""
    components = build_components(SyntheticSpec(family=family))
    if family == "minimax-h3":  # its modular pipeline carries diffusers' MiniMax-H3 loader
        ref = t2v_blocks().init_pipeline()
        ref.update_components(**components)
        if adapter is not None:
            ref.load_lora_weights(str(adapter), adapter_name="a")
            ref.set_adapters(["a"], [weight])
    else:  # Cosmos3OmniPipeline has no LoRA loader: the transformer's own (peft's) path
        ref = diffusers.Cosmos3OmniPipeline(**components)
        ref.set_progress_bar_config(disable=True)
        if adapter is not None:
            ref.transformer.load_lora_adapter(str(adapter), prefix="transformer",
                                              adapter_name="a",
                                              use_safetensors=True)  # with the header's config
            ref.transformer.set_adapters(["a"], [weight])
    return run_reference(ref, family, request)


@pytest.mark.parametrize("family", ["cosmos3", "minimax-h3"])
def test_cosmos3_and_minimax_h3_with_an_adapter_equal_diffusers_bit_for_bit(family, tmp_path):
    spec = SyntheticSpec(family=family)
    model_dir = make_checkpoint(tmp_path / family, spec)
    path = write_adapter(tmp_path / "a.safetensors", build_components(spec)["transformer"],
                         rank=4, alpha=8, seed=1, family=family)
    request = REQUESTS.get(family, REQUEST)
    pipe = load_diffusers(model_dir)
    try:
        adapter = load_adapter(path, family, named_transformers(pipe))
        frames = pipe.generate(dataclasses.replace(request, adapters=((adapter, 0.7),))).numpy()
        plain = pipe.generate(request).numpy()
    finally:
        pipe.close()
    np.testing.assert_array_equal(frames, family_reference(family, request, path, 0.7))
    assert np.abs(frames - plain).max() > 0.1 and frames.std() > 0.01


Job = tuple[VideoRequest, dict[str, float]]  # a request and its adapters: name -> weight


def _rounds_rank(rank: int, world: int, model_dir: str, family: str, files: dict[str, Path],
                 rounds: list[list[Job]]) -> list[tuple[list[list[int]], np.ndarray]]:
    """Rounds of jobs on one loaded group, one job per replica a round in lock-step (job i of a
    round on rank i, as ``runtime.render.generate_in_rounds`` feeds a group more jobs than it
    has replicas); this rank loads its own job's adapters. Per round: the blocks each handle
    gathered in each step, and this rank's frames."""
    pipe = load_diffusers(model_dir, device="cpu")
    try:
        assert all(h.config.use_allgather and h.config.world_size == world
                   for h in pipe.handles)
        growth = _record_steps(pipe)
        transformers = named_transformers(pipe)
        results = []
        for jobs in rounds:
            requests = [request for request, _ in jobs]
            request, weights = jobs[rank]
            requests[rank] = dataclasses.replace(request, adapters=tuple(
                (load_adapter(files[n], family, transformers), w) for n, w in weights.items()))
            first = len(growth)
            frames = run_lockstep(pipe, rank, requests)
            results.append((growth[first:], frames.numpy()))
        return results
    finally:
        pipe.close()


@contextlib.contextmanager
def rank_threads() -> Iterator[None]:
    """Compute with the one thread each rank of `tests.multirank` has: CPU kernels split their
    reductions by thread count, so a reference compares bits only with the same count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.chaos  # slow beside its siblings in make test: make chaos runs it
@pytest.mark.slow
@pytest.mark.parametrize("family", ["cosmos3", "minimax-h3"])
def test_cosmos3_and_minimax_h3_replicas_with_and_without_an_adapter_equal_diffusers(
        family, tmp_path):
    # dp=2, one launch: a round with no adapter on either replica, then the same jobs with an
    # adapter on rank 0 and none on rank 1.
    spec = SyntheticSpec(family=family)
    model_dir = make_checkpoint(tmp_path / family, spec)
    files = {"a": write_adapter(tmp_path / "a.safetensors", build_components(spec)["transformer"],
                                rank=4, alpha=8, seed=1, family=family)}
    base = REQUESTS.get(family, REQUEST)
    jobs = [base, dataclasses.replace(base, prompt="a blue cat flying over the sea", seed=7)]
    rounds = [[(jobs[0], {}), (jobs[1], {})], [(jobs[0], {"a": 0.7}), (jobs[1], {})]]
    results = run_ranks(2, _rounds_rank, str(model_dir), family, files, rounds)
    with rank_threads():
        refs = [family_reference(family, jobs[0], files["a"], 0.7),
                family_reference(family, jobs[1])]
    (plain_0, frames_0), (plain_1, frames_1) = results
    for rank, (plain, (growth, frames)) in enumerate(results):
        # The same gathers in every step as with no adapter on either replica.
        assert growth == plain[0] and len(growth) == base.num_inference_steps, f"rank {rank}"
        np.testing.assert_array_equal(frames, refs[rank])
    assert np.array_equal(frames_1[1], plain_1[1])  # beside an adapter or not
    assert np.abs(frames_0[1] - plain_0[1]).max() > 0.1  # the adapter counts


# Four jobs on one request, told apart by their adapters alone (job i on rank i % 2).
FOUR_JOBS = [{"a": 0.7}, {"b": 1.5}, {}, {"a": 0.3}]


@pytest.mark.chaos  # slow beside its siblings in make test: make chaos runs it
@pytest.mark.slow
def test_one_group_renders_four_jobs_with_their_own_adapters_two_at_a_time(wan):
    # dp=2, one launch, the same ranks throughout: a round without adapters (the gathers to
    # match), then A beside B, then none beside A at another weight (the hooks A and B left).
    rounds = [[(REQUEST, {}), (REQUEST, {})],
              [(REQUEST, FOUR_JOBS[0]), (REQUEST, FOUR_JOBS[1])],
              [(REQUEST, FOUR_JOBS[2]), (REQUEST, FOUR_JOBS[3])]]
    results = run_ranks(2, _rounds_rank, str(wan["model"]), "wan", wan, rounds)
    with rank_threads():
        pipe = load_diffusers(wan["model"], device="cpu")
        try:
            alone = [render(pipe, wan, weights) for weights in FOUR_JOBS]
        finally:
            pipe.close()
    for rank, ((plain_growth, _), *jobs) in enumerate(results):
        assert len(plain_growth) == REQUEST.num_inference_steps
        for i, (growth, frames) in enumerate(jobs):
            assert growth == plain_growth, f"rank {rank}, round {i + 1}"
            np.testing.assert_array_equal(frames, alone[2 * i + rank])
    for i in range(4):  # each job's adapters, and only they, made its video
        assert all(np.abs(alone[i] - alone[j]).max() > 0.01 for j in range(i))
