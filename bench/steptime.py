"""Step time against tokens on two ranks: a resident copy per rank, PyTorch FSDP2, kiln allgather,
kiln rank-local streamed and kiln rank-local mapped at dp=2, sp=2 over kiln allgather and over
the mapping, and kiln's planner choice, as ratios to resident, side by side.

Each of two CPU ranks (gloo, half the cores each) builds one DiT-shaped model (``bench.dit``;
by default width 1024 and 12 blocks in fp32, 0.6 GB) five ways from the same weights: a resident
copy, ``fully_shard`` per block and at the root (FSDP2, each rank a half of every block,
gathered before the block runs), ``apply_dlo`` in allgather mode (each rank a half, gathered
into two fixed slots, the next block's gather overlapping this block's compute), in rank-local
mode streaming (each rank copies whole blocks from its own copy through the slots: what a
rank-local rank does on an accelerator) and in rank-local mode mapped (every block bound to one
safetensors file that both ranks map: what a rank-local rank reading a checkpoint does on the
CPU, one copy in the page cache for both). At dp=2 each rank runs its own input, as a
data-parallel rank renders its own job; at sp=2 both ranks run one input split along its tokens
(``runtime.sequence.SequenceParallel``: each rank half the tokens, attention through four
all-to-alls per block), on the allgather model and on the mapped one. The seven run in rotation
(A B C D E F G A B ...) so that drift in the machine's load hits all alike; every forward starts
at a barrier. An sp=2 figure is one job's latency; per job it holds both ranks, so its cost in
rank time against a dp=2 rank's is twice its ratio.

The planner's choice: `runtime.planner.plan` fed a profile of this model measured in the same
run (one block's compute against tokens, fitted from the resident forwards at the smallest and
the largest token count; all-gather and all-to-all rates timed on the two ranks doing nothing
else) picks the layout and mode with the most jobs per hour at each token count; the figure
reported for it is the measured one of the mode it picked (rank-local on the CPU with a
checkpoint is the mapped form, as the worker runs it).

A figure is the median of a mode's forwards at one token count, the slowest rank's (the ranks
step together), and the best of ``--passes`` passes; a ratio is a mode's figure over
resident's from the same pass.

    python bench/steptime.py [--tokens 256,512,1024,2048] [--width 1024] [--blocks 12]
                             [--reps 2] [--passes 2] [--json out/steptime.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from bench.dit import DiT  # noqa: E402
from runtime.budget import EVERYTHING  # noqa: E402
from runtime.dlo import apply_dlo  # noqa: E402
from runtime.launch import RankContext, run_ranks  # noqa: E402
from runtime.planner import (  # noqa: E402
    JobShape,
    Profile,
    choose,
    link_figures,
    machine_description,
    plan,
    time_collectives,
)
from runtime.sequence import SequenceParallel  # noqa: E402

DP_MODES = ("resident", "fsdp2", "kiln-allgather", "kiln-rank-local", "kiln-mapped")
# sp=2 on the allgather model and on the mapped one: one input split over both ranks.
SP_MODES = {"sp2-allgather": "kiln-allgather", "sp2-mapped": "kiln-mapped"}
MODES = (*DP_MODES, *SP_MODES)
# The planner's (dp, sp, mode) -> the form measured for it.
PLANNED = {(2, 1, "allgather"): "kiln-allgather", (2, 1, "rank-local"): "kiln-mapped",
           (1, 2, "allgather"): "sp2-allgather", (1, 2, "rank-local"): "sp2-mapped"}


def _models(width: int, blocks: int, world: int,
            checkpoint: Path) -> tuple[dict[str, Any], list[Any]]:
    """The five forms of one model (same weights on every rank and in every form); rank 0
    writes the weights to ``checkpoint`` for the mapped form."""
    torch.manual_seed(0)
    resident = DiT(width, blocks).eval().requires_grad_(False)
    fsdp = copy.deepcopy(resident)
    mesh = init_device_mesh("cpu", (world,))
    for block in fsdp.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    allgather, local = copy.deepcopy(resident), copy.deepcopy(resident)
    mapped = copy.deepcopy(resident)
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in resident.state_dict().items()}, str(checkpoint))
    dist.barrier()
    handles = [apply_dlo(allgather, device="cpu", use_allgather=True),
               apply_dlo(local, device="cpu", use_allgather=False),
               apply_dlo(mapped, checkpoint=checkpoint, device="cpu", use_allgather=False,
                         device_budget_bytes=EVERYTHING)]
    return ({"resident": resident, "fsdp2": fsdp, "kiln-allgather": allgather,
             "kiln-rank-local": local, "kiln-mapped": mapped}, handles)


def _rank(ctx: RankContext, tokens: list[int], width: int, blocks: int, reps: int,
          passes: int, checkpoint: str) -> dict[str, Any]:
    models, handles = _models(width, blocks, ctx.world, Path(checkpoint))
    sp = SequenceParallel(dist.group.WORLD)
    sp.check_heads(models["resident"].blocks[0].num_heads)

    def forward(name: str, x: torch.Tensor) -> torch.Tensor:
        if name in SP_MODES:
            return models[SP_MODES[name]](x, sp)
        return models[name](x)

    times: dict[tuple[int, int, str], list[float]] = {}
    with torch.no_grad():
        for n in tokens:
            # dp: each rank its own input; sp: one input, the same on both ranks.
            x = torch.randn(1, n, 64, generator=torch.Generator().manual_seed(ctx.rank))
            x_sp = torch.randn(1, n, 64, generator=torch.Generator().manual_seed(1000 + n))
            expected = models["resident"](x)  # also a warm-up of the resident form
            expected_sp = models["resident"](x_sp)
            for name in MODES[1:]:  # every form computes the same thing (and warms up)
                dist.barrier()
                sp_mode = name in SP_MODES
                got = forward(name, x_sp if sp_mode else x)
                assert torch.allclose(got, expected_sp if sp_mode else expected, rtol=1e-4,
                                      atol=1e-4), name
            for p in range(passes):
                for _ in range(reps):
                    for name in MODES:
                        dist.barrier()
                        t0 = time.perf_counter()
                        forward(name, x_sp if name in SP_MODES else x)
                        times.setdefault((n, p, name), []).append(time.perf_counter() - t0)
        # The planner's link figures, timed with the ranks doing nothing else.
        probe = handles[0].stats()["max_block_bytes"]
        links = {**time_collectives(ctx, probe, 9), "probe_bytes": probe}
    for handle in handles:
        handle.close()
    return {"times": {f"{n}/{p}/{name}": statistics.median(v)
                      for (n, p, name), v in times.items()}, "links": links}


def profile_of(result: dict[str, Any], links: dict[str, float]) -> Profile:
    """A planner profile of the benchmark's model from this run: one block's compute against
    tokens fitted from the resident forwards at the smallest and largest token count (the best
    pass; embedding and head are inside, a small overestimate), the links timed alone."""
    lo, hi = result["points"][0], result["points"][-1]
    block = [p["seconds"]["resident"] / result["blocks"] for p in (lo, hi)]
    span = max(1, hi["tokens"] - lo["tokens"])
    slope = max(0.0, (block[1] - block[0]) / span)
    block_bytes = result["model_bytes"] // result["blocks"]
    return Profile(
        model="bench DiT", machine=machine_description(), checkpoint="", created_at=time.time(),
        cores=os.cpu_count() or 1, num_blocks=result["blocks"], max_block_bytes=block_bytes,
        block_bytes=result["model_bytes"], nonblock_bytes=0,
        width_tokens=(lo["tokens"], hi["tokens"]),
        block_seconds=(max(0.0, block[0] - slope * lo["tokens"]), slope),
        **link_figures(links, links["probe_bytes"], 2),
        activation_bytes_per_token=result["width"] * 4,
        prepare_seconds=0.0, decode_seconds=0.0, decode_pixels=1, framework_bytes=0,
        per_rank_bytes={}, crowded_collective_seconds=0.0)


def planner_choices(result: dict[str, Any], links: dict[str, float]) -> None:
    """Each point's ``planner``: what the planner picks for jobs per hour and for one job's
    latency, what it predicted, and the measured ratio of the form it picked."""
    profile = profile_of(result, links)
    heads = max(1, result["width"] // 128)
    for point in result["points"]:
        made = plan(profile, 2, JobShape(steps=1), tokens=point["tokens"], heads=heads)
        picked = {}
        for goal in ("throughput", "latency"):
            best, _ = choose(made, goal)
            form = PLANNED[best.dp, best.sp, best.mode]
            picked[goal] = {"layout": best.layout, "measured_as": form,
                            "ratio_to_resident": point["ratio_to_resident"][form]}
        picked["predicted_step_s"] = {
            PLANNED[p.dp, p.sp, p.mode]: round(p.step_seconds, 4) for p in made.predictions}
        point["planner"] = picked


def run(tokens: list[int], width: int, blocks: int, reps: int, passes: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kiln-steptime-") as tmp:
        ranks = run_ranks(2, _rank, tokens, width, blocks, reps, passes,
                          str(Path(tmp) / "dit.safetensors"), timeout_s=3600)
    per_rank = [r["times"] for r in ranks]
    result: dict[str, Any] = {"dp": 2, "width": width, "blocks": blocks, "dtype": "float32",
                              "model_bytes": sum(p.numel() * 4 for p in
                                                 DiT(width, 1).blocks[0].parameters()) * blocks,
                              "threads_per_rank": max(1, (os.cpu_count() or 2) // 2),
                              "reps": reps, "passes": passes, "points": []}
    for n in tokens:
        best, ratios = best_of_passes(per_rank, n, passes, MODES, "resident")
        result["points"].append({"tokens": n, "seconds": {k: round(v, 4) for k, v in best.items()},
                                 "ratio_to_resident": {k: round(v, 3) for k, v in ratios.items()}})
    result["links"] = ranks[0]["links"]
    planner_choices(result, result["links"])
    result["findings"] = findings(result["points"])
    return result


def best_of_passes(per_rank: list[dict[str, float]], tokens: int, passes: int,
                   modes: Sequence[str], base: str) -> tuple[dict[str, float], dict[str, float]]:
    """Per mode at ``tokens``, from each rank's ``"{tokens}/{pass}/{mode}"`` figures: the best
    pass's figure (a pass's figure is its slowest rank's: the ranks step together) and its ratio
    to ``base``'s in the same pass."""
    best: dict[str, float] = {}
    ratios: dict[str, float] = {}
    for p in range(passes):
        pass_s = {name: max(r[f"{tokens}/{p}/{name}"] for r in per_rank) for name in modes}
        for name in modes:
            if name not in best or pass_s[name] < best[name]:
                best[name] = pass_s[name]
                ratios[name] = pass_s[name] / pass_s[base]
    return best, ratios


