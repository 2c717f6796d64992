"""Random-weight diffusers-format model directories, for tests and benchmarks (nothing downloaded).

``make_checkpoint("wan", ...)`` writes what a real Wan2.1 T2V directory holds (``model_index.json``,
``transformer/``, ``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/``) with a transformer of
any depth and width and tiny companions: a small UMT5 encoder and a word-level tokenizer built
here. ``"wan-i2v"`` and ``"wan22-i2v"`` write image-to-video directories
(``WanImageToVideoPipeline``): Wan2.1 I2V's transformer of 36 input channels with its image
cross-attention, a small CLIP vision encoder and its image processor; Wan2.2 I2V's two experts,
without an image encoder. ``"cogvideox"``, ``"cosmos3"`` and ``"minimax-h3"`` do the same for
CogVideoX, Cosmos3 (no text encoder; a chat tokenizer) and MiniMax-H3 (a modular pipeline's
directory, with a small Qwen3-VL and a byte-level BPE tokenizer). The directories load through
the same path as real models (``runtime.pipelines.diffusers_video``), and through diffusers' own
pipelines, which the parity tests compare against.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import diffusers
import torch
import transformers
from diffusers.modular_pipelines import MiniMaxH3Blocks
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

FAMILIES = ("wan", "wan-i2v", "wan22-i2v", "cogvideox", "cosmos3", "minimax-h3")

# Enough words for test prompts; anything else maps to <unk>.
_WORDS = (
    "a an the of and in on at to with red green blue yellow black white orange purple circle "
    "square triangle ball cat dog bird fish car boat tree sky sea city street moving left right "
    "up down slowly fast flying running walking jumping over under through small big bright "
    "dark night day sunset rain snow fire water light shadow camera zoom pan video low quality "
    "blurry"
).split()


@dataclass(kw_only=True, slots=True)
class SyntheticSpec:
    family: str = "wan"
    num_layers: int = 2
    width: int = 64  # transformer hidden size (heads x head dim)
    head_dim: int = 32
    dtype: torch.dtype = torch.float32
    seed: int = 0
    text_dim: int = 32  # the tiny text encoder's width
    text_layers: int = 2  # and its depth
    num_experts: int = 1  # wan: 2 writes a Wan2.2-style pair (high-noise, low-noise)
    # wan with 2 experts, and wan22-i2v (always 2): where the low-noise expert takes over
    boundary_ratio: float = 0.875
    # wan-i2v: a first-and-last-frame model (Wan2.1 FLF2V), whose image embedder takes the two
    # frames' CLIP tokens side by side (``pos_embed_seq_len``); it renders only from both.
    first_last_frame: bool = False

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; expected one of {FAMILIES}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        head_dim = min(self.head_dim, self.width)
        if self.width <= 0 or self.width % head_dim:
            raise ValueError(f"width must be a positive multiple of the head dim {head_dim}, "
                             f"got {self.width}")
        self.head_dim = head_dim
        if self.num_experts not in (1, 2) or (self.num_experts == 2 and self.family != "wan"):
            raise ValueError("num_experts is 1, or 2 for the wan family (Wan2.2)")
        if self.first_last_frame and self.family != "wan-i2v":
            raise ValueError("first_last_frame is a wan-i2v model (Wan2.1 FLF2V)")


def build_tokenizer(max_length: int = 512):  # noqa: ANN201 - a transformers tokenizer
    """A word-level T5-style tokenizer (pad 0, eos 1, unk 2), built from a fixed word list."""
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in _WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                       special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=max_length)


# Cosmos3's tokenizer speaks Qwen's chat format: the pipeline wraps each prompt in a system and
# a user turn, then appends the end-of-turn and start-of-vision tokens.
_CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<unk>"]
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The words of Cosmos3's prompt templates and system prompt, and digits for the sizes.
_TEMPLATE_WORDS = ("this is not seconds long fps resolution you are helpful assistant who will "
                   "generate videos images from give prompt").split() + list(".,:;!?0123456789x")


def build_chat_tokenizer():  # noqa: ANN201 - a transformers tokenizer
    """A word-level tokenizer with Qwen's special tokens and chat template (Cosmos3's)."""
    vocab = {t: i for i, t in enumerate(_CHAT_SPECIALS)}
    for w in [*_WORDS, *_TEMPLATE_WORDS]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(),
        pre_tokenizers.Digits(individual_digits=True)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|vision_start|>",
                                                      "<|vision_end|>"],
        chat_template=_CHAT_TEMPLATE)


def _cosmos3_components(spec: SyntheticSpec) -> dict[str, object]:
    """Cosmos3: its mixture-of-transformers (GQA, Qwen3-style MLPs of 3x the width), a
    Wan2.2-style VAE (16x in space with its 2x2 patch, 4x in time), the chat tokenizer and the
    released models' UniPC settings. No text encoder: the transformer embeds the token ids."""
    tokenizer = build_chat_tokenizer()
    heads = spec.width // spec.head_dim
    half = spec.head_dim // 2  # the rotary axes (time, height, width) split head_dim / 2
    side = half * 5 // 16
    z = 4
    transformer = diffusers.Cosmos3OmniTransformer(
        hidden_size=spec.width, head_dim=spec.head_dim, num_attention_heads=heads,
        num_key_value_heads=heads // 4 if heads % 4 == 0 else heads,
        intermediate_size=3 * spec.width, num_hidden_layers=spec.num_layers, latent_channel=z,
        latent_patch_size=2, patch_latent_dim=2 * 2 * z,
        rope_axes_dim=[half - 2 * side, side, side], vocab_size=len(tokenizer))
    vae = diffusers.AutoencoderKLWan(
        base_dim=8, decoder_base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
        out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
        latents_mean=[0.1 * i for i in range(z)], latents_std=[1.0 + 0.5 * i for i in range(z)])
    scheduler = diffusers.UniPCMultistepScheduler(
        use_karras_sigmas=True, use_flow_sigmas=True, prediction_type="flow_prediction",
        sigma_max=200.0, sigma_min=0.147)
    return {"transformer": transformer, "vae": vae, "text_tokenizer": tokenizer,
            "scheduler": scheduler, "sound_tokenizer": None, "safety_checker": None,
            "enable_safety_checker": False}


