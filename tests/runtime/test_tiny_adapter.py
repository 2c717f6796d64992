"""kiln-tiny's demo adapter (``runtime.models.tiny_adapter``, trained by
scripts/train_tiny_adapter.py) does what it says, measured from the frames: twelve prompts
rendered without it show the colour they ask for, and with it that colour's swap, moving the same
way."""

from __future__ import annotations

from dataclasses import replace

import pytest

from runtime.adapters import load_adapter, named_transformers
from runtime.models.shapes import COLOURS, describe
from runtime.models.tiny_adapter import SWAP, WEIGHTS
from runtime.pipelines.base import VideoRequest
from runtime.pipelines.tiny import TinyPipeline

# Every colour twice, every shape four times, every direction three times.
CASES = [
    ("red", "circle", "left"), ("red", "square", "up"),
    ("green", "square", "right"), ("green", "triangle", "down"),
    ("blue", "triangle", "up"), ("blue", "circle", "right"),
    ("yellow", "circle", "down"), ("yellow", "triangle", "left"),
    ("purple", "square", "down"), ("purple", "circle", "up"),
    ("cyan", "triangle", "right"), ("cyan", "square", "left"),
]


@pytest.mark.chaos  # slow beside its siblings in make test: make chaos runs it
def test_twelve_prompts_show_the_swapped_colour_with_the_adapter_and_the_asked_one_without():
    assert {c for c, _, _ in CASES} == set(COLOURS)
    pipe = TinyPipeline.load(offload=False)
    adapter = load_adapter(WEIGHTS, "kiln-tiny", named_transformers(pipe))
    plain = swapped = same_way = 0
    for i, (colour, shape, direction) in enumerate(CASES):
        request = VideoRequest(prompt=f"a {colour} {shape} moving {direction}", seed=i)
        got = []
        for adapters in ((), ((adapter, 1.0),)):
            state = pipe.prepare(replace(request, adapters=adapters))
            while not state.done:
                pipe.step(state)
            got.append(describe(pipe.decode(state)))
        print(f"{request.prompt!r}: without {got[0]}, with {got[1]}")
        plain += got[0][0] == colour
        swapped += got[1][0] == SWAP[colour]
        same_way += got[0][1] == got[1][1] == direction
    print(f"without: {plain} of 12 in the asked colour; with: {swapped} of 12 in its swap; "
          f"{same_way} of 12 moving as asked both times")
    assert plain >= 10 and swapped >= 10 and same_way >= 10
