"""Transient peak memory of kiln-tiny's decode against the number of frames, tiled and untiled.

Each configuration runs in a fresh process. There the latents are prepared, the peak-RSS counter
is reset (``/proc/self/clear_refs``), the decode runs, and the transient is the new peak minus
the memory held before and minus the output frames themselves. "untiled" gives the planner
unlimited free memory (one tile); "tiled" simulates a device with ``--free-mib`` free, so the tile
comes from half of that. Prints one JSON document.

    python bench/tiling.py [--size 256x256] [--frames 9 33 65 129] [--free-mib 128]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure_one(width: int, height: int, num_frames: int, free_bytes: int | None) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from runtime.pipelines.base import VideoRequest
    from runtime.pipelines.tiny import TinyPipeline

    torch.set_num_threads(1)
    pipe = TinyPipeline.load(offload=False)
    pipe.decode_free_bytes = free_bytes
    # The latents are the initial noise: decode memory does not depend on their values.
    state = pipe.prepare(VideoRequest(prompt="a red circle moving left", width=width,
                                      height=height, num_frames=num_frames,
                                      num_inference_steps=1))
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    frames = pipe.decode(state)
    peak = _status("VmHWM")
    plan = pipe.last_decode_plan
    output_bytes = (plan.num_items * pipe.cfg.temporal_compression * height * width * 3
                    * frames.element_size())  # the whole output buffer, first sub-frames too
    return {
        "frames": num_frames,
        "latent_frames": plan.num_items,
        "tile": plan.tile,
        "num_tiles": plan.num_tiles,
        "budget_bytes": plan.budget_bytes,
        "bytes_per_item_estimate": plan.bytes_per_item,
        "output_bytes": output_bytes,
        "peak_delta_bytes": peak - before,
        "transient_bytes": max(0, peak - before - output_bytes),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="256x256")
    ap.add_argument("--frames", type=int, nargs="+", default=[9, 33, 65, 129])
    ap.add_argument("--free-mib", type=int, default=128, help="simulated free memory, tiled")
    ap.add_argument("--one", nargs=4, metavar=("W", "H", "FRAMES", "FREE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        w, h, n, free = (int(v) for v in args.one)
        print(json.dumps(measure_one(w, h, n, free if free > 0 else 1 << 50)))
        return
    w, h = (int(v) for v in args.size.lower().split("x"))
    results: dict[str, list[dict]] = {"untiled": [], "tiled": []}
    for mode, free in (("untiled", 0), ("tiled", args.free_mib * 2**20)):
        for n in args.frames:
            proc = subprocess.run([sys.executable, __file__, "--one", str(w), str(h), str(n),
                                   str(free)], check=True, capture_output=True, text=True)
            results[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(json.dumps({"stage": "kiln-tiny decode", "size": f"{w}x{h}",
                      "simulated_free_bytes_tiled": args.free_mib * 2**20, **results}, indent=1))


if __name__ == "__main__":
    main()
