"""One prepared CUDA check of the DLO engine (dp=1, NCCL world of one); a few minutes on one GPU.

Prints JSON (and writes it with ``--json PATH``) with the device (``device_name``, ``torch``,
``cuda``), the run's ``wall_seconds`` and:
- link: the host-device link's own rate, a plain ``copy_`` of a pinned 256 MiB host buffer into
  a device buffer and back, best and median of 5, in GB/s;
- exactness: DLO forward vs the resident forward on the GPU, fp32 and bf16, bit for bit;
- peak weight memory: ``torch.cuda.max_memory_allocated`` during a DLO forward against
  2 x max_block + resident (+ activations, measured apart with a resident-free baseline);
- the H2D bandwidth the prefetch reached (block bytes / transfer time, from CUDA events): over a
  prefetch's whole interval (``h2d_gbps``: it opens before the wait for a free slot, while the
  slot's previous block computes) and over its copy alone (``h2d_gbps_copy``: from the later of
  the interval's start and the end of that block's compute);
- the share of block compute overlapped with the next block's transfer (event timelines), the
  share of the copies hidden behind block compute, and the compute stream's stall for blocks;
- steptime: the DiT of ``bench/dit.py`` (default width 2048, 16 blocks, bf16: 1.6 GB) resident
  on the device against under DLO (allgather at world 1: every block copied per forward from
  pinned host memory through the two slots), per token count, interleaved, median of reps;
- sp2: kiln-tiny's transformer split over 2 ranks over NCCL (dp=1 x sp=2, DLO allgather across
  the two) against the same transformer unsplit on the same ranks: max abs diff and forward
  time of each, per token count; skipped (with the reason) when fewer than 2 GPUs are visible;
- gathers_per_step: the kiln-tiny pipeline at dp=1 with guidance on: blocks acquired per step
  (``handle.num_acquired``; one gather per block per step with CFG as one batch-2 forward, two
  with ``cfg_batch=False``) and the step time of each, interleaved;
- weights_dtypes: the DiT (default width 2048, 16 blocks, fp32: 3.2 GB) under DLO once per
  weights dtype (``checkpoint``, ``bf16``, ``fp8``: ``runtime.dlo.cast``): the bytes each
  copies and gathers per forward (``DLOHandle.bytes_moved``), its device buffers and host copy,
  its output against checkpoint's, and forward time per token count, the three in turn (ABC),
  median of reps, as ratios to checkpoint's;
- quality_tiers: kiln-tiny's pipeline at each quality tier (``common.quality``), 12 prompts at
  30 steps, each prompt exact and at every caching tier in turn: blocks computed per job, the
  frames' PSNR and SSIM against exact's (``bench/step_cache.py``'s) and wall time per job.

kiln-tiny's transformer makes its position and timestep tables with factory calls that take no
device, so its steps and forwards run under ``with torch.device(dev)`` here.

Usage: torchrun --nproc-per-node 1 bench/cuda_check.py   (or plain python: it inits itself)
           [--width 2048] [--blocks 16] [--tokens 1024,4096,16384,32768] [--reps 10]
           [--json PATH]
       python bench/cuda_check.py --dry-run   (no GPU: the steptime, sp2, gathers_per_step,
       weights_dtypes and quality_tiers cases on the CPU over gloo, small sizes, to check that
       they run, in under a minute; link and profile are reported as skipped)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.dit import DiT, block_bytes  # noqa: E402
from runtime.budget import WEIGHTS_DTYPES  # noqa: E402
from runtime.dlo import apply_dlo  # noqa: E402

PROFILE = {"width": 3072, "tokens": 8192, "blocks": 12}
PROFILE_KEY = "profile_width{width}_tokens{tokens}_bf16".format(**PROFILE)


def _intervals(events: list[tuple[Any, Any]], origin: Any) -> list[tuple[float, float]]:
    return [(origin.elapsed_time(a), origin.elapsed_time(b)) for a, b in events]


def _overlap(compute: list[tuple[float, float]], transfer: list[tuple[float, float]]) -> float:
    total = sum(e - s for s, e in compute)
    covered = sum(max(0.0, min(ce, te) - max(cs, ts))
                  for cs, ce in compute for ts, te in transfer)
    return covered / total if total else 0.0


def link(num_bytes: int = 256 * 2**20, reps: int = 5) -> dict[str, Any]:
    """The host-device link's own rate: ``copy_`` of a pinned host buffer into a device buffer
    (h2d) and back (d2h), one warm-up then ``reps`` each, timed with CUDA events."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    report: dict[str, Any] = {"bytes": num_bytes, "reps": reps, "host": "pinned"}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        seconds = []
        for i in range(reps + 1):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            if i:
                seconds.append(start.elapsed_time(end) / 1e3)
        report[f"{name}_gbps"] = round(num_bytes / min(seconds) / 1e9, 2)
        report[f"{name}_gbps_median"] = round(num_bytes / statistics.median(seconds) / 1e9, 2)
    del host, dev
    torch.cuda.empty_cache()
    return report


def exactness(dtype: torch.dtype, width: int, tokens: int, blocks: int) -> bool:
    torch.manual_seed(0)
    resident = DiT(width, blocks, dtype).cuda().eval()
    streamed = copy.deepcopy(resident).cpu()
    handle = apply_dlo(streamed, device="cuda")
    x = torch.randn(1, tokens, 64, device="cuda", dtype=dtype)
    with torch.no_grad():
        same = all(torch.equal(resident(x), streamed(x)) for _ in range(2))
    handle.close()
    del resident
    torch.cuda.empty_cache()
    return same


def profile(width: int, tokens: int, blocks: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DiT(width, blocks, torch.bfloat16).eval()
    handle = apply_dlo(model, device="cuda")
    x = torch.randn(1, tokens, 64, device="cuda", dtype=torch.bfloat16)
    compute: list[tuple[Any, Any]] = []
    starts: dict[int, Any] = {}

    def pre(i: int) -> Any:
        def hook(m: Any, a: Any) -> None:
            starts[i] = torch.cuda.Event(enable_timing=True)
            starts[i].record()
        return hook

    def post(i: int) -> Any:
        def hook(m: Any, a: Any, o: Any) -> None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            compute.append((starts[i], end))
        return hook

    # Registered after DLO's hooks: they time the block's compute only, not its wait.
    for i, blk in enumerate(model.blocks):
        blk.register_forward_pre_hook(pre(i))
        blk.register_forward_hook(post(i))
    with torch.no_grad():
        model(x)  # warm-up
        torch.cuda.synchronize()
        handle.stats()  # drains the warm-up's timing events
        compute.clear()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        origin = torch.cuda.Event(enable_timing=True)
        origin.record()
        model(x)
        done = torch.cuda.Event(enable_timing=True)
        done.record()
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    transfers = [(a, b) for kind, a, b in handle._timing_events if kind == "gather"]
    stalls = [(a, b) for kind, a, b in handle._timing_events if kind == "wait"]
    stats = handle.stats()
    transfer_s = sum(a.elapsed_time(b) for a, b in transfers) / 1e3
    moved = stats["max_block_bytes"] * len(transfers)
    # The last `blocks` prefetches are blocks 1 .. blocks-1 of this forward and block 0 of the
    # next (block 0 of this one came with the warm-up). Block k's slot last held block k-2: its
    # prefetch's interval opens before the wait for that block's compute, its copy after it.
    comp = _intervals(compute, origin)
    copies = [(max(s, comp[k - 2][1]) if k >= 2 else s, e)
              for k, (s, e) in enumerate(_intervals(transfers, origin)[-blocks:], start=1)]
    copy_s = sum(e - s for s, e in copies) / 1e3
    report = {
        "width": width,
        "tokens": tokens,
        "blocks": blocks,
        "dtype": "bf16",
        "max_block_bytes": stats["max_block_bytes"],
        "resident_bytes": stats["resident_bytes"],
        "device_weight_buffer_bytes": stats["device_weight_buffer_bytes"],
        "weights_bound_bytes": 2 * stats["max_block_bytes"] + stats["resident_bytes"],
        "allocated_before_forward_bytes": base,
        "peak_allocated_bytes": peak,
        "peak_minus_weights_bound_bytes(activations)": peak - 2 * stats["max_block_bytes"]
        - stats["resident_bytes"],
        "h2d_gbps": round(moved / transfer_s / 1e9, 2) if transfer_s else None,
        "h2d_gbps_copy": (round(stats["max_block_bytes"] * len(copies) / copy_s / 1e9, 2)
                          if copy_s else None),
        "overlap_share": round(_overlap(comp, _intervals(transfers, origin)), 3),
        "transfer_hidden_share": round(_overlap(copies, comp), 3),
        "stall_seconds": round(sum(a.elapsed_time(b) for a, b in stalls) / 1e3, 6),
        "forward_seconds": round(origin.elapsed_time(done) / 1e3, 6),
        "wait_seconds": stats["wait_seconds"],
    }
    handle.close()
    return report


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def steptime(device: torch.device, width: int, blocks: int, tokens: list[int], reps: int,
             dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Forward time of the DiT resident on ``device`` against the same weights under DLO
    (allgather at world 1: every block copied per forward from pinned host memory through the
    two slots), per token count: a warm-up of each (their outputs compared bit for bit), then
    ``reps`` forwards of each in turn (ABAB), each between two synchronizes; a figure is the
    median, the ratio DLO's over resident's. Block 0's copy for the next DLO forward runs during
    the resident forward between them. ``dlo_stall_s``: the compute stream's wait for blocks per
    DLO forward."""
    torch.manual_seed(0)
    resident = DiT(width, blocks, dtype).eval().requires_grad_(False)
    streamed = copy.deepcopy(resident)
    resident.to(device)
    handle = apply_dlo(streamed, device=device, use_allgather=True)
    stats = handle.stats()
    report: dict[str, Any] = {
        "dp": 1, "width": width, "blocks": blocks, "dtype": str(dtype).removeprefix("torch."),
        "model_bytes": sum(p.numel() * p.element_size() for p in resident.parameters()),
        "block_bytes": block_bytes(width, dtype), "mode": stats["mode"],
        "streamed_bytes_per_forward": stats["max_block_bytes"] * stats["num_blocks"],
        "reps": reps, "points": []}
    try:
        with torch.no_grad():
            for n in tokens:
                g = torch.Generator().manual_seed(n)
                x = torch.randn(1, n, 64, generator=g).to(device, dtype)
                same = bool(torch.equal(resident(x), streamed(x)))
                times: dict[str, list[float]] = {"resident": [], "dlo": []}
                waited = handle.stats()["wait_seconds"]
                for _ in range(reps):
                    for name, model in (("resident", resident), ("dlo", streamed)):
                        _sync(device)
                        t0 = time.perf_counter()
                        model(x)
                        _sync(device)
                        times[name].append(time.perf_counter() - t0)
                res, dlo = (statistics.median(times[k]) for k in ("resident", "dlo"))
                report["points"].append({
                    "tokens": n, "resident_s": round(res, 6), "dlo_s": round(dlo, 6),
                    "dlo_over_resident": round(dlo / res, 3),
                    "dlo_stall_s": round((handle.stats()["wait_seconds"] - waited) / reps, 6),
                    "bit_equal": same})
    finally:
        handle.close()
    del resident
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return report


def _sp_rank(ctx: Any, shapes: list[tuple[int, ...]], reps: int) -> list[dict[str, Any]]:
    """One rank of a dp=1 x sp=2 group: kiln-tiny's transformer under DLO (allgather across the
    two ranks), whole and split, on the same input on both ranks."""
    # kiln-tiny and the sequence layer: only the sp=2 case needs them.
    from runtime.launch import BACKENDS, device_for
    from runtime.models.tiny import build_tiny
    from runtime.sequence import Layout, open_sequence

    device = device_for(ctx.device)
    sequence = open_sequence(Layout(dp=1, sp=2), BACKENDS[ctx.device])  # before DLO's group
    model = build_tiny().transformer
    handle = apply_dlo(model, device=device)
    results = []
    try:
        for shape in shapes:
            g = torch.Generator().manual_seed(1)
            x = torch.randn(shape, generator=g).to(device)
            text = torch.randn(1, 32, model.cfg.text_dim, generator=g).to(device)
            t = torch.tensor([500.0], device=device)
            times: dict[str, list[float]] = {"whole": [], "split": []}
            with torch.no_grad(), torch.device(device):
                model.sequence_parallel = None
                whole = model(x, t, text)  # also the warm-up of both
                model.sequence_parallel = sequence
                split = model(x, t, text)
                for _ in range(reps):
                    for name, sp in (("whole", None), ("split", sequence)):
                        model.sequence_parallel = sp
                        _sync(device)
                        dist.barrier()
                        t0 = time.perf_counter()
                        model(x, t, text)
                        _sync(device)
                        times[name].append(time.perf_counter() - t0)
            model.sequence_parallel = None
            results.append({"max_abs_diff": float((split - whole).abs().max()),
                            "bit_equal": bool(torch.equal(split, whole)),
                            "whole_s": statistics.median(times["whole"]),
                            "split_s": statistics.median(times["split"])})
    finally:
        handle.close()
    return results


def sp2_check(device: str, shapes: list[tuple[int, ...]], reps: int) -> dict[str, Any]:
    """kiln-tiny's transformer at dp=1 x sp=2 against unsplit, on 2 spawned ranks (NCCL on two
    GPUs; gloo on the CPU for the dry run)."""
    if device == "cuda" and torch.cuda.device_count() < 2:
        return {"skipped": True,
                "reason": f"sp=2 over NCCL needs 2 GPUs, {torch.cuda.device_count()} visible"}
    from runtime.launch import run_ranks  # spawns the ranks; only the sp=2 case needs it

    per_rank = run_ranks(2, _sp_rank, shapes, reps, device=device, timeout_s=600)
    report: dict[str, Any] = {"skipped": False, "backend": "nccl" if device == "cuda" else "gloo",
                              "mode": "allgather", "dtype": "fp32"}
    for i, shape in enumerate(shapes):
        tokens = shape[2] * (shape[3] // 2) * (shape[4] // 2)
        rows = [r[i] for r in per_rank]
        whole = max(r["whole_s"] for r in rows)  # the group's: its slowest rank
        split = max(r["split_s"] for r in rows)
        report[f"tokens{tokens}"] = {
            "latent_shape": list(shape),
            "max_abs_diff": max(r["max_abs_diff"] for r in rows),
            "bit_equal": all(r["bit_equal"] for r in rows),
            "whole_forward_s": round(whole, 5),
            "split_forward_s": round(split, 5),
            "whole_over_split": round(whole / split, 3),
        }
    return report


def gathers_check(device: torch.device, sizes: list[tuple[int, int, int]], steps: int,
                  passes: int) -> dict[str, Any]:
    """kiln-tiny's pipeline at dp=1, guidance on: blocks acquired per step and step time, CFG as
    one batch-2 forward against two batch-1 forwards, interleaved (the first pass warms up)."""
    # kiln-tiny's pipeline: only the guidance case needs it.
    from runtime.pipelines.base import VideoRequest, agree_handles
    from runtime.pipelines.tiny import TinyPipeline

    variants = (("cfg_batch", True), ("two_forwards", False))
    # Every block streamed (no device budget): on a large GPU the automatic budget would keep
    # kiln-tiny's few blocks resident, and there would be no gather to count.
    pipes = {name: TinyPipeline.load(device=device, cfg_batch=batch, device_budget=None)
             for name, batch in variants}
    report: dict[str, Any] = {"steps": steps, "passes": passes}
    try:
        for w, h, f in sizes:
            request = VideoRequest(prompt="a red circle moving left", width=w, height=h,
                                   num_frames=f, num_inference_steps=steps, seed=0)
            assert request.guidance_scale > 1.0
            per_step: dict[str, list[float]] = {name: [] for name, _ in variants}
            acquired: dict[str, set[int]] = {name: set() for name, _ in variants}
            latents: dict[str, torch.Tensor] = {}
            for i in range(passes + 1):
                for name, pipe in pipes.items():
                    handle = pipe.handles[0]
                    state = pipe.prepare(request)  # outside the device context: CPU noise
                    _sync(device)
                    t0 = time.perf_counter()
                    with torch.device(device):
                        while not state.done:
                            before = handle.num_acquired
                            pipe.step(state, agree_handles(pipe, state))
                            acquired[name].add(handle.num_acquired - before)
                    _sync(device)
                    if i:
                        per_step[name].append((time.perf_counter() - t0) / steps)
                    latents[name] = state.latents
            row: dict[str, Any] = {}
            for name, batch in variants:
                handle = pipes[name].handles[0]
                expected = handle.num_blocks * (1 if batch else 2)
                row[name] = {
                    "num_blocks": handle.num_blocks,
                    "acquired_per_step": sorted(acquired[name]),
                    "as_expected": acquired[name] == {expected},
                    "s_per_step": round(statistics.median(per_step[name]), 5),
                    "best_s_per_step": round(min(per_step[name]), 5),
                }
            row["two_forwards_over_cfg_batch"] = round(row["two_forwards"]["s_per_step"]
                                                       / row["cfg_batch"]["s_per_step"], 3)
            row["latents_max_abs_diff"] = float((latents["cfg_batch"]
                                                 - latents["two_forwards"]).abs().max())
            report[f"{w}x{h}x{f}"] = row
    finally:
        for pipe in pipes.values():
            pipe.close()
    return report


def weights_dtypes(device: torch.device, width: int, blocks: int, tokens: list[int], reps: int,
                   dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The DiT under DLO (allgather, every block streamed) once per weights dtype, the same
    weights in each: per dtype the bytes copied and gathered per forward, the device buffers,
    the host copy and the output's largest difference from checkpoint's over its largest value;
    per token count a warm-up of each, then ``reps`` forwards of each in turn (ABC), each between
    two synchronizes; a figure is the median, its ratio checkpoint's."""
    torch.manual_seed(0)
    base = DiT(width, blocks, dtype).eval().requires_grad_(False)
    models: dict[str, torch.nn.Module] = {}
    handles = {}
    for name in WEIGHTS_DTYPES:
        models[name] = copy.deepcopy(base)
        handles[name] = apply_dlo(models[name], device=device, use_allgather=True,
                                  weights_dtype=name)
    del base
    report: dict[str, Any] = {
        "width": width, "blocks": blocks, "dtype": str(dtype).removeprefix("torch."),
        "model_bytes": block_bytes(width, dtype) * blocks, "reps": reps,
        "dtypes": list(WEIGHTS_DTYPES), "per_dtype": {}, "points": []}
    errors = dict.fromkeys(WEIGHTS_DTYPES, 0.0)
    moved: dict[str, tuple[int, int]] = {}
    try:
        with torch.no_grad():
            for n in tokens:
                x = torch.randn(1, n, 64, generator=torch.Generator().manual_seed(n)).to(
                    device, dtype)
                outputs = {name: model(x) for name, model in models.items()}  # warm-ups
                scale = float(outputs["checkpoint"].abs().max())
                for name, out in outputs.items():
                    diff = float((out - outputs["checkpoint"]).abs().max()) / scale
                    errors[name] = max(errors[name], diff)
                del outputs
                times: dict[str, list[float]] = {name: [] for name in WEIGHTS_DTYPES}
                for _ in range(reps):
                    for name, model in models.items():
                        before = handles[name].bytes_moved
                        _sync(device)
                        t0 = time.perf_counter()
                        model(x)
                        _sync(device)
                        times[name].append(time.perf_counter() - t0)
                        after = handles[name].bytes_moved
                        moved[name] = (after[0] - before[0], after[1] - before[1])
                median = {name: statistics.median(v) for name, v in times.items()}
                report["points"].append({
                    "tokens": n, "seconds": {k: round(v, 6) for k, v in median.items()},
                    "ratio_to_checkpoint": {k: round(v / median["checkpoint"], 3)
                                            for k, v in median.items()}})
        for name, handle in handles.items():
            stats = handle.stats()
            report["per_dtype"][name] = {
                "bytes_copied_per_forward": moved[name][0],
                "bytes_gathered_per_forward": moved[name][1],
                **{k: stats[k] for k in ("stored_block_bytes", "host_shard_bytes",
                                         "device_weight_buffer_bytes", "compute_buffer_bytes")},
                "max_rel_error_vs_checkpoint": errors[name]}
    finally:
        for handle in handles.values():
            handle.close()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return report


def quality_tiers(device: torch.device, prompts: int, steps: int) -> dict[str, Any]:
    """kiln-tiny's pipeline on ``device``, bench/step_cache.py's first ``prompts`` prompts, each
    exact and at every caching tier (``common.quality``) in turn after one warm-up job: blocks
    computed per job (mean over the prompts), the frames' PSNR and SSIM against exact's (mean and
    least over the prompts) and a job's wall time (mean), each against exact's."""
    from bench.step_cache import PROMPTS, psnr, ssim
    from common.quality import QUALITIES, TIERS, tier_threshold
    from runtime.pipelines.base import VideoRequest, agree_handles
    from runtime.pipelines.tiny import TinyPipeline

    family = "kiln-tiny"
    pipe = TinyPipeline.load(device=device)
    cache = pipe.step_caches[0]
    assert cache is not None

    def job(request: VideoRequest) -> tuple[Any, int, float]:
        before = cache.num_blocks_computed
        state = pipe.prepare(request)  # outside the device context, as gathers_check
        _sync(device)
        t0 = time.perf_counter()
        with torch.device(device):
            while not state.done:
                pipe.step(state, agree_handles(pipe, state))
            frames = pipe.decode(state)
        _sync(device)
        seconds = time.perf_counter() - t0
        return frames.float().cpu().numpy(), cache.num_blocks_computed - before, seconds

    figures: dict[str, dict[str, list[float]]] = {
        q: {"blocks": [], "seconds": [], "psnr": [], "ssim": []} for q in QUALITIES}
    try:
        job(VideoRequest(prompt="a warm-up", num_inference_steps=steps))
        for i, prompt in enumerate(PROMPTS[:prompts]):
            frames = {}
            for quality in QUALITIES:
                frames[quality], blocks, seconds = job(VideoRequest(
                    prompt=prompt, seed=i, num_inference_steps=steps,
                    step_cache=tier_threshold(family, quality)))
                figures[quality]["blocks"].append(blocks)
                figures[quality]["seconds"].append(seconds)
                figures[quality]["psnr"].append(psnr(frames[quality], frames["exact"]))
                figures[quality]["ssim"].append(ssim(frames[quality], frames["exact"]))
    finally:
        pipe.close()
    exact = figures["exact"]
    report: dict[str, Any] = {"model": family, "prompts": prompts, "steps": steps,
                              "thresholds": TIERS[family], "tiers": {}}
    for quality, f in figures.items():
        report["tiers"][quality] = {
            "blocks": statistics.mean(f["blocks"]),
            "fewer_by": round(statistics.mean(exact["blocks"]) / statistics.mean(f["blocks"]),
                              3),
            "psnr_mean": round(statistics.mean(f["psnr"]), 2), "psnr_min": round(min(f["psnr"]), 2),
            "ssim_mean": round(statistics.mean(f["ssim"]), 4), "ssim_min": round(min(f["ssim"]), 4),
            "wall_s": round(statistics.mean(f["seconds"]), 5),
            "wall_over_exact": round(statistics.mean(f["seconds"])
                                     / statistics.mean(exact["seconds"]), 3)}
    return report


