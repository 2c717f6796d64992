"""Train kiln-tiny's weights on procedural shape clips (``runtime.models.shapes``), on the CPU.

kiln-tiny's latents are fixed, not learned (``runtime.models.tiny.encode_video``: the mean
colours of 8 x 8 blocks), so two things learn side by side, one step of each per training step,
on the same freshly drawn clips:

- the transformer and the text encoder: rectified flow (velocity target ``noise - latents``),
  noise levels drawn as often as the sampler's shifted schedule visits them, the prompt dropped
  10% of the time so classifier-free guidance has an unconditional model to push away from;
- the decoder: from slightly noisy latents back to the frames (so the transformer's imperfect
  samples still decode to clean shapes), shape pixels weighted up (they are few).

A share of the clips (``--cond-fraction``) is conditioned on its own first frame
(``runtime.models.tiny.first_frame_condition``, the way Wan's image-to-video models take one), so
the model learns both to render from text alone and to continue a given first frame in the
direction the prompt says. ``--init`` starts from a checkpoint instead of the random
initialisation (one from before image conditioning loads with the condition's weights zero, the
text-only model exactly), and ``--keep-decoder`` leaves its decoder as it is: fine-tuning the
text-only weights to take a first frame took 4,000 steps, 867 s of CPU.

Fixed seeds and one CPU thread (results do not then depend on the core count, and two threads
spin-waiting on each other ran several times slower on a busy two-core machine): a run writes
the same file every time on the same torch build. The learning rates
are constant after warm-up and the saved weights are exponential moving averages, so nothing
depends on the total step count: the snapshot written at step k equals a run with ``--steps k``.
With ``--cond-fraction 0`` no condition is drawn or computed: the text-only recipe, the same
weights as before conditioning existed.

The shipped ``runtime/models/kiln_tiny.safetensors`` is the text-only model fine-tuned, made by
(its metadata records both runs' settings, the first under ``init``):

    python scripts/train_tiny.py --cond-fraction 0 --out text_only.safetensors
    python scripts/train_tiny.py --init text_only.safetensors --keep-decoder --steps 4000
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from runtime.models.shapes import sample_clips
from runtime.models.tiny import (
    TRAINED_WEIGHTS,
    KilnTiny,
    TinyConfig,
    encode_video,
    first_frame_condition,
    load_weights,
)

NUM_THREADS = 1


def decode_clip(model: KilnTiny, z_BCFHW: torch.Tensor) -> torch.Tensor:
    """Latents -> [B, F*tc, H, W, 3] in [-1, 1] (the first latent frame's sub-frames too)."""
    b, c, f, h, w = z_BCFHW.shape
    frames = model.decoder(z_BCFHW.transpose(1, 2).reshape(b * f, c, h, w))
    return frames.reshape(b, -1, *frames.shape[2:]).permute(0, 1, 3, 4, 2)


def repeat_first(video_BNHW3: torch.Tensor, tc: int) -> torch.Tensor:
    """The frames as the latents hold them: the first one ``tc`` times, then the rest."""
    first = video_BNHW3[:, :1].expand(-1, tc, -1, -1, -1)
    return torch.cat([first, video_BNHW3[:, 1:]], dim=1)


def flow_sigma(u: torch.Tensor, shift: float) -> torch.Tensor:
    """The sampler's shifted schedule applied to uniform ``u``."""
    return shift * u / (1 + (shift - 1) * u)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def save(model: KilnTiny, ema: dict[str, torch.Tensor], path: Path,
         meta: dict[str, object]) -> None:
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    state.update({k: v.clone().contiguous() for k, v in ema.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    # One metadata entry, its keys sorted: safetensors writes a metadata map in no fixed order,
    # so several entries would make equal weights give files that differ.
    save_file(state, str(path), metadata={"kiln_tiny": json.dumps(meta, sort_keys=True)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=6500)
    p.add_argument("--out", type=Path, default=TRAINED_WEIGHTS)
    p.add_argument("--batch", type=int, default=32, help="clips per transformer step")
    p.add_argument("--decoder-batch", type=int, default=8, help="of those, clips per decoder step")
    p.add_argument("--lr", type=float, default=1e-3, help="transformer and text encoder")
    p.add_argument("--cond-lr", type=float, default=1e-2,
                   help="the condition's input weights (cond_embed), which start from zero")
    p.add_argument("--decoder-lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--ema", type=float, default=0.995)
    p.add_argument("--shift", type=float, default=3.0, help="as the sampler's flow_shift")
    p.add_argument("--drop-prompt", type=float, default=0.1)
    p.add_argument("--latent-noise", type=float, default=0.05)
    p.add_argument("--shape-weight", type=float, default=4.0,
                   help="extra loss weight of pixels that differ from the background")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="also save the weights every this many steps (0: never)")
    p.add_argument("--cond-fraction", type=float, default=0.5,
                   help="share of the clips conditioned on their own first frame")
    p.add_argument("--init", type=Path, default=None,
                   help="start from these weights (a kiln-tiny safetensors file)")
    p.add_argument("--keep-decoder", action="store_true",
                   help="train the denoiser only; the decoder stays as initialised")
    args = p.parse_args()

    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(True)
    started = time.perf_counter()
    cfg = TinyConfig()
    torch.manual_seed(args.seed)
    model = KilnTiny(cfg)
    gen = torch.Generator().manual_seed(args.seed)
    settings = {k: str(v) for k, v in vars(args).items()
                if k not in ("out", "snapshot_every", "log_every", "init")}
    meta: dict[str, object] = {"config": asdict(cfg), **settings}
    if args.init is not None:
        load_weights(model, load_file(args.init))
        with safe_open(str(args.init), "pt") as f:
            meta["init"] = json.loads((f.metadata() or {}).get("kiln_tiny", "{}"))
    empty_ids, empty_mask = model.tokenizer([""])
    tc = cfg.temporal_compression

    denoiser = nn.ModuleDict({"text_encoder": model.text_encoder,
                              "transformer": model.transformer}).train()
    model.decoder.train(not args.keep_decoder)
    cond_params = list(model.transformer.cond_embed.parameters())
    rest = [p for p in denoiser.parameters() if all(p is not c for c in cond_params)]
    opt = torch.optim.AdamW([{"params": rest, "base_lr": args.lr},
                             {"params": cond_params, "base_lr": args.cond_lr}],
                            lr=args.lr, betas=(0.9, 0.99), weight_decay=0.01)
    dec_opt = torch.optim.AdamW([{"params": model.decoder.parameters(),
                                  "base_lr": args.decoder_lr}],
                                lr=args.decoder_lr, weight_decay=0.0)
    trained = nn.ModuleDict({"text_encoder": model.text_encoder,
                             "transformer": model.transformer})
    if not args.keep_decoder:
        trained["decoder"] = model.decoder
    ema = {k: v.detach().clone() for k, v in trained.state_dict().items()}
    curve: list[tuple[int, float, float]] = []
    window: list[tuple[float, float]] = []
    for step in range(1, args.steps + 1):
        warm = min(1.0, step / args.warmup)  # linear warm-up, then constant (see the docstring)
        for o in (opt, dec_opt):
            for group in o.param_groups:
                group["lr"] = group["base_lr"] * warm
        clips = sample_clips(args.batch, gen)
        video = clips.video_BNHW3
        x0 = encode_video(cfg, video)

        # Transformer and text encoder: one rectified-flow step.
        ids, mask = model.tokenizer(clips.prompts)
        drop = torch.rand(args.batch, generator=gen) < args.drop_prompt
        ids = torch.where(drop[:, None], empty_ids, ids)
        mask = torch.where(drop[:, None], empty_mask, mask)
        sigma = flow_sigma(torch.rand(args.batch, generator=gen), args.shift)
        noise = torch.randn(x0.shape, generator=gen)
        cond = None
        if args.cond_fraction > 0:  # the clips drawn as conditioned start from their own frame
            given = torch.rand(args.batch, generator=gen) < args.cond_fraction
            cond = first_frame_condition(cfg, video[:, 0], video.shape[1], given_B=given)
        s = sigma[:, None, None, None, None]
        pred = model.transformer((1 - s) * x0 + s * noise, sigma * 1000.0,
                                 model.text_encoder(ids, mask), cond)
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(denoiser.parameters(), 1.0)
        opt.step()

        # Decoder: one reconstruction step on the first clips.
        nb = args.decoder_batch
        z = x0[:nb] + args.latent_noise * torch.randn(x0[:nb].shape, generator=gen)
        target = repeat_first(video[:nb], tc)
        if args.keep_decoder:  # still measured, on the same clips: the curve stays comparable
            with torch.no_grad():
                err2 = (decode_clip(model, z) - target).square()
        else:
            shape_px = ((target - target[:, :, :1, :1]).abs().sum(-1, keepdim=True)
                        > 0.05).float()
            err2 = (decode_clip(model, z) - target).square()
            dec_loss = (err2 * (1 + args.shape_weight * shape_px)).mean()
            dec_opt.zero_grad(set_to_none=True)
            dec_loss.backward()
            dec_opt.step()

        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for k, v in trained.state_dict().items():
                ema[k].lerp_(v, 1 - decay)
        window.append((loss.item(), err2.mean().item()))
        if step % args.log_every == 0 or step == args.steps:
            flow, mse = (sum(x) / len(window) for x in zip(*window, strict=True))
            curve.append((step, flow, mse))
            window = []
            print(f"[{time.perf_counter() - started:7.1f} s wall, {cpu_seconds():7.1f} s cpu] "
                  f"step {step}/{args.steps} flow loss {flow:.4f} decoder mse {mse:.5f}",
                  flush=True)
        if args.snapshot_every and step % args.snapshot_every == 0 and step < args.steps:
            save(model, ema, out_for(args.out, step), {**meta, "steps": str(step)})
    save(model, ema, args.out, meta)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.2f} MiB)")
    print("step, flow loss, decoder mse:")
    for step, flow, mse in curve[:: max(1, len(curve) // 10)] + curve[-1:]:
        print(f"  {step:6d} {flow:.4f} {mse:.5f}")
    print(f"elapsed {time.perf_counter() - started:.0f} s wall, {cpu_seconds():.0f} s cpu "
          f"on {NUM_THREADS} threads")


def out_for(out: Path, step: int) -> Path:
    return out.with_name(f"{out.stem}-step{step}{out.suffix}")


if __name__ == "__main__":
    main()
