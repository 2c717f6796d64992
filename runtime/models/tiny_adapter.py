"""kiln-tiny's demo LoRA adapter: every shape drawn in the complement of the colour its prompt
asks for (red <-> cyan, green <-> purple, blue <-> yellow), where it moves and what it is kept.

``scripts/train_tiny_adapter.py`` trains it on the procedural clips kiln-tiny learnt from
(`runtime.models.shapes`), each recoloured by `swap_colours` and denoised under its own, unchanged
prompt; the adapter adapts the transformer's blocks and output projection, rank `RANK`. The
file is in diffusers' LoRA format (``transformer.<module>.lora_A.weight`` and its config in the
``lora_adapter_metadata`` entry), as a user's adapter would be. ``kiln up`` registers it as the
shared adapter `NAME`, so a ``make run`` user can try adapters at once.
"""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.models.shapes import COLOURS

NAME = "swap-colours"
RANK = 8
WEIGHTS = Path(__file__).with_name("kiln_tiny_swap_colours.safetensors")
# Each palette colour and the one the adapter draws instead: its near complement.
SWAP = {"red": "cyan", "cyan": "red", "green": "purple", "purple": "green",
        "blue": "yellow", "yellow": "blue"}


def swap_colours(video_BNHW3: torch.Tensor, colours: list[str]) -> torch.Tensor:
    """The clips [B, N, H, W, 3] (in [-1, 1], as `runtime.models.shapes.draw` makes them) with
    each shape's colour replaced by its `SWAP`; the anti-aliased edge keeps its coverage. A
    pixel is ``background + coverage * (colour - background)``, so the coverage is the pixel's
    projection on that line, and the background the first frame's corner (never covered)."""
    palette = {name: torch.tensor(rgb, dtype=torch.float32) / 127.5 - 1
               for name, rgb in COLOURS.items()}
    old = torch.stack([palette[c] for c in colours])[:, None, None, None]
    new = torch.stack([palette[SWAP[c]] for c in colours])[:, None, None, None]
    bg = video_BNHW3[:, :1, :1, :1]
    d = old - bg
    coverage = (((video_BNHW3 - bg) * d).sum(-1, keepdim=True) / (d * d).sum(-1, keepdim=True))
    return bg + coverage.clamp(0, 1) * (new - bg)