# MiniMax-H3's tokenizer is Qwen's byte-level BPE, with Qwen-VL's vision tokens.
_QWEN_SPECIALS = ["<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                  "<|video_pad|>"]


def build_qwen_tokenizer():  # noqa: ANN201 - a transformers tokenizer
    """A byte-level BPE of 320 tokens trained here on the word list, in Qwen2's tokenizer."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=_QWEN_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator([" ".join(_WORDS)] * 4, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return transformers.Qwen2TokenizerFast(vocab=model["vocab"], merges=merges,
                                           additional_special_tokens=_QWEN_SPECIALS[1:])


def _qwen_processor(tokenizer):  # noqa: ANN001, ANN202
    """Qwen3-VL's processor where transformers can build it (it needs torchvision); else
    LLaVA's, which marks the same image-pad token. A text-to-video prompt uses only
    ``create_mm_token_type_ids``, all zeros for text, so both give the same embeddings."""
    images = transformers.Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2,
                                                   merge_size=2)
    try:
        return transformers.Qwen3VLProcessor(
            image_processor=images, tokenizer=tokenizer,
            video_processor=transformers.Qwen3VLVideoProcessor())
    except (ImportError, AttributeError, TypeError, ValueError):
        return transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer,
                                           image_token="<|image_pad|>", patch_size=16)


def _qwen3vl_encoder(spec: SyntheticSpec, tokenizer) -> torch.nn.Module:  # noqa: ANN001
    """A small Qwen3-VL of 51 text layers: MiniMax-H3 reads the hidden state after layer 50."""
    ids = tokenizer.convert_tokens_to_ids(_QWEN_SPECIALS)
    config = transformers.Qwen3VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": spec.text_dim,
                     "intermediate_size": 2 * spec.text_dim, "num_hidden_layers": 51,
                     "num_attention_heads": 2, "num_key_value_heads": 1,
                     "head_dim": spec.text_dim // 2, "max_position_embeddings": 1024,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                         "mrope_section": [4, 2, 2], "mrope_interleaved": True}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                       "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
                       "out_hidden_size": spec.text_dim, "num_position_embeddings": 16,
                       "deepstack_visual_indexes": [0]},
        image_token_id=ids[3], video_token_id=ids[4], vision_start_token_id=ids[1],
        vision_end_token_id=ids[2])
    return transformers.Qwen3VLForConditionalGeneration(config)


def _randomize(module: torch.nn.Module) -> None:
    """Every parameter random (from the global generator): diffusers starts some at zero (the
    transformer's modulation, the VAE decoder's scales and register tokens), which would make
    whole paths of a random model do nothing."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape) / math.sqrt(math.prod(p.shape[1:])))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
            else:
                p.copy_(0.1 * torch.randn(p.shape))


def _minimax_h3_components(spec: SyntheticSpec) -> dict[str, object]:
    """MiniMax-H3: its transformer (the release's proportions: SwiGLU of 8/3 the width, a
    two-block text refiner, rotary on head_dim / 8 per axis), its ViT-decoder VAE (16x in space,
    17-frame clips into 5 latents), a 51-layer Qwen3-VL, the release's two schedules (video
    shift 12, audio shift 3) and its audio VAE (a mono BigVGAN decoder of 32 latent channels,
    800 samples a latent at 32 kHz, two stages wide instead of seven), which decodes the
    soundtrack the transformer denoises with the video."""
    tokenizer = build_qwen_tokenizer()
    heads = spec.width // spec.head_dim
    transformer = diffusers.MiniMaxH3Transformer3DModel(
        num_attention_heads=heads, attention_head_dim=spec.head_dim, hidden_size=spec.width,
        num_layers=spec.num_layers, num_refiner_layers=2,
        ffn_dim=max(16, 8 * spec.width // 3 // 16 * 16), in_channels=24, audio_in_channels=32,
        patch_size=(1, 2, 2), text_dim=spec.text_dim, freq_dim=32,
        time_embed_hidden_dim=spec.width, time_embed_dim=spec.width // 2,
        rope_freq_dim=spec.head_dim // 8, rope_theta=10000.0)
    vae = diffusers.AutoencoderKLMiniMaxH3(
        in_channels=3, out_channels=3, latent_channels=24, block_out_channels=(8, 8, 8, 8),
        layers_per_block=1, spatial_downsample_factors=(2, 2, 2, 2),
        temporal_downsample_factors=(1, 2, 2, 1), norm_num_groups=4, decoder_num_layers=1,
        decoder_num_attention_heads=2, decoder_attention_head_dim=8,
        decoder_num_register_tokens=2, decoder_ffn_mult=2, clip_length=17, token_drop=3,
        latents_mean=tuple(round(0.05 * (i - 12), 4) for i in range(24)),
        latents_std=tuple(round(0.5 + 0.05 * i, 4) for i in range(24)))
    text_encoder = _qwen3vl_encoder(spec, tokenizer)
    for module in (transformer, vae, text_encoder):
        _randomize(module)
    # Built after the others are drawn, so their weights are what they were without it.
    audio_vae = diffusers.AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4, encoder_rates=(8, 10, 10), latent_dim=32, latent_channels=32,
        num_attention_heads=2, decoder_dim=4, decoder_rates=(20, 40),
        decoder_kernel_sizes=(40, 80), resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1,),), sampling_rate=32_000,
        latents_mean=tuple(round(0.02 * (i - 16), 4) for i in range(32)),
        latents_std=tuple(round(0.8 + 0.01 * i, 4) for i in range(32)))
    _randomize(audio_vae)
    return {"tokenizer": tokenizer, "processor": _qwen_processor(tokenizer),
            "text_encoder": text_encoder, "transformer": transformer, "vae": vae,
            "audio_vae": audio_vae.eval(),
            "scheduler": diffusers.MiniMaxH3Scheduler(shift=12.0),
            "audio_scheduler": diffusers.MiniMaxH3Scheduler(shift=3.0)}


