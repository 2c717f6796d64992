"""Forward time of a DiT with a LoRA adapter applied on the activation side, over without.

A DiT-shaped model (`bench.dit`) of ``--width`` runs three ways, interleaved within every round
so drift in machine load hits each alike (``--reps`` rounds, median of each):

- ``none``: no adapter ever used, so no hook is installed;
- ``hooks_idle``: a copy whose Linears carry `runtime.adapters`' hooks (an adapter ran on it
  before) running a job without adapters: what such a job pays, one hook call per Linear;
- ``adapter``: that copy with a rank-``--rank`` adapter on every Linear of every block (qkv,
  proj, fc1, fc2), weight 1.

Prints JSON: the microseconds an idle hook adds to one Linear call, then per token count the
median forward seconds of each mode and their ratios to ``none``, by wall time and by the CPU
time the process spent (which other processes' load disturbs least). CPU, fp32, ``--threads``
torch threads (1 by default).

Usage: python bench/adapters.py [--width 1024] [--tokens 256,2048] [--blocks 2] [--rank 16]
       [--reps 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.dit import DiT  # noqa: E402
from runtime.adapters import Adapter, LoraLayer, use_adapters  # noqa: E402


def random_adapter(model: nn.Module, rank: int) -> Adapter:
    """A rank-``rank`` LoRA (alpha = rank) on every Linear of ``model.blocks``."""
    g = torch.Generator().manual_seed(0)
    layers = {}
    for name, linear in model.blocks.named_modules():
        if isinstance(linear, nn.Linear):
            layers[f"blocks.{name}"] = LoraLayer(
                down=torch.randn(rank, linear.in_features, generator=g) / linear.in_features,
                up=torch.randn(linear.out_features, rank, generator=g) / rank,
                up_bias=None, alpha=float(rank))
    return Adapter(name="bench", target="transformer", layers=layers, digest="bench")


def measure(width: int, blocks: int, tokens: int, rank: int, reps: int) -> dict[str, object]:
    torch.manual_seed(0)
    plain = DiT(width, blocks).eval()
    hooked = copy.deepcopy(plain)
    pipe = SimpleNamespace(pipe=SimpleNamespace(transformer=hooked))  # use_adapters reads .pipe
    adapter = random_adapter(hooked, rank)
    x = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(1))
    runs = {
        "none": lambda: plain(x),
        "hooks_idle": lambda: hooked(x),
        "adapter": lambda: _with(pipe, adapter, hooked, x),
    }
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    with torch.no_grad():
        for run in runs.values():  # warm-up; installs the hooks on the hooked copy
            run()
        assert torch.equal(plain(x), hooked(x))  # idle hooks change no bit
        for _ in range(reps):
            for name, run in runs.items():
                t0, c0 = time.perf_counter(), time.process_time()
                run()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    med = {name: statistics.median(t) for name, t in wall.items()}
    med_cpu = {name: statistics.median(t) for name, t in cpu.items()}
    return {
        "tokens": tokens, "width": width, "blocks": blocks, "rank": rank, "reps": reps,
        "threads": torch.get_num_threads(),
        **{f"{name}_s": round(s, 4) for name, s in med.items()},
        "hooks_idle_ratio": round(med["hooks_idle"] / med["none"], 3),
        "adapter_ratio": round(med["adapter"] / med["none"], 3),
        # The same from the CPU seconds the process spent: what other processes' load on the
        # machine changes least (with one thread, nothing but the forward's own work).
        "hooks_idle_cpu_ratio": round(med_cpu["hooks_idle"] / med_cpu["none"], 3),
        "adapter_cpu_ratio": round(med_cpu["adapter"] / med_cpu["none"], 3),
    }


def _with(pipe: SimpleNamespace, adapter: Adapter, model: nn.Module,
          x: torch.Tensor) -> torch.Tensor:
    with use_adapters(pipe, [(adapter, 1.0)]):
        return model(x)


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
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps({"idle_hook_us_per_linear_call": round(hook_call_us(), 2)}), flush=True)
    for tokens in (int(t) for t in args.tokens.split(",")):
        print(json.dumps(measure(args.width, args.blocks, tokens, args.rank, args.reps)),
              flush=True)


if __name__ == "__main__":
    main()
