"""Step time with a LoRA adapter applied on the activation side, over without.

One process, CPU, fp32, ``--threads`` torch threads (1 by default). Two models run three ways,
interleaved within every round so drift in machine load hits each alike (``--reps`` rounds,
median of each):

- ``none``: no adapter ever used, so no hook is installed;
- ``hooks_idle``: a copy whose Linears carry `runtime.adapters`' hooks (an adapter ran on it
  before) running a job without adapters: what such a job pays, one hook call per Linear;
- ``adapter``: that copy with a rank-``--rank`` adapter on every Linear of every block, weight 1.

The models: a DiT-shaped model (`bench.dit`) of ``--width`` at ``--tokens`` (its Linears qkv,
proj, fc1, fc2), and kiln-tiny's transformer (width 128; qkv, attention out, cross-attention q,
kv and out, the MLP's two) at ``--tiny-sizes`` videos, one forward of the CFG pair (batch 2) as
a kiln-tiny step runs it. Rank 16 adds 16 * (in + out) multiply-adds per token to a Linear's
in * out: about 2 % of the DiT's Linear flops at width 1024, 20 % of kiln-tiny's at width 128.

Then two replicas (``--replica-size``): kiln-tiny at dp=2 on two CPU ranks over gloo, DLO
allgather, one thread each, every step of one long job timed on each rank and attributed to the
adapters its two replicas ran in it, three ways in turn (``--replica-reps`` rounds): ``none``,
``one`` (the same adapter A on both replicas) and ``two`` (A on one replica, another adapter B
on the other). Merged weights would need a copy of the blocks per adapter for ``two``; kiln
gathers the same blocks for both replicas and adds each replica's own low-rank term.

Prints (or writes with ``--json``) one JSON document: the microseconds an idle hook adds to one
Linear call; per model and size the median forward seconds of each mode and their ratios to
``none`` by wall time and by the CPU time the process spent (which other processes' load
disturbs least); the replicas' median step seconds per mode (the slower rank's) and their
ratios, by wall and by CPU time; and when it ran, with the machine's load average (1 minute) at
the start and at the end.

Usage: python bench/adapters.py [--width 1024] [--tokens 256,2048] [--blocks 2] [--rank 16]
       [--reps 7] [--threads 1] [--tiny-sizes 64x64x9,256x256x17]
       [--replica-size 256x256x17] [--replica-reps 7] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.dit import DiT  # noqa: E402
from runtime.adapters import Adapter, LoraLayer, use_adapters  # noqa: E402
from runtime.models.tiny import TinyConfig, build_tiny  # noqa: E402
from runtime.pipelines.base import VideoRequest  # noqa: E402


def random_adapter(model: nn.Module, rank: int, seed: int = 0) -> Adapter:
    """A rank-``rank`` LoRA (alpha = rank) on every Linear of ``model.blocks``."""
    g = torch.Generator().manual_seed(seed)
    layers = {}
    for name, linear in model.blocks.named_modules():
        if isinstance(linear, nn.Linear):
            layers[f"blocks.{name}"] = LoraLayer(
                down=torch.randn(rank, linear.in_features, generator=g) / linear.in_features,
                up=torch.randn(linear.out_features, rank, generator=g) / rank,
                up_bias=None, alpha=float(rank))
    return Adapter(name=f"bench-{seed}", target="transformer", layers=layers,
                   digest=f"bench-{seed}")


def tiny_inputs(size: str) -> tuple[tuple[torch.Tensor, ...], int]:
    """A kiln-tiny transformer's inputs for one step of a ``WxHxF`` video with CFG (batch 2:
    latents, timesteps, text), and the video's token count."""
    width, height, frames = (int(v) for v in size.split("x"))
    cfg = TinyConfig()
    f = cfg.num_latent_frames(frames)
    h, w = height // cfg.spatial_compression, width // cfg.spatial_compression
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(2, cfg.latent_channels, f, h, w, generator=g),
              torch.full((2,), 500.0),
              torch.randn(2, cfg.text_len, cfg.text_dim, generator=g))
    return inputs, f * (h // cfg.patch_size) * (w // cfg.patch_size)


def measure(plain: nn.Module, inputs: tuple[torch.Tensor, ...], rank: int,
            reps: int) -> dict[str, object]:
    """``plain``'s forward on ``inputs`` in the three modes, interleaved: median seconds of each
    and their ratios to ``none``."""
    plain = plain.eval()
    hooked = copy.deepcopy(plain)
    pipe = SimpleNamespace(pipe=SimpleNamespace(transformer=hooked))  # use_adapters reads .pipe
    adapter = random_adapter(hooked, rank)
    runs = {
        "none": lambda: plain(*inputs),
        "hooks_idle": lambda: hooked(*inputs),
        "adapter": lambda: _with(pipe, adapter, hooked, inputs),
    }
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    with torch.no_grad():
        for run in runs.values():  # warm-up; installs the hooks on the hooked copy
            run()
        assert torch.equal(plain(*inputs), hooked(*inputs))  # idle hooks change no bit
        for _ in range(reps):
            for name, run in runs.items():
                t0, c0 = time.perf_counter(), time.process_time()
                run()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    med = {name: statistics.median(t) for name, t in wall.items()}
    med_cpu = {name: statistics.median(t) for name, t in cpu.items()}
    return {
        "rank": rank, "reps": reps, "threads": torch.get_num_threads(),
        **{f"{name}_s": round(s, 4) for name, s in med.items()},
        "hooks_idle_ratio": round(med["hooks_idle"] / med["none"], 3),
        "adapter_ratio": round(med["adapter"] / med["none"], 3),
        # The same from the CPU seconds the process spent: what other processes' load on the
        # machine changes least (with one thread, nothing but the forward's own work).
        "hooks_idle_cpu_ratio": round(med_cpu["hooks_idle"] / med_cpu["none"], 3),
        "adapter_cpu_ratio": round(med_cpu["adapter"] / med_cpu["none"], 3),
    }


def lora_flops_share(model: nn.Module, rank: int) -> float:
    """The multiply-adds a rank-``rank`` adapter on every Linear of ``model.blocks`` adds, over
    those Linears' own, per token (a Linear on text tokens counted as one on video tokens)."""
    linears = [m for m in model.blocks.modules() if isinstance(m, nn.Linear)]
    return (sum(rank * (m.in_features + m.out_features) for m in linears)
            / sum(m.in_features * m.out_features for m in linears))


# What each of the two replicas runs in each mode: rank -> adapter names.
REPLICA_MODES = {"none": ((), ()), "one": (("a",), ("a",)), "two": (("a",), ("b",))}


def _replicas_rank(ctx: Any, size: str, rank: int,
                   reps: int) -> dict[str, dict[str, list[float]]]:
    """One rank of the dp=2 group: one job of ``1 + reps * 3`` steps, each step run with the
    adapters of its mode (`REPLICA_MODES`, in turn); every step's wall and CPU seconds by mode
    (the first step, a warm-up, dropped)."""
    from runtime.pipelines.base import agree_handles
    from runtime.pipelines.tiny import TinyPipeline

    pipe = TinyPipeline.load(device="cpu")
    try:
        transformer = pipe.model.transformer
        adapters = {"a": random_adapter(transformer, rank, seed=0),
                    "b": random_adapter(transformer, rank, seed=1)}
        width, height, frames = (int(v) for v in size.split("x"))
        request = VideoRequest(prompt="a red ball", width=width, height=height,
                               num_frames=frames, num_inference_steps=1 + reps * 3,
                               guidance_scale=5.0, seed=ctx.rank)
        state = pipe.prepare(request)
        order = ["one"] + list(REPLICA_MODES) * reps  # the first step warms up
        times: dict[str, dict[str, list[float]]] = {
            clock: {mode: [] for mode in REPLICA_MODES} for clock in ("wall", "cpu")}
        for i, mode in enumerate(order):
            state.request = dataclasses.replace(request, adapters=tuple(
                (adapters[n], 1.0) for n in REPLICA_MODES[mode][ctx.rank]))
            t0, c0 = time.perf_counter(), time.process_time()
            pipe.step(state, agree_handles(pipe, state))
            if i:
                times["wall"][mode].append(time.perf_counter() - t0)
                times["cpu"][mode].append(time.process_time() - c0)
        return times
    finally:
        pipe.close()


def measure_replicas(size: str, rank: int, reps: int) -> dict[str, object]:
    """kiln-tiny's step seconds at dp=2 per mode of `REPLICA_MODES`: each rank's median, and
    the slower rank's with its ratios, by wall time and by the CPU time the rank spent."""
    from runtime.launch import run_ranks

    per_rank = run_ranks(2, _replicas_rank, size, rank, reps, threads=1, timeout_s=900)
    result: dict[str, object] = {"size": size, "rank": rank, "reps": reps,
                                 "threads_per_rank": 1}
    for clock, suffix in (("wall", ""), ("cpu", "_cpu")):
        medians = [{mode: statistics.median(t) for mode, t in times[clock].items()}
                   for times in per_rank]
        slower = {mode: max(m[mode] for m in medians) for mode in REPLICA_MODES}
        result |= {
            f"rank_step{suffix}_s": [{mode: round(s, 4) for mode, s in m.items()}
                                     for m in medians],
            **{f"{mode}{suffix}_s": round(s, 4) for mode, s in slower.items()},
            f"one{suffix}_ratio": round(slower["one"] / slower["none"], 3),
            f"two{suffix}_ratio": round(slower["two"] / slower["none"], 3),
            f"two_over_one{suffix}": round(slower["two"] / slower["one"], 3),
        }
    return result


def _with(pipe: SimpleNamespace, adapter: Adapter, model: nn.Module,
          inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    with use_adapters(pipe, [(adapter, 1.0)]):
        return model(*inputs)


def hook_call_us(calls: int = 20000) -> float:
    """Microseconds an idle hook adds to one Linear call (a Linear of 16 -> 16 on one row, so
    the call itself is small): the per-Linear figure of ``hooks_idle``, which its ratio is too
    coarse to show."""
    plain = nn.Linear(16, 16)
    hooked = copy.deepcopy(plain)
    layer = LoraLayer(down=torch.zeros(1, 16), up=torch.zeros(16, 1), up_bias=None, alpha=1.0)
    adapter = Adapter(name="bench", target="transformer", layers={"": layer}, digest="bench")
    with torch.no_grad(), use_adapters(SimpleNamespace(pipe=SimpleNamespace(transformer=hooked)),
                                       [(adapter, 1.0)]):
        pass  # installs the hook
    x = torch.randn(1, 16)
    best = {}
    with torch.no_grad():
        for name, linear in (("plain", plain), ("hooked", hooked)) * 3:
            t0 = time.perf_counter()
            for _ in range(calls):
                linear(x)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    return (best["hooked"] - best["plain"]) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--tokens", default="256,2048", help="comma-separated token counts")
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's own)")
    ap.add_argument("--tiny-sizes", default="64x64x9,256x256x17",
                    help="comma-separated kiln-tiny videos, WxHxF")
    ap.add_argument("--replica-size", default="256x256x17", help="the dp=2 job's video, WxHxF")
    ap.add_argument("--replica-reps", type=int, default=7)
    ap.add_argument("--json", help="write the JSON document here instead of printing it")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load = {"start": round(os.getloadavg()[0], 2)}
    result: dict[str, object] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "load_average": load,
        "idle_hook_us_per_linear_call": round(hook_call_us(), 2)}
    torch.manual_seed(0)
    dit = DiT(args.width, args.blocks)
    result["dit"] = {"width": args.width, "blocks": args.blocks,
                     "lora_flops_share": round(lora_flops_share(dit, args.rank), 3), "points": [
        {"tokens": tokens, **measure(dit, (torch.randn(
            1, tokens, 64, generator=torch.Generator().manual_seed(1)),), args.rank, args.reps)}
        for tokens in (int(t) for t in args.tokens.split(","))]}
    tiny = build_tiny().transformer
    points = []
    for size in args.tiny_sizes.split(","):
        inputs, tokens = tiny_inputs(size)
        points.append({"size": size, "tokens": tokens, "batch": 2,
                       **measure(tiny, inputs, args.rank, args.reps)})
    result["kiln_tiny"] = {"width": TinyConfig().dim, "blocks": TinyConfig().num_layers,
                           "lora_flops_share": round(lora_flops_share(tiny, args.rank), 3),
                           "points": points}
    result["replicas"] = measure_replicas(args.replica_size, args.rank, args.replica_reps)
    load["end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)

if __name__ == "__main__":
    main()
