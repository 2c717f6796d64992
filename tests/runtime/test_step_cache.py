"""Step caching (``runtime.step_cache``): kiln's first-block cache equals diffusers' pipeline with
its ``FirstBlockCacheConfig`` hook, bit for bit, alone and at dp=2 allgather with a job at another
threshold on the other rank; a step whose forwards every rank skips gathers only the first
block; an exact job is the render without the cache.

The tiny random Wan has 2 blocks and kiln-tiny 4, so a skipped forward gathers 1 of 2 or 1 of 4.
Its CFG pair runs as two batch-1 forwards (``cfg_batch=False``), as diffusers' ``WanPipeline``
runs it with a cache state per forward (``cache_context("cond")``, ``("uncond")``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import FirstBlockCacheConfig
from multirank import run_ranks

from common.quality import tier_threshold
from runtime.models.synthetic import SyntheticSpec, build_pipeline, make_checkpoint
from runtime.models.tiny import build_tiny
from runtime.pipelines.base import DenoiseState, VideoPipeline, VideoRequest, agree_handles
from runtime.pipelines.reference import run_reference
from runtime.pipelines.registry import load_diffusers
from runtime.pipelines.tiny import TinyPipeline
from runtime.render import run_lockstep, step_lockstep
from runtime.resume import request_digest

WAN = SyntheticSpec(family="wan")
WAN_REQUEST = VideoRequest(prompt="a red circle moving left", negative_prompt="blurry",
                           width=64, height=64, num_frames=9, num_inference_steps=10, seed=0,
                           guidance_scale=5.0)
# On this model and request: 0.1 skips 10 of the 20 forwards, 0.2 skips 18.
THRESHOLDS = (0.1, 0.2)
TINY_REQUESTS = [VideoRequest(prompt="a red ball", num_inference_steps=12, seed=1,
                              guidance_scale=5.0, step_cache=0.2),
                 VideoRequest(prompt="a blue cat", num_inference_steps=12, seed=2,
                              guidance_scale=5.0, step_cache=0.3)]


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("models") / "wan", WAN))


def diffusers_frames(request: VideoRequest, threads: int | None = None) -> np.ndarray:
    """diffusers' ``WanPipeline`` with its first-block cache at the request's threshold."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)  # as many as the rank it is compared with
    try:
        pipe = build_pipeline(WAN)
        pipe.set_progress_bar_config(disable=True)
        if request.step_cache is not None:
            pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=request.step_cache))
        return run_reference(pipe, "wan", request)
    finally:
        torch.set_num_threads(before)


def _record(pipe: VideoPipeline) -> list[dict[str, int]]:
    """Per step (or idle step) from now on: the blocks the first handle acquired (each one a
    gather in allgather mode) and the forwards this rank's job skipped."""
    steps: list[dict[str, int]] = []

    def recorded(fn: Any) -> Any:
        def call(*args: Any) -> None:
            handle = pipe.handles[0]
            state = args[0] if args and isinstance(args[0], DenoiseState) else None
            cache = None if state is None else state.extra.get("step_cache")
            acquired, skipped = handle.num_acquired, cache.num_forwards_skipped if cache else 0
            fn(*args)
            cache = None if state is None else state.extra.get("step_cache")
            steps.append({"gathered": handle.num_acquired - acquired,
                          "skipped": (cache.num_forwards_skipped if cache else 0) - skipped,
                          **{f"reported_{k}": v for k, v in pipe.last_step_figures.items()}})
        return call

    pipe.step = recorded(pipe.step)  # type: ignore[method-assign]
    pipe.idle_step = recorded(pipe.idle_step)  # type: ignore[method-assign]
    return steps


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_wan_first_block_cache_equals_diffusers_hook_bit_for_bit(wan_dir, threshold):
    request = dataclasses.replace(WAN_REQUEST, step_cache=threshold)
    pipe = load_diffusers(wan_dir, cfg_batch=False)
    try:
        state = pipe.prepare(request)
        while not state.done:
            pipe.step(state)
        frames = pipe.decode(state).numpy()
        figures = state.extra["step_cache"].figures()
    finally:
        pipe.close()
    assert figures["forwards"] == 20
    assert 0 < figures["forwards_skipped"] < 20  # some forwards skipped, the first never
    # 2 blocks: a skipped forward computes its first only.
    assert figures["blocks_computed"] == 2 * 20 - figures["forwards_skipped"]
    np.testing.assert_array_equal(frames, diffusers_frames(request))
    assert not np.array_equal(frames, diffusers_frames(WAN_REQUEST))  # the cache changed it


