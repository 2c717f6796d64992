"""Blocks kept and moved in bf16 or fp8 (``apply_dlo``'s ``weights_dtype``, ``runtime.dlo.cast``).

What the engine counts (``DLOHandle.bytes_moved``) is held against fp32: the bytes gathered per
step at dp=2 allgather (two CPU ranks over gloo, `tests.multirank`), the bytes copied per step
from a rank-local copy, and the host copy itself. kiln-tiny's frames over 12 prompts stay close
to fp32's; ``checkpoint`` is the engine as it was.
"""

from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dlo_models import build, make_input
from multirank import run_ranks
from safetensors.torch import save_file
from torch import nn

from runtime.dlo import apply_dlo, engine, find_block_lists
from runtime.dlo.cast import FP8, cast, fp8_scale, stored_dtype
from runtime.models.tiny import build_tiny
from runtime.pipelines.base import VideoRequest
from runtime.pipelines.tiny import TinyPipeline
from runtime.render import run_lockstep

DTYPES = ("checkpoint", "bf16", "fp8")  # kiln-tiny's checkpoint dtype is fp32
REQUESTS = [VideoRequest(prompt="a red ball", num_inference_steps=3, seed=1),
            VideoRequest(prompt="a blue cat", num_inference_steps=3, seed=2)]
PROMPTS = ["a red ball rolling left", "a blue cat on a sofa", "waves at dusk",
           "a green field in wind", "city lights at night", "a white bird flying",
           "rain on a window", "a yellow taxi turning", "smoke over a fire",
           "a purple flower opening", "snow falling on trees", "a black dog running"]


def _per_step(pipe: TinyPipeline) -> list[tuple[int, int]]:
    """(bytes copied, bytes gathered) by the handle in each step (or idle step) from now on."""
    moved: list[tuple[int, int]] = []
    handle = pipe.handles[0]
    assert handle is not None

    def recorded(fn: Any) -> Any:
        def call(*args: Any) -> None:
            copied, gathered = handle.bytes_moved
            fn(*args)
            after = handle.bytes_moved
            moved.append((after[0] - copied, after[1] - gathered))
        return call

    pipe.step = recorded(pipe.step)  # type: ignore[method-assign]
    pipe.idle_step = recorded(pipe.idle_step)  # type: ignore[method-assign]
    return moved


