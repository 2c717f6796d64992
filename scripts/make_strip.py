"""A strip of frames from rendered videos, one row per video with its prompt, for the README.

    kiln render --model kiln-tiny --dp 4 --prompt "a red circle moving left" --prompt ... \
        --out out/strip.mp4
    python scripts/make_strip.py out/strip.mp4 "a red circle moving left" \
        out/strip-1.mp4 "..." ... --out docs/tiny_strip.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from storage.video import read_video


def strip(rows: list[tuple[np.ndarray, str]], *, num_frames: int, scale: int) -> Image.Image:
    """Rows of ``num_frames`` evenly spaced frames, each scaled by ``scale``, prompt above."""
    label_h, gap = 18, 4
    h, w = rows[0][0].shape[1] * scale, rows[0][0].shape[2] * scale
    width = num_frames * w + (num_frames - 1) * gap
    img = Image.new("RGB", (width, len(rows) * (label_h + h + gap)), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    for r, (video, prompt) in enumerate(rows):
        top = r * (label_h + h + gap)
        draw.text((2, top + 3), prompt, fill=(0, 0, 0))
        picks = np.linspace(0, video.shape[0] - 1, num_frames).round().astype(int)
        for i, f in enumerate(picks):
            frame = Image.fromarray(video[f]).resize((w, h), Image.NEAREST)
            img.paste(frame, (i * (w + gap), top + label_h))
    return img


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pairs", nargs="+", help="video, prompt, video, prompt, ...")
    p.add_argument("--out", type=Path, default=Path("docs/tiny_strip.png"))
    p.add_argument("--frames", type=int, default=9, help="frames per row")
    p.add_argument("--scale", type=int, default=2)
    args = p.parse_args()
    if len(args.pairs) % 2:
        raise SystemExit("give a prompt after every video")
    rows = [(read_video(v), prompt) for v, prompt in zip(args.pairs[::2], args.pairs[1::2],
                                                         strict=True)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    strip(rows, num_frames=args.frames, scale=args.scale).save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