def _text_encoder(spec: SyntheticSpec, vocab_size: int, t5_class: str):  # noqa: ANN202
    config_cls = transformers.UMT5Config if t5_class.startswith("UMT5") else transformers.T5Config
    config = config_cls(vocab_size=vocab_size, d_model=spec.text_dim, d_kv=8,
                        d_ff=2 * spec.text_dim, num_layers=spec.text_layers, num_heads=4,
                        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
                        # The config takes keys beyond its fields; its typed signature does not.
                        decoder_start_token_id=0)  # type: ignore[call-arg]  # an extra key
    return getattr(transformers, t5_class)(config).eval()


def build_components(spec: SyntheticSpec) -> dict[str, object]:
    """The diffusers pipeline components, random weights from ``spec.seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        components = _BUILDERS[spec.family](spec)
    for name in ("transformer", "transformer_2"):
        model = components.get(name)
        if isinstance(model, torch.nn.Module):
            model.eval()
            if spec.dtype != torch.float32:
                model.to(spec.dtype)  # in place
    for name in ("vae", "text_encoder", "image_encoder"):
        module = components.get(name)
        if isinstance(module, torch.nn.Module):
            module.eval()
    return components


def _wan_cogvideox_components(spec: SyntheticSpec) -> dict[str, object]:
    """Wan (one expert, or Wan2.2's pair) or CogVideoX, each with a small T5-family encoder."""
    tokenizer = build_tokenizer()
    heads = spec.width // spec.head_dim
    extra: dict[str, object] = {}
    if spec.family == "wan":
        experts = [diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=spec.head_dim,
            in_channels=16, out_channels=16, text_dim=spec.text_dim, freq_dim=256,
            ffn_dim=4 * spec.width, num_layers=spec.num_layers, rope_max_seq_len=1024)
            for _ in range(spec.num_experts)]
        transformer = experts[0]
        if spec.num_experts == 2:
            extra = {"transformer_2": experts[1], "boundary_ratio": spec.boundary_ratio}
        vae = _wan_vae()
        text_encoder = _text_encoder(spec, len(tokenizer), "UMT5EncoderModel")
        scheduler = _wan_scheduler()
    else:
        transformer = diffusers.CogVideoXTransformer3DModel(
            num_attention_heads=heads, attention_head_dim=spec.head_dim, in_channels=4,
            out_channels=4, time_embed_dim=2, text_embed_dim=spec.text_dim,
            num_layers=spec.num_layers, sample_width=8, sample_height=8, sample_frames=9,
            patch_size=2, temporal_compression_ratio=4, max_text_seq_length=16,
            use_rotary_positional_embeddings=True)
        vae = diffusers.AutoencoderKLCogVideoX(
            in_channels=3, out_channels=3,
            down_block_types=("CogVideoXDownBlock3D",) * 4,
            up_block_types=("CogVideoXUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1,
            norm_num_groups=2, temporal_compression_ratio=4)
        text_encoder = _text_encoder(spec, len(tokenizer), "T5EncoderModel")
        scheduler = diffusers.CogVideoXDDIMScheduler(
            beta_schedule="scaled_linear", prediction_type="v_prediction",
            rescale_betas_zero_snr=True, timestep_spacing="trailing", snr_shift_scale=1.0)
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder,
            "tokenizer": tokenizer, "scheduler": scheduler, **extra}


