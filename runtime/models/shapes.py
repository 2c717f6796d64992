"""Procedural clips that kiln-tiny is trained on: one coloured shape moving on a plain background.

A clip is a circle, square or triangle in one of :data:`COLOURS`, moving left, right, up or down,
or bouncing, over a plain grey background; its prompt says what it shows ("a red circle moving
left"). Everything is drawn with torch from a ``torch.Generator``, so the same seed gives the same
clips on every machine, and the test that checks what kiln-tiny draws uses the same palette.

Shapes: B clips, N frames, H height, W width; colours are RGB in [0, 255].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 90, 230),
    "yellow": (240, 210, 40),
    "purple": (160, 50, 220),
    "cyan": (40, 200, 210),
}
SHAPES = ("circle", "square", "triangle")
DIRECTIONS = ("left", "right", "up", "down")
MOTIONS = DIRECTIONS + ("bouncing",)
# Greys far enough from every colour above that the shape always stands out.
BACKGROUNDS: tuple[tuple[int, int, int], ...] = ((16, 16, 16), (80, 80, 80), (224, 224, 224))

NUM_FRAMES = 9
SIZE = 64


@dataclass(kw_only=True, slots=True)
class Clips:
    video_BNHW3: torch.Tensor  # float RGB in [-1, 1] (the decoder's range)
    prompts: list[str]
    colour: list[str]
    shape: list[str]
    motion: list[str]


def prompt_for(colour: str, shape: str, motion: str) -> str:
    return f"a {colour} {shape} " + ("bouncing" if motion == "bouncing" else f"moving {motion}")


def _signed_distance(shape: str, x: torch.Tensor, y: torch.Tensor,
                     r: torch.Tensor) -> torch.Tensor:
    """Approximate signed distance (pixels, negative inside) of a shape centred at the origin."""
    if shape == "circle":
        return torch.sqrt(x * x + y * y) - r
    if shape == "square":
        return torch.maximum(x.abs(), y.abs()) - 0.85 * r
    # An upright triangle with its apex at -r and its base at +0.75 r: half-planes.
    height, half_base = 1.75 * r, 1.0 * r
    base = y - 0.75 * r
    side = (x.abs() * height - (y + r) * half_base) / torch.sqrt(height**2 + half_base**2)
    return torch.maximum(base, side)


def _centres(motion_B: torch.Tensor, x0_B: torch.Tensor, y0_B: torch.Tensor,
             speed_B: torch.Tensor, num_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shape centres [B, N] over the frames, from the first frame's centre and the speed."""
    t_N = torch.arange(num_frames, dtype=torch.float32)
    step_BN = speed_B[:, None] * t_N
    m = motion_B[:, None]
    dx = torch.where(m == 0, -step_BN, torch.where(m == 1, step_BN, 0.0))
    dy = torch.where(m == 2, -step_BN, torch.where(m == 3, step_BN, 0.0))
    # Bouncing: up off the floor at y0 and back, one bounce per clip.
    bounce_BN = (speed_B[:, None] * (num_frames - 1) / 2
                 * torch.sin(torch.pi * t_N / (num_frames - 1)).abs())
    dy = torch.where(m == 4, -bounce_BN, dy)
    return x0_B[:, None] + dx, y0_B[:, None] + dy


def draw(colour_B: torch.Tensor, shape_B: torch.Tensor, motion_B: torch.Tensor,
         background_B: torch.Tensor, x0_B: torch.Tensor, y0_B: torch.Tensor,
         radius_B: torch.Tensor, speed_B: torch.Tensor, *, num_frames: int = NUM_FRAMES,
         size: int = SIZE) -> torch.Tensor:
    """Clips [B, N, H, W, 3] in [-1, 1] from indices into COLOURS, SHAPES, MOTIONS and
    BACKGROUNDS, the first frame's centre, the radius and the speed (pixels per frame)."""
    cx_BN, cy_BN = _centres(motion_B, x0_B, y0_B, speed_B, num_frames)
    pix = torch.arange(size, dtype=torch.float32) + 0.5
    x = pix[None, None, None, :] - cx_BN[..., None, None]
    y = pix[None, None, :, None] - cy_BN[..., None, None]
    r = radius_B[:, None, None, None]
    sd = _signed_distance("circle", x, y, r)
    for i, shape in enumerate(SHAPES[1:], start=1):
        sd = torch.where(shape_B[:, None, None, None] == i, _signed_distance(shape, x, y, r), sd)
    # One pixel of anti-aliasing: coverage falls from 1 to 0 across the edge.
    alpha = (0.5 - sd).clamp(0, 1)[..., None]
    fg = torch.tensor(list(COLOURS.values()), dtype=torch.float32)[colour_B]
    bg = torch.tensor(BACKGROUNDS, dtype=torch.float32)[background_B]
    rgb = bg[:, None, None, None] * (1 - alpha) + fg[:, None, None, None] * alpha
    return rgb / 127.5 - 1


