"""One prepared CUDA check of the DLO engine (dp=1, NCCL world of one); a few minutes on one GPU.

Prints JSON with:
- exactness: DLO forward vs the resident forward on the GPU, fp32 and bf16, bit for bit;
- peak weight memory: ``torch.cuda.max_memory_allocated`` during a DLO forward against
  2 x max_block + resident (+ activations, measured apart with a resident-free baseline);
- the H2D bandwidth the prefetch reached (block bytes / transfer time, from CUDA events);
- the share of block compute overlapped with the next block's transfer (event timelines).

Usage: torchrun --nproc-per-node 1 bench/cuda_check.py   (or plain python: it inits itself)
"""

from __future__ import annotations

import copy
import json
import os
import sys
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


def main() -> None:
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    report = {
        "device": torch.cuda.get_device_name(),
        "exact_fp32": exactness(torch.float32, 1024, 1024, 6),
        "exact_bf16": exactness(torch.bfloat16, 1024, 1024, 6),
        "profile_width3072_tokens8192_bf16": profile(3072, 8192, 12),
    }
    print(json.dumps(report, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
