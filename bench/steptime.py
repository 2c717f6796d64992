"""Step time against tokens at dp=2: a resident copy per rank, PyTorch FSDP2, kiln allgather and
kiln rank-local, as ratios to resident, measured side by side.

Each of two CPU ranks (gloo, half the cores each) builds one DiT-shaped model (``bench.dit``;
by default width 1024 and 12 blocks in fp32, 0.6 GB) four ways from the same weights: a resident
copy, ``fully_shard`` per block and at the root (FSDP2, each rank a half of every block,
gathered before the block runs), ``apply_dlo`` in allgather mode (each rank a half, gathered
into two fixed slots, the next block's gather overlapping this block's compute) and in
rank-local mode (each rank streams whole blocks from its own copy through the slots). Each rank
runs its own input, as a data-parallel rank renders its own job, through the four in rotation
(A B C D A B C D ...) so that drift in the machine's load hits all alike; every forward starts
at a barrier. A figure is the median of a mode's forwards at one token count, the slowest
rank's (the ranks step together), and the best of ``--passes`` passes; a ratio is a mode's
figure over resident's from the same pass.

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
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from bench.dit import DiT  # noqa: E402
from runtime.dlo import apply_dlo  # noqa: E402
from runtime.launch import RankContext, run_ranks  # noqa: E402

MODES = ("resident", "fsdp2", "kiln-allgather", "kiln-rank-local")


def _models(width: int, blocks: int, world: int) -> tuple[dict[str, Any], list[Any]]:
    """The four forms of one model (same weights on every rank and in every form)."""
    torch.manual_seed(0)
    resident = DiT(width, blocks).eval().requires_grad_(False)
    fsdp = copy.deepcopy(resident)
    mesh = init_device_mesh("cpu", (world,))
    for block in fsdp.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    allgather, local = copy.deepcopy(resident), copy.deepcopy(resident)
    handles = [apply_dlo(allgather, device="cpu", use_allgather=True),
               apply_dlo(local, device="cpu", use_allgather=False)]
    return ({"resident": resident, "fsdp2": fsdp, "kiln-allgather": allgather,
             "kiln-rank-local": local}, handles)


def _rank(ctx: RankContext, tokens: list[int], width: int, blocks: int, reps: int,
          passes: int) -> dict[str, Any]:
    models, handles = _models(width, blocks, ctx.world)
    times: dict[tuple[int, int, str], list[float]] = {}
    with torch.no_grad():
        for n in tokens:
            x = torch.randn(1, n, 64, generator=torch.Generator().manual_seed(ctx.rank))
            expected = models["resident"](x)  # also a warm-up of the resident form
            for name in MODES[1:]:  # every form computes the same thing (and warms up)
                dist.barrier()
                got = models[name](x)
                assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4), name
            for p in range(passes):
                for _ in range(reps):
                    for name in MODES:
                        dist.barrier()
                        t0 = time.perf_counter()
                        models[name](x)
                        times.setdefault((n, p, name), []).append(time.perf_counter() - t0)
    for handle in handles:
        handle.close()
    return {f"{n}/{p}/{name}": statistics.median(v) for (n, p, name), v in times.items()}


def run(tokens: list[int], width: int, blocks: int, reps: int, passes: int) -> dict[str, Any]:
    per_rank = run_ranks(2, _rank, tokens, width, blocks, reps, passes, timeout_s=3600)
    result: dict[str, Any] = {"dp": 2, "width": width, "blocks": blocks, "dtype": "float32",
                              "model_bytes": sum(p.numel() * 4 for p in
                                                 DiT(width, 1).blocks[0].parameters()) * blocks,
                              "threads_per_rank": max(1, (os.cpu_count() or 2) // 2),
                              "reps": reps, "passes": passes, "points": []}
    for n in tokens:
        best: dict[str, float] = {}
        ratios: dict[str, float] = {}
        for p in range(passes):
            # The ranks step together: a pass's figure is its slowest rank's.
            pass_s = {name: max(r[f"{n}/{p}/{name}"] for r in per_rank) for name in MODES}
            for name in MODES:
                if name not in best or pass_s[name] < best[name]:
                    best[name] = pass_s[name]
                    ratios[name] = pass_s[name] / pass_s["resident"]
        result["points"].append({"tokens": n, "seconds": {k: round(v, 4) for k, v in best.items()},
                                 "ratio_to_resident": {k: round(v, 3) for k, v in ratios.items()}})
    result["findings"] = findings(result["points"])
    return result


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
