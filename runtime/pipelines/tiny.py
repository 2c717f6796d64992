"""The kiln-tiny pipeline: flow-matching Euler sampling with classifier-free guidance, then decode.

CFG runs as one batch-2 forward (conditional and unconditional stacked on the batch axis), so each
block is gathered once per step and ``forwards_per_step`` is 1; a request with
``guidance_scale <= 1`` runs a batch-1 forward. ``cfg_batch=False`` runs the pair as two batch-1
forwards instead (conditional, then unconditional; ``forwards_per_step`` 2, a request without
guidance idling the second), to measure what batching saves (``bench/gathers.py``).

It previews (`TinyPipeline.preview`): one latent frame through the decoder costs under a tenth of
a step (64x64, 9 frames, 2 CPU threads: 1.2 ms against a 16 ms step, medians of 100).

A request's ``conditioning.image`` (the first frame, uint8 [H, W, 3] at the request's size) is
encoded once in `prepare` by the model's fixed encoder and given to every forward as the
transformer's condition (``runtime.models.tiny.first_frame_condition``), to both halves of the
guidance pair, as Wan's image-to-video pipeline does: guidance then pushes towards the prompt,
not away from the image. Without it the render is text to video, exactly as before.

A request's ``conditioning.video`` (uint8 [N, H, W, 3] at the request's frames and size) makes it
video-to-video, SDEdit's way, as diffusers' video-to-video pipelines do: the clip is encoded by
the same fixed encoder, noised to the level where the last ``strength`` of the schedule begins
(`video_start`; 0.8 by default), and only those steps run. The model was never trained for it;
it works because the clip's latents are what it denoises towards anyway.
"""

from __future__ import annotations

from typing import Any

import torch

from common.families import TINY
from runtime.budget import AUTO, DeviceBudget, activation_bytes, resolve_budget
from runtime.dlo import DLOHandle, apply_dlo
from runtime.models.tiny import (
    KilnTiny,
    TinyConfig,
    build_tiny,
    encode_video,
    first_frame_condition,
)
from runtime.pipelines.base import DenoiseState, VideoPipeline, VideoRequest
from runtime.platform import default_device, get_platform
from runtime.sequence import SequenceParallel
from runtime.step_cache import StepCache
from runtime.tiling import map_tiles, plan_tiles

#: Video-to-video's strength when a request gives none: diffusers' video-to-video default.
DEFAULT_STRENGTH = 0.8


def _strength(request: VideoRequest) -> float:
    c = request.conditioning
    return DEFAULT_STRENGTH if c is None or c.strength is None else c.strength


def video_start(num_inference_steps: int, strength: float) -> int:
    """The step video-to-video starts at: the last ``strength`` of the schedule is run, by the
    rule of diffusers' video-to-video pipelines (``get_timesteps``); at least one step."""
    run = min(int(num_inference_steps * strength), num_inference_steps)
    if run < 1:
        raise ValueError(f"strength {strength} runs no step of {num_inference_steps}; give at "
                         f"least {1 / num_inference_steps:.3g}")
    return num_inference_steps - run


def flow_sigmas(num_inference_steps: int, shift: float) -> torch.Tensor:
    """Noise levels from 1 to 0 (``num_inference_steps + 1`` of them), shifted towards the noisy
    end."""
    sigmas = torch.linspace(1.0, 0.0, num_inference_steps + 1, dtype=torch.float64)
    return (shift * sigmas / (1 + (shift - 1) * sigmas)).to(torch.float32)


