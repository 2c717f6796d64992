"""kiln-tiny's step cache: blocks computed per job against the frames' PSNR and SSIM to the exact
render, and a job's wall time.

Renders 12 prompts at 30 steps on one CPU rank, exactly and at each first-block cache threshold
(``VideoRequest.step_cache``, ``runtime.step_cache``), and prints one row per threshold: the
blocks a job computed (mean over the prompts), how many times fewer than exact, the PSNR of its
frames against the exact ones (float frames in [0, 1], peak 1; identical frames count as
100 dB; mean and least over the prompts), their SSIM (`ssim`: 11x11 Gaussian window, per frame
and channel; mean and least over the prompts) and a job's wall time against exact's. The
settings run in turn for each prompt (exact, then every threshold, then back; ``--reps`` times,
after one warm-up job; a job's time the median of its reps), so drift in the machine's load
hits all alike. What kiln-tiny's quality tiers' thresholds are chosen from
(``common.quality.TIERS``): ``--plot`` draws the curve, blocks fewer by against mean PSNR for
every threshold, the tiers' marked. Three minutes on 2 cores at ``--reps 3``.

    python bench/step_cache.py [--steps 30] [--reps 2] [--json OUT.json] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common.quality import TIERS  # noqa: E402

PROMPTS = ["a red ball rolling left", "a blue cat on a sofa", "waves at dusk",
           "a green field in wind", "city lights at night", "a white bird flying",
           "rain on a window", "a yellow taxi turning", "smoke over a fire",
           "a purple flower opening", "snow falling on trees", "a black dog running"]
THRESHOLDS = (0.02, 0.05, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)
FAMILY = "kiln-tiny"


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 100.0 if mse == 0 else min(100.0, 10 * math.log10(1.0 / mse))


def ssim(a: np.ndarray, b: np.ndarray, window: int = 11, sigma: float = 1.5) -> float:
    """Mean SSIM (Wang et al. 2004) of two videos ``[frames, H, W, C]`` of floats in [0, 1]:
    each frame and channel against its counterpart through a ``window`` x ``window`` Gaussian
    window of ``sigma`` (valid positions only; C1 = 0.01², C2 = 0.03²), averaged over the
    positions, the channels and the frames. Identical videos give 1."""
    x, y = (torch.from_numpy(np.ascontiguousarray(v, dtype=np.float64)).permute(0, 3, 1, 2)
            for v in (a, b))
    channels = x.shape[1]
    g = torch.exp(-((torch.arange(window, dtype=torch.float64) - (window - 1) / 2) ** 2)
                  / (2 * sigma**2))
    g = g / g.sum()
    kernel = (g[:, None] * g[None, :]).expand(channels, 1, window, window).contiguous()

    def blur(v: torch.Tensor) -> torch.Tensor:
        return F.conv2d(v, kernel, groups=channels)

    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x**2
    var_y = blur(y * y) - mu_y**2
    cov = blur(x * y) - mu_x * mu_y
    c1, c2 = 0.01**2, 0.03**2
    index = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)
             / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2)))
    return float(index.mean())


def render(pipe: Any, request: Any) -> tuple[np.ndarray, int, float]:
    """The frames, the blocks computed and the wall seconds of one job (prepare to decode)."""
    before = pipe.step_caches[0].num_blocks_computed
    t0 = time.perf_counter()
    frames = pipe.generate(request).numpy()
    seconds = time.perf_counter() - t0
    return frames, pipe.step_caches[0].num_blocks_computed - before, seconds


def measure(steps: int, thresholds: list[float], reps: int,
            prompts: list[str] = PROMPTS) -> dict[str, Any]:
    """Every prompt exactly and at each threshold, in turn, ``reps`` times; the figures per
    threshold (see the module docstring) and exact's own."""
    from runtime.pipelines.base import VideoRequest
    from runtime.pipelines.tiny import TinyPipeline

    settings: list[float | None] = [None, *thresholds]
    pipe = TinyPipeline.load(device="cpu")
    blocks: dict[float | None, list[int]] = {s: [] for s in settings}
    seconds: dict[float | None, list[float]] = {s: [] for s in settings}
    psnrs: dict[float, list[float]] = {t: [] for t in thresholds}
    ssims: dict[float, list[float]] = {t: [] for t in thresholds}
    try:
        for setting in (None, thresholds[-1]):  # a warm-up, unrecorded
            render(pipe, VideoRequest(prompt="a warm-up", num_inference_steps=steps,
                                      step_cache=setting))
        for i, prompt in enumerate(prompts):
            request = VideoRequest(prompt=prompt, seed=i, num_inference_steps=steps)
            frames: dict[float | None, np.ndarray] = {}
            times: dict[float | None, list[float]] = {s: [] for s in settings}
            for rep in range(reps):
                # In turn, every other rep the other way round: no setting always runs first.
                for setting in settings if rep % 2 == 0 else settings[::-1]:
                    got, n, s = render(pipe, dataclasses.replace(request, step_cache=setting))
                    times[setting].append(s)
                    if rep == 0:
                        frames[setting] = got
                        blocks[setting].append(n)
            for setting in settings:
                seconds[setting].append(statistics.median(times[setting]))
            for t in thresholds:
                psnrs[t].append(psnr(frames[t], frames[None]))
                ssims[t].append(ssim(frames[t], frames[None]))
    finally:
        pipe.close()
    exact_blocks = float(np.mean(blocks[None]))
    exact_s = float(np.mean(seconds[None]))
    points = []
    for t in thresholds:
        mean_blocks = float(np.mean(blocks[t]))
        mean_s = float(np.mean(seconds[t]))
        points.append({"threshold": t, "blocks": round(mean_blocks, 2),
                       "fewer_by": round(exact_blocks / mean_blocks, 3),
                       "psnr_mean": round(float(np.mean(psnrs[t])), 2),
                       "psnr_min": round(min(psnrs[t]), 2),
                       "ssim_mean": round(float(np.mean(ssims[t])), 4),
                       "ssim_min": round(min(ssims[t]), 4),
                       "wall_s": round(mean_s, 4), "wall_over_exact": round(mean_s / exact_s, 3)})
    return {"exact": {"blocks": exact_blocks, "wall_s": round(exact_s, 4)}, "points": points}


