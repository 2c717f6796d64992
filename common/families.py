"""The model families kiln renders, each described once: how it loads, what a request gets for
the fields it leaves out, and the geometry of its latents.

A model renders best at the size, length and step count it was trained for: kiln-tiny at 64x64
and 9 frames, Wan at 832x480 and 81 frames. The API fills a job's missing fields from its
family's ``defaults`` (a ``KILN_DEFAULT_*`` setting, when set, wins for every model) and refuses
at submit the sizes and lengths the family cannot render, by the rule the runtime's pipeline
checks again when the job starts; the runtime loads the pipeline the family names; the API's
bound on one job and the batcher's cost count the rows one transformer forward attends over
(`tokens`): the video's patches, from the family's VAE and patch, and the soundtrack's and the
prompt's rows where the sequence holds them. Reading this needs no torch and no weights:
kiln-tiny is known by name, a diffusers directory by the pipeline class its
``model_index.json`` names (`family_of`).

The numbers are those of the released checkpoints, read from their diffusers configs and
pipelines (diffusers 0.42). Where one checkpoint differs (Wan2.2 TI2V-5B's VAE compresses 16x in
space, CogVideoX 1.5 patches time by 2), the runtime reads the loaded model's own config, and
the family's numbers stay the floor (sizes) and the estimate (tokens); `checkpoint_family` reads
the same configs from the model directory, so the API holds a request to the runtime's rule.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from common.render import RequestDefaults

TINY_MODEL = "kiln-tiny"
# A prompt's own tokens, as `tokens` counts them where the transformer's sequence holds the
# prompt (Cosmos3, MiniMax-H3). Neither pipeline pads nor cuts a prompt, so the true count is the
# prompt's; this is one of about 75 English words.
PROMPT_TOKENS = 100


@dataclass(kw_only=True, frozen=True, slots=True)
class Family:
    """One model family: the pipeline that renders it, its request defaults, what sizes and
    lengths it renders, and the geometry of its latents (which the batcher's cost counts)."""

    name: str
    # The ``_class_name``s of the diffusers pipelines (in ``model_index.json``) of this family.
    diffusers_classes: tuple[str, ...] = ()
    # The runtime's pipeline class that renders this family, by name (``runtime.render`` maps it
    # to the class); None: kiln cannot render it.
    pipeline: str | None
    defaults: RequestDefaults  # what a request gets for the fields it leaves out
    size_multiple: int  # width and height are multiples of this
    frame_stride: int  # the family renders frame_base + k * frame_stride frames
    patch_size: tuple[int, int, int]  # the transformer's patch: (frames, height, width)
    vae_scale_factor_spatial: int  # pixels per latent pixel, along height and width
    vae_scale_factor_temporal: int  # frames per latent frame, after the first (a causal VAE)
    # The largest job a deployment accepts unless it says otherwise (Settings.max_job_tokens):
    # rows per transformer forward (`tokens`). The work bound is this step 50 times.
    max_tokens: int
    # Whether its pipeline offers a preview frame while a job runs (the pipeline's
    # ``can_preview``, known here without torch for the job page).
    previews: bool = False
    # Whether its pipeline splits one job's token sequence over a replica's ranks (sp > 1).
    sequence_parallel: bool = False
    # The kinds of input file ("image", "video") its pipeline conditions a render on; empty:
    # text only, and a request that brings a file is refused naming the parameter.
    inputs: frozenset[str] = frozenset()
    # Whether every render needs one of those inputs (image-to-video); False: text alone will do.
    needs_input: bool = False
    # Whether a video input is rendered video-to-video, noised part-way by a request's strength;
    # False: the clip's frames are kept as they are and the rest rendered (Cosmos3), no strength.
    takes_strength: bool = True
    # A clip has frame_base + k * frame_stride frames, between min_frames and max_frames: 1 + 4k
    # for the causal VAEs (the first frame alone, then 4 per latent frame); MiniMax-H3's VAE
    # encodes clips of 17 frames into 5 latents plus two, so 5 + 17k, from 5 s to 15 s.
    frame_base: int = 1
    min_frames: int = 1
    max_frames: int | None = None
    # (latent frames of frame_base frames, latent frames per frame_stride frames after them) for
    # a VAE that is not causal in 1 + 4k (MiniMax-H3's: (2, 5)); None: 1 + (frames - 1) // the
    # VAE's time factor.
    latent_frames: tuple[int, int] | None = None
    # Rows besides the video's in the sequence every block attends over (`tokens`): audio
    # latents per video frame, in each of audio_channels channels; and the prompt's rows,
    # counted for a prompt of PROMPT_TOKENS tokens with what the pipeline wraps around it.
    audio_latents_per_frame: Fraction = Fraction(0)
    audio_channels: int = 0
    prompt_rows: int = 0


# kiln-tiny (``runtime.models.tiny.TinyConfig``): spatial_compression 8 times patch_size 2, and
# temporal_compression 4. Its defaults are what it was trained on (scripts/train_tiny.py) and
# what `kiln render` uses. It takes a first frame (``--image``) and continues it the way the
# prompt says, restyles a clip (``--video``, video-to-video), or renders from text alone.
TINY = Family(
    name=TINY_MODEL, pipeline="TinyPipeline",
    defaults=RequestDefaults(width=64, height=64, num_frames=9, fps=8, num_inference_steps=4,
                             guidance_scale=5.0),
    size_multiple=16, frame_stride=4, patch_size=(1, 2, 2),
    vae_scale_factor_spatial=8, vae_scale_factor_temporal=4,
    # It renders on CPUs: 16,384 tokens (1024x1024, 13 frames) is a 20 s step on one core of a
    # 2-core machine (one rank of `--dp 2`), a sixth of the default lease; see Settings.
    max_tokens=16_384,
    previews=True,
    sequence_parallel=True,
    inputs=frozenset({"image", "video"}),
)
# Wan2.1 and Wan2.2 T2V: ``WanPipeline.__call__``'s defaults (832x480, 81 frames, 50 steps,
# guidance 5) at the 16 fps of its examples; ``check_inputs`` wants sizes divisible by 16;
# ``AutoencoderKLWan``: scale_factor_spatial 8, scale_factor_temporal 4;
# ``WanTransformer3DModel``: patch_size (1, 2, 2). Wan2.1 also renders video-to-video, as
# ``WanVideoToVideoPipeline`` does with the same directory (which runs one transformer: a
# Wan2.2 checkpoint takes no video, `checkpoint_family`).
WAN = Family(
    name="wan", diffusers_classes=("WanPipeline",), pipeline="WanVideoPipeline",
    defaults=RequestDefaults(width=832, height=480, num_frames=81, fps=16,
                             num_inference_steps=50, guidance_scale=5.0),
    size_multiple=16, frame_stride=4, patch_size=(1, 2, 2),
    vae_scale_factor_spatial=8, vae_scale_factor_temporal=4,
    max_tokens=75_600,  # its largest released setting: 1280x720, 81 frames
    sequence_parallel=True,
    inputs=frozenset({"video"}),
)
# Wan image-to-video: Wan2.1 I2V (480P, 720P; a CLIP image encoder) and FLF2V (first and last
# frame), and Wan2.2 I2V-A14B (two experts, no image encoder), all ``WanImageToVideoPipeline``,
# whose ``__call__`` has WanPipeline's defaults; the geometry of Wan T2V (the transformer takes
# 36 channels in the same patches: the noisy latents' 16 beside the condition's 20, a 4-channel
# mask and the encoded frames' 16). It renders from an image, the first frame (FLF2V: and a
# last one). Wan2.2 I2V splits its sequence over sp > 1 ranks as Wan T2V does; Wan2.1's image
# cross-attention is not split (`checkpoint_family`).
WAN_I2V = Family(
    name="wan-i2v", diffusers_classes=("WanImageToVideoPipeline",),
    pipeline="WanI2VPipeline",
    defaults=RequestDefaults(width=832, height=480, num_frames=81, fps=16,
                             num_inference_steps=50, guidance_scale=5.0),
    size_multiple=16, frame_stride=4, patch_size=(1, 2, 2),
    vae_scale_factor_spatial=8, vae_scale_factor_temporal=4,
    max_tokens=75_600,  # its largest released setting: 1280x720, 81 frames
    inputs=frozenset({"image"}),
    needs_input=True,
    sequence_parallel=True,
)
# CogVideoX: ``CogVideoXPipeline.__call__``'s defaults (the transformer's sample size 90x60
# latents times the VAE's 8: 720x480; 49 frames, 50 steps, guidance 6) at the 8 fps of its
# examples; ``AutoencoderKLCogVideoX``: 4 blocks (2**3 = 8 in space), temporal_compression_ratio
# 4; ``CogVideoXTransformer3DModel``: patch_size 2, no time patch (1.0).
COGVIDEOX = Family(
    name="cogvideox", diffusers_classes=("CogVideoXPipeline",),
    pipeline="CogVideoXVideoPipeline",
    defaults=RequestDefaults(width=720, height=480, num_frames=49, fps=8,
                             num_inference_steps=50, guidance_scale=6.0),
    size_multiple=16, frame_stride=4, patch_size=(1, 2, 2),
    vae_scale_factor_spatial=8, vae_scale_factor_temporal=4,
    max_tokens=85_680,  # CogVideoX1.5's 1360x768, 81 frames, counted without its time patch
)
# Cosmos3 (Nano, Super): ``Cosmos3OmniPipeline.__call__``'s defaults (1280x720, 189 frames at 24
# fps, 35 steps, guidance 6); ``check_inputs`` wants sizes divisible by the VAE's 16 (Wan2.2's
# VAE: 16 in space, 4 in time); ``Cosmos3OmniTransformer`` patches 2x2 and pads an odd latent
# size to whole patches, so 16 is the multiple. Every block of ``layers`` runs the prompt's
# token ids and the video's patches as one packed sequence (the video's queries attend to the
# prompt's keys and their own), each of the CFG pair's two forwards with its own prompt:
# ``tokenize_prompt`` wraps it in a chat template with a system prompt, a duration and a
# resolution sentence, and two special tokens follow: 53 rows at the defaults for an empty
# prompt by the test checkpoints' word-level tokenizer, which keeps no newline or space; about
# 60 with a Qwen BPE's. It also renders from a first frame, or continues a clip's first 5 frames
# (its first two latent frames), as ``Cosmos3OmniPipeline`` does given ``image`` or ``video``.
COSMOS3 = Family(
    name="cosmos3", diffusers_classes=("Cosmos3OmniPipeline",), pipeline="Cosmos3VideoPipeline",
    defaults=RequestDefaults(width=1280, height=720, num_frames=189, fps=24,
                             num_inference_steps=35, guidance_scale=6.0),
    size_multiple=16, frame_stride=4, patch_size=(1, 2, 2),
    vae_scale_factor_spatial=16, vae_scale_factor_temporal=4,
    prompt_rows=60 + PROMPT_TOKENS,
    max_tokens=44_320,  # its default: 48 latent frames x 23 x 40 patches, and a prompt's 160
    inputs=frozenset({"image", "video"}),
    takes_strength=False,  # a clip's frames are kept, not noised part-way
)
# MiniMax-H3: its modular pipeline's defaults (the 16:9 canvas of 1344x768, 124 frames: 5 s at
# its fixed 24 fps; 50 steps, which run 49 forwards); guidance-distilled, so it takes no guidance
# scale and no negative prompt (one forward per step). Sizes are multiples of the VAE's 16 times
# the 2x2 patch; clips are 17n + 5 frames from 5 s to 15 s (124 to 345), of which the t2va
# workflow makes 5n + 2 latent frames (``video_latent_num_frames``: 37 for 124). Every block of
# ``transformer_blocks`` attends over the prompt's rows (its Qwen3-VL tokens, no template), the
# soundtrack's (``audio_latent_num_frames``: 40 latents a second at 24 fps, rounded, in each of 2
# channels: 414 for 124 frames) and the video's patches.
MINIMAX_H3 = Family(
    name="minimax-h3", diffusers_classes=("MiniMaxH3ModularPipeline",),
    pipeline="MiniMaxH3VideoPipeline",
    defaults=RequestDefaults(width=1344, height=768, num_frames=124, fps=24,
                             num_inference_steps=50, guidance_scale=1.0),
    size_multiple=32, frame_stride=17, frame_base=5, min_frames=124, max_frames=345,
    patch_size=(1, 2, 2), vae_scale_factor_spatial=16, vae_scale_factor_temporal=4,
    latent_frames=(2, 5), audio_latents_per_frame=Fraction(40, 24), audio_channels=2,
    prompt_rows=PROMPT_TOKENS,
    # Its longest clip, 345 frames, on the default canvas: 102 latent frames x 24 x 42 patches,
    # 2 x 575 audio rows and a prompt's 100.
    max_tokens=104_066,
    sequence_parallel=True,
)
# Anything else: no pipeline; defaults small enough to finish on a CPU, large enough to see; the
# geometry of a typical video DiT (a causal VAE of 4x8x8, patch 1x2x2) for its cost.
GENERIC = Family(
    name="generic", pipeline=None,
    defaults=RequestDefaults(width=256, height=256, num_frames=17, fps=8,
                             num_inference_steps=30, guidance_scale=5.0),
    size_multiple=16, frame_stride=4, patch_size=(1, 2, 2),
    vae_scale_factor_spatial=8, vae_scale_factor_temporal=4,
    max_tokens=16_384,
)

FAMILIES = (TINY, WAN, COGVIDEOX, COSMOS3, MINIMAX_H3, WAN_I2V)
_BY_DIFFUSERS_CLASS = {c: f for f in FAMILIES for c in f.diffusers_classes}


@functools.cache
def family_of(model: str) -> Family:
    """The family of ``model``: kiln-tiny by name, a diffusers model directory by the pipeline
    class its index (`model_index_path`) names; `GENERIC` for anything else."""
    if model == TINY_MODEL:
        return TINY
    name = model_index(model).get("_class_name")
    return _BY_DIFFUSERS_CLASS.get(name, GENERIC) if isinstance(name, str) else GENERIC


#: The index files of a diffusers model directory: a pipeline's, and a modular pipeline's
#: (MiniMax-H3 ships only the second).
MODEL_INDEX_FILES = ("model_index.json", "modular_model_index.json")


def model_index_path(model: str) -> Path | None:
    """The index file of the diffusers model directory ``model``, if it has one."""
    for name in MODEL_INDEX_FILES:
        if (Path(model) / name).is_file():
            return Path(model) / name
    return None


def model_index(model: str) -> dict[str, Any]:
    """The index of the diffusers model directory ``model`` (its pipeline class, its
    components); empty when it has none or it cannot be read."""
    path = model_index_path(model)
    try:
        index = json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def latent_shape(width: int, height: int, num_frames: int, *,
                 family: Family) -> tuple[int, int, int]:
    """(frames, height, width) of the latent video: a causal VAE keeps the first frame alone;
    MiniMax-H3's makes 5n + 2 latent frames of 17n + 5 (``family.latent_frames``)."""
    if width <= 0 or height <= 0 or num_frames <= 0:
        raise ValueError(f"size and frames must be positive, got {width}x{height}, "
                         f"{num_frames} frames")
    st, s = family.vae_scale_factor_temporal, family.vae_scale_factor_spatial
    if family.latent_frames is None:
        frames = (num_frames - 1) // st + 1
    else:
        first, per_stride = family.latent_frames
        strides = max(0, (num_frames - family.frame_base) // family.frame_stride)
        frames = first + strides * per_stride
    return frames, math.ceil(height / s), math.ceil(width / s)


def tokens(width: int, height: int, num_frames: int, *, family: Family) -> int:
    """Rows of the sequence one transformer forward of ``family`` attends over (e.g. 64x64, 9
    frames on kiln-tiny: 3x4x4=48): the latent video in patches, a partial patch counted whole
    (the runtime pads a clip to whole time patches); MiniMax-H3's soundtrack rows; and where the
    sequence holds the prompt (Cosmos3, MiniMax-H3), ``family.prompt_rows`` for it, which a
    prompt other than one of PROMPT_TOKENS tokens changes."""
    f, h, w = latent_shape(width, height, num_frames, family=family)
    pt, ph, pw = family.patch_size
    audio = family.audio_channels * round(num_frames * family.audio_latents_per_frame)
    return (math.ceil(f / pt) * math.ceil(h / ph) * math.ceil(w / pw) + audio
            + family.prompt_rows)


def _config(model: str, component: str) -> dict[str, Any]:
    try:
        config = json.loads((Path(model) / component / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else default


def _wan_geometry(model: str, family: Family) -> dict[str, Any]:
    # ``WanPipeline``: the VAE's scale_factor_spatial and scale_factor_temporal (Wan2.2
    # TI2V-5B: 16 and 4); ``WanTransformer3DModel``: patch_size (frames, height, width).
    vae, transformer = _config(model, "vae"), _config(model, "transformer")
    patch = transformer.get("patch_size")
    if not (isinstance(patch, list) and len(patch) == 3):
        patch = family.patch_size
    return {"vae_scale_factor_spatial": _int(vae.get("scale_factor_spatial"),
                                             family.vae_scale_factor_spatial),
            "vae_scale_factor_temporal": _int(vae.get("scale_factor_temporal"),
                                              family.vae_scale_factor_temporal),
            "patch_size": tuple(_int(p, d) for p, d in zip(patch, family.patch_size,
                                                          strict=True))}


def _wan_t2v_geometry(model: str, family: Family) -> dict[str, Any]:
    # Video-to-video follows ``WanVideoToVideoPipeline``, which runs one transformer without
    # per-token timesteps: Wan2.1's, not Wan2.2's two experts (``boundary_ratio``) nor TI2V-5B
    # (``expand_timesteps``).
    index = model_index(model)
    wan22 = index.get("boundary_ratio") is not None or bool(index.get("expand_timesteps"))
    return _wan_geometry(model, family) | ({"inputs": frozenset()} if wan22 else {})


def _wan_i2v_geometry(model: str, family: Family) -> dict[str, Any]:
    # Wan2.1 I2V and FLF2V attend to CLIP tokens (``image_dim``), which
    # ``runtime.pipelines.wan_sequence`` does not split: they run at sp=1.
    clip = _config(model, "transformer").get("image_dim") is not None
    return _wan_geometry(model, family) | ({"sequence_parallel": False} if clip else {})


def _cogvideox_geometry(model: str, family: Family) -> dict[str, Any]:
    # ``CogVideoXPipeline``: 2 ** (VAE blocks - 1) in space, the VAE's
    # temporal_compression_ratio in time; the transformer's patch_size, and patch_size_t
    # (CogVideoX 1.5: 2; None: no time patch).
    vae, transformer = _config(model, "vae"), _config(model, "transformer")
    blocks = vae.get("block_out_channels")
    spatial = (2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks
               else family.vae_scale_factor_spatial)
    patch = _int(transformer.get("patch_size"), family.patch_size[1])
    return {"vae_scale_factor_spatial": spatial,
            "vae_scale_factor_temporal": _int(vae.get("temporal_compression_ratio"),
                                              family.vae_scale_factor_temporal),
            "patch_size": (_int(transformer.get("patch_size_t"), 1), patch, patch)}


def _cosmos3_geometry(model: str, family: Family) -> dict[str, Any]:
    # ``Cosmos3OmniPipeline``: the VAE's scale_factor_spatial and scale_factor_temporal (sizes
    # are multiples of the first: the transformer pads a partial patch); the transformer's
    # latent_patch_size, in space only.
    vae, transformer = _config(model, "vae"), _config(model, "transformer")
    spatial = _int(vae.get("scale_factor_spatial"), family.vae_scale_factor_spatial)
    patch = _int(transformer.get("latent_patch_size"), family.patch_size[1])
    return {"vae_scale_factor_spatial": spatial,
            "vae_scale_factor_temporal": _int(vae.get("scale_factor_temporal"),
                                              family.vae_scale_factor_temporal),
            "patch_size": (1, patch, patch), "size_multiple": max(family.size_multiple, spatial)}


_GEOMETRY = {WAN.name: _wan_t2v_geometry, WAN_I2V.name: _wan_i2v_geometry,
             COGVIDEOX.name: _cogvideox_geometry,
             COSMOS3.name: _cosmos3_geometry}


@functools.cache
def checkpoint_family(model: str) -> Family:
    """`family_of(model)` with the geometry the checkpoint's own configs give (its VAE's factors,
    its transformer's patch), read as the runtime reads them from the loaded model: sizes are
    multiples of the larger of the family's ``size_multiple`` and VAE factor x patch, and a clip
    has 1 + k x the VAE's time factor frames. Wan2.2 TI2V-5B (a VAE of 16 in space): multiples
    of 32. A missing or unreadable config keeps the family's numbers (diffusers' defaults). A
    Wan2.2 text-to-video checkpoint takes no video (``_wan_t2v_geometry``); a Wan2.1
    image-to-video one runs at sp=1 (``_wan_i2v_geometry``)."""
    family = family_of(model)
    read = _GEOMETRY.get(family.name)
    if read is None:
        return family
    geometry = read(model, family)
    spatial = geometry["vae_scale_factor_spatial"]
    _, ph, pw = geometry["patch_size"]
    # A family whose transformer pads partial patches says its own multiple.
    geometry.setdefault("size_multiple", max(family.size_multiple, spatial * max(ph, pw)))
    return replace(family, **geometry, frame_stride=geometry["vae_scale_factor_temporal"])
