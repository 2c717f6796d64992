"""DLO forward time over resident forward time, same model, same inputs, same threads.

Each rank holds a resident copy of a DiT-shaped model and a DLO (allgather) copy of it, and
alternates the two forwards on its own input, so any drift in machine load hits both alike.
Prints JSON per dp size: the median forward seconds of each and their ratio (target <= 1.15 on
the CPU), plus the gather and wait seconds the engine measured.

Usage: python bench/overhead.py [--dp 1,2] [--width 1536] [--tokens 4096] [--blocks 4]
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.procs import free_port  # noqa: E402


def _rank(rank: int, dp: int, port: int, args: argparse.Namespace, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from bench.dit import DiT
    from runtime.dlo import apply_dlo

    # The cores are split evenly between ranks; resident and DLO forwards use the same threads.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dp))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=dp)
    torch.manual_seed(0)
    resident = DiT(args.width, args.blocks).eval()
    streamed = copy.deepcopy(resident)
    handle = apply_dlo(streamed, device="cpu")
    x = torch.randn(1, args.tokens, 64, generator=torch.Generator().manual_seed(rank))
    times: dict[str, list[float]] = {"resident": [], "dlo": []}
    with torch.no_grad():
        assert torch.equal(resident(x), streamed(x))  # warm-up, and the outputs agree
        base = handle.stats()
        for _ in range(args.reps):
            for name, model in (("resident", resident), ("dlo", streamed)):
                dist.barrier()
                t0 = time.perf_counter()
                model(x)
                times[name].append(time.perf_counter() - t0)
    stats = handle.stats()
    handle.close()
    dist.destroy_process_group()
    res, dlo = statistics.median(times["resident"]), statistics.median(times["dlo"])
    out.put((rank, {
        "resident_s": round(res, 3),
        "dlo_s": round(dlo, 3),
        "ratio": round(dlo / res, 4),
        "gather_s_per_forward": round((stats["gather_seconds"] - base["gather_seconds"])
                                      / args.reps, 4),
        "wait_s_per_forward": round((stats["wait_seconds"] - base["wait_seconds"]) / args.reps,
                                    4),
        "threads": torch.get_num_threads(),
    }))


def run(dp: int, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, dp, port, args, out)) for r in range(dp)]
    for p in procs:
        p.start()
    ranks = dict(out.get(timeout=3600) for _ in range(dp))
    for p in procs:
        p.join()
    return {"ranks": [ranks[r] for r in range(dp)],
            "ratio": max(r["ratio"] for r in ranks.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", default="1,2")
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    report: dict[str, Any] = {"width": args.width, "tokens": args.tokens,
                              "blocks": args.blocks, "dtype": "fp32", "target_ratio<=": 1.15}
    for dp in (int(d) for d in args.dp.split(",")):
        print(f"dp={dp} ...", file=sys.stderr)
        report[f"dp{dp}"] = run(dp, args)
        report[f"dp{dp}"]["ok"] = report[f"dp{dp}"]["ratio"] <= 1.15
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
