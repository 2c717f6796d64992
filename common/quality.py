"""A request's quality tiers: how far a render may trade exactness for fewer computed blocks.

``exact`` computes every block of every step. ``balanced`` and ``fast`` cache steps
(``runtime.step_cache``: a forward skips its remaining blocks when its first block's output has
hardly changed) at a threshold per family, measured on the family's weights; the pipelines take
the threshold (``VideoRequest.step_cache``), what admits a request takes the tier. Plain data,
no torch, so that admission can check a tier without loading a model.
"""

from __future__ import annotations

#: A request's quality tiers: ``exact`` computes every block of every step (the frames are
#: those of a render without step caching, bit for bit); ``balanced`` and ``fast`` cache steps at
#: a family's thresholds (`TIERS`).
QUALITIES = ("exact", "balanced", "fast")
#: Per family, the first-block cache threshold of each caching tier, measured on its shipped
#: weights with bench/step_cache.py (12 prompts, 30 steps, against exact). kiln-tiny: balanced
#: computes 1.40x fewer blocks at a mean PSNR of 44.7 dB (least 38.3), fast 1.86x at 33.3 dB
#: (least 29.3). A family without an entry renders exact only: thresholds depend on the model.
TIERS: dict[str, dict[str, float]] = {"kiln-tiny": {"balanced": 0.1, "fast": 0.2}}


def tier_threshold(family: str, quality: str) -> float | None:
    """The step cache threshold (``VideoRequest.step_cache``) of ``quality`` for ``family`` (a
    ``common.families`` name); None for ``exact``. A ValueError for an unknown tier, or a
    caching tier of a family that has none."""
    if quality not in QUALITIES:
        raise ValueError(f"quality must be one of {', '.join(QUALITIES)}, got {quality!r}")
    if quality == "exact":
        return None
    tiers = TIERS.get(family)
    if tiers is None:
        raise ValueError(f"{family} renders at quality exact only (no measured step cache "
                         f"thresholds), not {quality}")
    return tiers[quality]
