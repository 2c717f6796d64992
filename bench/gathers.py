"""Per-step time of a dp=2 kiln-tiny group with CFG as two batch-1 forwards against one batch-2.

Two CPU ranks over gloo (``runtime.launch.run_ranks``), blocks sharded across them (allgather);
each rank renders its own request with guidance on, in lock-step (``runtime.render``'s loop:
``agree_handles``, then ``step``). "before" runs the CFG pair as two batch-1 forwards
(``TinyPipeline(cfg_batch=False)``: every block gathered twice per step), "after" as one batch-2
forward (each block gathered once and computing both branches). Both pipelines are loaded on
every rank and run interleaved, before, after, before, after, ..., so drift in machine load hits
both alike. A pass's figure is the group's: the slowest rank's mean step time. Prints JSON per
size: the median and best of the passes for each and the ratio before/after of the medians.

With ``--tiers``: the gathers a dp=2 allgather group skips when its jobs cache steps (quality
tiers, ``common.quality``; ``runtime.step_cache``). The two replicas render bench/step_cache.py's
12 prompts two at a time at kiln-tiny's defaults and 30 steps (CFG as one batch-2 forward: 4
gathers a step), the pair at each pairing of tiers in turn (``TIER_PAIRS``: both exact, both
balanced, both fast, fast beside exact, balanced beside fast; then back), ``--reps`` times. A
block is gathered unless every rank skips it: a step whose forwards both jobs take from their
caches gathers the first block only, and one where either computes gathers all four. Per
pairing: the gathers a job took (the blocks rank 0's engine acquired, ``num_acquired``, each
one a gather; both ranks join every gather), the blocks each replica's job computed, and the
group's wall time per job (the slower rank's, from the plan to the decoded frames; median of the
reps, mean over the pairs), each against both exact.

Usage: python bench/gathers.py [--sizes 64x64x9,256x256x17] [--steps 4] [--passes 5]
       python bench/gathers.py --tiers [--steps 30] [--reps 2] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.families import TINY  # noqa: E402

VARIANTS = (("before", False), ("after", True))  # (name, cfg_batch)
# --tiers: the pairings of quality tiers the two replicas' jobs run at (rank 0's, rank 1's).
TIER_PAIRS = (("exact", "exact"), ("balanced", "balanced"), ("fast", "fast"), ("fast", "exact"),
              ("balanced", "fast"))


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


def _tiers_rank(ctx: Any, prompts: list[str], steps: int, reps: int) -> list[dict[str, Any]]:
    """Every pair of ``prompts`` at every pairing of ``TIER_PAIRS`` in turn, ``reps`` times:
    per job, this rank's gathers, blocks computed and seconds."""
    import torch.distributed as dist

    from common.quality import tier_threshold
    from runtime.pipelines.base import VideoRequest
    from runtime.pipelines.tiny import TinyPipeline
    from runtime.render import step_lockstep

    pipe = TinyPipeline.load(device="cpu")
    handle, cache = pipe.handles[0], pipe.step_caches[0]
    assert handle is not None and handle.gathers and cache is not None
    rows = []

    def job(requests: list[Any]) -> dict[str, Any]:
        gathers, computed = handle.num_acquired, cache.num_blocks_computed
        dist.barrier()
        t0 = time.perf_counter()
        state = step_lockstep(pipe, ctx.rank, requests)
        assert state is not None
        pipe.decode(state)
        return {"seconds": time.perf_counter() - t0,
                "gathers": handle.num_acquired - gathers,
                "blocks_computed": cache.num_blocks_computed - computed}

    try:
        job([VideoRequest(prompt="a warm-up", num_inference_steps=steps)] * 2)  # unrecorded
        for pair in range(len(prompts) // 2):
            for rep in range(reps):
                for tiers in TIER_PAIRS if rep % 2 == 0 else TIER_PAIRS[::-1]:
                    requests = [VideoRequest(prompt=prompts[2 * pair + r], seed=2 * pair + r,
                                             num_inference_steps=steps,
                                             step_cache=tier_threshold(TINY.name, tiers[r]))
                                for r in range(2)]
                    rows.append({"pair": pair, "rep": rep, "tiers": list(tiers),
                                 **job(requests)})
        return rows
    finally:
        pipe.close()


def tiers(steps: int, reps: int) -> dict[str, Any]:
    """``--tiers``' JSON document (see the module docstring)."""
    from bench.step_cache import PROMPTS
    from common.quality import TIERS
    from runtime.launch import run_ranks

    ranks = run_ranks(2, _tiers_rank, PROMPTS, steps, reps, threads=1)
    pairs = len(PROMPTS) // 2
    pairings = []
    for tiers in TIER_PAIRS:
        def rows(rank: int, tiers: tuple[str, str] = tiers) -> list[dict[str, Any]]:
            return [r for r in ranks[rank] if tuple(r["tiers"]) == tiers]

        mine, theirs = rows(0), rows(1)
        assert all(a["gathers"] == b["gathers"] for a, b in zip(mine, theirs, strict=True))
        first = [r for r in mine if r["rep"] == 0]  # the counts are the same every rep
        # A job's time is the group's (its slower rank's), the median of its reps.
        seconds = [statistics.median(max(a["seconds"], b["seconds"])
                                     for a, b in zip(mine, theirs, strict=True)
                                     if a["pair"] == pair) for pair in range(pairs)]
        pairings.append({
            "tiers": list(tiers),
            "gathers_per_job": statistics.mean(r["gathers"] for r in first),
            "gathers_min": min(r["gathers"] for r in first),
            "gathers_max": max(r["gathers"] for r in first),
            "blocks_computed_per_job": [statistics.mean(r["blocks_computed"] for r in rows(rank)
                                                        if r["rep"] == 0) for rank in (0, 1)],
            "wall_s": round(statistics.mean(seconds), 4)})
    exact = pairings[0]
    assert exact["tiers"] == ["exact", "exact"]
    for p in pairings:
        p["gathers_skipped_per_job"] = exact["gathers_per_job"] - p["gathers_per_job"]
        p["gathers_over_exact"] = round(p["gathers_per_job"] / exact["gathers_per_job"], 3)
        p["wall_over_exact"] = round(p["wall_s"] / exact["wall_s"], 3)
    return {"model": TINY.name, "dp": 2, "mode": "allgather", "backend": "gloo",
            "threads_per_rank": 1, "steps": steps, "reps": reps, "jobs_per_replica": pairs,
            "size": f"{TINY.defaults.width}x{TINY.defaults.height}x{TINY.defaults.num_frames}",
            "tiers": TIERS[TINY.name], "pairings": pairings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = TINY.defaults
    parser.add_argument("--sizes", default=f"{d.width}x{d.height}x{d.num_frames},256x256x17",
                        help="WxHxF, comma-separated")
    parser.add_argument("--steps", type=int,
                        help=f"default {d.num_inference_steps}; with --tiers, 30")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--tiers", action="store_true",
                        help="the gathers two replicas skip at quality tiers (30 steps unless "
                        "--steps), instead of the CFG pair's step time")
    parser.add_argument("--reps", type=int, default=2, help="--tiers: timed runs of each job")
    parser.add_argument("--json", type=Path, help="--tiers: also write the JSON document here")
    args = parser.parse_args()
    if args.tiers:
        started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        load = {"start": round(os.getloadavg()[0], 2)}
        result = tiers(args.steps or 30, args.reps)
        load["end"] = round(os.getloadavg()[0], 2)
        argv = ["OUT.json" if a == str(args.json) else a for a in sys.argv[1:]]
        result.update({"date": started, "load_average": load,
                       "command": " ".join(["python bench/gathers.py", *argv])})
        text = json.dumps(result, indent=1)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(text + "\n")
        print(text)
        return

    from runtime.launch import rank_threads, run_ranks

    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    print(f"dp=2, {len(sizes)} size(s), {args.passes} passes ...", file=sys.stderr)
    steps = args.steps or d.num_inference_steps
    ranks = run_ranks(2, _rank, sizes, steps, args.passes)
    report: dict[str, Any] = {"dp": 2, "mode": "allgather", "backend": "gloo",
                              "threads_per_rank": rank_threads(2), "steps": steps,
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
