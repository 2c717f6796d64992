"""Train kiln-tiny's weights on procedural shape clips (``runtime.models.shapes``), on the CPU.

Two stages, both with fixed seeds and two CPU threads, so the defaults reproduce the committed
``runtime/models/kiln_tiny.safetensors`` bit for bit on the same torch build:

1. Autoencoder: a patch encoder (used here only) and kiln-tiny's decoder learn to squeeze each
   8 x 8 pixel, 4-frame block into the model's 8 latent channels. The encoder ends in a
   non-affine batch norm, so latents have about unit variance per channel, the scale of the
   sampler's starting noise; the decoder learns on slightly noisy latents, so the transformer's
   imperfect samples still decode to clean shapes.
2. Transformer and text encoder: rectified flow (velocity target ``noise - latents``) on the
   encoded latents of a pool of clips, the prompt dropped 10% of the time so classifier-free
   guidance has an unconditional model to push away from. The learning rate is constant after
   warm-up and the saved weights are an exponential moving average, so the snapshot written at
   step k equals a run with ``--steps k``.

    python scripts/train_tiny.py            # writes runtime/models/kiln_tiny.safetensors
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
from safetensors.torch import save_file
from torch import nn

from runtime.models.shapes import sample_clips
from runtime.models.tiny import TRAINED_WEIGHTS, KilnTiny, TinyConfig

NUM_THREADS = 2


class PatchEncoder(nn.Module):
    """Video [B, N, H, W, 3] in [-1, 1] -> latents [B, C, F, H/s, W/s], one MLP per 8 x 8 x 4
    block (the decoder's layout mirrored; the first frame stands alone, repeated)."""

    def __init__(self, cfg: TinyConfig, hidden: int = 256) -> None:
        super().__init__()
        self.cfg = cfg
        s, tc = cfg.spatial_compression, cfg.temporal_compression
        self.mlp = nn.Sequential(nn.Linear(tc * 3 * s * s, hidden), nn.SiLU(),
                                 nn.Linear(hidden, hidden), nn.SiLU(),
                                 nn.Linear(hidden, cfg.latent_channels))
        self.norm = nn.BatchNorm1d(cfg.latent_channels, affine=False)

    def forward(self, video_BNHW3: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        s, tc = cfg.spatial_compression, cfg.temporal_compression
        b, n, h, w, _ = video_BNHW3.shape
        first = video_BNHW3[:, :1].expand(-1, tc, -1, -1, -1)
        v = torch.cat([first, video_BNHW3[:, 1:]], dim=1)  # [B, F*tc, H, W, 3]
        f, hs, ws = v.shape[1] // tc, h // s, w // s
        blocks = v.reshape(b, f, tc, hs, s, ws, s, 3).permute(0, 1, 3, 5, 2, 7, 4, 6)
        z = self.norm(self.mlp(blocks.reshape(b * f * hs * ws, -1)))
        return z.reshape(b, f, hs, ws, -1).permute(0, 4, 1, 2, 3)


def decode_clip(model: KilnTiny, z_BCFHW: torch.Tensor) -> torch.Tensor:
    """Latents -> [B, F*tc, H, W, 3] in [-1, 1] (the first latent frame repeated, as encoded)."""
    b, c, f, h, w = z_BCFHW.shape
    frames = model.decoder(z_BCFHW.transpose(1, 2).reshape(b * f, c, h, w))
    return frames.reshape(b, -1, *frames.shape[2:]).permute(0, 1, 3, 4, 2)


def repeat_first(video_BNHW3: torch.Tensor, tc: int) -> torch.Tensor:
    first = video_BNHW3[:, :1].expand(-1, tc, -1, -1, -1)
    return torch.cat([first, video_BNHW3[:, 1:]], dim=1)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def log(msg: str, started: float) -> None:
    print(f"[{time.perf_counter() - started:7.1f} s wall, {cpu_seconds():7.1f} s cpu] {msg}",
          flush=True)


def train_autoencoder(model: KilnTiny, encoder: PatchEncoder, args: argparse.Namespace,
                      gen: torch.Generator, started: float) -> list[float]:
    params = list(encoder.parameters()) + list(model.decoder.parameters())
    opt = torch.optim.AdamW(params, lr=args.ae_lr, weight_decay=0.0)
    tc = model.cfg.temporal_compression
    losses, window = [], []
    encoder.train()
    for step in range(1, args.ae_steps + 1):
        video = sample_clips(args.ae_batch, gen).video_BNHW3
        z = encoder(video)
        noisy = z + args.latent_noise * torch.randn(z.shape, generator=gen)
        loss = F.mse_loss(decode_clip(model, noisy), repeat_first(video, tc))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        window.append(loss.item())
        if step % args.log_every == 0 or step == args.ae_steps:
            losses.append(sum(window) / len(window))
            log(f"autoencoder step {step}/{args.ae_steps} mse {losses[-1]:.5f}", started)
            window = []
    # Population statistics for the latents' normalisation (the running averages lag behind
    # the last steps): a cumulative average over fresh clips.
    encoder.norm.reset_running_stats()
    encoder.norm.momentum = None
    with torch.no_grad():
        for _ in range(8):
            encoder(sample_clips(128, gen).video_BNHW3)
    encoder.eval()
    return losses


@torch.no_grad()
def encode_pool(model: KilnTiny, encoder: PatchEncoder, num_clips: int,
                gen: torch.Generator) -> tuple[torch.Tensor, list[str]]:
    latents, prompts = [], []
    for start in range(0, num_clips, 256):
        clips = sample_clips(min(256, num_clips - start), gen)
        latents.append(encoder(clips.video_BNHW3))
        prompts += clips.prompts
    return torch.cat(latents), prompts


def flow_sigma(u: torch.Tensor, shift: float) -> torch.Tensor:
    """The sampler's shifted schedule applied to uniform ``u``: training sees noise levels as
    often as sampling visits them."""
    return shift * u / (1 + (shift - 1) * u)


def train_denoiser(model: KilnTiny, latents: torch.Tensor, prompts: list[str],
                   args: argparse.Namespace, gen: torch.Generator, started: float,
                   out: Path, meta: dict[str, str]
                   ) -> tuple[list[float], dict[str, torch.Tensor]]:
    ids, mask = model.tokenizer(prompts)
    empty_ids, empty_mask = model.tokenizer([""])
    trained = nn.ModuleDict({"text_encoder": model.text_encoder,
                             "transformer": model.transformer}).train()
    ema = {k: v.detach().clone() for k, v in trained.state_dict().items()}
    opt = torch.optim.AdamW(trained.parameters(), lr=args.lr, betas=(0.9, 0.99),
                            weight_decay=0.01)
    losses, window = [], []
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:  # linear warm-up, then constant (see the docstring)
            group["lr"] = args.lr * min(1.0, step / args.warmup)
        idx = torch.randint(latents.shape[0], (args.batch,), generator=gen)
        x0 = latents[idx]
        drop = torch.rand(args.batch, generator=gen) < args.drop_prompt
        b_ids = torch.where(drop[:, None], empty_ids, ids[idx])
        b_mask = torch.where(drop[:, None], empty_mask, mask[idx])
        sigma = flow_sigma(torch.rand(args.batch, generator=gen), args.shift)
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma[:, None, None, None, None]
        xt = (1 - s) * x0 + s * noise
        pred = model.transformer(xt, sigma * 1000.0, model.text_encoder(b_ids, b_mask))
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(trained.parameters(), 1.0)
        opt.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for k, v in trained.state_dict().items():
                ema[k].lerp_(v, 1 - decay)
        window.append(loss.item())
        if step % args.log_every == 0 or step == args.steps:
            losses.append(sum(window) / len(window))
            log(f"denoiser step {step}/{args.steps} loss {losses[-1]:.4f}", started)
            window = []
        if args.snapshot_every and step % args.snapshot_every == 0 and step < args.steps:
            save(model, ema, out.with_name(f"{out.stem}-step{step}{out.suffix}"),
                 {**meta, "steps": str(step)})
    trained.eval()
    return losses, ema


def save(model: KilnTiny, ema: dict[str, torch.Tensor], path: Path,
         meta: dict[str, str]) -> None:
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    state.update({k: v.clone().contiguous() for k, v in ema.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata=meta)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1000, help="denoiser steps")
    p.add_argument("--out", type=Path, default=TRAINED_WEIGHTS)
    p.add_argument("--ae-steps", type=int, default=300)
    p.add_argument("--ae-batch", type=int, default=16)
    p.add_argument("--ae-lr", type=float, default=2e-3)
    p.add_argument("--latent-noise", type=float, default=0.1)
    p.add_argument("--pool", type=int, default=4096, help="clips encoded for the denoiser")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--ema", type=float, default=0.995)
    p.add_argument("--shift", type=float, default=3.0)
    p.add_argument("--drop-prompt", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="also save the weights every this many denoiser steps (0: never)")
    args = p.parse_args()

    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(True)
    started = time.perf_counter()
    cfg = TinyConfig()
    torch.manual_seed(args.seed)
    model = KilnTiny(cfg)
    encoder = PatchEncoder(cfg)
    gen = torch.Generator().manual_seed(args.seed)
    settings = {k: str(v) for k, v in vars(args).items() if k not in ("out", "snapshot_every")}
    meta = {"config": json.dumps(asdict(cfg)), **settings}

    ae_losses = train_autoencoder(model, encoder, args, gen, started)
    latents, prompts = encode_pool(model, encoder, args.pool, gen)
    log(f"encoded {len(prompts)} clips: latent std {latents.std():.3f} "
        f"mean {latents.mean():.3f}", started)
    losses, ema = train_denoiser(model, latents, prompts, args, gen, started, args.out, meta)
    save(model, ema, args.out, meta)
    size = args.out.stat().st_size
    log(f"wrote {args.out} ({size / 2**20:.2f} MiB)", started)
    print("autoencoder mse every", args.log_every, "steps:",
          " ".join(f"{x:.4f}" for x in ae_losses))
    print("denoiser loss every", args.log_every, "steps:", " ".join(f"{x:.3f}" for x in losses))
    print(f"elapsed {time.perf_counter() - started:.0f} s wall, {cpu_seconds():.0f} s cpu "
          f"on {NUM_THREADS} threads")


if __name__ == "__main__":
    main()
