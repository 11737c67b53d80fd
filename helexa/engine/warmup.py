"""Compile the kernels a request can reach before the first request arrives.

Triton compiles a kernel at its first launch for each specialization (constexprs, and integer
arguments equal to 1 or divisible by 16), and a compile takes from a fraction of a second to
seconds. CUDA-graph capture launches the decode forward only: without this, the first prompt
step, the first sampled (not greedy) row, the first penalty and the first two-row decode each
paid their compiles inside a user's request (`LLM.generate` of 64 tokens on a cold engine
measured 38 tok/s on an H200 where the warm engine decodes at 128).

`warm_up` drives the engine itself (add_request / step) through the shapes requests take: a
prompt of 16 tokens alone (batch-1 prefill and decode), then a prompt of 7 beside a second
sequence (ragged prefill, two-row decode) sampling with every knob (temperature, top-k, top-p,
min-p, penalties, logit bias, a seed), a prompt long enough for quantized weights' dense
prefill path (`quant_dequant.DENSE_MIN_M` rows), and the structured-output mask once. Afterwards the
engine's counters read as if nothing had run. Triton keeps what it compiled in its on-disk
cache, so a later load warms up in well under a second.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch

from helexa import kernels
from helexa.engine.sampling_params import SamplingParams
from helexa.kernels import quant_dequant


class LLMEngine(Protocol):
    """What the warm-up uses of llm_engine.LLMEngine (which imports this module)."""

    tokenizer: Any
    loaded: Any
    runner: Any
    block_manager: Any
    scheduler: Any
    max_model_len: int
    num_generated_tokens: int

    def add_request(self, prompt: list[int], params: SamplingParams) -> Any: ...

    def step(self) -> list: ...

    def abort(self, request_id: str) -> Any: ...

    def has_unfinished(self) -> bool: ...


log = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
SAMPLED = SamplingParams(
    temperature=0.8,
    top_k=20,
    top_p=0.9,
    min_p=0.05,
    repetition_penalty=1.1,
    frequency_penalty=0.1,
    presence_penalty=0.1,
    logit_bias={0: -1.0},
    seed=0,
    max_tokens=3,
    ignore_eos=True,
)


def warm_up(engine: LLMEngine) -> float:
    """Run the warm-up requests through `engine` (which must be idle) and reset its counters;
    returns the seconds it took."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up needs an idle engine")
    t0 = time.perf_counter()
    ids = _token_ids(engine, 16 + 7 + 16)
    _run(engine, [(ids[:16], GREEDY)])
    _run(engine, [(ids[16:23], SAMPLED), (ids[23:], GREEDY)])
    long = min(quant_dequant.DENSE_MIN_M + 16, engine.max_model_len - GREEDY.max_tokens)
    _run(engine, [((ids * -(-long // len(ids)))[:long], GREEDY)])
    device = engine.runner.device
    vocab = engine.loaded.config.vocab_size
    logits = torch.zeros(1, vocab, device=device)
    words = torch.full((1, -(-vocab // 32)), -1, dtype=torch.int32, device=device)
    kernels.apply_token_bitmask(logits, words)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    _reset_counters(engine)
    seconds = time.perf_counter() - t0
    log.info("warm-up: kernels compiled in %.1fs", seconds)
    return seconds


def _token_ids(engine: LLMEngine, n: int) -> list[int]:
    """n ordinary token ids (no special token: a stop token would end a sequence early)."""
    special = engine.tokenizer.special_ids()
    vocab = engine.loaded.config.vocab_size
    ids = [t for t in range(min(vocab, n + len(special) + 1)) if t not in special]
    return ids[:n]


def _run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> None:
    seqs = [engine.add_request(p, params) for p, params in requests]
    try:
        while any(not s.is_finished for s in seqs):
            engine.step()
    finally:
        for s in seqs:  # finished ones are gone already; a failed step leaves none behind
            engine.abort(s.request_id)


def _reset_counters(engine: LLMEngine) -> None:
    """Stats as a fresh engine's: the warm-up generated nothing a user asked for."""
    engine.num_generated_tokens = 0
    engine.block_manager.num_prefix_queries = 0
    engine.block_manager.num_prefix_hits = 0
    engine.scheduler.num_preemptions = 0
    engine.scheduler.num_drafts = 0  # a draft model drafts for the warm-up's greedy rows
    engine.scheduler.num_draft_tokens = 0
    engine.scheduler.num_accepted_tokens = 0
