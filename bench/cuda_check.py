"""One prepared CUDA check of the DLO engine (dp=1, NCCL world of one); a few minutes on one GPU.

Prints JSON with:
- exactness: DLO forward vs the resident forward on the GPU, fp32 and bf16, bit for bit;
- peak weight memory: ``torch.cuda.max_memory_allocated`` during a DLO forward against
  2 x max_block + resident (+ activations, measured apart with a resident-free baseline);
- the H2D bandwidth the prefetch reached (block bytes / transfer time, from CUDA events);
- the share of block compute overlapped with the next block's transfer (event timelines);
- sp2: kiln-tiny's transformer split over 2 ranks over NCCL (dp=1 x sp=2, DLO allgather across
  the two) against the same transformer unsplit on the same ranks: max abs diff and forward
  time of each, per token count; skipped (with the reason) when fewer than 2 GPUs are visible;
- gathers_per_step: the kiln-tiny pipeline at dp=1 with guidance on: blocks acquired per step
  (``handle.num_acquired``; one gather per block per step with CFG as one batch-2 forward, two
  with ``cfg_batch=False``) and the step time of each, interleaved.

kiln-tiny's transformer makes its position and timestep tables with factory calls that take no
device, so its steps and forwards run under ``with torch.device(dev)`` here.

Usage: torchrun --nproc-per-node 1 bench/cuda_check.py   (or plain python: it inits itself)
       python bench/cuda_check.py --dry-run   (no GPU: the sp2 and gathers_per_step cases on
       the CPU over gloo, small sizes, to check that they run)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.dit import DiT  # noqa: E402
from runtime.dlo import apply_dlo  # noqa: E402


def _intervals(events: list[tuple[Any, Any]], origin: Any) -> list[tuple[float, float]]:
    return [(origin.elapsed_time(a), origin.elapsed_time(b)) for a, b in events]


def _overlap(compute: list[tuple[float, float]], transfer: list[tuple[float, float]]) -> float:
    total = sum(e - s for s, e in compute)
    covered = sum(max(0.0, min(ce, te) - max(cs, ts))
                  for cs, ce in compute for ts, te in transfer)
    return covered / total if total else 0.0


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
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    transfers = [(a, b) for kind, a, b in handle._timing_events if kind == "gather"]
    stats = handle.stats()
    transfer_s = sum(a.elapsed_time(b) for a, b in transfers) / 1e3
    moved = stats["max_block_bytes"] * len(transfers)
    report = {
        "max_block_bytes": stats["max_block_bytes"],
        "resident_bytes": stats["resident_bytes"],
        "device_weight_buffer_bytes": stats["device_weight_buffer_bytes"],
        "weights_bound_bytes": 2 * stats["max_block_bytes"] + stats["resident_bytes"],
        "allocated_before_forward_bytes": base,
        "peak_allocated_bytes": peak,
        "peak_minus_weights_bound_bytes(activations)": peak - 2 * stats["max_block_bytes"]
        - stats["resident_bytes"],
        "h2d_gbps": round(moved / transfer_s / 1e9, 2) if transfer_s else None,
        "overlap_share": round(_overlap(_intervals(compute, origin),
                                        _intervals(transfers, origin)), 3),
        "wait_seconds": stats["wait_seconds"],
    }
    handle.close()
    return report


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sp_rank(ctx: Any, shapes: list[tuple[int, ...]], reps: int) -> list[dict[str, Any]]:
    """One rank of a dp=1 x sp=2 group: kiln-tiny's transformer under DLO (allgather across the
    two ranks), whole and split, on the same input on both ranks."""
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
    from runtime.launch import run_ranks

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
    from runtime.pipelines.base import VideoRequest, agree_handles
    from runtime.pipelines.tiny import TinyPipeline

    variants = (("cfg_batch", True), ("two_forwards", False))
    pipes = {name: TinyPipeline.load(device=device, cfg_batch=batch) for name, batch in variants}
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


def _init_world(backend: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))


def dry_run() -> dict[str, Any]:
    """The new cases on the CPU over gloo, small: that they run, not what a GPU measures."""
    from common.procs import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    torch.set_num_threads(1)
    _init_world("gloo")
    report = {
        "dry_run": True,
        "device": "cpu",
        # 48 tokens (kiln-tiny's default clip) and 27 (padded: 2 does not divide it).
        "sp2": sp2_check("cpu", [(1, 12, 3, 8, 8), (1, 12, 3, 6, 6)], reps=1),
        "gathers_per_step": gathers_check(torch.device("cpu"), [(64, 64, 9)], steps=2,
                                          passes=1),
    }
    dist.destroy_process_group()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="run the sp2 and gathers_per_step cases on the CPU (gloo), small")
    args = parser.parse_args()
    if args.dry_run:
        print(json.dumps(dry_run(), indent=2))
        return
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return
    _init_world("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device())
    report = {
        "device": torch.cuda.get_device_name(),
        "exact_fp32": exactness(torch.float32, 1024, 1024, 6),
        "exact_bf16": exactness(torch.bfloat16, 1024, 1024, 6),
        "profile_width3072_tokens8192_bf16": profile(3072, 8192, 12),
        # Latent shapes [1, C, F, H, W]: 48 tokens (the default clip), 27 (padded), 5120
        # (512x512x17) and 17408 (512x512x65).
        "sp2": sp2_check("cuda", [(1, 12, 3, 8, 8), (1, 12, 3, 6, 6), (1, 12, 5, 64, 64),
                                  (1, 12, 17, 64, 64)], reps=10),
        "gathers_per_step": gathers_check(device, [(64, 64, 9), (256, 256, 17), (512, 512, 33)],
                                          steps=4, passes=5),
    }
    print(json.dumps(report, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