def _wan_vae():  # noqa: ANN202 - a diffusers AutoencoderKLWan
    """Wan2.1's VAE (16 latent channels, 8x in space, 4x in time), three channels wide."""
    return diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1],
                                      num_res_blocks=1, temperal_downsample=[False, True, True])


def _wan_scheduler():  # noqa: ANN202 - a diffusers scheduler
    return diffusers.UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
        num_train_timesteps=1000)


# The small CLIP vision encoder of "wan-i2v": 32x32 pictures in 8x8 patches, so 17 tokens (the
# class token and 16 patches; the release's ViT-H/14 at 224: 257 of width 1280).
_CLIP_SIZE, _CLIP_PATCH, _CLIP_WIDTH = 32, 8, 32


def _wan_i2v_components(spec: SyntheticSpec) -> dict[str, object]:
    """Wan image-to-video, laid out as the releases are: the transformer takes the noisy latents
    and the condition (4 mask channels, one per frame of a latent frame, and the 16 channels of
    the encoded clip that holds the image) side by side, 36 channels. Wan2.1 I2V ("wan-i2v")
    also attends to the image's CLIP tokens (``image_dim``, ``added_kv_proj_dim``: the width, as
    released); Wan2.2 I2V ("wan22-i2v") has two experts and no image encoder."""
    tokenizer = build_tokenizer()
    heads = spec.width // spec.head_dim
    num_experts = 2 if spec.family == "wan22-i2v" else 1
    clip = spec.family == "wan-i2v"
    tokens = (_CLIP_SIZE // _CLIP_PATCH) ** 2 + 1
    experts = [diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=spec.head_dim,
        in_channels=36, out_channels=16, text_dim=spec.text_dim, freq_dim=256,
        ffn_dim=4 * spec.width, num_layers=spec.num_layers, rope_max_seq_len=1024,
        image_dim=_CLIP_WIDTH if clip else None, added_kv_proj_dim=spec.width if clip else None,
        pos_embed_seq_len=2 * tokens if spec.first_last_frame else None)
        for _ in range(num_experts)]
    extra: dict[str, object] = {"image_encoder": None, "image_processor": None}
    if clip:
        config = transformers.CLIPVisionConfig(
            hidden_size=_CLIP_WIDTH, intermediate_size=2 * _CLIP_WIDTH, num_hidden_layers=2,
            num_attention_heads=2, image_size=_CLIP_SIZE, patch_size=_CLIP_PATCH,
            projection_dim=_CLIP_WIDTH)
        # The PIL backend: the default one needs torchvision. Both resize, crop and normalise
        # as CLIP does; kiln and the reference call whichever the directory names.
        extra = {"image_encoder": transformers.CLIPVisionModel(config).eval(),
                 "image_processor": transformers.CLIPImageProcessorPil(
                     size={"shortest_edge": _CLIP_SIZE},
                     crop_size={"height": _CLIP_SIZE, "width": _CLIP_SIZE})}
    if num_experts == 2:
        extra |= {"transformer_2": experts[1], "boundary_ratio": spec.boundary_ratio}
    return {"transformer": experts[0], "vae": _wan_vae(),
            "text_encoder": _text_encoder(spec, len(tokenizer), "UMT5EncoderModel"),
            "tokenizer": tokenizer, "scheduler": _wan_scheduler(), **extra}


