"""The node's inference engine: `from helexa.engine import LLM, SamplingParams`."""

from helexa.engine.async_engine import AsyncLLM
from helexa.engine.llm import LLM
from helexa.engine.llm_engine import (
    ContextLengthExceededError,
    EngineArgs,
    EngineStats,
    LLMEngine,
)
from helexa.engine.rank_worker import RankLostError
from helexa.engine.sampling_params import SamplingParams
from helexa.engine.sequence import RequestOutput

__all__ = [
    "LLM",
    "AsyncLLM",
    "ContextLengthExceededError",
    "EngineArgs",
    "EngineStats",
    "LLMEngine",
    "RankLostError",
    "RequestOutput",
    "SamplingParams",
]