def findings(points: list[dict[str, Any]]) -> list[str]:
    """Where kiln loses, to the peer or to its own other mode, and why, from the figures."""
    out = []
    for point in points:
        r, n = point["ratio_to_resident"], point["tokens"]
        if r["kiln-allgather"] > r["fsdp2"]:
            out.append(f"at {n} tokens kiln allgather ({r['kiln-allgather']:.2f}x) is slower "
                       f"than FSDP2 ({r['fsdp2']:.2f}x)")
        if r["kiln-rank-local"] > r["fsdp2"]:
            out.append(f"at {n} tokens kiln rank-local ({r['kiln-rank-local']:.2f}x) is slower "
                       f"than FSDP2 ({r['fsdp2']:.2f}x)")
        if r["kiln-allgather"] > r["kiln-rank-local"] * 1.05:
            out.append(f"at {n} tokens kiln allgather ({r['kiln-allgather']:.2f}x) costs more "
                       f"than rank-local ({r['kiln-rank-local']:.2f}x): a block's compute on "
                       f"{n} tokens is too short to hide its gather (a collective over gloo "
                       "between processes), while a rank-local block is a copy within the "
                       "process's own memory")
        if r["kiln-mapped"] > 1.05:
            out.append(f"at {n} tokens kiln mapped ({r['kiln-mapped']:.2f}x) is slower than "
                       "resident although no block moves: both ranks compute on the same "
                       "pages, and their reads meet in the shared caches")
    for point in points:
        r, n = point["ratio_to_resident"], point["tokens"]
        # Rank time per job: a dp=2 form's ratio; an sp=2 form holds both ranks for one job.
        # The forms the planner chooses between.
        cost = {m: r[m] * (2 if m in SP_MODES else 1) for m in PLANNED.values()}
        cheapest = min(cost, key=cost.__getitem__)
        predicted = point["planner"]["predicted_step_s"]
        # Per goal: what the planner's pick measured against the best measured, by that goal's
        # figure (rank time per job for jobs per hour; the ratio itself for one job's latency).
        for goal, figure in (("throughput", cost), ("latency", {m: r[m] for m in cost})):
            chosen = point["planner"][goal]["measured_as"]
            best = min(figure, key=figure.__getitem__)
            if figure[chosen] > figure[best] * 1.05:
                out.append(f"at {n} tokens the planner's pick for {goal} "
                           f"({point['planner'][goal]['layout']}, measured {figure[chosen]:.2f}x) "
                           f"is slower than {best} ({figure[best]:.2f}x): its profile "
                           f"predicted a step of {predicted[chosen]:.3f} s against "
                           f"{predicted[best]:.3f} s")
        for mode in SP_MODES:
            if cost[mode] > cost[cheapest] * 1.05:
                out.append(f"at {n} tokens {mode} finishes one job in {r[mode]:.2f}x a "
                           f"resident rank's time but holds both ranks: {cost[mode]:.2f}x the "
                           f"rank time per job, against {cost[cheapest]:.2f}x for {cheapest} "
                           "(each rank computes half the tokens, but every block adds four "
                           "all-to-alls over gloo that both ranks wait in: sp=2 buys one job's "
                           "latency, not jobs per hour)")
    if len(points) > 1:
        first, last = points[0], points[-1]
        ratio = [p["ratio_to_resident"]["kiln-allgather"] for p in (first, last)]
        if ratio[1] < ratio[0]:
            out.append(f"allgather's time over resident falls from {ratio[0]:.2f}x at "
                       f"{first['tokens']} tokens to {ratio[1]:.2f}x at {last['tokens']}: the "
                       "gathers are the same bytes whatever the tokens, the compute they hide "
                       "behind grows with them")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="256,512,1024,2048")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--json", default="out/steptime.json")
    args = ap.parse_args()
    result = run([int(t) for t in args.tokens.split(",")], args.width, args.blocks, args.reps,
                 args.passes)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