def _init_world(backend: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))


def dry_run() -> dict[str, Any]:
    """The new cases on the CPU over gloo, small: that they run, not what a GPU measures."""
    from common.procs import free_port  # only the dry run picks its own port

    os.environ["MASTER_PORT"] = str(free_port())
    torch.set_num_threads(1)
    _init_world("gloo")
    no_gpu = "needs a CUDA device (pinned host memory, CUDA events, the device allocator)"
    report = {
        "dry_run": True,
        "device": "cpu",
        "device_name": "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "link": {"skipped": True, "reason": no_gpu},
        PROFILE_KEY: {"skipped": True, "reason": no_gpu},
        "steptime": steptime(torch.device("cpu"), 128, 2, [16, 32, 64, 128], reps=2),
        # 48 tokens (kiln-tiny's default clip) and 27 (padded: 2 does not divide it).
        "sp2": sp2_check("cpu", [(1, 12, 3, 8, 8), (1, 12, 3, 6, 6)], reps=1),
        "gathers_per_step": gathers_check(torch.device("cpu"), [(64, 64, 9)], steps=2,
                                          passes=1),
        "weights_dtypes": weights_dtypes(torch.device("cpu"), 128, 2, [16, 64], reps=2),
        "quality_tiers": quality_tiers(torch.device("cpu"), prompts=2, steps=12),
    }
    dist.destroy_process_group()
    return report


