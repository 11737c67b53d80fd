"""M-RoPE positions (Qwen2-VL's multimodal rotary, interleaved as Qwen3-VL / Qwen3.5 have
it) of a prompt whose image pad runs are known.

Every token has three positions: temporal, height, width. A text token has the same one on
all three, one more than the token before. An image's tokens sit on its merged grid: the
temporal axis holds the position the image starts at, the height and width axes add the
token's row and column to it. The text after an image resumes at the start plus the longer
side of the grid, so an image takes fewer positions than it has tokens; what follows the
prompt (the generated tokens) is at its index plus `delta`, the same on all three axes.
Without images the positions are the token indices and delta is 0: plain rotary.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ImageRun:
    """An image's pad run in a prompt: where it starts, and its merged grid."""

    offset: int  # index of its first pad token
    rows: int  # grid height / merge
    cols: int  # grid width / merge

    @property
    def length(self) -> int:
        return self.rows * self.cols

    @property
    def end(self) -> int:
        return self.offset + self.length


def prompt_positions(num_tokens: int, runs: list[ImageRun]) -> tuple[list[list[int]], int]:
    """([t, h, w] positions of each prompt token, delta) for a prompt of `num_tokens`
    tokens with image runs `runs` (in order, not overlapping)."""
    t: list[int] = []
    h: list[int] = []
    w: list[int] = []
    index = 0  # the next token
    pos = 0  # the next text position
    for run in runs:
        text = range(pos, pos + run.offset - index)
        t.extend(text)
        h.extend(text)
        w.extend(text)
        pos += run.offset - index
        for r in range(run.rows):
            t.extend([pos] * run.cols)
            h.extend([pos + r] * run.cols)
            w.extend(range(pos, pos + run.cols))
        pos += max(run.rows, run.cols)
        index = run.end
    text = range(pos, pos + num_tokens - index)
    t.extend(text)
    h.extend(text)
    w.extend(text)
    pos += num_tokens - index
    return [t, h, w], pos - num_tokens