_BUILDERS = {"wan": _wan_cogvideox_components, "cogvideox": _wan_cogvideox_components,
             "wan-i2v": _wan_i2v_components, "wan22-i2v": _wan_i2v_components,
             "cosmos3": _cosmos3_components, "minimax-h3": _minimax_h3_components}


def build_pipeline(spec: SyntheticSpec):  # noqa: ANN201 - a diffusers pipeline
    """diffusers' own pipeline around ``build_components(spec)``: MiniMax-H3's modular one (its
    whole block set, as the release is laid out), the others' classes."""
    components = build_components(spec)
    if spec.family == "minimax-h3":
        pipe = MiniMaxH3Blocks().init_pipeline()
        pipe.update_components(**components)
        return pipe
    classes = {"wan": diffusers.WanPipeline, "cogvideox": diffusers.CogVideoXPipeline,
               "wan-i2v": diffusers.WanImageToVideoPipeline,
               "wan22-i2v": diffusers.WanImageToVideoPipeline,
               "cosmos3": diffusers.Cosmos3OmniPipeline}
    return classes[spec.family](**components)


def make_checkpoint(out: str | os.PathLike[str], spec: SyntheticSpec) -> Path:
    """Write a random-weight diffusers model directory; returns its path."""
    out = Path(out)
    pipe = build_pipeline(spec)
    if spec.family == "minimax-h3":
        # modular_model_index.json and a folder per component, as the release ships.
        pipe.save_pretrained(str(out), safe_serialization=True, overwrite_modular_index=True)
    else:
        # Shards of at most 1 GB: big checkpoints get an index file, as real ones do.
        pipe.save_pretrained(out, safe_serialization=True, max_shard_size="1GB")
    return out


def checkpoint_bytes(out: str | os.PathLike[str]) -> int:
    """Bytes of the transformer's safetensors files in a model directory."""
    return sum(f.stat().st_size for f in (Path(out) / "transformer").glob("*.safetensors"))
