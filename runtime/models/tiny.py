"""kiln-tiny: a small Wan-like video DiT in pure torch, for demos and tests; nothing to download.

Four parts, all built from one :class:`TinyConfig` with a fixed seed, so every process that builds
it gets the same weights:
- :class:`TinyTokenizer`: lower-cased words hashed into the vocabulary (deterministic, no files);
- :class:`TinyTextEncoder`: token + position embeddings, a few pre-norm self-attention layers;
- :class:`TinyTransformer`: patch-embedded latent video, sinusoidal 3-D positions, a timestep
  embedding driving AdaLN-style shift/scale/gate modulation, self-attention, cross-attention to
  the text, an MLP; the blocks sit in ``nn.ModuleList`` ``blocks`` so DLO finds them;
- :class:`TinyDecoder`: latents to RGB frames, one latent frame at a time (so decode tiles over
  frames), each latent frame unfolding into ``temporal_compression`` frames, the first into one
  frame (a causal layout like Wan's VAE: 9 frames <-> 3 latent frames).

The latent space is fixed, not learned: :func:`encode_video` averages each 8 x 8 block of every
frame, and a latent pixel holds the mean colours of its ``temporal_compression`` frames
(3 x 4 = 12 channels), scaled to about unit variance. The denoiser therefore works on a small
video of colours (what it draws and where it moves are plain in the latents) and the decoder,
trained by ``scripts/train_tiny.py``, learns to draw the sharp picture back.

A render may start from a given first frame, as Wan's image-to-video models do: the transformer
takes, beside the noisy latents, the condition :func:`first_frame_condition` builds (the clean
latents of the first frame in latent frame 0, zeros elsewhere, and a mask channel that is 1 where
a frame is given), concatenated on the channel axis before the patch embedding. The embedding of
the concatenation is written as two matmuls: ``patch_embed`` on the noisy latents' patches and
``cond_embed`` (no bias) on the condition's, so a text-only render (no condition: zeros) adds
exactly nothing and skips the second.

Weights: the state dict of :class:`KilnTiny` (``text_encoder.*``, ``transformer.*``,
``decoder.*``) in one safetensors file, with the training settings and the :class:`TinyConfig`
as JSON in its ``kiln_tiny`` metadata entry. ``transformer.cond_embed.weight`` is
[dim, (latent_channels + 1) * patch_size**2]; it is zero at initialisation, and a checkpoint from
before image conditioning, which lacks it, loads with it zero (:func:`load_weights`): the
text-only model it was.

Shapes: B batch, F latent frames, H/W latent height/width, C latent channels, L video tokens,
T text tokens, D width, E text width.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from runtime.sequence import SequenceParallel

PAD_ID = 0
BOS_ID = 1
# Weights trained by scripts/train_tiny.py on procedural shape clips (runtime.models.shapes).
TRAINED_WEIGHTS = Path(__file__).with_name("kiln_tiny.safetensors")


@dataclass(kw_only=True, slots=True)
class TinyConfig:
    latent_channels: int = 12  # 3 colours x temporal_compression frames (see encode_video)
    latent_scale: float = 1.5  # pooled colours in [-1, 1] times this: about unit variance
    patch_size: int = 2
    spatial_compression: int = 8  # pixels per latent pixel
    temporal_compression: int = 4  # frames per latent frame (after the first)
    dim: int = 128
    num_heads: int = 4
    num_layers: int = 4
    ffn_dim: int = 384
    freq_dim: int = 64  # sinusoidal timestep features
    text_dim: int = 64
    text_heads: int = 2
    text_layers: int = 2
    vocab_size: int = 4096
    text_len: int = 32  # tokens per prompt, BOS included
    decoder_channels: int = 128
    init_seed: int = 0

    def __post_init__(self) -> None:
        if self.dim % self.num_heads or self.text_dim % self.text_heads:
            raise ValueError("dim and text_dim must be divisible by their head counts")
        if self.dim % 2:
            raise ValueError(f"dim must be even (sinusoidal positions), got {self.dim}")
        if 2 ** round(math.log2(self.spatial_compression)) != self.spatial_compression:
            raise ValueError("spatial_compression must be a power of two")
        if self.latent_channels != 3 * self.temporal_compression:
            raise ValueError(f"latent_channels must be 3 x temporal_compression "
                             f"({3 * self.temporal_compression}), got {self.latent_channels}")

    def num_latent_frames(self, num_frames: int) -> int:
        return (num_frames - 1) // self.temporal_compression + 1

    def check_video_size(self, width: int, height: int, num_frames: int) -> None:
        multiple = self.spatial_compression * self.patch_size
        if width <= 0 or height <= 0 or width % multiple or height % multiple:
            raise ValueError(f"kiln-tiny renders sizes that are positive multiples of {multiple}, "
                             f"got {width}x{height}")
        if num_frames < 1 or (num_frames - 1) % self.temporal_compression:
            raise ValueError(f"kiln-tiny renders 1 + {self.temporal_compression}k frames "
                             f"(1, 5, 9, ...), got {num_frames}")


class TinyTokenizer:
    """Words to ids by a stable hash: the same prompt gives the same ids in every process."""

    def __init__(self, vocab_size: int, max_length: int) -> None:
        self.vocab_size = vocab_size
        self.max_length = max_length

    def word_id(self, word: str) -> int:
        return 2 + zlib.crc32(word.encode()) % (self.vocab_size - 2)

    def __call__(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids_BT, mask_BT): BOS, the words, then padding; longer prompts are truncated."""
        ids = torch.full((len(prompts), self.max_length), PAD_ID, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            words = re.findall(r"[a-z0-9]+", prompt.lower())[: self.max_length - 1]
            ids[i, : len(words) + 1] = torch.tensor([BOS_ID] + [self.word_id(w) for w in words])
        return ids, ids != PAD_ID


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-head attention on [B, N, D] inputs."""
    b, n, d = q.shape
    split = lambda t: t.unflatten(-1, (num_heads, d // num_heads)).transpose(1, 2)  # noqa: E731
    out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask)
    return out.transpose(1, 2).reshape(b, n, d)


class _AttentionSlice(nn.Module):
    """One kernel call of `SlicedAttention`: a module, so that hooks run before each."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


class SlicedAttention(nn.Module):
    """Multi-head self-attention on [B, N, D] inputs, as `_attention` computes it, but on the CPU
    and from ``SLICE_MIN_TOKENS`` tokens one batch row and a few heads at a time: each slice is
    a call of ``slice``, so forward pre-hooks run between slices. A step is left at a module
    boundary (`runtime.rank_loop._Interrupt`, `DLOHandle.leave_when`'s ``within_blocks``), and
    a 256x256x33 clip's self-attention is two thirds of its block (77 ms of 119 on one core):
    sliced, a preempted step is left within about a tenth of that. Each slice holds enough heads
    to give every thread about ``SLICE_ROWS_PER_THREAD`` query rows. From that length the
    slices equal the batched call bit for bit, on 1 to 16 threads (below it, the kernel's
    blocking depends on the thread count and the batch: `tests/runtime/test_tiny.py`). On an
    accelerator the kernels run asynchronously to the host, so the call stays whole."""

    SLICE_MIN_TOKENS = 512
    SLICE_ROWS_PER_THREAD = 256

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.slice = _AttentionSlice()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, n, d = q.shape
        heads = self.num_heads
        if q.device.type != "cpu" or n < self.SLICE_MIN_TOKENS:
            return _attention(q, k, v, heads)
        q_BHND, k_BHND, v_BHND = (t.unflatten(-1, (heads, d // heads)).transpose(1, 2)
                                  for t in (q, k, v))
        out_BNHD = q.new_empty((b, n, heads, d // heads))
        per = min(heads, -(-torch.get_num_threads() * self.SLICE_ROWS_PER_THREAD // n))
        for i in range(b):
            for h in range(0, heads, per):
                rows, group = slice(i, i + 1), slice(h, h + per)
                out_BNHD[rows, :, group] = self.slice(
                    q_BHND[rows, group], k_BHND[rows, group], v_BHND[rows, group]
                ).transpose(1, 2)
        return out_BNHD.reshape(b, n, d)


def _attention_BLHD(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention on [B, L, heads, head_dim] inputs (a replica's head shard, see
    ``runtime.sequence``): the same kernel call as `_attention`."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


class TinyTextLayer(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * dim, dim))

    def forward(self, x_BTE: torch.Tensor, mask_B11T: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x_BTE)).chunk(3, dim=-1)
        x_BTE = x_BTE + self.proj(_attention(q, k, v, self.num_heads, mask_B11T))
        return x_BTE + self.mlp(self.norm2(x_BTE))


class TinyTextEncoder(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.text_dim)
        self.position_embedding = nn.Parameter(torch.randn(cfg.text_len, cfg.text_dim) * 0.02)
        self.layers = nn.ModuleList(TinyTextLayer(cfg.text_dim, cfg.text_heads)
                                    for _ in range(cfg.text_layers))
        self.norm = nn.LayerNorm(cfg.text_dim)

    def forward(self, ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
        """Text features [B, T, E]; padding positions are zero (Wan's convention), so the
        cross-attention needs no mask and an empty prompt is a well-defined context."""
        x_BTE = self.token_embedding(ids_BT) + self.position_embedding[: ids_BT.shape[1]]
        keep_B11T = mask_BT[:, None, None, :]  # BOS is always there: no row is fully masked
        for layer in self.layers:
            x_BTE = layer(x_BTE, keep_B11T)
        return self.norm(x_BTE) * mask_BT[..., None].to(x_BTE.dtype)


def sinusoid(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """[N] float positions -> [N, dim] (cos | sin) features, computed on the CPU in float64
    (the same bits on every device, also under a ``torch.device`` context)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64, device="cpu")
                      / half)
    angles = positions.to("cpu", torch.float64)[:, None] * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(torch.float32)


def positions_3d(f: int, h: int, w: int, dim: int) -> torch.Tensor:
    """[F*H*W, dim] sinusoidal features, about a third of the width per axis (frames, rows,
    columns; every part even so it splits into cos and sin)."""
    axes = [torch.arange(n, device="cpu") for n in (f, h, w)]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
    k = 2 * (dim // 6)
    return torch.cat([sinusoid(grid[:, i], n) for i, n in enumerate((dim - 2 * k, k, k))], dim=-1)


class TinyBlock(nn.Module):
    """Self-attention, cross-attention to text, MLP; AdaLN shift/scale/gate from the timestep."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        d = cfg.dim
        self.num_heads = cfg.num_heads
        # Per-block offsets added to the shared timestep modulation (as in Wan).
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, d) / d**0.5)
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(d, 3 * d)
        self.self_attention = SlicedAttention(cfg.num_heads)  # no weights
        self.attn_out = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d, eps=1e-6)
        self.cross_q = nn.Linear(d, d)
        self.cross_kv = nn.Linear(cfg.text_dim, 2 * d)
        self.cross_out = nn.Linear(d, d)
        self.norm3 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.ffn = nn.Sequential(nn.Linear(d, cfg.ffn_dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(cfg.ffn_dim, d))

    def forward(self, x_BLD: torch.Tensor, text_BTE: torch.Tensor, mod_B6D: torch.Tensor,
                seq: tuple[SequenceParallel, int] | None = None) -> torch.Tensor:
        """``seq``: (the replica's split, the whole sequence's length) when ``x_BLD`` is this
        rank's shard of the video tokens; only self-attention needs the other shards."""
        shift1, scale1, gate1, shift2, scale2, gate2 = (
            (self.scale_shift_table + mod_B6D).unsqueeze(2).unbind(1)
        )
        h = self.norm1(x_BLD) * (1 + scale1) + shift1
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        if seq is None:
            attn = self.self_attention(q, k, v)
        else:
            sp, length = seq
            q, k, v = (t.unflatten(-1, (self.num_heads, -1)) for t in (q, k, v))
            attn = sp.attention(q, k, v, length, _attention_BLHD).flatten(2)
        x_BLD = x_BLD + gate1 * self.attn_out(attn)
        k, v = self.cross_kv(text_BTE).chunk(2, dim=-1)
        x_BLD = x_BLD + self.cross_out(_attention(self.cross_q(self.norm2(x_BLD)), k, v,
                                                  self.num_heads))
        h = self.norm3(x_BLD) * (1 + scale2) + shift2
        return x_BLD + gate2 * self.ffn(h)


class TinyTransformer(nn.Module):
    """Predicts the flow-matching velocity of latent video ``x`` at noise level ``timestep``."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, p, c = cfg.dim, cfg.patch_size, cfg.latent_channels
        self.patch_embed = nn.Linear(c * p * p, d)
        # The condition's channels (the first frame's latents and a mask) into the same width;
        # zero, so conditioning starts as the text-only model. skip_init draws no random numbers:
        # every weight built after it gets the same initialisation as before it existed.
        self.cond_embed = nn.utils.skip_init(nn.Linear, (c + 1) * p * p, d, bias=False)
        nn.init.zeros_(self.cond_embed.weight)
        self.time_embed = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_proj = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList(TinyBlock(cfg) for _ in range(cfg.num_layers))
        self.head_table = nn.Parameter(torch.randn(1, 2, d) / d**0.5)
        self.norm_out = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.proj_out = nn.Linear(d, c * p * p)
        # Set by the pipeline when the ranks of a replica split the sequence (runtime.sequence).
        self.sequence_parallel: SequenceParallel | None = None

    def _patches(self, x_BCFHW: torch.Tensor) -> torch.Tensor:
        """[B, C, F, H, W] -> [B, F*hp*wp, C*p*p]: one token per p x p patch of a latent frame."""
        b, c, f, h, w = x_BCFHW.shape
        p = self.cfg.patch_size
        tokens = x_BCFHW.reshape(b, c, f, h // p, p, w // p, p).permute(0, 2, 3, 5, 1, 4, 6)
        return tokens.reshape(b, f * (h // p) * (w // p), c * p * p)

    def forward(self, x_BCFHW: torch.Tensor, timestep_B: torch.Tensor, text_BTE: torch.Tensor,
                cond_BCFHW: torch.Tensor | None = None) -> torch.Tensor:
        """``cond_BCFHW``: the first-frame condition (:func:`first_frame_condition`, C + 1
        channels, batch 1 or B), None for a text-only render."""
        b, c, f, h, w = x_BCFHW.shape
        p, d = self.cfg.patch_size, self.cfg.dim
        hp, wp = h // p, w // p
        x_BLD = self.patch_embed(self._patches(x_BCFHW))
        if cond_BCFHW is not None:
            x_BLD = x_BLD + self.cond_embed(self._patches(cond_BCFHW))
        # The sinusoidal tables are computed on the CPU (in float64) and moved: the same bits on
        # every device.
        x_BLD = x_BLD + positions_3d(f, hp, wp, d).to(x_BLD.device, x_BLD.dtype)
        temb_BD = self.time_embed(sinusoid(timestep_B.cpu(), self.cfg.freq_dim).to(
            x_BLD.device, x_BLD.dtype))
        mod_B6D = self.time_proj(temb_BD).unflatten(1, (6, d))
        sp, length = self.sequence_parallel, x_BLD.shape[1]
        if sp is None:
            for block in self.blocks:
                x_BLD = block(x_BLD, text_BTE, mod_B6D)
        else:  # the blocks run on this rank's shard of the tokens
            x_BLD = sp.split(x_BLD)
            for block in self.blocks:
                x_BLD = block(x_BLD, text_BTE, mod_B6D, (sp, length))
            x_BLD = sp.gather(x_BLD, length)
        shift, scale = (self.head_table + temb_BD[:, None]).unsqueeze(2).unbind(1)
        out = self.proj_out(self.norm_out(x_BLD) * (1 + scale) + shift)
        out = out.reshape(b, f, hp, wp, c, p, p).permute(0, 4, 1, 2, 5, 3, 6)
        return out.reshape(b, c, f, h, w)


class TinyDecoder(nn.Module):
    """One latent frame [C, H, W] -> ``temporal_compression`` RGB frames in [-1, 1].

    Each latent pixel, with its 3 x 3 neighbourhood, goes through an MLP to an
    ``s x s`` patch of pixels for every output frame (depth-to-space). Everything is a matmul
    with the items stacked along rows, which on the CPU gives the same bits whatever the number of
    items (a batched oneDNN convolution does not), so decoding in tiles equals decoding at once.
    """

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        ch, s = cfg.decoder_channels, cfg.spatial_compression
        self.cfg = cfg
        self.mlp = nn.Sequential(
            nn.Linear(9 * cfg.latent_channels, ch), nn.SiLU(), nn.Linear(ch, ch), nn.SiLU(),
            nn.Linear(ch, s * s * 3 * cfg.temporal_compression))

    def bytes_per_item(self, height: int, width: int) -> int:
        """Transient bytes to decode one latent frame to ``height`` x ``width`` pixels: the
        patch MLP's output and its depth-to-space copy, each the size of the output frames,
        dominate (one more frame size of headroom for allocator fragmentation); the hidden
        activations on the latent grid are small next to them."""
        cfg = self.cfg
        frames = cfg.temporal_compression * 3 * height * width * 4
        latent_pixels = (height // cfg.spatial_compression) * (width // cfg.spatial_compression)
        hidden = latent_pixels * (9 * cfg.latent_channels + 2 * cfg.decoder_channels) * 4
        return 3 * frames + hidden

    def forward(self, z_NCHW: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] latent frames -> [N, temporal_compression, 3, H*s, W*s]."""
        n, _, h, w = z_NCHW.shape
        s, tc = self.cfg.spatial_compression, self.cfg.temporal_compression
        cols = F.unfold(z_NCHW, kernel_size=3, padding=1).transpose(1, 2)  # [N, H*W, 9C]
        patches = self.mlp(cols.reshape(n * h * w, -1))  # [N*H*W, s*s*3*tc]
        x = patches.reshape(n, h, w, tc, 3, s, s).permute(0, 3, 4, 1, 5, 2, 6)
        x = x.reshape(n, tc, 3, h * s, w * s)  # a copy: depth-to-space
        del patches  # in place from here: two frame-sized buffers at most, not four
        return x.tanh_()


def encode_video(cfg: TinyConfig, video_BNHW3: torch.Tensor) -> torch.Tensor:
    """RGB frames [B, N, H, W, 3] in [-1, 1] (N = 1 + 4k) -> latents [B, C, F, H/s, W/s]: the
    mean colour of every s x s block of every frame, the first frame standing alone (repeated
    ``temporal_compression`` times, the causal layout the decoder undoes)."""
    s, tc = cfg.spatial_compression, cfg.temporal_compression
    b, n, h, w, _ = video_BNHW3.shape
    first = video_BNHW3[:, :1].expand(-1, tc, -1, -1, -1)
    v = torch.cat([first, video_BNHW3[:, 1:]], dim=1)
    f = v.shape[1] // tc
    pooled = v.reshape(b, f, tc, h // s, s, w // s, s, 3).mean(dim=(4, 6))  # [B, F, tc, h, w, 3]
    # Channel tc * 3 + rgb, the order in which the decoder lays out its frames.
    latents = pooled.permute(0, 2, 5, 1, 3, 4).reshape(b, tc * 3, f, h // s, w // s)
    return latents * cfg.latent_scale


def first_frame_condition(cfg: TinyConfig, image_BHW3: torch.Tensor, num_frames: int,
                          *, given_B: torch.Tensor | None = None) -> torch.Tensor:
    """The transformer's condition [B, C + 1, F, H/s, W/s] for clips of ``num_frames`` frames:
    the latents of the first frames ``image_BHW3`` (RGB in [-1, 1]; :func:`encode_video` of the
    frame alone, which is what latent frame 0 holds) in latent frame 0, zeros in the others, and
    last a mask channel, 1 over latent frame 0. ``given_B`` (bool): which items are conditioned;
    the others get zeros throughout, the same as no condition (training mixes both)."""
    b, h, w, _ = image_BHW3.shape
    s = cfg.spatial_compression
    first_BC1HW = encode_video(cfg, image_BHW3[:, None])
    cond = torch.zeros((b, cfg.latent_channels + 1, cfg.num_latent_frames(num_frames),
                        h // s, w // s), dtype=first_BC1HW.dtype, device=first_BC1HW.device)
    cond[:, :-1, :1] = first_BC1HW
    cond[:, -1:, :1] = 1.0
    if given_B is not None:
        cond *= given_B.to(cond.dtype)[:, None, None, None, None]
    return cond


class KilnTiny(nn.Module):
    """The whole kiln-tiny model; its weights are one small state dict."""

    def __init__(self, cfg: TinyConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or TinyConfig()
        self.tokenizer = TinyTokenizer(self.cfg.vocab_size, self.cfg.text_len)
        self.text_encoder = TinyTextEncoder(self.cfg)
        self.transformer = TinyTransformer(self.cfg)
        self.decoder = TinyDecoder(self.cfg)


def build_tiny(cfg: TinyConfig | None = None, *, trained: bool = True) -> KilnTiny:
    """kiln-tiny with the trained weights shipped with kiln (the default configuration, when
    the file is there), else its deterministic random initialisation; the same weights in
    every process either way."""
    cfg = cfg or TinyConfig()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        model = KilnTiny(cfg)
    if trained and cfg == TinyConfig() and TRAINED_WEIGHTS.is_file():
        load_weights(model, load_file(TRAINED_WEIGHTS))
    return model.eval().requires_grad_(False)


# Weights added after the first checkpoints; one that lacks them keeps their zero initialisation.
ADDED_WEIGHTS = frozenset({"transformer.cond_embed.weight"})


def load_weights(model: KilnTiny, state: dict[str, torch.Tensor]) -> None:
    """Load a kiln-tiny state dict; one written before image conditioning has no
    ``cond_embed`` and loads with it zero, the text-only model it was. Anything else missing or
    unexpected is an error, as with a strict ``load_state_dict``."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if set(missing) - ADDED_WEIGHTS or unexpected:
        raise RuntimeError(f"kiln-tiny checkpoint does not fit the model: missing "
                           f"{sorted(set(missing) - ADDED_WEIGHTS)}, unexpected {unexpected}")
    with torch.no_grad():
        for name in missing:
            model.get_parameter(name).zero_()
