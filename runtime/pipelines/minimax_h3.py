"""MiniMax-H3 text to video (diffusers' modular ``MiniMaxH3Blocks``, workflow ``t2va``) with its
transformer under DLO.

MiniMax-H3 generates a video and its soundtrack in one packed sequence: the prompt's rows (a
Qwen3-VL's hidden state after layer 50, refined by the transformer's own text blocks), two
channels of audio latents and the video's patches, all attended jointly by every block of
``transformer_blocks``. It is guidance-distilled: one forward per step, no negative prompt, no
guidance scale. A request of N steps runs N - 1 forwards (the schedule's N points bound N - 1
intervals), so a job's progress counts those. The soundtrack is denoised with the video (the
video depends on it) and decoded by ``decode_audio`` with the directory's audio VAE, as
diffusers' ``decode.audio`` block does; a directory without one renders the video alone.

kiln follows the ``t2va`` blocks operation for operation, calling their own helpers for the
layout, the patchify and the per-row timesteps, and its frames equal the modular pipeline's bit
for bit (CPU, fp32, the same thread count). The text encoder streams its 51+ layers rank-local
(as Wan's UMT5 does); its language-model head and vision tower, which a text prompt never runs,
are never loaded.

Sequence parallelism (sp > 1): the packed sequence is split over a replica's ranks at the seams
diffusers' ``_cp_plan`` for the model declares (``runtime.pipelines.minimax_h3_sequence``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers.modular_pipelines import MiniMaxH3Blocks
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
    patchify_video_latents,
)
from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    audio_latent_num_frames,
    video_latent_num_frames,
)
from diffusers.utils.torch_utils import randn_tensor

from common.families import MINIMAX_H3
from runtime.pipelines.base import DenoiseState, VideoRequest
from runtime.pipelines.diffusers_video import DiffusersVideoPipeline, check_frames
from runtime.pipelines.minimax_h3_sequence import enable_sequence_parallel

# The components the t2va workflow loads from the directory; kiln builds the transformer and the
# text encoder itself (DLO). The audio VAE too, where the directory has one.
_LOADED = ("tokenizer", "processor", "vae", "scheduler", "audio_scheduler")
_AUDIO_VAE = "audio_vae"


def t2v_blocks() -> Any:
    """diffusers' text-to-video workflow of MiniMax-H3, without the soundtrack's decode (so a
    reference renders from a directory without an audio VAE)."""
    blocks = MiniMaxH3Blocks().get_workflow("t2va")
    blocks.sub_blocks.pop("decode.audio")  # the only block that needs the audio VAE
    return blocks


class MiniMaxH3VideoPipeline(DiffusersVideoPipeline):
    """MiniMax-H3 T2V: one forward per step over the prompt, audio and video rows."""

    family = MINIMAX_H3
    enable_sequence_parallel = staticmethod(enable_sequence_parallel)
    text_encoder_blocks: ClassVar[list[str] | None] = ["model.language_model.layers"]
    unused_text_modules: ClassVar[tuple[str, ...]] = ("lm_head", "model.visual")
    # The soundtrack's decoder, and the reference-to-video workflow's second transformer.
    optional_components: ClassVar[tuple[str, ...]] = ("audio_vae", "transformer_ref")
    # The soundtrack's latents, denoised with the video's (both schedulers are saved by default).
    resume_keys: ClassVar[tuple[str, ...]] = ("audio",)

    @classmethod
    def assemble(cls, model_dir: Path, name: str, models: dict[str, Any]) -> Any:
        # The whole t2va workflow where there is an audio VAE: its blocks are what declare the
        # components a modular pipeline loads (kiln calls none of them).
        sound = (model_dir / _AUDIO_VAE).is_dir()
        blocks = MiniMaxH3Blocks().get_workflow("t2va") if sound else t2v_blocks()
        pipe = blocks.init_pipeline(str(model_dir))
        loaded = (*_LOADED, _AUDIO_VAE) if sound else _LOADED
        pipe.load_components(names=list(loaded), local_files_only=True)
        pipe.update_components(**models)
        # load_components logs a component it could not load and leaves it None.
        missing = [n for n in (*loaded, *models) if getattr(pipe, n, None) is None]
        if missing:
            raise ValueError(f"{model_dir}: could not load {', '.join(missing)} of {name} (the "
                             "log above says why; Qwen3-VL's processor needs torchvision)")
        return pipe

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.makes_audio:
            self.pipe.audio_vae.to(self.device)  # beside the video VAE, which load moves

    @property
    def makes_audio(self) -> bool:
        """Whether `decode_audio` gives a soundtrack: the directory has an audio VAE."""
        return getattr(self.pipe, _AUDIO_VAE, None) is not None

    @torch.no_grad()
    def prepare(self, request: VideoRequest) -> DenoiseState:
        p, r, dev = self.pipe, request, self.device
        # 17n + 5 frames (clips of 17 into 5 latents, plus two), on a canvas of VAE x patch.
        check_frames(r, self.family, p.vae_frames_per_chunk, p.canvas_multiple,
                     base=p.vae_latents_per_chunk)
        ids = p.tokenizer(r.prompt, add_special_tokens=False)["input_ids"]
        embeds = get_qwen3vl_prompt_embeds(p.text_encoder, p.processor, ids, {},
                                           text_encoder_layer=p.text_encoder_layer, device=dev,
                                           dtype=self.text_dtype)
        text_tags = torch.full((len(ids),), p.text_tag, dtype=torch.long)
        frames = video_latent_num_frames(r.num_frames, p.vae_frames_per_chunk,
                                         p.vae_latents_per_chunk)
        ratio = p.vae_spatial_compression_ratio
        height, width = r.height // ratio, r.width // ratio
        audio = audio_latent_num_frames(r.num_frames)
        position_ids, tags, video_rows, audio_rows, text_rows, _, _ = (
            MiniMaxH3PrepareLayoutStep.build_packed_sequence(
                text_tags, frames, height, width, audio, p.patch_size, p.audio_channels,
                p.audio_tag, p.video_tag))
        layout = {"position_ids": position_ids.to(dev), "token_tags": tags.to(dev),
                  "video_indices": video_rows.to(dev), "audio_indices": audio_rows.to(dev),
                  "text_indices": text_rows.to(dev)}
        # One generator, drawn in the reference's order: the video's noise, then the audio's.
        generator = self._generator(r.seed)
        noise = randn_tensor((1, p.vae_latent_channels, frames, height, width),
                             generator=generator, device=dev, dtype=torch.float32)
        audio_latents = randn_tensor((audio * p.audio_channels, p.audio_latent_channels),
                                     generator=generator, device=dev, dtype=torch.float32)
        video, sound = self._own_scheduler(), self._own_scheduler("audio_scheduler")
        video.set_timesteps(r.num_inference_steps, device=dev)
        sound.set_timesteps(r.num_inference_steps, device=dev)
        plan = [tuple(x.to(dev) for x in MiniMaxH3SetTimestepsStep.build_row_timesteps(
                    video_rows, audio_rows, 0, 0, text_rows.numel(), float(t), float(ta),
                    max(float(t), p.keyframe_noise_aug), 1.0))
                for t, ta in zip(video.timesteps, sound.timesteps, strict=False)]
        extra = {"embeds": embeds, "layout": layout, "audio": audio_latents, "plan": plan,
                 "schedulers": (video, sound), "shape": (frames, height, width)}
        return DenoiseState(request=r, latents=patchify_video_latents(noise, p.patch_size),
                            num_inference_steps=len(plan), extra=extra)

    @property
    def text_dtype(self) -> torch.dtype:
        return self.pipe.text_encoder._kiln_dtype

    @torch.no_grad()
    def _denoise(self, state: DenoiseState) -> None:
        x, i = state.extra, state.step_index
        video, sound = x["schedulers"]
        timesteps, rows = x["plan"][i]
        noise, audio_noise = self.pipe.transformer(
            hidden_states=state.latents[None], audio_hidden_states=x["audio"][None],
            encoder_hidden_states=x["embeds"], timestep=timesteps, timestep_indices=rows,
            return_dict=False, **x["layout"])
        state.latents = video.step(noise[0].float(), video.timesteps[i], state.latents,
                                   return_dict=False)[0]
        x["audio"] = sound.step(audio_noise[0].float(), sound.timesteps[i], x["audio"],
                                return_dict=False)[0]

    def _final_latents(self, state: DenoiseState) -> torch.Tensor:
        """The video's rows back in the latent video's shape (the inverse of the patchify)."""
        p = self.pipe
        frames, height, width = state.extra["shape"]
        pt, ph, pw = p.patch_size
        channels = p.vae_latent_channels
        rows = state.latents.reshape(-1, frames // pt, height // ph, width // pw, channels,
                                     pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return rows.reshape(-1, channels, frames, height, width).contiguous()

    @torch.no_grad()
    def decode(self, state: DenoiseState) -> torch.Tensor:
        """[N, H, W, 3] in [0, 1]. The VAE decodes in chunks of its own (7 latent frames, with
        spatial tiles above 256 px) into ImageNet-normalised colour, which is reverted and
        clamped as the reference does; its post-processing (no normalisation) is a transpose."""
        p, dev = self.pipe, self.device
        latents = self._final_latents(state)
        mean = torch.tensor(p.vae.config.latents_mean, device=dev).view(1, -1, 1, 1, 1)
        std = torch.tensor(p.vae.config.latents_std, device=dev).view(1, -1, 1, 1, 1)
        video = p.vae.decode(latents * std + mean, return_dict=False)[0]
        pixel_mean = torch.tensor(p.pixel_mean, device=dev).view(1, -1, 1, 1, 1)
        pixel_std = torch.tensor(p.pixel_std, device=dev).view(1, -1, 1, 1, 1)
        video = (video.float() * pixel_std + pixel_mean).clamp(0, 1)
        return video[0].permute(1, 2, 3, 0).cpu()

    @torch.no_grad()
    def decode_audio(self, state: DenoiseState) -> tuple[torch.Tensor, int] | None:
        """The soundtrack of a finished job: float samples ``[2, 800 x latents]`` in [-1, 1]
        (left, right) on the CPU, and the audio VAE's sample rate; None without an audio VAE
        (`makes_audio`). As diffusers' after-denoise step (its audio half) and ``decode.audio``
        block: the channel-major rows become the mono VAE's two batch items, denormalised by
        its latents' mean and std, decoded, and the batch made the channel axis. The sound
        covers ``audio_latent_num_frames`` latents of 1/40 s, so it ends within 1/80 s of the
        last frame at 24 fps (`storage.video.fit_audio` fits it to the video)."""
        if not self.makes_audio:
            return None
        p, dev = self.pipe, self.device
        rows = state.extra["audio"]
        latents = rows.reshape(p.audio_channels, -1, rows.shape[-1]).permute(0, 2, 1).contiguous()
        mean = torch.tensor(p.audio_vae.config.latents_mean, device=dev).view(1, -1, 1)
        std = torch.tensor(p.audio_vae.config.latents_std, device=dev).view(1, -1, 1)
        audio = p.audio_vae.decode(latents * std + mean, return_dict=False)[0]
        return audio.float().permute(1, 0, 2)[0].cpu(), p.audio_sampling_rate
