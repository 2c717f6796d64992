"""Host memory of a ``--dp N`` render against the size of the checkpoint it streams.

Renders one prompt through :func:`runtime.render.render` (rank 0 renders, the others take part in
the gathers) and samples the summed PSS of the rank processes every 0.1 s: PSS splits every shared
page (the memory-mapped checkpoint, shared libraries) among the processes that map it, so the sum
is the physical memory the ranks hold together, counted once. Also reports each rank's peak RSS
(which counts shared pages in full in every rank) and its DLO host shard. With ``--make`` it
first writes a random-weight Wan checkpoint of the given size. Prints one JSON document.

    python bench/render_memory.py --make --layers 30 --width 1024 --model /tmp/wan-2g --dp 2
        [--text-dim 1024 --text-layers 24]   # a 0.6 GB text encoder as well
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.models.synthetic import SyntheticSpec, checkpoint_bytes, make_checkpoint  # noqa: E402
from runtime.pipelines.base import VideoRequest  # noqa: E402
from runtime.render import render  # noqa: E402


def _peak_render(model: str, dp: int, steps: int, out: str) -> tuple[int, list]:
    samples: list[int] = []
    request = VideoRequest(prompt="a red circle moving left", num_inference_steps=steps, fps=16)
    reports = render(model, [request], out, dp=dp, on_sample=samples.append)
    return max(samples, default=0), reports


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="diffusers model directory")
    ap.add_argument("--make", action="store_true", help="write a random Wan checkpoint first")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--text-dim", type=int, default=32, help="with --make: the text encoder's "
                    "width (Wan's UMT5-XXL: 4096)")
    ap.add_argument("--text-layers", type=int, default=2, help="with --make: its depth (24)")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="out/render_memory.mp4")
    args = ap.parse_args()
    if args.make:
        make_checkpoint(args.model, SyntheticSpec(family="wan", num_layers=args.layers,
                                                  width=args.width, head_dim=128,
                                                  text_dim=args.text_dim,
                                                  text_layers=args.text_layers))
    ckpt = checkpoint_bytes(args.model)
    started = time.perf_counter()
    peak_pss, reports = _peak_render(args.model, args.dp, args.steps, args.out)
    seconds = time.perf_counter() - started
    # The same render with a 2-block, width-64 model: what the ranks hold whatever the model
    # (interpreter, torch, diffusers, buffers).
    with tempfile.TemporaryDirectory() as tmp:
        small = make_checkpoint(Path(tmp) / "small", SyntheticSpec(family="wan"))
        baseline, _ = _peak_render(str(small), args.dp, args.steps, str(Path(tmp) / "s.mp4"))
    result = {
        "checkpoint_bytes": ckpt,
        "dp": args.dp,
        "peak_summed_pss_bytes": peak_pss,
        "peak_summed_pss_over_checkpoint": round(peak_pss / ckpt, 3),
        "baseline_summed_pss_bytes_tiny_model": baseline,
        "model_dependent_bytes": peak_pss - baseline,
        "model_dependent_over_checkpoint": round((peak_pss - baseline) / ckpt, 3),
        "naive_dp_copies_bytes": args.dp * ckpt,
        "seconds": round(seconds, 1),
        "ranks": [{
            "rank": r.rank,
            "peak_rss_bytes": r.peak_rss_bytes,
            "pss_end_bytes": r.pss_bytes,
            "private_end_bytes": r.private_bytes,
            "host_shard_bytes": r.dlo.get("host_shard_bytes"),
            "max_block_bytes": r.dlo.get("max_block_bytes"),
            "gather_seconds": round(r.dlo.get("gather_seconds", 0.0), 2),
            "out": r.out,
            "frames": r.num_frames,
        } for r in reports],
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
