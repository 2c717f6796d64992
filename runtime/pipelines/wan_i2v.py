"""Wan image-to-video with its transformers under DLO, following diffusers'
``WanImageToVideoPipeline`` operation for operation: Wan2.1 I2V (a CLIP image encoder whose
tokens the transformer attends to beside the prompt's), Wan2.1 FLF2V (the same, from a first and
a last frame) and Wan2.2 I2V (two experts, streamed like Wan2.2 T2V's, no image encoder).

The picture enters twice, both times in ``prepare`` (local work: the VAE and the image encoder
are whole on every rank, no collective). The VAE encodes a clip of the request's length that
holds the image as its first frame (and the last image as its last), zeros between; those
latents, behind a 4-channel mask of which frames are given, sit beside the noisy latents on the
channel axis of every forward (16 + 20 = the transformer's 36 input channels). Wan2.1's
transformer also takes the CLIP tokens of the image (of both images, for FLF2V) in its
cross-attention. The step is Wan's (``WanVideoPipeline._denoise``): the CFG pair as one batch-2
forward by default, as the reference's two batch-1 forwards with ``cfg_batch=False``, which
matches ``WanImageToVideoPipeline`` bit for bit (CPU, fp32, the same thread count).

What a request brings: ``request.conditioning.image`` (and ``last_image``), uint8
``[height, width, 3]`` at exactly the request's size (``runtime.pipelines.base.Conditioning``:
the caller fits it). They go through diffusers' own preprocessing as the PIL images the reference
takes at that size, so neither side resizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import PIL.Image
import torch

from common.families import WAN_I2V
from runtime.pipelines.base import DenoiseState, VideoRequest
from runtime.pipelines.diffusers_video import WanVideoPipeline, check_frames


class WanI2VPipeline(WanVideoPipeline):
    """``WanImageToVideoPipeline``'s loop: Wan2.1 I2V and FLF2V, Wan2.2 I2V (two experts)."""

    family = WAN_I2V

    @classmethod
    def load(cls, model_dir: str | Path, **kwargs: Any) -> WanI2VPipeline:
        loop = super().load(model_dir, **kwargs)
        assert isinstance(loop, WanI2VPipeline)
        p = loop.pipe
        if p.config.expand_timesteps:
            loop.close()
            raise ValueError(f"{model_dir}: an image-to-video model with expand_timesteps "
                             "(Wan2.2 TI2V-5B) is not one kiln renders from an image")
        if p.image_encoder is not None:
            p.image_encoder.to(loop.device)  # whole, as the VAE: a rank encodes its own image
        return loop

    def _pictures(self, r: VideoRequest) -> tuple[PIL.Image.Image, PIL.Image.Image | None]:
        """The request's first (and last) frame as the PIL images the reference takes; a
        ValueError for what this model cannot render from."""
        c = r.conditioning
        if c is not None and c.video is not None:
            raise ValueError(f"{self.family.name} renders from an image, not from a video (a "
                             "Wan2.1 text-to-video model does)")
        if c is None or c.image is None:
            raise ValueError(f"{self.family.name} renders from an image (the first frame); "
                             "the request has none")
        config = self.pipe.transformer.config
        if c.last_image is not None and config.image_dim is not None \
                and config.pos_embed_seq_len is None:
            raise ValueError("this model renders from a first frame only; a last image needs a "
                             "first-and-last-frame model (Wan2.1 FLF2V) or Wan2.2 I2V")
        if c.last_image is None and config.pos_embed_seq_len is not None:
            raise ValueError("this model (first and last frame) renders from two images; the "
                             "request has no last image")
        if c.last_image is not None and r.num_frames < 2:
            raise ValueError("a first and a last frame need a clip of 5 frames or more")
        first = _picture(c.image, r, "image")
        last = None if c.last_image is None else _picture(c.last_image, r, "last image")
        return first, last

    @torch.no_grad()
    def prepare(self, request: VideoRequest) -> DenoiseState:
        p, r = self.pipe, request
        patch = p.transformer.config.patch_size
        check_frames(r, self.family, p.vae_scale_factor_temporal,
                     p.vae_scale_factor_spatial * max(patch[1], patch[2]))
        image, last_image = self._pictures(r)
        cfg = r.guidance_scale > 1.0
        cond, uncond = p.encode_prompt(prompt=r.prompt, negative_prompt=r.negative_prompt,
                                       do_classifier_free_guidance=cfg, num_videos_per_prompt=1,
                                       max_sequence_length=self.max_sequence_length,
                                       device=self.device)
        dtype = self.transformers[0]._kiln_dtype
        image_embeds = None
        if p.transformer.config.image_dim is not None:  # Wan2.1: the CLIP tokens
            image_embeds = p.encode_image(image if last_image is None else [image, last_image],
                                          self.device).to(dtype)
        scheduler = self._own_scheduler()
        scheduler.set_timesteps(r.num_inference_steps, device=self.device)
        scheduler.set_begin_index(0)
        pixels = [None if i is None else p.video_processor.preprocess(
            i, height=r.height, width=r.width).to(self.device, dtype=torch.float32)
            for i in (image, last_image)]
        # The noise first (the only draw from the generator), then the VAE's mode of the clip.
        latents, condition = p.prepare_latents(
            pixels[0], 1, p.vae.config.z_dim, r.height, r.width, r.num_frames, torch.float32,
            self.device, self._generator(r.seed), None, pixels[1])
        ratio = p.config.boundary_ratio
        extra = {
            "cond": cond.to(dtype), "uncond": uncond.to(dtype) if cfg else None,
            "image_embeds": image_embeds, "condition": condition, "scheduler": scheduler,
            "boundary": None if ratio is None else ratio * scheduler.config.num_train_timesteps,
        }
        return DenoiseState(request=r, latents=latents,
                            num_inference_steps=r.num_inference_steps, extra=extra)

    def _model_input(self, state: DenoiseState) -> torch.Tensor:
        return torch.cat([state.latents, state.extra["condition"]], dim=1)


def _picture(pixels: torch.Tensor, r: VideoRequest, what: str) -> PIL.Image.Image:
    if pixels.dtype != torch.uint8 or tuple(pixels.shape) != (r.height, r.width, 3):
        raise ValueError(f"the {what} must be uint8 [{r.height}, {r.width}, 3], fitted to the "
                         f"request's {r.width}x{r.height}; got {pixels.dtype} "
                         f"{list(pixels.shape)}")
    return PIL.Image.fromarray(pixels.detach().cpu().contiguous().numpy())