def _wan_rank(rank: int, world: int, model_dir: str,
              requests: list[VideoRequest]) -> tuple[np.ndarray, list[dict[str, int]]]:
    pipe = load_diffusers(model_dir, device="cpu", cfg_batch=False)
    try:
        assert pipe.handles[0].gathers
        steps = _record(pipe)
        frames = run_lockstep(pipe, rank, requests)
        return frames.numpy(), steps
    finally:
        pipe.close()


def test_wan_at_dp2_allgather_each_job_equals_diffusers_at_its_threshold(wan_dir):
    requests = [dataclasses.replace(WAN_REQUEST, step_cache=t) for t in THRESHOLDS]
    results = run_ranks(2, _wan_rank, wan_dir, requests)
    for (frames, _), request in zip(results, requests, strict=True):
        np.testing.assert_array_equal(frames, diffusers_frames(request, threads=1))
    # Each step is 2 forwards of 2 blocks: a forward both ranks skip gathers its first block
    # only. Which forwards of a step skipped is not recorded, so count by step: a step gathers
    # 4 blocks less one per forward skipped on both ranks, at least as few as either allows.
    steps = list(zip(results[0][1], results[1][1], strict=True))
    for a, b in steps:
        assert a["gathered"] == b["gathered"]
        assert 4 - min(a["skipped"], b["skipped"]) >= a["gathered"] >= 2
    both = sum(min(a["skipped"], b["skipped"]) for a, b in steps)
    assert both > 0
    assert sum(a["gathered"] for a, _ in steps) <= 4 * len(steps) - both


def _tiny_rank(rank: int, world: int, resident: int, requests: list[VideoRequest]
               ) -> tuple[np.ndarray, list[dict[str, int]], dict[str, int]]:
    # A budget for ``resident`` leading blocks and the two slots (kiln-tiny's blocks are alike).
    block_bytes = 4 * sum(p.numel() for p in build_tiny().transformer.blocks[0].parameters())
    budget = int((resident + 2.5) * block_bytes) if resident else None
    pipe = TinyPipeline.load(device="cpu", device_budget=budget)
    try:
        assert pipe.handles[0].gathers and pipe.handles[0].resident_blocks == resident
        steps = _record(pipe)
        gathers = pipe.handles[0].stats()["num_gathers"]
        state = step_lockstep(pipe, rank, requests)
        assert state is not None
        figures = {**state.extra["step_cache"].figures(),
                   "gathers": pipe.handles[0].stats()["num_gathers"] - gathers}
        return pipe.decode(state).numpy(), steps, figures
    finally:
        pipe.close()


