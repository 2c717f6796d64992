"""Host memory of a ``--dp N`` render against the size of the checkpoint it streams.

Renders one prompt per rank through :func:`runtime.render.render` and samples the summed PSS of
the rank processes every 0.1 s: PSS splits every shared page (the memory-mapped checkpoint,
shared libraries) among the processes that map it, so the sum is the physical memory the ranks
hold together, counted once. Also reports each rank's peak RSS (which counts shared pages in full
in every rank) and its DLO host shard, and the same render on a 2-block model of the family
(what the ranks hold whatever the model: interpreter, torch, diffusers). kiln runs in allgather
mode (each rank keeps its shard) and rank-local mode (on the CPU every block is bound to the
checkpoint's mapping, which the ranks share). With ``--naive`` it also renders the same prompts
with diffusers' own pipeline in N processes (what a user runs without kiln), sampled the same way,
twice: as loaded (diffusers with accelerate computes on the memory-mapped safetensors, so on a
CPU host the processes share the page cache) and with every weight copied into the process's own
memory first, the N private copies that each GPU of a naive data-parallel group holds. With
``--make`` it first writes a random-weight checkpoint of the family and size. Prints one JSON
document.

    python bench/render_memory.py --make --layers 30 --width 1024 --model /tmp/wan-2g --dp 2
        [--text-dim 1024 --text-layers 24]   # a 0.6 GB text encoder as well
    python bench/render_memory.py --make --family cosmos3 --layers 12 --width 1024 \
        --model /tmp/cosmos3-1g --dp 2 --naive
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.families import checkpoint_family  # noqa: E402
from runtime.launch import RankContext, run_ranks  # noqa: E402
from runtime.models.synthetic import (  # noqa: E402
    FAMILIES,
    SyntheticSpec,
    checkpoint_bytes,
    make_checkpoint,
)
from runtime.pipelines.base import VideoRequest  # noqa: E402
from runtime.pipelines.reference import open_reference, run_reference  # noqa: E402
from runtime.render import render  # noqa: E402

PROMPTS = ["a red circle moving left", "a blue cat flying over the sea", "a green tree",
           "a yellow boat at sunset"]


def _requests(model: str, dp: int, steps: int) -> list[VideoRequest]:
    """One small request per rank, at the family's fewest frames (MiniMax-H3: 124, 5 s)."""
    family = checkpoint_family(model)
    frames = max(9, family.min_frames)
    size = family.size_multiple * (2 if family.size_multiple < 32 else 1)
    return [VideoRequest(prompt=PROMPTS[i % len(PROMPTS)], width=2 * size, height=size,
                         num_frames=frames, num_inference_steps=steps, seed=i, fps=16)
            for i in range(dp)]


def _peak_render(model: str, dp: int, steps: int, out: str,
                 use_allgather: bool = True) -> tuple[int, list]:
    samples: list[int] = []
    reports = render(model, _requests(model, dp, steps), out, dp=dp, on_sample=samples.append,
                     use_allgather=use_allgather)
    return max(samples, default=0), reports


def _naive_rank(ctx: RankContext, model: str, requests: list[VideoRequest],
                private: bool) -> int:
    """One rank of the naive baseline: diffusers' pipeline loaded whole, its own request;
    ``private``: its weights copied out of the file mapping into this process's memory."""
    pipe = open_reference(model)
    if private:
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                for t in [*component.parameters(), *component.buffers()]:
                    t.data = t.data.clone()
    frames = run_reference(pipe, checkpoint_family(model).name, requests[ctx.rank])
    return len(frames)


def _peak_naive(model: str, dp: int, steps: int, private: bool) -> int:
    samples: list[int] = []
    run_ranks(dp, _naive_rank, model, _requests(model, dp, steps), private,
              on_sample=samples.append)
    return max(samples, default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="diffusers model directory")
    ap.add_argument("--make", action="store_true", help="write a random checkpoint first")
    ap.add_argument("--family", default="wan", choices=FAMILIES, help="with --make")
    ap.add_argument("--naive", action="store_true",
                    help="also measure diffusers' own pipeline, a whole copy per rank")
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
        make_checkpoint(args.model, SyntheticSpec(family=args.family, num_layers=args.layers,
                                                  width=args.width, head_dim=128,
                                                  text_dim=args.text_dim,
                                                  text_layers=args.text_layers))
    ckpt = checkpoint_bytes(args.model)
    started = time.perf_counter()
    peak_pss, reports = _peak_render(args.model, args.dp, args.steps, args.out)
    seconds = time.perf_counter() - started
    local_pss, _ = _peak_render(args.model, args.dp, args.steps, args.out, use_allgather=False)
    # The same render with a 2-block, width-64 model: what the ranks hold whatever the model
    # (interpreter, torch, diffusers, buffers).
    with tempfile.TemporaryDirectory() as tmp:
        family = checkpoint_family(args.model).name
        small = make_checkpoint(Path(tmp) / "small", SyntheticSpec(family=family))
        baseline, _ = _peak_render(str(small), args.dp, args.steps, str(Path(tmp) / "s.mp4"))
    naive = _peak_naive(args.model, args.dp, args.steps, private=False) if args.naive else None
    private = _peak_naive(args.model, args.dp, args.steps, private=True) if args.naive else None
    result = {
        "checkpoint_bytes": ckpt,
        "dp": args.dp,
        "peak_summed_pss_bytes": peak_pss,  # kiln, allgather
        "peak_summed_pss_over_checkpoint": round(peak_pss / ckpt, 3),
        "baseline_summed_pss_bytes_tiny_model": baseline,
        "model_dependent_bytes": peak_pss - baseline,
        "model_dependent_over_checkpoint": round((peak_pss - baseline) / ckpt, 3),
        # kiln, rank-local: on the CPU every block bound to the shared mapping.
        "rank_local_peak_summed_pss_bytes": local_pss,
        "rank_local_model_dependent_bytes": local_pss - baseline,
        "naive_dp_copies_bytes": args.dp * ckpt,
        # Measured, when asked: diffusers' own pipeline in every rank, as loaded (sharing the
        # mapped files' page cache) and with its weights copied into each process.
        "naive_peak_summed_pss_bytes": naive,
        "private_copies_peak_summed_pss_bytes": private,
        "naive_over_kiln": round(naive / peak_pss, 2) if naive else None,
        "private_copies_over_kiln_rank_local": round(private / local_pss, 2) if private else None,
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
