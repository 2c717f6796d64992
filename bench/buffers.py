"""Weight bytes a rank holds for its device against model depth: kiln allgather against FSDP2.

Two CPU ranks (gloo) build the DiT of ``bench.dit`` at each depth and run one forward, once
under kiln's allgather DLO (blocks streamed from a safetensors checkpoint through two slots)
and once under FSDP2 (``fully_shard`` per block and at the root, each rank loading its shard).
What a rank's allocator holds is read from glibc (``mallinfo2``: bytes in use on the heap plus
mapped chunks) before the model is built and inside every block's forward; the peak over the
forward, less the figure before, is the memory the weights made the rank hold at once
(activations at 16 tokens are a few KB). On an accelerator kiln's host shard lives in pinned
host memory, not on the device, so kiln's device figure is that peak less its shard; FSDP2
keeps its shards on the device, so its figure is the whole peak. Beside them, the engine's own
count of its device buffers (``device_weight_buffer_bytes``: the two slots).

    python bench/buffers.py [--depths 8,16,32,64] [--width 256]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from bench.dit import DiT, fsdp2_from_checkpoint  # noqa: E402
from runtime.dlo import apply_dlo  # noqa: E402
from runtime.launch import RankContext, run_ranks  # noqa: E402


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _in_use() -> int:
    """Bytes this process's malloc has handed out and not taken back."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _peak_forward(model: torch.nn.Module, blocks: Any, before: int) -> int:
    """The most bytes in use, over ``before``, inside any block's forward (its weights there)."""
    peak = 0

    def sample(*_: Any) -> None:
        nonlocal peak
        peak = max(peak, _in_use() - before)

    hooks = [block.fc2.register_forward_pre_hook(sample) for block in blocks]
    with torch.no_grad():
        model(torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(dist.get_rank())))
    for h in hooks:
        h.remove()
    return peak


def _rank(ctx: RankContext, depths: list[int], width: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    # The first depth twice: the first pass pays the one-time allocations (gloo's buffers,
    # torch's caches) and is not kept.
    for i, depth in enumerate([depths[0], *depths]):
        path = Path(tmp) / f"dit-{depth}.safetensors"
        if ctx.rank == 0:
            torch.manual_seed(0)
            save_file({k: v.contiguous() for k, v in DiT(width, depth).state_dict().items()},
                      str(path))
        dist.barrier()
        gc.collect()
        before = _in_use()
        with torch.device("meta"):
            model = DiT(width, depth).eval()
        handle = apply_dlo(model, checkpoint=path, use_allgather=True, device="cpu")
        stats = handle.stats()
        kiln_peak = _peak_forward(model, model.blocks, before)
        handle.close()
        del model, handle
        gc.collect()
        dist.barrier()

        before = _in_use()
        with torch.device("meta"):
            model = DiT(width, depth).eval()
        fsdp2_from_checkpoint(model, str(path), ctx.rank, ctx.world)
        sharded = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        fsdp_peak = _peak_forward(model, model.blocks, before)
        del model
        gc.collect()
        dist.barrier()
        if i == 0:
            continue
        out[str(depth)] = {
            "max_block_bytes": stats["max_block_bytes"],
            "kiln_device_buffer_bytes": stats["device_weight_buffer_bytes"],
            "kiln_host_shard_bytes": stats["host_shard_bytes"],
            "kiln_peak_bytes": kiln_peak,
            "kiln_device_bytes": kiln_peak - stats["host_shard_bytes"],
            "fsdp2_sharded_bytes": sharded,
            "fsdp2_peak_bytes": fsdp_peak,
        }
    return out


def run(depths: list[int], width: int) -> dict[str, Any]:
    # Every buffer of a block's size is its own mapping, so freeing it gives it back at once
    # and the in-use figure is what is live, not what the heap kept.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    with tempfile.TemporaryDirectory(prefix="kiln-buffers-") as tmp:
        per_rank = run_ranks(2, _rank, depths, width, tmp, timeout_s=1800)
    points = []
    for depth in depths:
        # The figures of the rank that held the most.
        r = max((rank[str(depth)] for rank in per_rank), key=lambda f: f["fsdp2_peak_bytes"])
        points.append({"blocks": depth, **r})
    return {"dp": 2, "width": width, "dtype": "float32", "tokens": 16, "points": points}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="8,16,32,64")
    ap.add_argument("--width", type=int, default=256)
    args = ap.parse_args()
    print(json.dumps(run([int(d) for d in args.depths.split(",")], args.width), indent=1))


if __name__ == "__main__":
    main()
