"""What one denoising step of a job costs: its video tokens, and seconds per step from history.

The ranks of a worker group step in lock-step on the weight gathers, so a step lasts as long as
its slowest rank. The batcher therefore groups jobs of similar cost per step, and the cost of a
step is driven by how many tokens the transformer sees per forward: `common.families.tokens`,
from the model family's VAE and patch, the count the API's bound on one job uses too:

    latent frames = (num_frames - 1) // temporal + 1      (causal video VAE: the first frame alone)
    latent size   = ceil(height / spatial) x ceil(width / spatial)
    tokens        = ceil(latent frames / patch_t) x ceil(latent height / patch_h)
                    x ceil(latent width / patch_w)

and the rows besides the video's where the transformer's sequence holds them: MiniMax-H3's
soundtrack (and 5n + 2 latent frames of 17n + 5), and Cosmos3's and MiniMax-H3's prompt, at
``Family.prompt_rows``.

Tokens are a proxy; seconds are what the lock-step pays. `CostModel` fits, per model,
``seconds_per_step = overhead + per_token * tokens`` by exponentially decayed least squares over
finished jobs (`observe`), and answers `step_seconds` for a job not yet run. Until a model has
history it assumes ``DEFAULT_SECONDS_PER_TOKEN`` and no overhead, which keeps the ordering of
jobs by tokens, all that grouping needs on day one.

A step split over the ``sp`` ranks of a replica (`runtime.sequence.Layout`) costs otherwise
than one on a single rank, so the fits are kept per model and layout (`cost_key_for`). A
`CostModel` reads and writes the fits of one layout, its ``sp``; its state holds them all.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from common.families import tokens

__all__ = ["DEFAULT_DECAY", "DEFAULT_SECONDS_PER_TOKEN", "CostModel", "cost_key_for", "tokens"]

# A guess used until a model has history; only the ratio between jobs matters then.
DEFAULT_SECONDS_PER_TOKEN = 1e-5
# Each finished job weighs this much less than the one after it: the fit follows the hardware
# (a driver upgrade, another model revision) within a few hundred jobs.
DEFAULT_DECAY = 0.99


def cost_key_for(model: str, sp: int = 1) -> str:
    """The fit's key for ``model`` rendered by replicas of ``sp`` ranks: the model's name at
    sp=1, ``model@sp{sp}`` otherwise."""
    return model if sp == 1 else f"{model}@sp{sp}"


@dataclass(slots=True)
class _Fit:
    """Decayed sums for the weighted least-squares line seconds = a + b * tokens."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float, decay: float) -> None:
        self.w = self.w * decay + 1.0
        self.x = self.x * decay + x
        self.y = self.y * decay + y
        self.xx = self.xx * decay + x * x
        self.xy = self.xy * decay + x * y

    def line(self) -> tuple[float, float] | None:
        """(overhead, per_token), or None without history."""
        if self.w <= 0 or self.x <= 0:
            return None
        var = self.w * self.xx - self.x * self.x
        # Too little spread in job sizes to tell overhead from per-token cost: proportional fit.
        if var <= 1e-9 * self.w * self.xx:
            return 0.0, self.y / self.x
        b = (self.w * self.xy - self.x * self.y) / var
        a = (self.y - b * self.x) / self.w
        if b <= 0:  # noise: bigger jobs never step faster
            return 0.0, self.y / self.x
        if a < 0:  # a line through the origin fits better than a negative overhead
            return 0.0, self.xy / self.xx
        return a, b


@dataclass(slots=True)
class CostModel:
    """Seconds per denoising step, per model, learned from finished jobs, for replicas of
    ``sp`` ranks (the fits of other layouts ride along in the state, untouched)."""

    decay: float = DEFAULT_DECAY
    default_seconds_per_token: float = DEFAULT_SECONDS_PER_TOKEN
    sp: int = 1
    _fits: dict[str, _Fit] = field(default_factory=dict)  # cost_key_for(model, sp) -> fit

    def observe(self, model: str, num_tokens: int, seconds_per_step: float) -> None:
        if num_tokens <= 0 or not math.isfinite(seconds_per_step) or seconds_per_step <= 0:
            return  # a cancelled or broken run says nothing about cost
        key = cost_key_for(model, self.sp)
        self._fits.setdefault(key, _Fit()).add(float(num_tokens), seconds_per_step, self.decay)

    def step_seconds(self, model: str, num_tokens: int) -> float:
        fit = self._fits.get(cost_key_for(model, self.sp))
        line = fit.line() if fit is not None else None
        if line is None:
            return self.default_seconds_per_token * num_tokens
        a, b = line
        return a + b * num_tokens

    def to_state(self) -> dict[str, dict[str, float]]:
        """Plain numbers per model and layout, for storing between processes (see
        `from_state`)."""
        return {m: asdict(f) for m, f in self._fits.items()}

    @classmethod
    def from_state(cls, state: dict[str, dict[str, float]], **kwargs: Any) -> CostModel:
        """The model a `to_state` stored; ``kwargs`` are the fields (``sp``: the layout read)."""
        model = cls(**kwargs)
        model._fits = {m: _Fit(**{k: float(v) for k, v in f.items()}) for m, f in state.items()}
        return model
