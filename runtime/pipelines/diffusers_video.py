"""Real video DiTs from a local diffusers model directory, with their transformers under DLO.

Loading is one path for every family: each transformer (``transformer``, and ``transformer_2``
for Wan2.2's two experts) is built on the meta device from its config and handed to
:func:`runtime.dlo.apply_dlo` with its own directory as the checkpoint, so block weights are
streamed from the memory-mapped safetensors and never copied whole into any rank. diffusers'
pipeline class (named in ``model_index.json``; MiniMax-H3: its modular pipeline, ``assemble``)
then loads the tokenizer, text encoder, VAE and scheduler around those transformers. The offload
mechanism knows nothing about the family; a family says only what its loop never runs (dropped
before loading), its text encoder's block lists and its optional components.

What differs per family is the denoising loop (which loop a model gets, and the least size multiple
it renders, come from its family in ``common.families``; ``runtime.pipelines.registry`` maps one to
the other), following each reference pipeline operation for operation. Here: ``WanPipeline``
(Wan2.1, Wan2.2 with two experts) and ``CogVideoXPipeline``; Wan image-to-video
(``runtime.pipelines.wan_i2v``), Cosmos3 and MiniMax-H3 have modules of their own. CogVideoX's
output matches its reference bit for bit (CPU, fp32, the same number of CPU threads: kernels split
their reductions by thread count), and so does Wan's with ``cfg_batch=False``. By default Wan runs
its CFG pair as one batch-2 forward where ``WanPipeline`` runs two batch-1 forwards (one gather per
block per step, not two), which changes the last bits: a one-row matmul (the timestep embedding of a
batch-1 forward) takes a different kernel from a two-row one. The loop is driven step by step (see
``runtime.pipelines.base``); each job keeps its own copy of the scheduler, whose multistep state
belongs to that job.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import diffusers
import diffusers.utils.logging as dlog
import PIL.Image
import torch
import transformers.utils.logging as tlog
from diffusers import CogVideoXDPMScheduler
from diffusers.utils.torch_utils import randn_tensor

from common import admission
from common.families import COGVIDEOX, FAMILIES, WAN, Family, family_of, model_index
from runtime.budget import AUTO, DeviceBudget, activation_bytes, resolve_budget
from runtime.dlo import DLOHandle, apply_dlo
from runtime.models.loading import build_on_meta
from runtime.pipelines.base import DenoiseState, VideoPipeline, VideoRequest
from runtime.pipelines.wan_sequence import enable_sequence_parallel
from runtime.platform import default_device, get_platform
from runtime.sequence import SequenceParallel
from runtime.step_cache import StepCache
from runtime.tiling import map_tiles, plan_tiles

TRANSFORMER_NAMES = ("transformer", "transformer_2")


class DiffusersVideoPipeline(VideoPipeline):
    """Shared loading and request-tiled decode; subclasses hold one family's loop."""

    #: The family this loop renders (its ``pipeline`` names this class).
    family: ClassVar[Family]
    #: The reference pipeline's default text length.
    max_sequence_length: ClassVar[int] = 512
    #: Whether the loop can run the CFG pair as two batch-1 forwards (``cfg_batch=False``).
    unbatched_cfg: ClassVar[bool] = True
    #: Modules of the transformer, and of the text encoder, that this loop never runs: dropped
    #: before the weights load, so no rank holds them.
    unused_modules: ClassVar[tuple[str, ...]] = ()
    unused_text_modules: ClassVar[tuple[str, ...]] = ()
    #: The text encoder's block lists (T5's; None: found by ``runtime.dlo.find_block_lists``).
    text_encoder_blocks: ClassVar[list[str] | None] = ["encoder.block"]
    #: Components of the model's index the loop renders without (diffusers' own optional ones).
    optional_components: ClassVar[tuple[str, ...]] = ()

    def __init__(self, pipe: Any, handles: Sequence[DLOHandle | None], *,
                 device: torch.device, text_handle: DLOHandle | None = None,
                 cfg_batch: bool = True) -> None:
        if not cfg_batch and not self.unbatched_cfg:
            raise ValueError(f"{self.family.name} runs its CFG pair as one batch-2 forward only")
        super().__init__(handles)
        self.cfg_batch = cfg_batch  # the CFG pair as one batch-2 forward
        self.pipe = pipe
        self.device = device
        self.text_handle = text_handle  # the text encoder's blocks, streamed rank-local
        self.transformers = [getattr(pipe, n) for n in TRANSFORMER_NAMES
                             if getattr(pipe, n, None) is not None]
        self.decode_free_bytes: int | None = None  # None: measure free memory at decode time
        self.last_decode_plan: Any = None

    @classmethod
    def pipeline_kwargs(cls, model_dir: Path) -> dict[str, Any]:
        """Extra arguments for the diffusers pipeline's ``from_pretrained``."""
        return {}

    @classmethod
    def assemble(cls, model_dir: Path, name: str, models: dict[str, Any]) -> Any:
        """The diffusers pipeline ``name`` of ``model_dir`` around ``models`` (the transformers
        and text encoder kiln built under DLO), its other components loaded from the directory:
        nothing is fetched from a hub at run time."""
        return getattr(diffusers, name).from_pretrained(
            model_dir, local_files_only=True, **cls.pipeline_kwargs(model_dir), **models)

    @classmethod
    def load(cls, model_dir: str | Path, *, group: Any = None, device: Any = None,
             use_allgather: bool = True, cfg_batch: bool = True,
             sequence: SequenceParallel | None = None, device_budget: DeviceBudget = AUTO,
             max_tokens: int | None = None,
             weights_dtype: str = "checkpoint") -> DiffusersVideoPipeline:
        """This family's loop around the model's components (``runtime.pipelines.registry``
        picks the class by ``common.families.family_of``); ``cfg_batch=False``: Wan's CFG pair
        as two batch-1 forwards (CogVideoX refuses it); ``sequence``: the replica's split of
        the token sequence (Wan; ``runtime.sequence``); ``device_budget``: device memory for
        resident blocks (``runtime.budget``), with activations reserved for a job of
        ``max_tokens`` tokens (default: the family's most); ``weights_dtype``: the dtype the
        transformers' streamed blocks are kept and moved in (``apply_dlo``)."""
        model_dir = Path(model_dir)
        index = model_index(str(model_dir))
        name = index.get("_class_name", "")
        if not cfg_batch and not cls.unbatched_cfg:
            raise ValueError(f"{cls.family.name} runs its CFG pair as one batch-2 forward only")
        if sequence is not None and not cls.family.sequence_parallel:
            splits = ", ".join(f.name for f in FAMILIES if f.sequence_parallel)
            raise ValueError(f"{model_dir}: {name} runs at sp=1; sequence parallelism (sp > 1) "
                             f"renders {splits}")
        check_components(model_dir, index, cls.optional_components)
        # The engine's default device too, so every component lands on the same one.
        dev = torch.device(device) if device is not None else default_device()
        transformers: dict[str, Any] = {}
        handles: list[DLOHandle | None] = []
        names = [t for t in TRANSFORMER_NAMES if (spec := index.get(t)) and spec[0] is not None
                 and (model_dir / t).is_dir()]
        tokens = max_tokens or family_of(str(model_dir)).max_tokens
        for tname in names:
            model = build_on_meta(model_dir / tname)
            _drop(model, cls.unused_modules)
            # dtype before DLO swaps the block parameters for placeholders.
            model._kiln_dtype = next(model.parameters()).dtype
            budget = resolve_budget(device_budget, get_platform(dev), parts=len(names),
                                    activations=_activations(model, model_dir, tokens, sequence),
                                    maps_checkpoint=not use_allgather)
            handles.append(apply_dlo(model, checkpoint=model_dir / tname, group=group,
                                     use_allgather=use_allgather, device=dev,
                                     device_budget_bytes=budget, weights_dtype=weights_dtype))
            if sequence is not None:
                cls.enable_sequence_parallel(model, sequence)
                model._kiln_sequence_parallel = True  # no step cache (runtime.step_cache)
            transformers[tname] = model
        if not transformers:
            raise ValueError(f"{model_dir}: no transformer directory")
        # The text encoder (Wan's UMT5-XXL: 5.7 B parameters) streams its blocks too, but
        # rank-local: a rank encodes its job's prompt when it admits the job, so its forwards
        # are not in step with the other ranks' and must not wait on gathers. The ranks still
        # share one copy of its weights, the checkpoint's page cache; on the CPU its blocks are
        # bound to that mapping for good (``runtime.budget``).
        text_handle = None
        text_dir = model_dir / "text_encoder"
        if (text_dir / "config.json").is_file():
            encoder = build_on_meta(text_dir)
            _drop(encoder, cls.unused_text_modules)
            encoder._kiln_dtype = next(encoder.parameters()).dtype
            platform = get_platform(dev)
            text_budget = (None if platform.is_accelerator else resolve_budget(
                device_budget, platform, activations=0, maps_checkpoint=True))
            text_handle = apply_dlo(encoder, checkpoint=text_dir, blocks=cls.text_encoder_blocks,
                                    group=group, use_allgather=False, device=dev,
                                    device_budget_bytes=text_budget)
            transformers["text_encoder"] = encoder
        with _quiet_loading():
            pipe = cls.assemble(model_dir, name, transformers)
        pipe.set_progress_bar_config(disable=True)
        pipe.vae.to(dev)
        if text_handle is None and getattr(pipe, "text_encoder", None) is not None:
            pipe.text_encoder.to(dev)
        return cls(pipe, handles, device=dev, text_handle=text_handle, cfg_batch=cfg_batch)

    @staticmethod
    def enable_sequence_parallel(model: Any, sp: SequenceParallel) -> None:
        """Split the transformer's token sequence over the replica (families whose
        ``sequence_parallel`` is set)."""
        raise NotImplementedError

    def _own_scheduler(self, name: str = "scheduler") -> Any:
        """A copy of the model's scheduler for one job: its multistep state is the job's."""
        return copy.deepcopy(getattr(self.pipe, name))

    def close(self) -> None:
        super().close()
        if self.text_handle is not None:
            self.text_handle.close()

    # ---- the shared decode ------------------------------------------------------------

    def _vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        """[1, ...] final latents -> [1, 3, N, H, W] video in [-1, 1]."""
        raise NotImplementedError

    @torch.no_grad()
    def decode(self, state: DenoiseState) -> torch.Tensor:
        """[N, H, W, 3] frames in [0, 1].

        Both VAEs decode their latent frames in chunks of their own (Wan: one latent frame at a
        time with a causal cache; CogVideoX: ``frame_batch_size``), so their transients do not
        grow with the clip; what does is diffusers' post-processing (denormalise, clamp, channels
        last, float32 copies of the whole video), so kiln runs that same code on tiles of frames
        sized by free memory. It is per frame, so the bits equal one pass."""
        video = self._vae_decode(self._final_latents(state))
        frames_NCHW = video[0].permute(1, 0, 2, 3)
        n, c, h, w = frames_NCHW.shape
        # Per frame: the float32 result plus two intermediate copies of the frame.
        plan = plan_tiles(n, 3 * c * h * w * 4, free_bytes=self.decode_free_bytes,
                          device=self.device)
        self.last_decode_plan = plan
        processor = self.pipe.video_processor

        def postprocess(f: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(processor.postprocess(f, output_type="np"))

        return map_tiles(postprocess, frames_NCHW, torch.empty((n, h, w, c)), plan)

    def _final_latents(self, state: DenoiseState) -> torch.Tensor:
        return state.latents

    def _generator(self, seed: int) -> torch.Generator:
        # A CPU generator, as the reference pipelines take: the same seed gives the same noise
        # whatever device renders.
        return torch.Generator("cpu").manual_seed(seed)


def _drop(model: Any, paths: Sequence[str]) -> None:
    """Remove the submodules ``paths`` (dotted) from ``model`` before its weights load."""
    for path in paths:
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, None)


