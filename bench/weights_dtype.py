"""Host memory and bytes gathered per step of a dp=2 allgather group, per weights dtype.

Loads a diffusers-format model on two CPU ranks over gloo in allgather mode with every block
streamed (``--device-budget none``), once per weights dtype (``checkpoint``, ``bf16``, ``fp8``:
``runtime.dlo.cast``), runs one denoising step on each rank, and prints one JSON document:

- ``host_bytes``: the ranks' summed PSS after the step (the steady state: the shards are filled
  and the checkpoint's pages dropped), less the same ranks' before they load anything (a bare
  rank set: torch, the pipelines' code imported and a process group, no weights), so what the
  model costs the host. It holds the transformer's host shards, the non-block tensors (mapped
  from the checkpoint, in its dtype whatever ``weights_dtype``), the tiny text encoder and VAE,
  a job's state and what the allocator keeps of the forward's activations; and on the CPU,
  where the device is host memory, the engine's device buffers too (two slots and the compute
  buffer a cast layer is upcast into);
- ``device_buffer_bytes``: those device buffers, summed over the ranks (``DLOHandle.stats``),
  and ``host_bytes_less_device_buffers``: what the group would hold in host memory were they on
  an accelerator;
- ``bytes_gathered_per_step`` and ``bytes_copied_per_step``: what rank 0's engine counted over
  the step (``DLOHandle.bytes_moved``), and each over the ``checkpoint`` run's;
- ``host_shard_bytes``: rank 0's host shard, as the engine sized it;
- ``falls``: per cast dtype, how much less than ``checkpoint``'s the group's ``host_bytes``
  is, as a fraction of ``checkpoint``'s (the weights' share: its steady figure less the bare
  rank set's), next to the target the dtype is held to; and the same of
  ``host_bytes_less_device_buffers``.

With ``--make`` it first writes a random-weight fp32 Wan checkpoint (about 1 GB at the
defaults: 15 blocks of width 1024).

    python bench/weights_dtype.py --make --model /tmp/wan-1g
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.distributed as dist  # noqa: E402

from runtime.budget import WEIGHTS_DTYPES  # noqa: E402
from runtime.launch import RankContext, run_ranks  # noqa: E402
from runtime.models.synthetic import SyntheticSpec, checkpoint_bytes, make_checkpoint  # noqa: E402
from runtime.pipelines import registry  # noqa: E402, F401  (code a bare rank holds, not weights)
from runtime.pipelines.base import VideoRequest, agree_handles  # noqa: E402
from runtime.render import load_pipeline, memory_figures  # noqa: E402
from runtime.sequence import Layout, open_sequence  # noqa: E402

DP = 2
# How much of the weights' share a cast dtype must take off at least (``falls``).
TARGET_FALLS = {"bf16": 0.40, "fp8": 0.65}


def _loaded_rank(ctx: RankContext, model: str, weights_dtype: str) -> dict[str, int]:
    dist.barrier()
    bare = memory_figures()[1]  # torch and the process group, no model yet
    started = time.perf_counter()
    pipe = load_pipeline(model, device="cpu", use_allgather=True, device_budget=None,
                         sequence=open_sequence(Layout(dp=DP), "gloo"),
                         weights_dtype=weights_dtype)
    loaded = time.perf_counter() - started
    try:
        handle = pipe.handles[0]
        state = pipe.prepare(VideoRequest(prompt="a red circle moving left", width=64,
                                          height=64, num_frames=5, num_inference_steps=2,
                                          seed=ctx.rank))
        copied, gathered = handle.bytes_moved
        pipe.step(state, agree_handles(pipe, state))
        after = handle.bytes_moved
        # Waits for the next forward's first block, prefetched after the step: the transfer
        # thread runs in order. Else the block gloo allocates to gather it is counted or not,
        # depending on when the figure is taken.
        handle.agree_any(False)
        dist.barrier()
        stats = handle.stats()
        return {"bare": bare, "pss": memory_figures()[1], "copied": after[0] - copied,
                "gathered": after[1] - gathered, "load_seconds": loaded,
                "host_shard_bytes": stats["host_shard_bytes"],
                "device_buffer_bytes": stats["device_weight_buffer_bytes"]}
    finally:
        pipe.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="diffusers model directory")
    ap.add_argument("--make", action="store_true", help="write a random fp32 checkpoint first")
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--width", type=int, default=1024)
    args = ap.parse_args()
    if args.make:
        make_checkpoint(args.model, SyntheticSpec(family="wan", num_layers=args.layers,
                                                  width=args.width, head_dim=128))
    runs = {}
    for weights_dtype in WEIGHTS_DTYPES:
        per_rank = run_ranks(DP, _loaded_rank, args.model, weights_dtype, threads=1,
                             timeout_s=300)
        bare = sum(r["bare"] for r in per_rank)
        host = sum(r["pss"] for r in per_rank) - bare
        device = sum(r["device_buffer_bytes"] for r in per_rank)
        runs[weights_dtype] = {
            "bare_rank_set_bytes": bare,
            "host_bytes": host,
            "device_buffer_bytes": device,
            "host_bytes_less_device_buffers": host - device,
            "bytes_gathered_per_step": per_rank[0]["gathered"],
            "bytes_copied_per_step": per_rank[0]["copied"],
            "host_shard_bytes": per_rank[0]["host_shard_bytes"],
            "load_seconds": round(max(r["load_seconds"] for r in per_rank), 1),
        }
    base = runs["checkpoint"]
    for run in runs.values():
        for key in ("host_bytes", "bytes_gathered_per_step", "bytes_copied_per_step"):
            run[f"{key}_over_checkpoint"] = round(run[key] / base[key], 3)
    falls = {}
    for weights_dtype, target in TARGET_FALLS.items():
        run = runs[weights_dtype]
        falls[weights_dtype] = {"target": target}
        for key in ("host_bytes", "host_bytes_less_device_buffers"):
            fall = round(1 - run[key] / base[key], 3)
            falls[weights_dtype][key] = {"fall": fall, "meets_target": fall >= target}
    print(json.dumps({"checkpoint_bytes": checkpoint_bytes(args.model), "dp": DP,
                      "runs": runs, "falls": falls}, indent=1))


if __name__ == "__main__":
    main()