def _tiny_alone(request: VideoRequest) -> tuple[np.ndarray, dict[str, int]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank computes
    pipe = TinyPipeline.load(device="cpu")
    try:
        state = pipe.prepare(request)
        while not state.done:
            pipe.step(state)
        return pipe.decode(state).numpy(), state.extra["step_cache"].figures()
    finally:
        pipe.close()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("resident", [0, 1])
def test_kiln_tiny_at_dp2_skips_the_gathers_of_forwards_both_ranks_skip(resident):
    # resident=1: the first block stays on the device, so a step both ranks skip gathers none.
    results = run_ranks(2, _tiny_rank, resident, TINY_REQUESTS)
    num_blocks, streamed = 4, 4 - resident
    first = 1 - resident  # what a skipped forward gathers: its first block, if that streams
    for (frames, _, figures), request in zip(results, TINY_REQUESTS, strict=True):
        alone, alone_figures = _tiny_alone(request)
        np.testing.assert_array_equal(frames, alone)  # whatever the other rank's job does
        assert {k: figures[k] for k in alone_figures} == alone_figures
    steps = list(zip(results[0][1], results[1][1], strict=True))
    # One forward per step: every streamed block gathered unless both ranks skip, then the
    # first only.
    for a, b in steps:
        expected = first if a["skipped"] and b["skipped"] else streamed
        assert a["gathered"] == b["gathered"] == expected
        # What the pipeline reports of the step (the rank's status figures): the same gathers,
        # and the first block only where its own job skipped.
        for rank in (a, b):
            assert rank["reported_gathers"] == expected
            assert rank["reported_blocks_computed"] == (1 if rank["skipped"] else num_blocks)
    both = sum(1 for a, b in steps if a["skipped"] and b["skipped"])
    assert both >= 3
    # The engine's own count of gathers issued falls by as much: 3 fewer per step both skip (to
    # one: the prefetch of the next forward's first block may be issued before it is read).
    expected = streamed * len(steps) - (streamed - first) * both
    assert expected - 1 <= results[0][2]["gathers"] <= expected + 1


def test_an_exact_job_is_the_render_without_the_cache_and_agrees_nothing():
    request = dataclasses.replace(TINY_REQUESTS[0], step_cache=None)
    pipe = TinyPipeline.load(device="cpu")
    try:
        cached_pipeline = pipe.generate(request)
        calls: list[bool] = []
        handle = pipe.handles[0]
        agree = handle.agree_any
        handle.agree_any = lambda flag: calls.append(flag) or agree(flag)  # type: ignore
        state = pipe.prepare(request)
        while not state.done:
            before = handle.num_acquired
            pipe.step(state, agree_handles(pipe, state))
            assert handle.num_acquired - before == handle.streamed_blocks
            assert pipe.last_step_figures == {"gathers": 0, "blocks_computed": 4}  # one rank
        assert calls == [] and "step_cache" not in state.extra
        assert torch.equal(pipe.decode(state), cached_pipeline)
        # The blocks' own forwards, with the cache's wrappers taken off.
        for block in pipe.model.transformer.blocks:
            del block.forward
        pipe.step_caches = [None]
        plain = pipe.generate(request)
    finally:
        pipe.close()
    assert torch.equal(cached_pipeline, plain)


def test_a_cached_step_on_gathering_ranks_without_agreement_is_refused(monkeypatch):
    pipe = TinyPipeline.load(device="cpu")
    try:
        state = pipe.prepare(TINY_REQUESTS[0])
        # As if its blocks were gathered across ranks that were never asked (no agree_handles).
        monkeypatch.setattr(type(pipe.handles[0]), "gathers", property(lambda self: True))
        with pytest.raises(ValueError, match="agree_handles"):
            pipe.step(state)
        assert state.step_index == 0
    finally:
        pipe.close()


def test_an_exact_request_digests_as_before_a_cached_one_apart():
    assert VideoRequest(prompt="a red ball").step_cache is None  # exact unless asked
    fields = {f.name: getattr(TINY_REQUESTS[0], f.name)
              for f in dataclasses.fields(TINY_REQUESTS[0])}
    for name in ("step_cache", "conditioning", "adapters"):
        del fields[name]
    legacy = dataclasses.make_dataclass("Legacy", list(fields), slots=True)(**fields)
    exact = dataclasses.replace(TINY_REQUESTS[0], step_cache=None)
    assert request_digest(exact) == request_digest(legacy)  # type: ignore[arg-type]
    assert request_digest(TINY_REQUESTS[0]) != request_digest(exact)


def test_kiln_tiny_fast_tier_computes_at_least_1_4x_fewer_blocks_at_30_db():
    # Three of bench/step_cache.py's twelve prompts (all twelve: 1.86x, 33.3 dB mean).
    pipe = TinyPipeline.load(device="cpu")
    cache = pipe.step_caches[0]
    try:
        blocks, scores = {"exact": 0, "fast": 0}, []
        for seed, prompt in enumerate(["a red ball rolling left", "a blue cat on a sofa",
                                       "waves at dusk"]):
            frames = {}
            for quality in ("exact", "fast"):
                request = VideoRequest(prompt=prompt, seed=seed, num_inference_steps=30,
                                       step_cache=tier_threshold("kiln-tiny", quality))
                before = cache.num_blocks_computed
                frames[quality] = pipe.generate(request).numpy().astype(np.float64)
                blocks[quality] += cache.num_blocks_computed - before
            mse = float(np.mean((frames["fast"] - frames["exact"]) ** 2))
            scores.append(10 * np.log10(1.0 / mse))
    finally:
        pipe.close()
    assert blocks["exact"] == 3 * 30 * 4
    assert blocks["exact"] / blocks["fast"] >= 1.4
    assert np.mean(scores) >= 30


@pytest.mark.chaos  # slow beside its siblings in make test: make chaos runs it
def test_kiln_tiny_both_replicas_on_fast_gather_3_of_4_blocks_less_per_step_both_skip():
    fast = tier_threshold("kiln-tiny", "fast")
    requests = [VideoRequest(prompt=p, seed=i, num_inference_steps=30, step_cache=fast)
                for i, p in enumerate(["a red ball rolling left", "a blue cat on a sofa"])]
    results = run_ranks(2, _tiny_rank, 0, requests)
    steps = list(zip(results[0][1], results[1][1], strict=True))
    both = sum(1 for a, b in steps if a["skipped"] and b["skipped"])
    gathered = sum(a["gathered"] for a, _ in steps)
    # With the shipped weights each job skips 18 of its 30 steps, 9 of them the same: 120
    # gathers become 93. Every step both skip saves the 3 blocks after the first.
    assert both >= 1 and all(r[2]["forwards_skipped"] > both for r in results)
    assert gathered == 4 * 30 - 3 * both


def _failing_rank(rank: int, world: int, block: int) -> np.ndarray | None:
    """Rank 0's job raises in block ``block`` in its first step (before the group's decision,
    or after), then the rank idles; rank 1 renders TINY_REQUESTS[1]."""
    pipe = TinyPipeline.load(device="cpu")
    try:
        def fail(module: Any, args: Any) -> None:
            raise RuntimeError("a block failed")

        if rank == 0:
            pipe.model.transformer.blocks[block].register_forward_pre_hook(fail)
        state = pipe.prepare(TINY_REQUESTS[rank])
        failed = False
        for _ in range(state.num_inference_steps):
            active = agree_handles(pipe, state if not failed else None)
            assert active.step_cache  # both jobs cache: every forward decides
            if failed:
                pipe.idle_step(active)
                continue
            try:
                pipe.step(state, active)
            except RuntimeError as exc:
                assert rank == 0 and "a block failed" in str(exc)
                failed = True
        return None if failed else pipe.decode(state).numpy()
    finally:
        pipe.close()


@pytest.mark.chaos  # slow beside its siblings in make test: make chaos runs it
@pytest.mark.parametrize("block", [0, 2])
def test_a_forward_that_raises_in_a_deciding_step_leaves_the_other_rank_rendering(block):
    results = run_ranks(2, _failing_rank, block)
    assert results[0] is None
    np.testing.assert_array_equal(results[1], _tiny_alone(TINY_REQUESTS[1])[0])


def test_a_jobs_end_and_the_ranks_status_count_its_gathers_and_computed_blocks():
    """Through the service's rank loop: the job's final status carries the blocks its steps
    computed (fewer at ``fast``, every one at ``exact``) and the gathers they took part in (none
    on one rank), and the rank's status the last step's, as /v1/workers shows them."""
    from runtime.platform import get_platform
    from runtime.rank_loop import Ended, RankLoop, StepPlan, Ticket

    pipe = TinyPipeline.load(device="cpu")
    loop = RankLoop(0, pipe, lambda *a, **k: None, get_platform("cpu"))  # type: ignore[arg-type]
    ends = {}
    try:
        for quality in ("exact", "fast"):
            request = VideoRequest(prompt="waves at dusk", seed=2, width=64, height=64,
                                   num_frames=9, num_inference_steps=12,
                                   step_cache=tier_threshold("kiln-tiny", quality))
            loop.apply(StepPlan(assign={0: Ticket(job_id=quality, attempt_token="t",
                                                  request=request)}, step=True))
            while loop.current is not None:
                loop.step()
                status = loop.report().memory
                assert status["step_gathers"] == 0 and status["step_blocks_computed"] in (1, 4)
            loop.reported()  # the turn's messages are out: its files are written
            ends[quality] = next(e for e in loop.written(wait=30) if isinstance(e, Ended))
    finally:
        loop.close()
        pipe.close()
    assert ends["exact"].blocks_computed == 12 * 4 and ends["exact"].gathers == 0
    assert ends["fast"].blocks_computed < ends["exact"].blocks_computed


def test_a_caching_job_resumed_from_a_checkpoint_renders_the_uninterrupted_frames():
    """Its step cache travels in the checkpoint: resumed at any step, the job skips the steps it
    would have skipped and its frames are the uninterrupted render's, bit for bit."""
    from runtime.resume import restore, snapshot

    pipe = TinyPipeline.load(device="cpu")
    request = VideoRequest(prompt="waves at dusk", seed=2, num_inference_steps=12,
                           step_cache=tier_threshold("kiln-tiny", "fast"))
    try:
        plain = pipe.prepare(request)
        while not plain.done:
            pipe.step(plain)
        for at in (0, 5, 9):
            state = pipe.prepare(request)
            for _ in range(at):
                pipe.step(state)
            blob = snapshot(pipe, state, model_fingerprint="m")
            resumed = restore(pipe, request, blob, model_fingerprint="m")
            assert resumed.step_index == at
            while not resumed.done:
                pipe.step(resumed)
            assert torch.equal(resumed.latents, plain.latents), at
            assert resumed.extra["step_cache"].figures() == plain.extra["step_cache"].figures()
    finally:
        pipe.close()
    assert plain.extra["step_cache"].num_blocks_computed < 12 * 4