def _activations(model: Any, model_dir: Path, tokens: int,
                 sequence: SequenceParallel | None) -> int:
    """What a rank keeps free of resident blocks: a block's activations on this rank's share of
    the largest admitted job, and the components placed after the transformers (the VAE, an
    image-to-video model's image encoder, and the text encoder, counted whole: its blocks
    stream, but a conservative budget only streams a little more)."""
    c = model.config
    width = getattr(c, "hidden_size", None) or (
        getattr(c, "num_attention_heads", 1) * getattr(c, "attention_head_dim", 1))
    ffn = getattr(c, "ffn_dim", None) or getattr(c, "intermediate_size", None) or 4 * width
    shard = -(-tokens // (sequence.degree if sequence is not None else 1))
    others = sum(f.stat().st_size for part in ("vae", "text_encoder", "image_encoder")
                 for f in (model_dir / part).glob("*.safetensors"))
    dtype_bytes = torch.empty((), dtype=model._kiln_dtype).element_size()
    return activation_bytes(shard, width, ffn, dtype_bytes) + others


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    """No per-component progress bars or install hints from the hub libraries while loading:
    a render prints its own progress."""
    levels = dlog.get_verbosity(), tlog.get_verbosity()
    bars = dlog.is_progress_bar_enabled(), tlog.is_progress_bar_enabled()
    dlog.set_verbosity_error()
    tlog.set_verbosity_error()
    dlog.disable_progress_bar()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        dlog.set_verbosity(levels[0])
        tlog.set_verbosity(levels[1])
        for log, enabled in zip((dlog, tlog), bars, strict=True):
            if enabled:
                log.enable_progress_bar()


def check_components(model_dir: Path, index: dict[str, Any],
                     optional: Sequence[str] = ()) -> None:
    """Every component the index names (``[library, class, ...]``) is a directory of the
    model, unless it is one the pipeline renders without: a clear error before anything loads,
    where diffusers would look for it on the hub."""
    missing = [f"{name} ({spec[1]})" for name, spec in index.items()
               if not name.startswith("_") and isinstance(spec, list) and len(spec) >= 2
               and spec[0] is not None and name not in optional
               and not (model_dir / name).is_dir()]
    if missing:
        raise ValueError(f"{model_dir} lacks {', '.join(missing)}, which its "
                         f"{index.get('_class_name')} needs; kiln reads every component from "
                         "the model directory and downloads nothing")


def check_frames(r: VideoRequest, family: Family, temporal: int, multiple: int,
                 base: int = 1) -> None:
    """The request against the model's own rules (`common.admission.model_problems`, the rules
    the API and `kiln render` refuse by) with the numbers the loaded model reports: a clip has
    ``base`` + k x ``temporal`` frames within the family's ``min_frames`` and ``max_frames``;
    sizes are multiples of ``multiple`` and of the family's ``size_multiple``. A ValueError
    naming every problem, each with the nearest valid value."""
    loaded = dataclasses.replace(family, frame_stride=temporal, frame_base=base,
                                 size_multiple=math.lcm(family.size_multiple, multiple))
    admission.raise_if_any(admission.model_problems(loaded, r))


class WanVideoPipeline(DiffusersVideoPipeline):
    """Wan2.1 / Wan2.2 T2V: CFG as one batch-2 forward ([conditional, unconditional]); with
    ``cfg_batch=False`` as two batch-1 forwards (conditional, then unconditional), as the
    reference pipeline runs it. Wan2.2 gathers only the expert its step needs (``handles_needed``).

    With a video (``request.conditioning.video``), Wan2.1 renders video-to-video as
    ``WanVideoToVideoPipeline`` does (`_video_latents`): the clip's latents noised as far as
    ``strength`` says (1.0: from the top of the schedule; 0.5: from halfway down), and the
    steps from there.
    """

    family = WAN
    max_sequence_length = 512
    enable_sequence_parallel = staticmethod(enable_sequence_parallel)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.forwards_per_step = 1 if self.cfg_batch else 2
        self.step_caches = [
            None if getattr(model, "_kiln_sequence_parallel", False)
            else StepCache(model.blocks, handle)
            for model, handle in zip(self.transformers, self.handles, strict=True)]

    @torch.no_grad()
    def prepare(self, request: VideoRequest) -> DenoiseState:
        p, r = self.pipe, request
        patch = p.transformer.config.patch_size
        check_frames(r, self.family, p.vae_scale_factor_temporal,
                      p.vae_scale_factor_spatial * max(patch[1], patch[2]))
        cfg = r.guidance_scale > 1.0
        cond, uncond = p.encode_prompt(prompt=r.prompt, negative_prompt=r.negative_prompt,
                                       do_classifier_free_guidance=cfg, num_videos_per_prompt=1,
                                       max_sequence_length=self.max_sequence_length,
                                       device=self.device)
        dtype = self.transformers[0]._kiln_dtype
        scheduler = self._own_scheduler()
        scheduler.set_timesteps(r.num_inference_steps, device=self.device)
        video = self._video(r)
        if video is None:
            scheduler.set_begin_index(0)
            latents = p.prepare_latents(1, p.transformer.config.in_channels, r.height, r.width,
                                        r.num_frames, torch.float32, self.device,
                                        self._generator(r.seed))
            first_step, num_steps = 0, r.num_inference_steps
        else:
            latents, first_step = self._video_latents(r, video, scheduler)
            num_steps = len(scheduler.timesteps) - first_step
        ratio = p.config.boundary_ratio
        extra = {
            "cond": cond.to(dtype), "uncond": uncond.to(dtype) if cfg else None,
            "scheduler": scheduler, "first_step": first_step,
            "boundary": None if ratio is None else ratio * scheduler.config.num_train_timesteps,
        }
        return DenoiseState(request=r, latents=latents, num_inference_steps=num_steps,
                            extra=extra)

    def _video(self, r: VideoRequest) -> list[Any] | None:
        """The request's clip as the PIL frames the reference takes (None: text to video); a
        ValueError for an input this loop does not render from."""
        c = r.conditioning
        if c is None:
            return None
        if c.image is not None or c.last_image is not None:
            raise ValueError(f"{self.family.name} renders from text or a video, not from an "
                             "image (an image-to-video model does)")
        if c.video is None:
            return None
        if len(self.transformers) > 1 or self.pipe.config.expand_timesteps:
            raise ValueError("video-to-video renders Wan2.1 models (one transformer, as "
                             "WanVideoToVideoPipeline runs), not Wan2.2's")
        want = (r.num_frames, r.height, r.width, 3)
        if c.video.dtype != torch.uint8 or tuple(c.video.shape) != want:
            raise ValueError(f"the video must be uint8 {list(want)}: the request's frames at its "
                             f"size; got {c.video.dtype} {list(c.video.shape)}")
        return [PIL.Image.fromarray(frame) for frame in c.video.detach().cpu().numpy()]

    def _video_latents(self, r: VideoRequest, video: list[Any],
                       scheduler: Any) -> tuple[torch.Tensor, int]:
        """``WanVideoToVideoPipeline``'s start: the steps ``strength`` (default 0.8, its own)
        leaves of the schedule (``get_timesteps``: the first ``num_inference_steps - int(steps x
        strength)`` are skipped), and the latents: the VAE's mode of the clip, normalised, then
        noised by the scheduler to the first remaining timestep. Returns (latents, index of
        the first step run)."""
        p = self.pipe
        c = r.conditioning
        assert c is not None
        strength = 0.8 if c.strength is None else c.strength
        steps = r.num_inference_steps
        skipped = steps - min(int(steps * strength), steps)
        if skipped >= steps:
            raise ValueError(f"strength {strength} of {steps} steps runs no step; it must be "
                             f"at least {1 / steps:.3g}")
        first_step = skipped * scheduler.order
        pixels = p.video_processor.preprocess_video(video, height=r.height, width=r.width).to(
            self.device, dtype=torch.float32)
        vae = p.vae
        z = vae.config.z_dim
        encoded = vae.encode(pixels[0].unsqueeze(0).to(self.device, dtype=vae.dtype))
        init = encoded.latent_dist.mode().to(torch.float32)
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(self.device,
                                                                          torch.float32)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(
            self.device, torch.float32)
        init = (init - mean) * inv_std
        spatial = p.vae_scale_factor_spatial
        shape = (1, p.transformer.config.in_channels,
                 (r.num_frames - 1) // p.vae_scale_factor_temporal + 1, r.height // spatial,
                 r.width // spatial)
        noise = randn_tensor(shape, generator=self._generator(r.seed), device=self.device,
                             dtype=torch.float32)
        start = scheduler.timesteps[first_step:first_step + 1]
        return scheduler.add_noise(init, noise, start), first_step

    def _timestep(self, state: DenoiseState) -> torch.Tensor:
        """The timestep of the job's next step (video-to-video starts part-way down)."""
        x = state.extra
        return x["scheduler"].timesteps[x.get("first_step", 0) + state.step_index]

    def _expert(self, state: DenoiseState) -> int:
        """The transformer the job's next step runs: Wan2.2's high-noise expert at timesteps at
        or above the boundary, the low-noise one below (Wan2.1: its one transformer)."""
        t = self._timestep(state)
        boundary = state.extra["boundary"]
        return 0 if boundary is None or t >= boundary else 1

    def handles_needed(self, state: DenoiseState) -> list[bool]:
        expert = self._expert(state)
        return [i == expert for i in range(len(self.handles))]

    @torch.no_grad()
    def _denoise(self, state: DenoiseState) -> None:
        x, scheduler = state.extra, state.extra["scheduler"]
        t = self._timestep(state)
        expert = self._expert(state)
        model = self.transformers[expert]
        self._complete_handles_before(expert)  # same handle order on every rank
        latents = state.latents
        model_input = self._model_input(state).to(model._kiln_dtype)
        image = x.get("image_embeds")  # Wan2.1 I2V: its image's CLIP tokens; else None
        batched = x["uncond"] is not None and self.cfg_batch
        batch = 2 * latents.shape[0] if batched else latents.shape[0]
        if self.pipe.config.expand_timesteps:
            # Wan2.2 TI2V: one timestep per token (every token is noised the same here).
            mask = torch.ones(latents.shape, dtype=torch.float32, device=latents.device)
            timestep = (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(batch, -1)
        else:
            timestep = t.expand(batch)
        noise_uncond = None
        if batched:
            # [cond, uncond] on the batch axis (both padded to max_sequence_length): each block
            # computes both branches while it is in its slot.
            with self._forward(expert, state):
                noise, noise_uncond = model(
                    hidden_states=torch.cat([model_input, model_input]), timestep=timestep,
                    encoder_hidden_states=torch.cat([x["cond"], x["uncond"]]),
                    encoder_hidden_states_image=(None if image is None
                                                 else torch.cat([image, image])),
                    return_dict=False)[0].chunk(2)
        else:
            with self._forward(expert, state, 0):
                noise = model(hidden_states=model_input, timestep=timestep,
                              encoder_hidden_states=x["cond"], encoder_hidden_states_image=image,
                              return_dict=False)[0]
            if x["uncond"] is not None:
                with self._forward(expert, state, 1):
                    noise_uncond = model(hidden_states=model_input, timestep=timestep,
                                         encoder_hidden_states=x["uncond"],
                                         encoder_hidden_states_image=image,
                                         return_dict=False)[0]
        if noise_uncond is not None:
            noise = noise_uncond + state.request.guidance_scale * (noise - noise_uncond)
        state.latents = scheduler.step(noise, t, latents, return_dict=False)[0]

    def _model_input(self, state: DenoiseState) -> torch.Tensor:
        """What the transformer denoises, fp32: the latents (image-to-video: with the image's
        condition beside them, ``runtime.pipelines.wan_i2v``)."""
        return state.latents

    def _vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        z = vae.config.z_dim
        latents = latents.to(self.device, dtype=vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device,
                                                                            latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(
            latents.device, latents.dtype)
        return vae.decode(latents / inv_std + mean, return_dict=False)[0]


class CogVideoXVideoPipeline(DiffusersVideoPipeline):
    """CogVideoX T2V: CFG as one batch-2 forward ([unconditional, conditional]), as the
    reference pipeline runs it."""

    family = COGVIDEOX
    forwards_per_step = 1
    max_sequence_length = 226

    unbatched_cfg = False
    # CogVideoXDPMScheduler's previous prediction, which its next step takes (its generator, in
    # ``step_kwargs``, is saved by default).
    resume_keys = ("old_pred",)

    @torch.no_grad()
    def prepare(self, request: VideoRequest) -> DenoiseState:
        p, r = self.pipe, request
        config = p.transformer.config
        check_frames(r, self.family, p.vae_scale_factor_temporal,
                      p.vae_scale_factor_spatial * config.patch_size)
        cfg = r.guidance_scale > 1.0
        cond, uncond = p.encode_prompt(r.prompt, r.negative_prompt, cfg, num_videos_per_prompt=1,
                                       max_sequence_length=self.max_sequence_length,
                                       device=self.device)
        embeds = torch.cat([uncond, cond], dim=0) if cfg else cond
        scheduler = self._own_scheduler()
        scheduler.set_timesteps(r.num_inference_steps, device=self.device)
        num_frames = r.num_frames
        latent_frames = (num_frames - 1) // p.vae_scale_factor_temporal + 1
        extra_frames = 0
        if config.patch_size_t is not None and latent_frames % config.patch_size_t:
            # CogVideoX 1.5 patches time too: pad the clip, drop the padding before decode.
            extra_frames = config.patch_size_t - latent_frames % config.patch_size_t
            num_frames += extra_frames * p.vae_scale_factor_temporal
        generator = self._generator(r.seed)
        latents = p.prepare_latents(1, config.in_channels, num_frames, r.height, r.width,
                                    embeds.dtype, self.device, generator)
        rotary = (p._prepare_rotary_positional_embeddings(r.height, r.width, latents.size(1),
                                                          self.device)
                  if config.use_rotary_positional_embeddings else None)
        extra = {
            "embeds": embeds, "cfg": cfg, "scheduler": scheduler, "rotary": rotary,
            "step_kwargs": p.prepare_extra_step_kwargs(generator, 0.0),
            "dpm": isinstance(scheduler, CogVideoXDPMScheduler), "old_pred": None,
            "extra_frames": extra_frames,
        }
        return DenoiseState(request=r, latents=latents,
                            num_inference_steps=r.num_inference_steps, extra=extra)

    @torch.no_grad()
    def _denoise(self, state: DenoiseState) -> None:
        x, scheduler, i = state.extra, state.extra["scheduler"], state.step_index
        timesteps = scheduler.timesteps
        t = timesteps[i]
        latents = state.latents
        model_input = torch.cat([latents] * 2) if x["cfg"] else latents
        model_input = scheduler.scale_model_input(model_input, t)
        noise = self.pipe.transformer(hidden_states=model_input,
                                      encoder_hidden_states=x["embeds"],
                                      timestep=t.expand(model_input.shape[0]),
                                      image_rotary_emb=x["rotary"], return_dict=False)[0].float()
        if x["cfg"]:
            noise_uncond, noise_text = noise.chunk(2)
            noise = noise_uncond + state.request.guidance_scale * (noise_text - noise_uncond)
        if x["dpm"]:
            latents, x["old_pred"] = scheduler.step(
                noise, x["old_pred"], t, timesteps[i - 1] if i > 0 else None, latents,
                **x["step_kwargs"], return_dict=False)
        else:
            latents = scheduler.step(noise, t, latents, **x["step_kwargs"], return_dict=False)[0]
        state.latents = latents.to(x["embeds"].dtype)

    def _final_latents(self, state: DenoiseState) -> torch.Tensor:
        return state.latents[:, state.extra["extra_frames"]:]

    def _vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pipe.decode_latents(latents)
