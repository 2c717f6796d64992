"""Train kiln-tiny's demo LoRA adapter (``runtime.models.tiny_adapter``) on the CPU, in minutes.

The shipped kiln-tiny stays frozen; only the low-rank factors learn, through the very hooks that
apply an adapter when a job runs (`runtime.adapters.use_adapters`: with gradients on, the term is
added out of place, so it trains). Each step draws fresh procedural clips
(``runtime.models.shapes``), recolours them (`swap_colours`) and takes one rectified-flow step
towards the recoloured clip's latents under the clip's own prompt (dropped 10% of the time, as
kiln-tiny was trained, so the unconditional half of guidance swaps too). ``B`` starts at zero, as
peft initialises a LoRA: step 0 is the base model exactly.

Fixed seeds and one CPU thread, as ``scripts/train_tiny.py``. At the end it renders the twelve
prompts of the adapter's test with and without the adapter and prints what each shows.

    python scripts/train_tiny_adapter.py  # runtime/models/kiln_tiny_swap_colours.safetensors
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from runtime.adapters import Adapter, LoraLayer, use_adapters
from runtime.models.shapes import describe, sample_clips
from runtime.models.tiny import KilnTiny, build_tiny, encode_video
from runtime.models.tiny_adapter import NAME, RANK, SWAP, WEIGHTS, swap_colours

NUM_THREADS = 1
#: The Linears adapted: every one of the transformer's blocks, and the output projection.
TARGETS = ("qkv", "attn_out", "cross_q", "cross_kv", "cross_out", "ffn.0", "ffn.2")


def new_adapter(model: KilnTiny, rank: int, gen: torch.Generator) -> Adapter:
    """Factors to train: ``A`` uniform in +-1/sqrt(in) (peft's kaiming init), ``B`` zero."""
    names = [f"blocks.{i}.{t}" for i in range(len(model.transformer.blocks)) for t in TARGETS]
    layers = {}
    for name in [*names, "proj_out"]:
        linear = model.transformer.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        bound = 1 / math.sqrt(linear.in_features)
        down = (torch.rand(rank, linear.in_features, generator=gen) * 2 - 1) * bound
        layers[name] = LoraLayer(down=down.requires_grad_(),
                                 up=torch.zeros(linear.out_features, rank).requires_grad_(),
                                 up_bias=None, alpha=float(rank))
    return Adapter(name=NAME, target="transformer", layers=layers, digest="training")


def save(adapter: Adapter, path: Path, meta: dict[str, object]) -> None:
    """diffusers' LoRA format: ``transformer.<module>.lora_A/B.weight`` and the config."""
    state = {}
    for name, layer in adapter.layers.items():
        state[f"transformer.{name}.lora_A.weight"] = layer.down.detach().clone().contiguous()
        state[f"transformer.{name}.lora_B.weight"] = layer.up.detach().clone().contiguous()
    config = {"transformer.r": RANK, "transformer.lora_alpha": RANK,
              "transformer.target_modules": sorted(adapter.layers)}
    save_file(state, str(path), metadata={
        "lora_adapter_metadata": json.dumps(config, sort_keys=True),
        "kiln_tiny_adapter": json.dumps(meta, sort_keys=True)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--shift", type=float, default=3.0, help="as the sampler's flow_shift")
    p.add_argument("--drop-prompt", type=float, default=0.1)
    p.add_argument("--out", type=Path, default=WEIGHTS)
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args()

    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(True)
    started = time.perf_counter()
    model = build_tiny()
    cfg = model.cfg
    gen = torch.Generator().manual_seed(args.seed)
    adapter = new_adapter(model, RANK, gen)
    params = [t for layer in adapter.layers.values() for t in (layer.down, layer.up)]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    empty_ids, empty_mask = model.tokenizer([""])
    pipe = SimpleNamespace(model=model)  # what use_adapters finds the transformer in
    window: list[float] = []
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, step / args.warmup)
        clips = sample_clips(args.batch, gen)
        x0 = encode_video(cfg, swap_colours(clips.video_BNHW3, clips.colour))
        ids, mask = model.tokenizer(clips.prompts)
        drop = torch.rand(args.batch, generator=gen) < args.drop_prompt
        ids = torch.where(drop[:, None], empty_ids, ids)
        mask = torch.where(drop[:, None], empty_mask, mask)
        u = torch.rand(args.batch, generator=gen)
        sigma = args.shift * u / (1 + (args.shift - 1) * u)
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma[:, None, None, None, None]
        with torch.no_grad():
            text = model.text_encoder(ids, mask)
        with use_adapters(pipe, [(adapter, 1.0)]):
            pred = model.transformer((1 - s) * x0 + s * noise, sigma * 1000.0, text)
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        window.append(loss.item())
        if step % args.log_every == 0 or step == args.steps:
            print(f"[{time.perf_counter() - started:6.1f} s] step {step}/{args.steps} "
                  f"flow loss {sum(window) / len(window):.4f}", flush=True)
            window = []
    save(adapter, args.out, {k: str(v) for k, v in vars(args).items()
                             if k not in ("out", "log_every")})
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB) in "
          f"{time.perf_counter() - started:.0f} s")
    check(args.out)


def check(path: Path) -> None:
    """The test's twelve prompts, rendered with and without the adapter: what each shows."""
    from runtime.adapters import load_adapter, named_transformers
    from runtime.pipelines.base import VideoRequest
    from runtime.pipelines.tiny import TinyPipeline

    pipe = TinyPipeline.load(offload=False)
    adapter = load_adapter(path, "kiln-tiny", named_transformers(pipe))
    cases = [("red", "circle", "left"), ("red", "square", "up"),
             ("green", "square", "right"), ("green", "triangle", "down"),
             ("blue", "triangle", "up"), ("blue", "circle", "right"),
             ("yellow", "circle", "down"), ("yellow", "triangle", "left"),
             ("purple", "square", "down"), ("purple", "circle", "up"),
             ("cyan", "triangle", "right"), ("cyan", "square", "left")]
    swapped = plain = 0
    for i, (colour, shape, direction) in enumerate(cases):
        request = VideoRequest(prompt=f"a {colour} {shape} moving {direction}", seed=i)
        got = []
        for adapters in ((), ((adapter, 1.0),)):
            state = pipe.prepare(replace(request, adapters=adapters))
            while not state.done:
                pipe.step(state)
            got.append(describe(pipe.decode(state)))
        plain += got[0][0] == colour
        swapped += got[1][0] == SWAP[colour]
        print(f"{request.prompt!r}: without {got[0]}, with {got[1]}")
    print(f"without: {plain} of 12 in the prompt's colour; with: {swapped} of 12 in its swap")


if __name__ == "__main__":
    main()