def tier_points(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The figures of the thresholds ``result`` names as its tiers' (tier -> point)."""
    by_threshold = {p["threshold"]: p for p in result["points"]}
    return {tier: by_threshold[t] for tier, t in result["tiers"].items() if t in by_threshold}


def plot(result: dict[str, Any], path: Path) -> None:
    """Blocks fewer by (x) against mean PSNR (y), a point per threshold, the least PSNR beside
    it, the tiers' thresholds marked and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    xs = [p["fewer_by"] for p in pts]
    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=110)
    ax.plot(xs, [p["psnr_mean"] for p in pts], marker="o", label="mean PSNR over the prompts")
    ax.plot(xs, [p["psnr_min"] for p in pts], marker=".", linestyle="--", color="tab:grey",
            label="least PSNR over the prompts")
    # Each threshold's label beside its point; points that fall together share one label.
    groups: list[list[dict[str, Any]]] = []
    for p in pts:
        last = groups[-1][-1] if groups else None
        if last and abs(p["fewer_by"] - last["fewer_by"]) < 0.02 and abs(
                p["psnr_mean"] - last["psnr_mean"]) < 4:
            groups[-1].append(p)
        else:
            groups.append([p])
    for group in groups:
        ax.annotate(", ".join(f"{p['threshold']:g}" for p in group),
                    (group[0]["fewer_by"], group[0]["psnr_mean"]), textcoords="offset points",
                    xytext=(5, 5), fontsize=7)
    for i, (tier, p) in enumerate(tier_points(result).items()):
        ax.scatter([p["fewer_by"]], [p["psnr_mean"]], s=160, facecolors="none",
                   edgecolors="tab:red", linewidths=2, zorder=3,
                   label="a quality tier's threshold (common.quality)" if i == 0 else None)
        ax.annotate(f"{tier} ({p['threshold']:g}): {p['fewer_by']:.2f}x fewer blocks,\n"
                    f"PSNR {p['psnr_mean']:.1f} dB, SSIM {p['ssim_mean']:.3f}",
                    (p["fewer_by"], p["psnr_mean"]), textcoords="offset points",
                    xytext=(25, 30), fontsize=8, color="tab:red",
                    bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "tab:red"},
                    arrowprops={"arrowstyle": "->", "color": "tab:red"})
    ax.set_xlabel("blocks a job computes: fewer than exact by (x)")
    ax.set_ylabel("PSNR against exact, dB")
    ax.set_title(f"{result['model']} step cache: {result['prompts']} prompts, "
                 f"{result['steps']} steps, a point per threshold")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS),
                        help="the tiers' thresholds are added when missing")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS),
                        help=f"the first N of the {len(PROMPTS)} prompts")
    parser.add_argument("--reps", type=int, default=2, help="timed renders of each job")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's own)")
    parser.add_argument("--json", type=Path, help="also write the JSON document here")
    parser.add_argument("--plot", type=Path, help="draw the curve into this PNG")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tiers = TIERS[FAMILY]
    thresholds = sorted(set(args.thresholds) | set(tiers.values()))
    load = {"start": round(os.getloadavg()[0], 2)}
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    measured = measure(args.steps, thresholds, args.reps, PROMPTS[: args.prompts])
    load["end"] = round(os.getloadavg()[0], 2)
    argv = [{str(args.json): "OUT.json", str(args.plot): "OUT.png"}.get(a, a)
            for a in sys.argv[1:]]
    result: dict[str, Any] = {
        "model": FAMILY, "prompts": args.prompts, "steps": args.steps, "size": "64x64x9",
        "reps": args.reps, "threads": args.threads or torch.get_num_threads(),
        "tiers": tiers, **measured, "date": started, "load_average": load,
        "command": " ".join(["python bench/step_cache.py", *argv])}
    exact = result["exact"]
    print(f"{FAMILY}, {args.prompts} prompts, {args.steps} steps; exact computes "
          f"{exact['blocks']:.0f} blocks a job in {exact['wall_s']:.3f} s")
    print("| threshold | blocks a job | fewer than exact | mean PSNR (dB) | least PSNR (dB) | "
          "mean SSIM | least SSIM | wall / exact |")
    print("|---|---|---|---|---|---|---|---|")
    for p in result["points"]:
        print(f"| {p['threshold']:g} | {p['blocks']:.1f} | {p['fewer_by']:.2f}x | "
              f"{p['psnr_mean']:.1f} | {p['psnr_min']:.1f} | {p['ssim_mean']:.4f} | "
              f"{p['ssim_min']:.4f} | {p['wall_over_exact']:.3f} |")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot is not None:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
