"""A prompt's images as the engine carries them through its sequence's life: where each
image's pad run is, its M-RoPE positions, the keys the prefix cache knows its tokens by,
and the tower's output while its run is being prefilled."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from helexa.engine.vision.inputs import ImageInput, VisionProfile
from helexa.engine.vision.mrope import ImageRun, prompt_positions


@dataclass(slots=True, eq=False)
class PromptImage:
    image: ImageInput
    run: ImageRun
    # the tower's output [run.length, hidden]: set when the scheduler has it encoded, and
    # dropped once the run's KV is computed (or the sequence is preempted)
    embeds: torch.Tensor | None = None


@dataclass(slots=True)
class MultiModalPrompt:
    images: list[PromptImage]
    positions: list[list[int]]  # [t, h, w] of each prompt token
    delta: int  # what follows the prompt sits at its index plus this
    cache_keys: list[int] = field(default_factory=list)  # the prompt's, for the prefix cache

    @classmethod
    def build(
        cls, ids: list[int], images: list[ImageInput], profile: VisionProfile
    ) -> MultiModalPrompt:
        """From a prompt whose every image has its pad run (the node expanded each
        placeholder to the image's token count). Raises ValueError when the runs and the
        images do not match one to one, in order."""
        pad = profile.image_token_id
        runs: list[tuple[int, int]] = []  # (offset, length)
        i = 0
        while i < len(ids):
            if ids[i] == pad:
                j = i
                while j < len(ids) and ids[j] == pad:
                    j += 1
                runs.append((i, j - i))
                i = j
            else:
                i += 1
        if len(runs) != len(images):
            raise ValueError(
                f"the prompt has {len(runs)} image placeholder runs for {len(images)} images"
            )
        out: list[PromptImage] = []
        for k, ((offset, length), image) in enumerate(zip(runs, images, strict=True)):
            _, h, w = image.grid(profile)
            if h * w > profile.max_patches:
                raise ValueError(
                    f"image {k} has {h * w} patches; the tower takes at most {profile.max_patches}"
                )
            run = ImageRun(offset, h // profile.merge_size, w // profile.merge_size)
            if run.length != length:
                raise ValueError(
                    f"image {k} takes {run.length} tokens but its placeholder run has {length}"
                )
            out.append(PromptImage(image, run))
        positions, delta = prompt_positions(len(ids), [p.run for p in out])
        keys = list(ids)
        for p in out:
            # negative, so never a token id: the same image gives the same keys, and the
            # prefix cache matches a block of its run only for the same pixels
            key = -1 - int(p.image.digest[:15], 16)
            keys[p.run.offset : p.run.end] = [key] * p.run.length
        return cls(out, positions, delta, keys)

    def overlapping(self, start: int, end: int) -> list[PromptImage]:
        """The images whose runs meet prompt positions [start, end)."""
        return [p for p in self.images if p.run.offset < end and p.run.end > start]

    def release(self, num_computed: int) -> None:
        """Drop the tower's output of runs computed up to `num_computed` tokens."""
        for p in self.images:
            if p.embeds is not None and p.run.end <= num_computed:
                p.embeds = None

    def drop_embeds(self) -> None:
        for p in self.images:
            p.embeds = None
