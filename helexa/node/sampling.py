"""From a parsed OpenAI request to the engine's sampling parameters, one per choice."""

from __future__ import annotations

import dataclasses

from helexa.engine.sampling_params import SamplingParams, SamplingParamsError
from helexa.errors import invalid_request
from helexa.protocol.openai import FLOAT_FIELDS, ChatCompletionRequest, CompletionRequest

_SEED_MASK = (1 << 64) - 1


def to_sampling_params(
    req: ChatCompletionRequest | CompletionRequest, *, max_tokens_default: int | None = None
) -> SamplingParams:
    """The engine's SamplingParams for `req`; a range error is the 400 naming its field."""
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    given = {name: getattr(req, name) for name in (*FLOAT_FIELDS, "top_k")}
    try:
        return SamplingParams(
            **{k: v for k, v in given.items() if v is not None},
            seed=req.seed,
            max_tokens=req.output_limit or max_tokens_default,
            min_tokens=req.min_tokens,
            stop=list(req.stop),
            stop_token_ids=list(req.stop_token_ids),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            logit_bias=req.logit_bias,
        )
    except SamplingParamsError as e:
        raise invalid_request(str(e), e.param) from None


def choice_params(req: ChatCompletionRequest | CompletionRequest) -> list[SamplingParams]:
    """One SamplingParams per choice; with a seed, choice i uses seed + i so the n choices
    differ yet the whole response is reproducible."""
    base = to_sampling_params(req)
    if base.seed is None:
        return [base] + [dataclasses.replace(base) for _ in range(req.n - 1)]
    return [dataclasses.replace(base, seed=(base.seed + i) & _SEED_MASK) for i in range(req.n)]