class TinyPipeline(VideoPipeline):
    can_preview = True
    # The last step's guided velocity: the preview's estimate of the clean video.
    resume_keys = ("velocity",)

    def __init__(self, model: KilnTiny, handle: DLOHandle | None, *, flow_shift: float = 3.0,
                 device: torch.device | str = "cpu", cfg_batch: bool = True) -> None:
        super().__init__([handle])
        self.cfg_batch = cfg_batch  # the CFG pair as one batch-2 forward, else two batch-1
        self.forwards_per_step = 1 if cfg_batch else 2
        self.model = model
        self.cfg: TinyConfig = model.cfg
        if model.transformer.sequence_parallel is None:  # see runtime.step_cache
            self.step_caches = [StepCache(model.transformer.blocks, handle)]
        self.flow_shift = flow_shift
        self.device = torch.device(device)
        # What the decode tile plan used last (read by tests and the tiling benchmark).
        self.last_decode_plan: Any = None
        self.decode_free_bytes: int | None = None  # None: measure free memory at decode time

    @classmethod
    def load(cls, *, cfg: TinyConfig | None = None, group: Any = None, use_allgather: bool = True,
             device: torch.device | str | None = None, offload: bool = True,
             cfg_batch: bool = True, sequence: SequenceParallel | None = None,
             device_budget: DeviceBudget = AUTO,
             max_tokens: int = TINY.max_tokens,
             weights_dtype: str = "checkpoint") -> TinyPipeline:
        """kiln-tiny with its transformer blocks streamed by DLO (``offload=False``: resident);
        ``cfg_batch``: see the module docstring; ``sequence``: the replica's split of the token
        sequence (``runtime.sequence``), None when one rank renders a job alone;
        ``device_budget``: device memory for resident blocks (``runtime.budget``), with
        activations reserved for a job of ``max_tokens`` tokens; ``weights_dtype``: the dtype
        the streamed blocks are kept and moved in (``apply_dlo``)."""
        model = build_tiny(cfg)
        if sequence is not None:
            sequence.check_heads(model.cfg.num_heads, "kiln-tiny")
            model.transformer.sequence_parallel = sequence
        # The engine's default device too, so every component lands on the same one; they go
        # first, so what is free afterwards is what blocks may use.
        dev = torch.device(device) if device is not None else default_device()
        model.text_encoder.to(dev)
        model.decoder.to(dev)
        handle = None
        if offload:
            shard = -(-max_tokens // (sequence.degree if sequence is not None else 1))
            budget = resolve_budget(device_budget, get_platform(dev), activations=activation_bytes(
                shard, model.cfg.dim, model.cfg.ffn_dim, dtype_bytes=4))
            handle = apply_dlo(model.transformer, group=group, use_allgather=use_allgather,
                               device=device, device_budget_bytes=budget,
                               weights_dtype=weights_dtype)
        return cls(model, handle, device=dev, cfg_batch=cfg_batch)

    @torch.no_grad()
    def prepare(self, request: VideoRequest) -> DenoiseState:
        cfg = self.cfg
        cfg.check_video_size(request.width, request.height, request.num_frames)
        ids, mask = self.model.tokenizer([request.prompt, request.negative_prompt])
        text = self.model.text_encoder(ids.to(self.device), mask.to(self.device))
        shape = (1, cfg.latent_channels, cfg.num_latent_frames(request.num_frames),
                 request.height // cfg.spatial_compression,
                 request.width // cfg.spatial_compression)
        # Noise from a CPU generator, so the same seed gives the same video on every device.
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(request.seed))
        sigmas = flow_sigmas(request.num_inference_steps, self.flow_shift)
        latents = noise.to(self.device)
        clip = self._clip_latents(request)
        if clip is not None:  # video-to-video: start part-way, from the clip's noised latents
            sigmas = sigmas[video_start(request.num_inference_steps, _strength(request)):]
            latents = (1 - sigmas[0]) * clip + sigmas[0] * latents
        return DenoiseState(
            request=request,
            latents=latents,
            num_inference_steps=len(sigmas) - 1,
            extra={"text": text, "cond": text[:1], "uncond": text[1:],
                   "image": self._first_frame(request), "sigmas": sigmas},
        )

    def _clip_latents(self, request: VideoRequest) -> torch.Tensor | None:
        """The latents of the request's clip (``conditioning.video``), None without one."""
        c = request.conditioning
        if c is None or c.video is None:
            return None
        if c.image is not None or c.last_image is not None:
            raise ValueError("kiln-tiny starts from a first frame or from a video, not both")
        want = (request.num_frames, request.height, request.width, 3)
        if tuple(c.video.shape) != want:
            raise ValueError(f"the video must be {want} (the request's frames and size), got "
                             f"{tuple(c.video.shape)}")
        video = c.video.to(self.device, torch.float32).div(127.5).sub(1)  # the decoder's range
        return encode_video(self.cfg, video[None])

    def _first_frame(self, request: VideoRequest) -> torch.Tensor | None:
        """The transformer's condition for the request's first frame, None without one."""
        c = request.conditioning
        if c is None:
            return None
        if c.last_image is not None:
            raise ValueError("kiln-tiny takes a first frame, not a last frame")
        if c.image is None:
            return None
        if tuple(c.image.shape) != (request.height, request.width, 3):
            raise ValueError(f"the first frame must be {request.height}x{request.width}x3 "
                             f"(the request's size), got {tuple(c.image.shape)}")
        image = c.image.to(self.device, torch.float32).div(127.5).sub(1)  # the decoder's range
        return first_frame_condition(self.cfg, image[None], request.num_frames)

    @torch.no_grad()
    def _denoise(self, state: DenoiseState) -> None:
        i = state.step_index
        sigma, sigma_next = state.extra["sigmas"][i], state.extra["sigmas"][i + 1]
        x = state.latents
        t = torch.full((1,), float(sigma) * 1000.0, device=self.device)
        g = state.request.guidance_scale
        image = state.extra["image"]  # both halves of the pair see the first frame
        if g > 1.0 and self.cfg_batch:
            # [cond, uncond] on the batch axis: each block computes both while it is in its slot.
            with self._forward(0, state):
                velocity, uncond = self.model.transformer(
                    torch.cat([x, x]), t.expand(2), state.extra["text"],
                    None if image is None else torch.cat([image, image])).chunk(2)
            velocity = uncond + g * (velocity - uncond)
        else:
            with self._forward(0, state, 0):
                velocity = self.model.transformer(x, t, state.extra["cond"], image)
            if g > 1.0:
                with self._forward(0, state, 1):
                    uncond = self.model.transformer(x, t, state.extra["uncond"], image)
                velocity = uncond + g * (velocity - uncond)
        state.latents = x + (sigma_next - sigma) * velocity
        state.extra["velocity"] = velocity  # the preview's estimate of the clean video

    @torch.no_grad()
    def preview(self, state: DenoiseState) -> torch.Tensor:
        """The middle frame of the clean video the model predicted at the last step: with
        flow matching the latents are ``x = (1 - sigma) x0 + sigma noise`` and the model's
        velocity ``v = noise - x0``, so ``x0 = x - sigma v`` (the guided velocity of the last step,
        the latents' noise level now). Before the first step it is the noise itself; after the
        last, the rendered video's own middle frame. Decodes the one latent frame that holds the
        middle frame; ``state`` is left as it was."""
        r, tc = state.request, self.cfg.temporal_compression
        velocity = state.extra.get("velocity")
        x0 = state.latents
        if velocity is not None:
            x0 = x0 - state.extra["sigmas"][state.step_index] * velocity
        # `decode` drops the first latent frame's first tc - 1 sub-frames (causal layout).
        latent_frame, sub_frame = divmod(r.num_frames // 2 + tc - 1, tc)
        z_1CHW = x0[0, :, latent_frame:latent_frame + 1].transpose(0, 1)
        frame_3HW = self.model.decoder(z_1CHW)[0, sub_frame].div_(2).add_(0.5).clamp_(0, 1)
        return frame_3HW.permute(1, 2, 0).mul(255).round_().to(torch.uint8).cpu()

    @torch.no_grad()
    def decode(self, state: DenoiseState) -> torch.Tensor:
        """[N, H, W, 3] frames in [0, 1]; latent frames decoded in tiles sized by free memory.

        The tile function returns finished frames (scaled, channels last), so the only buffer
        that grows with the clip is the output itself."""
        r, cfg = state.request, self.cfg
        z_FCHW = state.latents[0].transpose(0, 1)  # one item per latent frame
        num_lat, tc = z_FCHW.shape[0], cfg.temporal_compression
        plan = plan_tiles(num_lat, self.model.decoder.bytes_per_item(r.height, r.width),
                          free_bytes=self.decode_free_bytes, device=self.device)
        self.last_decode_plan = plan

        def decode_tile(z: torch.Tensor) -> torch.Tensor:
            # In place: the tile's transients stay at the decoder's own.
            return self.model.decoder(z).div_(2).add_(0.5).clamp_(0, 1).permute(0, 1, 3, 4, 2)

        out = torch.empty((num_lat, tc, r.height, r.width, 3), device=self.device)
        map_tiles(decode_tile, z_FCHW, out, plan)
        # The first latent frame stands for one frame (causal layout): keep its last sub-frame.
        return out.flatten(0, 1)[tc - 1:]
