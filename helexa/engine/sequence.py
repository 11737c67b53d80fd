"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass

import torch

from helexa.engine.detokenizer import IncrementalDetokenizer, StopMatcher
from helexa.engine.grammar import Matcher
from helexa.engine.sampling_params import SamplingParams
from helexa.engine.tokenizer import Tokenizer
from helexa.engine.vision.prompt import MultiModalPrompt

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class TokenLogprob:
    """The chosen token's logprob and the top alternatives at that step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class RequestOutput:
    """A finished request (the sync API) or a delta of one (the async API)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    # of the prompt, computed and stored in the prefix cache for later requests to reuse
    num_cache_written_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class GrammarViolationError(RuntimeError):
    """A sampled token its grammar does not allow: the bitmask was not applied to its row."""


class Sequence:
    """Prompt + generated tokens, KV bookkeeping and stop logic of one request."""

    def __init__(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        request_id: str | None = None,
        max_tokens: int = 16,
        matcher: Matcher | None = None,
        mm: MultiModalPrompt | None = None,
    ) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id or f"seq-{self.seq_id}"
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_tokens = max_tokens  # resolved against the context by the engine
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of the prompt, reused from the prefix cache
        self.num_cache_written_tokens = 0  # of the prompt, stored there for later reuse
        self.block_table: list[int] = []
        # Hybrid models: the row of the recurrent-state pools this sequence holds (-1: none),
        # and the prompt position to snapshot that state at for the prefix cache (None: none).
        self.state_slot = -1
        self.snapshot_at: int | None = None
        self.arrival_time = time.monotonic()
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: Exception | None = None  # why this sequence alone failed
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self._detok = IncrementalDetokenizer(
            tokenizer, params.skip_special_tokens, start=self.num_prompt_tokens
        )
        self._stops = StopMatcher(params.stop) if params.stop else None
        # The output text in pieces, so that growing it never copies what came before:
        # what deltas have emitted, then what they have not (new, or held back).
        self._sent: list[str] = []
        self._unsent: list[str] = []
        self.num_chars = 0
        self.num_emitted_tokens = 0  # for deltas
        self.num_emitted_chars = 0
        self.num_emitted_logprobs = 0
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids |= tokenizer.eos_token_ids
        # structured output: where the output stands in its grammar (None: unconstrained)
        self.matcher = matcher
        # images in the prompt (None: text only). The prefix cache knows the tokens by
        # `cache_ids`: the token ids, but each image's pad run keyed by its pixels; and the
        # tokens after the prompt sit at their index plus `position_offset` (M-RoPE's delta)
        self.mm = mm
        self.cache_ids = self.token_ids if mm is None else [*mm.cache_keys]
        self.position_offset = 0 if mm is None else mm.delta
        # speculative decoding: the tokens drafted for this step (checked by it), and the
        # drafter's own state for this sequence (helexa/engine/spec)
        self.draft: list[int] = []
        self.drafter_state: object | None = None
        # the chance a drafted token is kept once those before it were (spec/policy.py);
        # None until the sequence has drafted
        self.draft_acceptance: float | None = None

    # -- sizes ---------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def output_text(self) -> str:
        return "".join(self._sent) + "".join(self._unsent)

    # -- generation ----------------------------------------------------------------
    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        """Add a sampled token and decide whether the sequence is done."""
        if self.params.debug_fault == "detokenizer":
            raise RuntimeError("fault injected by HELEXA_DEBUG_FAULT=detokenizer")
        if self.matcher is not None and not self.matcher.accept(token_id):
            raise GrammarViolationError(
                f"token {token_id} does not continue request {self.request_id}'s grammar"
            )
        self.token_ids.append(token_id)
        if self.cache_ids is not self.token_ids:
            self.cache_ids.append(token_id)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
        n_out = self.num_output_tokens
        if token_id in self._stop_ids and n_out > self.params.min_tokens:
            self._finish("stop", token_id)
            return
        start = self.num_chars
        new = self._detok.step(self.token_ids)
        self._add_text(new)
        if self._stops is not None:
            hit = self._stops.feed(new)
            if hit is not None and n_out > self.params.min_tokens:
                self._truncate(start + hit[0])
                self._finish("stop", hit[1])
                return
        if self.matcher is not None and self.matcher.is_terminated:  # complete, no stop token
            self._add_text(self._detok.step(self.token_ids, final=True))
            self._finish("stop", None)
            return
        if n_out >= self.max_tokens:
            self._add_text(self._detok.step(self.token_ids, final=True))
            self._finish("length", None)

    def _add_text(self, text: str) -> None:
        if text:
            self._unsent.append(text)
            self.num_chars += len(text)

    def _truncate(self, num_chars: int) -> None:
        """Keep the first `num_chars` of the output; held-back text is never emitted,
        so the cut falls in what deltas have not sent."""
        assert num_chars >= self.num_emitted_chars, (num_chars, self.num_emitted_chars)
        unsent = "".join(self._unsent)[: num_chars - self.num_emitted_chars]
        self._unsent = [unsent] if unsent else []
        self.num_chars = num_chars

    def _finish(self, reason: str, stop_reason: str | int | None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def abort(self) -> None:
        self._finish("abort", None)

    def fail(self, error: Exception) -> None:
        """End this sequence alone with `error`; its batch-mates go on."""
        self.error = error
        self._finish("error", None)

    def take_delta(self) -> RequestOutput:
        """What is new since the last delta; text that may start a stop string is held."""
        finished = self.is_finished
        unsent = "".join(self._unsent)
        held = self._stops.num_held if self._stops is not None and not finished else 0
        text = unsent[: max(0, len(unsent) - held)]
        self._unsent = [unsent[len(text) :]] if len(text) < len(unsent) else []
        if text:
            self._sent.append(text)
            self.num_emitted_chars += len(text)
        ids = self.token_ids[self.num_prompt_tokens + self.num_emitted_tokens :]
        self.num_emitted_tokens += len(ids)
        lps = None
        if self.logprobs is not None:
            lps = self.logprobs[self.num_emitted_logprobs :]
            self.num_emitted_logprobs = len(self.logprobs)
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=ids,
            text=text,
            finished=finished,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=lps,
            num_cached_tokens=self.num_cached_tokens,
            num_cache_written_tokens=self.num_cache_written_tokens,
        )

    def to_output(self) -> RequestOutput:
        """The whole result of a finished sequence."""
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.output_token_ids,
            text=self.output_text,
            finished=self.is_finished,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            num_cached_tokens=self.num_cached_tokens,
            num_cache_written_tokens=self.num_cache_written_tokens,
        )
