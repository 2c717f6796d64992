"""Random-weight diffusers-format model directories, for tests and benchmarks (nothing downloaded).

``make_checkpoint("wan", ...)`` writes what a real Wan2.1 T2V directory holds (``model_index.json``,
``transformer/``, ``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/``) with a transformer of
any depth and width and tiny companions: a small UMT5 encoder and a word-level tokenizer built
here. ``"cogvideox"`` does the same for CogVideoX. The directories load through the same path as
real models (``runtime.pipelines.diffusers_video``), and through diffusers' own pipelines, which
the parity tests compare against.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import diffusers
import torch
import transformers
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

FAMILIES = ("wan", "cogvideox")

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
    boundary_ratio: float = 0.875  # wan, 2 experts: where the low-noise expert takes over

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


def _text_encoder(spec: SyntheticSpec, vocab_size: int, t5_class: str):  # noqa: ANN202
    config_cls = transformers.UMT5Config if t5_class.startswith("UMT5") else transformers.T5Config
    config = config_cls(vocab_size=vocab_size, d_model=spec.text_dim, d_kv=8,
                        d_ff=2 * spec.text_dim, num_layers=spec.text_layers, num_heads=4,
                        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
                        decoder_start_token_id=0)
    return getattr(transformers, t5_class)(config).eval()


def build_components(spec: SyntheticSpec) -> dict[str, object]:
    """The diffusers pipeline components, random weights from ``spec.seed``."""
    tokenizer = build_tokenizer()
    heads = spec.width // spec.head_dim
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        extra: dict[str, object] = {}
        if spec.family == "wan":
            experts = [diffusers.WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=spec.head_dim,
                in_channels=16, out_channels=16, text_dim=spec.text_dim, freq_dim=256,
                ffn_dim=4 * spec.width, num_layers=spec.num_layers, rope_max_seq_len=32)
                for _ in range(spec.num_experts)]
            transformer = experts[0]
            if spec.num_experts == 2:
                extra = {"transformer_2": experts[1].eval(),
                         "boundary_ratio": spec.boundary_ratio}
            vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1],
                                             num_res_blocks=1,
                                             temperal_downsample=[False, True, True])
            text_encoder = _text_encoder(spec, len(tokenizer), "UMT5EncoderModel")
            scheduler = diffusers.UniPCMultistepScheduler(
                prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                num_train_timesteps=1000)
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
    for model in (transformer, extra.get("transformer_2")):
        if isinstance(model, torch.nn.Module) and spec.dtype != torch.float32:
            model.to(spec.dtype)  # in place
    return {"transformer": transformer.eval(), "vae": vae.eval(), "text_encoder": text_encoder,
            "tokenizer": tokenizer, "scheduler": scheduler, **extra}


def pipeline_class(family: str):  # noqa: ANN201
    return {"wan": diffusers.WanPipeline, "cogvideox": diffusers.CogVideoXPipeline}[family]


def make_checkpoint(out: str | os.PathLike[str], spec: SyntheticSpec) -> Path:
    """Write a random-weight diffusers model directory; returns its path."""
    out = Path(out)
    components = build_components(spec)
    pipe = pipeline_class(spec.family)(**components)
    # Shards of at most 1 GB: big checkpoints get an index file, as real ones do.
    pipe.save_pretrained(out, safe_serialization=True, max_shard_size="1GB")
    return out


def checkpoint_bytes(out: str | os.PathLike[str]) -> int:
    """Bytes of the transformer's safetensors files in a model directory."""
    return sum(f.stat().st_size for f in (Path(out) / "transformer").glob("*.safetensors"))
