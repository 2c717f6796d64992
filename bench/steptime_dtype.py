"""Step time against tokens on two ranks for each weights dtype of kiln allgather, as ratios to
``checkpoint`` (the blocks as the model has them: the engine before ``weights_dtype`` existed).

Each of two CPU ranks (gloo, one torch thread each) builds the DiT of ``bench.dit`` once (by
default width 1024 and 8 blocks in fp32, 0.40 GB) and puts three copies of it under
``apply_dlo`` in allgather mode, one per weights dtype (``checkpoint``, ``bf16``, ``fp8``:
``runtime.dlo.cast``): each rank keeps half of every block in that dtype, gathers the halves
into its two slots every forward and upcasts a cast block into fp32 before it runs. Each rank
runs its own input, as a dp=2 replica renders its own job. The three run in rotation (A B C A B
C ...) at every token count, every forward starting at a barrier, so drift in the machine's
load hits all alike; a figure is the median of ``--reps`` forwards, the slower rank's, and the
best of ``--passes`` passes (``bench.steptime.best_of_passes``), its ratio to ``checkpoint``'s
from the same pass. Beside the wall time, the CPU time the rank process spent in the forward
(its threads: compute, the transfer thread, gloo's), the figure other processes' load on the
machine disturbs least. Per dtype also: the bytes rank 0's engine gathered and copied per forward
(``DLOHandle.bytes_moved``), its host shard and its device buffers (``DLOHandle.stats``), and how
far its output is from ``checkpoint``'s (max abs difference over the output's max abs).

    python bench/steptime_dtype.py [--tokens 128,256,512,1024] [--width 1024] [--blocks 8]
                                   [--reps 2] [--passes 2] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.dit import DiT  # noqa: E402
from bench.steptime import best_of_passes  # noqa: E402
from runtime.budget import WEIGHTS_DTYPES  # noqa: E402
from runtime.dlo import apply_dlo  # noqa: E402
from runtime.launch import RankContext, run_ranks  # noqa: E402

BASE = "checkpoint"
STATS = ("host_shard_bytes", "device_weight_buffer_bytes", "compute_buffer_bytes",
         "stored_block_bytes", "max_stored_block_bytes")


def _rank(ctx: RankContext, tokens: list[int], width: int, blocks: int, reps: int,
          passes: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DiT(width, blocks).eval().requires_grad_(False)
    models, handles = {}, {}
    for dtype in WEIGHTS_DTYPES:
        models[dtype] = copy.deepcopy(model)
        handles[dtype] = apply_dlo(models[dtype], device="cpu", use_allgather=True,
                                   weights_dtype=dtype)
    del model
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    moved: dict[str, tuple[int, int]] = {}
    error: dict[str, float] = {}
    try:
        with torch.no_grad():
            for n in tokens:
                x = torch.randn(1, n, 64, generator=torch.Generator().manual_seed(ctx.rank))
                outputs = {}
                for dtype in WEIGHTS_DTYPES:  # a warm-up of each, its output kept
                    dist.barrier()
                    outputs[dtype] = models[dtype](x)
                scale = float(outputs[BASE].abs().max())
                for dtype in WEIGHTS_DTYPES:
                    diff = float((outputs[dtype] - outputs[BASE]).abs().max()) / scale
                    error[dtype] = max(error.get(dtype, 0.0), diff)
                for p in range(passes):
                    for _ in range(reps):
                        for dtype in WEIGHTS_DTYPES:
                            handle = handles[dtype]
                            before = handle.bytes_moved
                            dist.barrier()
                            t0, c0 = time.perf_counter(), time.process_time()
                            models[dtype](x)
                            c1, t1 = time.process_time(), time.perf_counter()
                            after = handle.bytes_moved
                            key = f"{n}/{p}/{dtype}"
                            wall.setdefault(key, []).append(t1 - t0)
                            cpu.setdefault(key, []).append(c1 - c0)
                            moved[dtype] = (after[0] - before[0], after[1] - before[1])
        stats = {dtype: {k: h.stats()[k] for k in STATS} for dtype, h in handles.items()}
    finally:
        for handle in handles.values():
            handle.close()
    return {"wall": {k: statistics.median(v) for k, v in wall.items()},
            "cpu": {k: statistics.median(v) for k, v in cpu.items()},
            "moved": moved, "stats": stats, "error": error}


def _source() -> dict[str, Any]:
    """The commit measured, and whether the engine (runtime/dlo) differed from it."""
    repo = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                              check=False)
        return done.stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"),
            "engine_modified": bool(git("status", "--porcelain", "--", "runtime/dlo"))}


def run(tokens: list[int], width: int, blocks: int, reps: int, passes: int) -> dict[str, Any]:
    ranks = run_ranks(2, _rank, tokens, width, blocks, reps, passes, threads=1,
                      timeout_s=3600)
    result: dict[str, Any] = {
        "dp": 2, "mode": "allgather", "backend": "gloo", "threads_per_rank": 1, "width": width,
        "blocks": blocks, "dtype": "float32",
        "model_bytes": sum(p.numel() * 4 for p in DiT(width, 1).blocks[0].parameters()) * blocks,
        "reps": reps, "passes": passes, "dtypes": list(WEIGHTS_DTYPES), "base": BASE,
        "per_dtype": {}, "points": []}
    for dtype in WEIGHTS_DTYPES:
        copied, gathered = ranks[0]["moved"][dtype]
        result["per_dtype"][dtype] = {
            "bytes_gathered_per_forward": gathered, "bytes_copied_per_forward": copied,
            **ranks[0]["stats"][dtype],
            "max_rel_error_vs_checkpoint": max(r["error"][dtype] for r in ranks)}
    base = result["per_dtype"][BASE]
    for figures in result["per_dtype"].values():
        figures["bytes_gathered_over_checkpoint"] = round(
            figures["bytes_gathered_per_forward"] / base["bytes_gathered_per_forward"], 3)
    for n in tokens:
        wall, wall_ratio = best_of_passes([r["wall"] for r in ranks], n, passes,
                                          WEIGHTS_DTYPES, BASE)
        cpu, cpu_ratio = best_of_passes([r["cpu"] for r in ranks], n, passes,
                                        WEIGHTS_DTYPES, BASE)
        result["points"].append({
            "tokens": n, "seconds": {k: round(v, 4) for k, v in wall.items()},
            "ratio_to_checkpoint": {k: round(v, 3) for k, v in wall_ratio.items()},
            "cpu_seconds": {k: round(v, 4) for k, v in cpu.items()},
            "cpu_ratio_to_checkpoint": {k: round(v, 3) for k, v in cpu_ratio.items()}})
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="128,256,512,1024")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the JSON document here")
    args = ap.parse_args()
    load = {"start": round(os.getloadavg()[0], 2)}
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    result = run([int(t) for t in args.tokens.split(",")], args.width, args.blocks, args.reps,
                 args.passes)
    load["end"] = round(os.getloadavg()[0], 2)
    argv = ["OUT.json" if a == str(args.json) else a for a in sys.argv[1:]]
    result.update({"date": started, "load_average": load, "source": _source(),
                   "command": " ".join(["python bench/steptime_dtype.py", *argv])})
    text = json.dumps(result, indent=1)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