def _allgather_rank(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for weights_dtype in DTYPES:
        pipe = TinyPipeline.load(device="cpu", weights_dtype=weights_dtype)
        try:
            handle = pipe.handles[0]
            assert handle.config.use_allgather and handle.config.world_size == world
            moved = _per_step(pipe)
            run_lockstep(pipe, rank, REQUESTS)
            out[weights_dtype] = {"moved": moved, "host": handle.stats()["host_shard_bytes"],
                                  "stored": handle.weight_figures()["stored_block_bytes"]}
        finally:
            pipe.close()
    return out


def test_bf16_halves_and_fp8_quarters_what_dp2_allgather_gathers_per_step():
    for rank, result in enumerate(run_ranks(2, _allgather_rank)):
        fp32 = result["checkpoint"]
        gathered = {d: {g for _, g in result[d]["moved"]} for d in DTYPES}
        assert all(len(g) == 1 for g in gathered.values()), gathered  # the same every step
        per_step = {d: gathered[d].pop() for d in DTYPES}
        # What a step gathers is every block once, as stored; each rank copies its half.
        for d in DTYPES:
            assert per_step[d] == result[d]["stored"]
            assert {c for c, _ in result[d]["moved"]} == {per_step[d] // 2}
        ratios = {d: per_step[d] / per_step["checkpoint"] for d in DTYPES}
        host = {d: result[d]["host"] / fp32["host"] for d in DTYPES}
        print(f"rank {rank}: bytes gathered per step {per_step} (ratio to fp32 {ratios}); "
              f"host shard ratio {host}")
        assert ratios["bf16"] == 0.5 and host["bf16"] == 0.5
        # fp8: a quarter for the weight matrices, plus their scales and bf16 biases and norms
        # (kiln-tiny is 128 wide, so those weigh more than in a real model).
        assert 0.25 < ratios["fp8"] < 0.3 and 0.25 < host["fp8"] < 0.3


def test_rank_local_copy_holds_and_copies_the_stored_dtype():
    moved, host, device = {}, {}, {}
    for weights_dtype in DTYPES:
        pipe = TinyPipeline.load(device="cpu", weights_dtype=weights_dtype)
        try:
            handle = pipe.handles[0]
            assert not handle.config.use_allgather  # one CPU rank: rank-local
            steps = _per_step(pipe)
            pipe.generate(REQUESTS[0])
            assert {g for _, g in steps} == {0}  # nothing to gather
            (moved[weights_dtype],) = {c for c, _ in steps}
            host[weights_dtype] = handle.stats()["host_shard_bytes"]
            device[weights_dtype] = handle.weight_figures()["device_weight_buffer_bytes"]
        finally:
            pipe.close()
    ratios = {d: moved[d] / moved["checkpoint"] for d in DTYPES}
    print(f"bytes copied per step {moved} (ratio to fp32 {ratios}); rank-local copy {host}")
    assert host["checkpoint"] == 0  # fp32 streams from the model's own tensors, no copy
    # A cast block streams from the rank's own copy: every block once per step, as stored.
    assert host["bf16"] == moved["bf16"] and host["fp8"] == moved["fp8"]
    assert ratios["bf16"] == 0.5
    assert 0.25 < ratios["fp8"] < 0.3
    # Two slots as stored and one compute buffer: no more than two fp32 slots.
    print(f"device bytes for block weights {device}")
    assert device["bf16"] <= device["checkpoint"] and device["fp8"] <= device["checkpoint"]


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def test_kiln_tiny_frames_stay_close_to_fp32_and_checkpoint_is_bit_identical():
    frames: dict[str, list[np.ndarray]] = {}
    for weights_dtype in (*DTYPES, "resident"):
        pipe = (TinyPipeline.load(device="cpu", offload=False) if weights_dtype == "resident"
                else TinyPipeline.load(device="cpu", weights_dtype=weights_dtype))
        try:
            frames[weights_dtype] = [pipe.generate(VideoRequest(prompt=p, seed=i)).numpy()
                                     for i, p in enumerate(PROMPTS)]
        finally:
            pipe.close()
    for a, b in zip(frames["checkpoint"], frames["resident"], strict=True):
        np.testing.assert_array_equal(a, b)
    psnr = {d: [_psnr(a, b) for a, b in zip(frames[d], frames["checkpoint"], strict=True)]
            for d in ("bf16", "fp8")}
    print({d: f"min {min(v):.1f} dB, mean {np.mean(v):.1f} dB" for d, v in psnr.items()})
    assert min(psnr["bf16"]) >= 35
    assert min(psnr["fp8"]) >= 30


@pytest.mark.parametrize("weights_dtype", ["bf16", "fp8"])
def test_resident_and_streamed_blocks_compute_from_the_same_cast_weights(weights_dtype):
    """A resident block is upcast once at set-up, a streamed one before every forward: the
    same values either way, so the output does not depend on how many blocks stay resident."""
    x = torch.randn(1, 12, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([500.0])
    outs = []
    for resident in (0, 2, 4):
        model = build_tiny()
        text = model.text_encoder(*model.tokenizer(["a red ball"]))
        handle = apply_dlo(model.transformer, device="cpu", resident_blocks=resident,
                           weights_dtype=weights_dtype)
        try:
            with torch.no_grad():
                outs.append(model.transformer(x, t, text))
        finally:
            handle.close()
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0)


@pytest.mark.parametrize("weights_dtype", ["bf16", "fp8"])
def test_a_cast_block_is_upcast_layer_by_layer(weights_dtype):
    """The compute buffer holds the largest layer in the compute dtype, not a block: a layer's
    cast tensors are upcast just before it runs and bound only for its forward, so a read of
    them anywhere else finds a meta tensor, never another layer's values."""
    model = build_tiny()
    handle = apply_dlo(model.transformer, device="cpu", weights_dtype=weights_dtype)
    try:
        block = model.transformer.blocks[0]
        layers = [m for m in block.modules() if next(m.children(), None) is None
                  and any(p.is_floating_point() for p in m.parameters(recurse=False))]
        largest = max(sum(p.numel() * 4 for p in m.parameters(recurse=False)) for m in layers)
        block_bytes = sum(p.numel() * 4 for p in block.parameters())
        compute = handle.stats()["compute_buffer_bytes"]
        assert largest <= compute < largest + block_bytes // 4 < block_bytes
        assert handle.stored_sizes(weights_dtype)["compute_buffer_bytes"] == compute
        seen = {}

        def record(module: nn.Module, args: Any) -> None:  # runs after the engine's own
            seen[module] = module.weight.device.type
        hooks = [m.register_forward_pre_hook(record) for m in layers if hasattr(m, "weight")]
        x = torch.randn(1, 12, 3, 4, 4, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            model.transformer(x, torch.tensor([500.0]),
                              model.text_encoder(*model.tokenizer(["a red ball"])))
        for h in hooks:
            h.remove()
        assert seen and set(seen.values()) == {"cpu"}  # bound while each layer ran
        assert all(m.weight.device.type == "meta" for m in seen)  # and only then
    finally:
        handle.close()


@pytest.mark.parametrize("weights_dtype", ["bf16", "fp8"])
def test_on_the_cpu_a_large_linear_is_upcast_in_row_chunks_bit_for_bit(weights_dtype,
                                                                       monkeypatch):
    """On the CPU a cast Linear weight over ``UPCAST_CHUNK_BYTES`` is upcast a chunk of rows at
    a time (64 at the least here: every Linear of kiln-tiny's blocks, 128 to 384 rows), each
    chunk's output features computed before the next: a compute buffer of a chunk, not of the
    largest layer, and the same output as the whole weight's (every block resident, upcast
    once at set-up), bit for bit. The weight is never bound whole."""
    x = torch.randn(1, 12, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([500.0])
    outs, computes = [], []
    for chunk_bytes, resident in ((1 << 20, 4), (1 << 20, 0), (2048, 0)):
        monkeypatch.setattr(engine, "UPCAST_CHUNK_BYTES", chunk_bytes)
        model = build_tiny()
        text = model.text_encoder(*model.tokenizer(["a red ball"]))
        handle = apply_dlo(model.transformer, device="cpu", resident_blocks=resident,
                           weights_dtype=weights_dtype)
        try:
            linears = [m for m in model.transformer.blocks[0].modules()
                       if type(m) is nn.Linear and m.weight.shape[0] > 64 and chunk_bytes < 1 << 20]
            chunked = [m for m in linears if "forward" in m.__dict__]
            assert len(chunked) == (len(linears) if resident == 0 else 0)
            computes.append(handle.stats()["compute_buffer_bytes"])
            if resident == 0:  # what the planner is told a streamed cast block needs
                assert handle.stored_sizes(weights_dtype)["compute_buffer_bytes"] == computes[-1]
            with torch.no_grad():
                outs.append(model.transformer(x, t, text))
            assert all(m.weight.device.type == "meta" for m in chunked)
        finally:
            handle.close()
        assert not any("forward" in m.__dict__ for m in linears)  # taken off with the hooks
    assert computes[2] < computes[1]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0)


def test_fp8_scales_per_output_channel_and_what_stays_wider():
    w = torch.randn(6, 5) * torch.tensor([1e-3, 1.0, 10.0, 100.0, 0.5, 0.0])[:, None]
    scale = fp8_scale(w)
    q = cast(w, FP8)
    assert q.dtype == FP8 and scale.tolist()[5] == 1.0  # a channel of zeros keeps scale 1
    back = q.float() * scale[:, None]
    # Every channel keeps e4m3's relative precision (3 mantissa bits), whatever its magnitude.
    assert torch.all((back - w).abs() <= w.abs().amax(dim=1, keepdim=True) * 2**-4)
    assert stored_dtype(torch.float32, (6, 5), "fp8") == FP8
    assert stored_dtype(torch.float32, (6,), "fp8") == torch.bfloat16  # bias, norm
    assert stored_dtype(torch.float32, (1, 6, 5), "fp8") == torch.bfloat16  # one channel
    assert stored_dtype(torch.float16, (6, 5), "bf16") == torch.float16  # no smaller
    assert stored_dtype(torch.int64, (6, 5), "fp8") == torch.int64
    assert stored_dtype(torch.float32, (6, 5), "checkpoint") == torch.float32


def test_an_unknown_weights_dtype_is_a_value_error():
    model = build_tiny()
    with pytest.raises(ValueError, match="weights_dtype must be one of checkpoint, bf16, fp8"):
        apply_dlo(model.transformer, device="cpu", weights_dtype="int4")


def _cast_and_back(model: nn.Module, weights_dtype: str) -> nn.Module:
    """``model`` with each block tensor replaced by what the engine computes with: stored in
    ``weights_dtype``, then back in its own dtype (fp8: times its channels' scales in float32)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for path in find_block_lists(model):
            for t in model.get_submodule(path).state_dict(keep_vars=True).values():
                stored = stored_dtype(t.dtype, tuple(t.shape), weights_dtype)
                q = cast(t, stored)
                if stored == FP8:
                    scale = fp8_scale(t).view(-1, *([1] * (t.dim() - 1)))
                    t.copy_((q.to(torch.float32) * scale).to(t.dtype))
                else:
                    t.copy_(q.to(t.dtype))
    return model


EXACT = list(itertools.product(("uneven", "mixed_dtype"), ("bf16", "fp8"),
                               ("materialised", "checkpoint"), ("allgather", "rank-local"),
                               (0, 2)))


def _exact_rank(rank: int, world: int, checkpoints: dict[str, str]) -> dict[str, list[bool]]:
    results = {}
    for name, weights_dtype, source, mode, resident in EXACT:
        original = build(name, torch.float32)
        reference = _cast_and_back(original, weights_dtype)
        if source == "checkpoint":
            model, ckpt = build(name, torch.float32, meta=True), checkpoints[name]
        else:
            model, ckpt = copy.deepcopy(original), None
        handle = apply_dlo(model, checkpoint=ckpt, use_allgather=mode == "allgather",
                           resident_blocks=resident, weights_dtype=weights_dtype)
        dtype = next(reference.parameters()).dtype
        with torch.no_grad():
            results[f"{name}-{weights_dtype}-{source}-{mode}-{resident}"] = [
                torch.equal(reference(x), model(x))
                for x in (make_input(rank, call, dtype) for call in range(3))]
        handle.close()
    return results


def test_dp2_forward_equals_the_resident_model_with_its_blocks_cast_and_back(tmp_path: Path):
    """Bit for bit, on both ranks: allgather and rank-local, from the model's tensors or a
    checkpoint's mapping, with blocks streamed or resident, a block of two dtypes included."""
    checkpoints = {}
    for name in ("uneven", "mixed_dtype"):
        checkpoints[name] = str(tmp_path / f"{name}.safetensors")
        save_file({k: v.contiguous() for k, v in build(name, torch.float32).state_dict().items()},
                  checkpoints[name])
    for rank, results in enumerate(run_ranks(2, _exact_rank, checkpoints, timeout=300)):
        wrong = {k: v for k, v in results.items() if v != [True] * 3}
        assert not wrong, f"rank {rank}: {wrong}"


def test_kiln_render_at_dp2_in_fp8_reports_the_stored_size(tmp_path: Path):
    from typer.testing import CliRunner

    from kiln.cli import app

    result = CliRunner().invoke(app, [
        "render", "--prompt", "a red ball", "--prompt", "a blue cat", "--dp", "2", "--steps",
        "2", "--weights-dtype", "fp8", "--out", str(tmp_path / "a.mp4")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "a-1.mp4").is_file()
    assert "per rank blocks: host shard 0.4 MB in fp8, host shard 0.4 MB in fp8" in result.output
    assert "blocks kept and moved in fp8: 0.9 MB (as the checkpoint stores them: 3.4 MB)" \
        in result.output


@pytest.mark.parametrize("command", ["render", "worker", "up"])
def test_an_unknown_weights_dtype_is_refused_before_anything_starts(command: str,
                                                                   tmp_path: Path):
    from typer.testing import CliRunner

    from kiln.cli import app

    extra = ["--prompt", "a", "--out", str(tmp_path / "a.mp4")] if command == "render" else []
    result = CliRunner().invoke(app, [command, *extra, "--weights-dtype", "fp4"])
    assert result.exit_code == 2
    assert "must be checkpoint, bf16, fp8, got 'fp4'" in result.output


def _profile(**sizes: dict[str, int]) -> Any:
    from runtime.planner import Profile, checkpoint_fingerprint, machine_description

    gb = 10**9
    return Profile(
        model="kiln-tiny", machine=machine_description(),
        checkpoint=checkpoint_fingerprint("kiln-tiny"), created_at=0.0, cores=8,
        num_blocks=10, max_block_bytes=gb // 10, block_bytes=gb, nonblock_bytes=gb // 100,
        width_tokens=(100, 400), block_seconds=(0.01, 0.001), gather_seconds_per_byte=1e-9,
        gather_latency_seconds=0.0, all_to_all_seconds_per_byte=1e-9,
        all_to_all_latency_seconds=1e-4, activation_bytes_per_token=8192, prepare_seconds=0.1,
        decode_seconds=0.2, decode_pixels=64 * 64 * 9, framework_bytes=300_000_000,
        per_rank_bytes={"allgather": 100_000_000, "rank-local": 50_000_000},
        crowded_collective_seconds=0.02, stored_sizes=sizes)


def test_the_planner_sizes_host_memory_slots_and_gathers_from_the_stored_dtype():
    from runtime.planner import JobShape, plan, predict
    from runtime.sequence import Layout

    gb = 10**9
    bf16 = {"block_bytes": gb // 2, "max_block_bytes": gb // 20, "compute_buffer_bytes": gb // 10}
    p = _profile(bf16=bf16)
    job = JobShape()
    fp32, half = (predict(p, Layout(dp=2), mode, job, tokens=400, weights_dtype=d)
                  for mode, d in (("allgather", "checkpoint"), ("allgather", "bf16")))
    assert fp32.host_bytes - half.host_bytes == gb // 2  # the shards hold the blocks once
    assert half.transfer_seconds == pytest.approx(fp32.transfer_seconds / 2)
    # Two slots of the stored block and a compute buffer, against two fp32 slots.
    assert fp32.device_bytes - half.device_bytes == 2 * gb // 10 - (2 * gb // 20 + gb // 10)
    local = predict(p, Layout(dp=2), "rank-local", job, tokens=400, weights_dtype="bf16")
    shared = predict(p, Layout(dp=2), "rank-local", job, tokens=400)
    # Rank-local and cast: each rank its own copy, where fp32 shares the checkpoint's mapping.
    assert local.host_bytes - shared.host_bytes == 2 * gb // 2 - gb
    chosen = plan(p, 2, job, tokens=400, weights_dtype="bf16").best_throughput
    assert chosen.weights_dtype == "bf16"
    with pytest.raises(ValueError, match="no figures for weights dtype 'fp8'"):
        predict(p, Layout(dp=2), "allgather", job, tokens=400, weights_dtype="fp8")


def test_a_handle_sizes_its_blocks_in_every_weights_dtype():
    model = build_tiny()
    handle = apply_dlo(model.transformer, device="cpu", weights_dtype="fp8")
    try:
        figures = handle.weight_figures()
        assert handle.stored_sizes("fp8")["block_bytes"] == figures["stored_block_bytes"]
        assert handle.stored_sizes("checkpoint") == {
            "block_bytes": figures["model_bytes"] - handle.stats()["resident_bytes"],
            "max_block_bytes": handle.stats()["max_block_bytes"], "compute_buffer_bytes": 0}
        assert handle.stored_sizes("bf16")["block_bytes"] * 2 == \
            handle.stored_sizes("checkpoint")["block_bytes"]
    finally:
        handle.close()


def test_a_diffusers_model_streams_its_transformer_blocks_in_the_weights_dtype(tmp_path: Path):
    """A random-weight Wan: its transformer's blocks kept at half and about a quarter of their
    fp32 bytes, and its frames close to fp32's (the text encoder is not cast)."""
    from runtime.models.synthetic import SyntheticSpec, make_checkpoint
    from runtime.pipelines.registry import load_diffusers

    model = make_checkpoint(tmp_path / "wan", SyntheticSpec(family="wan"))
    frames, stored = {}, {}
    for weights_dtype in DTYPES:
        pipe = load_diffusers(model, device="cpu", weights_dtype=weights_dtype)
        try:
            stored[weights_dtype] = pipe.handles[0].weight_figures()["stored_block_bytes"]
            frames[weights_dtype] = pipe.generate(
                VideoRequest(prompt="a red ball", num_inference_steps=2, seed=0)).numpy()
        finally:
            pipe.close()
    psnr = {d: _psnr(frames[d], frames["checkpoint"]) for d in ("bf16", "fp8")}
    print(f"stored block bytes {stored}; PSNR against fp32 {psnr}")
    assert stored["bf16"] * 2 == stored["checkpoint"]
    assert stored["fp8"] < 0.3 * stored["checkpoint"]
    assert psnr["bf16"] >= 35 and psnr["fp8"] >= 30


def test_the_group_reports_its_weights_dtype_with_every_rank():
    from kiln.config import WorkerConfig
    from kiln.coordinator import Coordinator
    from runtime.sequence import Layout

    class Reports:
        def __init__(self) -> None:
            self.reports: list[Any] = []

        def report(self, report: Any) -> None:
            self.reports.append(report)

    io = Reports()
    coordinator = Coordinator(WorkerConfig(dp=2, weights_dtype="fp8"), Layout(dp=2), "allgather",
                              "cpu", io=io, group_id="g", lease_seconds=60)  # type: ignore[arg-type]
    coordinator.report([{"rank": 1, "stored_block_bytes": 900}, {"rank": 0}])
    assert [r["weights_dtype"] for r in io.reports[-1].ranks] == ["fp8", "fp8"]