def main() -> None:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="run the steptime, sp2, gathers_per_step, weights_dtypes and "
                        "quality_tiers cases on the CPU (gloo), small; the steptime options do "
                        "not apply")
    parser.add_argument("--width", type=int, default=2048,
                        help="steptime and weights_dtypes: the DiT's width")
    parser.add_argument("--blocks", type=int, default=16,
                        help="steptime and weights_dtypes: the DiT's blocks")
    parser.add_argument("--tokens", default="1024,4096,16384,32768",
                        help="steptime: token counts, comma-separated")
    parser.add_argument("--reps", type=int, default=10, help="steptime: forwards per mode")
    parser.add_argument("--json", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if args.dry_run:
        report = dry_run()
    elif not torch.cuda.is_available():
        report = {"error": "no CUDA device"}
    else:
        report = gpu_run(args.width, args.blocks, [int(t) for t in args.tokens.split(",")],
                         args.reps)
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


def _section(name: str, measure: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """One section's figures; a section that fails is reported as skipped with its error (and
    its traceback on stderr), so that the others' figures are still written."""
    print(f"cuda check: {name} ...", file=sys.stderr, flush=True)
    try:
        return measure(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON, the run goes on
        traceback.print_exc()
        return {"skipped": True, "reason": f"failed: {type(exc).__name__}: {exc}"[:400]}


def gpu_run(width: int, blocks: int, tokens: list[int], reps: int) -> dict[str, Any]:
    _init_world("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device())
    report = {
        "device": torch.cuda.get_device_name(),
        "device_name": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "link": _section("link", link),
        "exact_fp32": _section("exact_fp32", exactness, torch.float32, 1024, 1024, 6),
        "exact_bf16": _section("exact_bf16", exactness, torch.bfloat16, 1024, 1024, 6),
        PROFILE_KEY: _section("profile", profile, **PROFILE),
        "steptime": _section("steptime", steptime, device, width, blocks, tokens, reps),
        # Latent shapes [1, C, F, H, W]: 48 tokens (the default clip), 27 (padded), 5120
        # (512x512x17) and 17408 (512x512x65).
        "sp2": _section("sp2", sp2_check, "cuda", [(1, 12, 3, 8, 8), (1, 12, 3, 6, 6),
                                                   (1, 12, 5, 64, 64), (1, 12, 17, 64, 64)],
                        reps=10),
        "gathers_per_step": _section("gathers_per_step", gathers_check, device,
                                     [(64, 64, 9), (256, 256, 17), (512, 512, 33)], steps=4,
                                     passes=5),
        # fp32, so that bf16 halves the blocks and fp8 quarters them.
        "weights_dtypes": _section("weights_dtypes", weights_dtypes, device, width, blocks,
                                   [1024, 4096, 16384], reps, dtype=torch.float32),
        "quality_tiers": _section("quality_tiers", quality_tiers, device, prompts=12, steps=30),
    }
    dist.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