def sample_clips(num_clips: int, generator: torch.Generator, *,
                 num_frames: int = NUM_FRAMES, size: int = SIZE) -> Clips:
    """``num_clips`` random clips with their prompts; the shape stays inside the frame."""
    n = num_clips

    def uniform(lo: torch.Tensor | float, hi: torch.Tensor | float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(n, generator=generator)

    colour = torch.randint(len(COLOURS), (n,), generator=generator)
    shape = torch.randint(len(SHAPES), (n,), generator=generator)
    motion = torch.randint(len(MOTIONS), (n,), generator=generator)
    background = torch.randint(len(BACKGROUNDS), (n,), generator=generator)
    radius = uniform(9.0, 12.0)
    speed = uniform(2.5, 3.5)  # pixels per frame: 20-28 pixels over 9 frames
    travel = speed * (num_frames - 1)
    # The path crosses the middle of the frame, a little off it at random: a demo model trained
    # in minutes learns what the prompt asks far sooner when the start is not anywhere at all.
    along, across = uniform(-4.0, 4.0), uniform(-6.0, 6.0)
    centre = size / 2
    start = centre + travel / 2 + along  # the far side of the middle from where it goes
    x0 = torch.where(motion == 0, start, torch.where(motion == 1, size - start, centre + across))
    y0 = torch.where(motion == 2, start, torch.where(motion == 3, size - start, centre + across))
    y0 = torch.where(motion == 4, centre + travel / 4 + along, y0)  # bouncing: off this floor
    lo, hi = radius + 1, size - radius - 1
    x0, y0 = torch.minimum(torch.maximum(x0, lo), hi), torch.minimum(torch.maximum(y0, lo), hi)
    video = draw(colour, shape, motion, background, x0, y0, radius, speed,
                 num_frames=num_frames, size=size)
    names = list(COLOURS)
    c = [names[i] for i in colour.tolist()]
    s = [SHAPES[i] for i in shape.tolist()]
    m = [MOTIONS[i] for i in motion.tolist()]
    return Clips(video_BNHW3=video, prompts=[prompt_for(*p) for p in zip(c, s, m, strict=True)],
                 colour=c, shape=s, motion=m)


def describe(frames_NHW3: torch.Tensor, *, min_distance: float = 60.0,
             min_travel: float = 4.0) -> tuple[str | None, str | None]:
    """(dominant colour, direction of motion) of a clip [N, H, W, 3] in [0, 1], by simple image
    analysis: the background is the median of each frame's border, the foreground the pixels
    far from it; the colour is the palette entry nearest the foreground's core (its half
    farthest from the background, free of edge blending); the direction is the main axis of the
    foreground centroid's travel from the first frame to the last. None where there is no
    foreground, or "still" where it travels less than ``min_travel`` pixels."""
    rgb = frames_NHW3.float() * 255
    border = torch.cat([rgb[:, 0], rgb[:, -1], rgb[:, :, 0], rgb[:, :, -1]], dim=1)  # [N, P, 3]
    bg_N3 = border.median(dim=1).values
    dist_NHW = (rgb - bg_N3[:, None, None]).norm(dim=-1)
    fg_NHW = dist_NHW > min_distance
    if fg_NHW.sum() == 0:
        return None, None
    core = dist_NHW >= dist_NHW[fg_NHW].median()
    mean = rgb[core & fg_NHW].mean(dim=0)
    palette = torch.tensor(list(COLOURS.values()), dtype=torch.float32)
    colour = list(COLOURS)[int((palette - mean).norm(dim=-1).argmin())]
    if fg_NHW[0].sum() == 0 or fg_NHW[-1].sum() == 0:
        return colour, None
    ys, xs = torch.meshgrid(torch.arange(rgb.shape[1], dtype=torch.float32),
                            torch.arange(rgb.shape[2], dtype=torch.float32), indexing="ij")

    def centroid(mask: torch.Tensor) -> tuple[float, float]:
        w = mask.float()
        return float((xs * w).sum() / w.sum()), float((ys * w).sum() / w.sum())

    (x0, y0), (x1, y1) = centroid(fg_NHW[0]), centroid(fg_NHW[-1])
    dx, dy = x1 - x0, y1 - y0
    if max(abs(dx), abs(dy)) < min_travel:
        return colour, "still"
    if abs(dx) >= abs(dy):
        return colour, "right" if dx > 0 else "left"
    return colour, "down" if dy > 0 else "up"
