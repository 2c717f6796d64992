"""Per-step time of a dp=2 kiln-tiny group with CFG as two batch-1 forwards against one batch-2.

Two CPU ranks over gloo (``runtime.launch.run_ranks``), blocks sharded across them (allgather);
each rank renders its own request with guidance on, in lock-step (``runtime.render``'s loop:
``agree_handles``, then ``step``). "before" runs the CFG pair as two batch-1 forwards
(``TinyPipeline(cfg_batch=False)``: every block gathered twice per step), "after" as one batch-2
forward (each block gathered once and computing both branches). Both pipelines are loaded on
every rank and run interleaved, before, after, before, after, ..., so drift in machine load hits
both alike. A pass's figure is the group's: the slowest rank's mean step time. Prints JSON per
size: the median and best of the passes for each and the ratio before/after of the medians.

Usage: python bench/gathers.py [--sizes 64x64x9,256x256x17] [--steps 4] [--passes 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.families import TINY  # noqa: E402

VARIANTS = (("before", False), ("after", True))  # (name, cfg_batch)


def _parse_size(text: str) -> tuple[int, int, int]:
    w, h, f = (int(v) for v in text.lower().split("x"))
    return w, h, f


def _rank(ctx: Any, sizes: list[tuple[int, int, int]], steps: int,
          passes: int) -> dict[str, dict[str, list[float]]]:
    import torch.distributed as dist

    from runtime.pipelines.base import VideoRequest, agree_handles
    from runtime.pipelines.tiny import TinyPipeline

    pipes = {name: TinyPipeline.load(device="cpu", cfg_batch=cfg_batch)
             for name, cfg_batch in VARIANTS}
    try:
        for pipe in pipes.values():
            assert pipe.handles[0].config.use_allgather
        times: dict[str, dict[str, list[float]]] = {}
        for w, h, f in sizes:
            request = VideoRequest(prompt=f"a red ball moving left {ctx.rank}", width=w,
                                   height=h, num_frames=f, num_inference_steps=steps,
                                   guidance_scale=TINY.defaults.guidance_scale, seed=ctx.rank)
            assert request.guidance_scale > 1.0
            per_variant: dict[str, list[float]] = {name: [] for name, _ in VARIANTS}
            for i in range(passes + 1):  # the first pass warms up, unrecorded
                for name, pipe in pipes.items():
                    state = pipe.prepare(request)
                    dist.barrier()
                    t0 = time.perf_counter()
                    while not state.done:
                        pipe.step(state, agree_handles(pipe, state))
                    seconds = (time.perf_counter() - t0) / steps
                    if i:
                        per_variant[name].append(seconds)
            times[f"{w}x{h}x{f}"] = per_variant
        return times
    finally:
        for pipe in pipes.values():
            pipe.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = TINY.defaults
    parser.add_argument("--sizes", default=f"{d.width}x{d.height}x{d.num_frames},256x256x17",
                        help="WxHxF, comma-separated")
    parser.add_argument("--steps", type=int, default=d.num_inference_steps)
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()

    from runtime.launch import rank_threads, run_ranks

    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    print(f"dp=2, {len(sizes)} size(s), {args.passes} passes ...", file=sys.stderr)
    ranks = run_ranks(2, _rank, sizes, args.steps, args.passes)
    report: dict[str, Any] = {"dp": 2, "mode": "allgather", "backend": "gloo",
                              "threads_per_rank": rank_threads(2), "steps": args.steps,
                              "passes": args.passes,
                              "guidance_scale": TINY.defaults.guidance_scale}
    for key in ranks[0]:
        row: dict[str, Any] = {}
        for name, _ in VARIANTS:
            # The group steps together: a pass takes as long as its slowest rank.
            group = [max(r[key][name][i] for r in ranks) for i in range(args.passes)]
            row[f"{name}_s_per_step"] = round(statistics.median(group), 4)
            row[f"{name}_best_s_per_step"] = round(min(group), 4)
        row["ratio_before_over_after"] = round(row["before_s_per_step"]
                                               / row["after_s_per_step"], 3)
        report[key] = row
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
