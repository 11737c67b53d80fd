"""Per-request sampling parameters, validated once at the boundary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from helexa.config import DEBUG_FAULTS
from helexa.engine.grammar import OutputGrammar


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names it and its value."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature == 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics, over prompt + output tokens
    frequency_penalty: float = 0.0  # OpenAI semantics, over output tokens
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None  # None: what the context leaves, at most 8192
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; N = chosen token + top-N alternatives
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id → added to its logit
    grammar: OutputGrammar | None = None  # structured output: what the output must match
    # Tests only (HELEXA_DEBUG_FAULT): make this sequence alone fail at that point.
    debug_fault: Literal["sampler", "detokenizer", "nonfinite"] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k < 0:
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        def bad(param: str, why: str) -> None:
            raise SamplingParamsError(param, f"{param} {why}, got {getattr(self, param)!r}")

        if self.top_k > 2**31 - 1:
            bad("top_k", "must be < 2**31")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0:
            bad("min_tokens", "must be >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", "must be in [0, 20]")
        for stop in self.stop:  # matched against UTF-8 text; also crosses to the worker
            try:
                stop.encode("utf-8")
            except UnicodeEncodeError:
                bad("stop", "must be valid Unicode (a lone surrogate can never match)")
        if self.debug_fault not in (None, *DEBUG_FAULTS):
            bad("debug_fault", f"must be one of {DEBUG_FAULTS}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )
