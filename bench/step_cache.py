"""kiln-tiny's step cache: blocks computed per job against the frames' PSNR to the exact render.

Renders 12 prompts at 30 steps on one CPU rank, exactly and at each first-block cache threshold
(``VideoRequest.step_cache``, ``runtime.step_cache``), and prints one row per threshold: the
blocks a job computed (mean over the prompts), how many times fewer than exact, and the PSNR of
its frames against the exact ones (float frames in [0, 1], peak 1; identical frames count as
100 dB; mean and least over the prompts). What kiln-tiny's quality tiers' thresholds are chosen
from (``common.quality.TIERS``). About a minute.

    python bench/step_cache.py
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from runtime.pipelines.base import VideoRequest  # noqa: E402
from runtime.pipelines.tiny import TinyPipeline  # noqa: E402

PROMPTS = ["a red ball rolling left", "a blue cat on a sofa", "waves at dusk",
           "a green field in wind", "city lights at night", "a white bird flying",
           "rain on a window", "a yellow taxi turning", "smoke over a fire",
           "a purple flower opening", "snow falling on trees", "a black dog running"]
THRESHOLDS = (0.05, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 100.0 if mse == 0 else min(100.0, 10 * math.log10(1.0 / mse))


def render(pipe: TinyPipeline, request: VideoRequest) -> tuple[np.ndarray, int]:
    """The frames and the blocks computed."""
    before = pipe.step_caches[0].num_blocks_computed  # type: ignore[union-attr]
    frames = pipe.generate(request).numpy()
    return frames, pipe.step_caches[0].num_blocks_computed - before  # type: ignore[union-attr]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS))
    args = parser.parse_args()
    pipe = TinyPipeline.load(device="cpu")
    try:
        requests = [VideoRequest(prompt=p, seed=i, num_inference_steps=args.steps)
                    for i, p in enumerate(PROMPTS)]
        exact = [render(pipe, r) for r in requests]
        exact_blocks = float(np.mean([n for _, n in exact]))
        print(f"kiln-tiny, {len(PROMPTS)} prompts, {args.steps} steps; exact computes "
              f"{exact_blocks:.0f} blocks a job")
        print("| threshold | blocks a job | fewer than exact | mean PSNR (dB) | least PSNR (dB) |")
        print("|---|---|---|---|---|")
        for threshold in args.thresholds:
            runs = [render(pipe, dataclasses.replace(r, step_cache=threshold))
                    for r in requests]
            blocks = float(np.mean([n for _, n in runs]))
            scores = [psnr(f, e) for (f, _), (e, _) in zip(runs, exact, strict=True)]
            print(f"| {threshold:g} | {blocks:.1f} | {exact_blocks / blocks:.2f}x | "
                  f"{np.mean(scores):.1f} | {min(scores):.1f} |")
    finally:
        pipe.close()


if __name__ == "__main__":
    main()
