"""Cosmos3 (diffusers' ``Cosmos3OmniPipeline``) with its transformer under DLO: text to video, and
video from a first frame or from the start of a clip.

Cosmos3 has no text encoder. Its transformer (``Cosmos3OmniTransformer``) is a mixture of
transformers: every block of ``layers`` carries two pathways, one over the prompt's token ids
(causal self-attention, the "understanding" stream) and one over the video tokens (full
attention over the prompt's keys and its own, the "generation" stream), so the prompt is
embedded by the transformer itself, from ``embed_tokens``. The sequence is packed and unbatched,
and the conditional and unconditional prompts differ in length, so the reference pipeline runs
the classifier-free-guidance pair as two forwards. kiln does the same (``forwards_per_step`` 2),
and its frames equal the reference's bit for bit (CPU, fp32, the same thread count).

A request may bring a picture (``request.conditioning``, uint8 at the request's size; the
caller fits it): ``image``, the first frame, or ``video``, a clip whose first frames the render
keeps and continues: those of the first two latent frames (the reference's default
``condition_frame_indexes_vision=(0, 1)``), 5 frames with the VAE's 4 per latent frame.
``prepare`` runs the reference's own ``prepare_latents`` on it, given as the PIL image or
frames the reference takes at that size: the VAE encodes a clip of the request's length that
holds those frames and repeats the last of them to the end; the latent frames they fill start
clean (a mask of them picks the encoded latents over the noise), the rest as noise. The packed
sequences mark those frames as conditions (the transformer gives them no timestep), and each
forward's velocity is zero on them, as the reference masks it; the scheduler steps the whole
latent. ``prepare`` rebuilds the mask, the packs and the initial latents from the request, so a
checkpoint holds only the latents and the scheduler, as for text. A clip takes no
``strength``: the frames it gives are kept as they are, not noised part-way.

Where kiln's loop differs from ``Cosmos3OmniPipeline.__call__``, no bit of the output changes:

- Text to video draws the initial noise directly in the latent shape. The reference VAE-encodes
  an all-zero video of the requested size only to learn that shape, and multiplies the result by
  zero (no frame is a condition); at its default 189 frames of 1280x720 that is a whole VAE
  encode. A conditioned request runs that encode, of its own frames.
- ``lm_head`` (vocabulary x width: 1.2 GB in bf16 for the released models) is dropped before the
  weights load: it predicts text tokens, and video generation never runs it.
- The safety checker (NVIDIA's ``cosmos_guardrail``, whose models come from the hub) is off
  unless the model directory carries a ``safety_checker`` component. When it does, diffusers
  loads it, and kiln runs its text check on the prompt when a job starts and its video check on
  the decoded frames, as the reference does.

Sequence parallelism: none (sp=1). diffusers says Cosmos3's packed attention (two pathways with
ragged lengths, grouped-query heads, the video stream attending to the prompt's keys as well as
its own) cannot be declared as a ``_cp_plan`` and needs its own helper, which diffusers 0.42 does
not ship; kiln's Ulysses split (``runtime.sequence``) would have to split the video stream alone
and gather the prompt's keys to every rank, which is future work.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import PIL.Image
import torch
from diffusers.utils.torch_utils import randn_tensor

from common.families import COSMOS3
from runtime.pipelines.base import DenoiseState, VideoRequest
from runtime.pipelines.diffusers_video import DiffusersVideoPipeline, check_frames

# The latent frames a clip conditions: ``Cosmos3OmniPipeline.__call__``'s default
# ``condition_frame_indexes_vision``.
CLIP_LATENT_FRAMES = (0, 1)


class Cosmos3VideoPipeline(DiffusersVideoPipeline):
    """Cosmos3 T2V, I2V (a first frame) and from a clip's first frames: CFG as two forwards,
    conditional then unconditional (the prompts' packed sequences differ in length)."""

    family = COSMOS3
    forwards_per_step = 2
    # What the transformer never runs for video: kept on the meta device, never loaded.
    unused_modules: ClassVar[tuple[str, ...]] = ("lm_head",)
    optional_components: ClassVar[tuple[str, ...]] = ("sound_tokenizer", "safety_checker")

    def __init__(self, *args: Any, cfg_batch: bool = False, **kwargs: Any) -> None:
        # There is no batched pair to ask for: the two prompts' sequences differ in length.
        super().__init__(*args, cfg_batch=False, **kwargs)
        self.safety_checker = getattr(self.pipe, "safety_checker", None)

    @classmethod
    def pipeline_kwargs(cls, model_dir: Any) -> dict[str, Any]:
        # Cosmos3OmniPipeline builds NVIDIA's guardrail (downloaded from the hub) whenever its
        # config enables it and no checker was loaded: only a directory that carries one gets it.
        return {"enable_safety_checker": (model_dir / "safety_checker").is_dir()}

    @torch.no_grad()
    def prepare(self, request: VideoRequest) -> DenoiseState:
        p, r, dev = self.pipe, request, self.device
        check_frames(r, self.family, p.vae_scale_factor_temporal, p.vae_scale_factor_spatial)
        image, video = self._pictures(r)
        if self.safety_checker is not None and not self.safety_checker.check_text_safety(
                r.prompt):
            raise ValueError("the model's safety checker refused the prompt")
        cfg = r.guidance_scale != 1.0  # the reference's do_classifier_free_guidance
        fps = float(r.fps)
        cond_ids, uncond_ids = p.tokenize_prompt(r.prompt, r.negative_prompt,
                                                 num_frames=r.num_frames, height=r.height,
                                                 width=r.width, fps=fps)
        sf, st = p.vae_scale_factor_spatial, p.vae_scale_factor_temporal
        latent_frames = (r.num_frames - 1) // st + 1
        generator = self._generator(r.seed)
        if image is None and video is None:
            shape = (1, p.vae.config.z_dim, latent_frames, r.height // sf, r.width // sf)
            latents = randn_tensor(shape, generator=generator, device=dev, dtype=torch.float32)
            mask = torch.zeros((latent_frames, 1, 1), device=dev, dtype=torch.float32)
        else:
            # The reference's own: the encoded frames where the mask is 1, the noise elsewhere
            # (one draw from the generator, in the latents' shape).
            out = p.prepare_latents(
                image=image, video=video, condition_frame_indexes_vision=CLIP_LATENT_FRAMES,
                condition_video_keep="first", num_frames=r.num_frames, height=r.height,
                width=r.width, fps=fps, generator=generator, device=dev, dtype=torch.float32)
            latents, mask = out[0], out[5]
        conditions = [int(i) for i in torch.nonzero(mask[:, 0, 0] > 0).flatten()]
        packs = [self._pack(ids, latents, fps, conditions) for ids in
                 ((cond_ids, uncond_ids) if cfg else (cond_ids,))]
        scheduler = self._scheduler(r.num_inference_steps)
        extra = {"packs": packs, "scheduler": scheduler, "mask": mask,
                 "num_noisy": packs[0]["num_noisy_vision_tokens"]}
        return DenoiseState(request=r, latents=latents,
                            num_inference_steps=r.num_inference_steps, extra=extra)

    def _pictures(self, r: VideoRequest) -> tuple[PIL.Image.Image | None,
                                                    list[PIL.Image.Image] | None]:
        """The request's first frame, or its clip, as the PIL pictures the reference takes
        (None, None: text to video); a ValueError for what Cosmos3 does not render from."""
        c = r.conditioning
        if c is None:
            return None, None
        if c.last_image is not None:
            raise ValueError("cosmos3 renders from a first frame or the start of a clip, not "
                             "from a last image")
        if c.image is not None and c.video is not None:
            raise ValueError("cosmos3 renders from an image or a video, not both")
        if c.image is None and c.video is None:
            return None, None
        if r.num_frames == 1:
            raise ValueError("a single frame renders from text alone: cosmos3 renders a clip "
                             "from an image or a video")
        # The clip's frames the render keeps: those of its conditioned latent frames.
        kept = 1 + self.pipe.vae_scale_factor_temporal * max(CLIP_LATENT_FRAMES)
        size = (r.height, r.width, 3)
        if c.image is not None:
            if c.image.dtype != torch.uint8 or tuple(c.image.shape) != size:
                raise ValueError(f"the image must be uint8 {list(size)}, fitted to the request's "
                                 f"{r.width}x{r.height}; got {c.image.dtype} "
                                 f"{list(c.image.shape)}")
            return PIL.Image.fromarray(c.image.detach().cpu().contiguous().numpy()), None
        assert c.video is not None
        if c.strength is not None:
            raise ValueError(f"cosmos3 keeps the clip's first {kept} frames as they are and "
                             "renders the rest: it takes no strength")
        if r.num_frames <= kept:
            raise ValueError(f"a clip conditions the first {kept} frames; the request must "
                             f"render more, got {r.num_frames}")
        if c.video.dtype != torch.uint8 or c.video.ndim != 4 or len(c.video) < 1 \
                or tuple(c.video.shape[1:]) != size:
            raise ValueError(f"the video must be uint8 [frames, {r.height}, {r.width}, 3], "
                             f"fitted to the request's {r.width}x{r.height}; got "
                             f"{c.video.dtype} {list(c.video.shape)}")
        return None, [PIL.Image.fromarray(f) for f in c.video.detach().cpu().numpy()]

    def _pack(self, ids: list[int], latents: torch.Tensor, fps: float,
              conditions: list[int]) -> dict[str, Any]:
        """One prompt's packed sequence: its text segment and the video's, whose latent frames
        ``conditions`` are given (clean, no timestep), as ``Cosmos3OmniPipeline.__call__``
        builds them before its loop."""
        p = self.pipe
        text = p._prepare_text_segment(ids, device=self.device)
        vision = p._prepare_vision_segment(
            input_vision_tokens=latents, has_image_condition=bool(conditions),
            mrope_offset=text["vision_start_temporal_offset"], vision_fps=fps,
            curr=text["und_len"], device=self.device, condition_frame_indexes=conditions)
        return {**text, **vision,
                "position_ids": torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], 1),
                "sequence_length": text["und_len"] + vision["num_vision_tokens"]}

    def _scheduler(self, steps: int) -> Any:
        scheduler = self._own_scheduler()
        if self.pipe.config.use_native_flow_schedule:
            sigmas = np.linspace(1.0 - 1.0 / scheduler.config.num_train_timesteps, 0.0,
                                 steps + 1)[:-1]
            scheduler.set_timesteps(steps, device=self.device, sigmas=sigmas)
        else:
            scheduler.set_timesteps(steps, device=self.device)
        return scheduler

    @torch.no_grad()
    def _denoise(self, state: DenoiseState) -> None:
        x, i = state.extra, state.step_index
        scheduler = x["scheduler"]
        t = scheduler.timesteps[i]
        tokens = state.latents.to(self.transformers[0]._kiln_dtype)
        # An integer tensor, as the reference builds it (the transformer scales it to floats).
        timesteps = torch.full((x["num_noisy"],), t.item(), device=self.device)
        velocity = [self._velocity(pack, tokens, timesteps, x["mask"]) for pack in x["packs"]]
        if len(velocity) == 2:
            cond, uncond = velocity
            v = uncond + state.request.guidance_scale * (cond - uncond)
        else:
            v = velocity[0]
        state.latents = scheduler.step(v.unsqueeze(0), t, state.latents.unsqueeze(0),
                                       return_dict=False)[0].squeeze(0)

    def _velocity(self, pack: dict[str, Any], tokens: torch.Tensor, timesteps: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
        """One forward's velocity, zero on the latent frames ``mask`` marks as given (the
        reference's ``_mask_velocity_predictions``; text to video marks none)."""
        preds = self.pipe.transformer(
            input_ids=pack["input_ids"], text_indexes=pack["text_indexes"],
            position_ids=pack["position_ids"], und_len=pack["und_len"],
            sequence_length=pack["sequence_length"], vision_tokens=[tokens],
            vision_token_shapes=pack["vision_token_shapes"],
            vision_sequence_indexes=pack["vision_sequence_indexes"],
            vision_mse_loss_indexes=pack["vision_mse_loss_indexes"], vision_timesteps=timesteps,
            vision_noisy_frame_indexes=pack["vision_noisy_frame_indexes"], return_dict=False)[0]
        pred = preds[0]
        noisy = (1.0 - mask).to(dtype=pred.dtype, device=pred.device)
        return (pred * noisy if noisy.sum() > 0 else torch.zeros_like(pred)).float()

    def _vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        p = self.pipe
        dtype = p.vae.dtype
        mean = p._vae_latents_mean.to(device=latents.device, dtype=dtype).view(1, -1, 1, 1, 1)
        inv_std = p._vae_latents_inv_std.to(device=latents.device, dtype=dtype)
        z = latents.to(dtype) / inv_std.view(1, -1, 1, 1, 1) + mean
        return p.vae.decode(z).sample.to(latents.dtype)

    @torch.no_grad()
    def decode(self, state: DenoiseState) -> torch.Tensor:
        frames = super().decode(state)
        if self.safety_checker is not None:
            # The reference's video check, on the same float frames in [0, 1].
            frames = torch.from_numpy(np.asarray(self.pipe._apply_video_safety_check(
                frames.numpy(), output_type="np", device=self.device)))
        return frames
