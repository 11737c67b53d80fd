"""The synchronous public API: `LLM(model).generate(...)` and `.chat(...)`."""

from __future__ import annotations

import weakref
from dataclasses import fields
from typing import Any

from helexa.engine.chat_template import render_chat
from helexa.engine.llm_engine import EngineArgs, LLMEngine
from helexa.engine.sampling_params import SamplingParams
from helexa.engine.sequence import RequestOutput


class LLM:
    """Offline generation with one model.

    `model` is a local HF-layout directory, a `.gguf` file, a hub id (`org/name`), or
    None for the bundled SmolLM2. Other keyword arguments are `EngineArgs` fields.
    """

    def __init__(self, model: str | None = None, dtype: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, dtype=dtype, **kwargs))
        self.tokenizer = self.engine.tokenizer
        # at garbage collection or interpreter exit, whichever comes first
        self._close = weakref.finalize(self, self.engine.shutdown)

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (if any); idempotent."""
        self._close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def from_args(cls, args: EngineArgs) -> LLM:
        return cls(**{f.name: getattr(args, f.name) for f in fields(args)})

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (strings or token-id lists), batched together."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        return self.engine.generate(list(prompts), params or SamplingParams())

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [
            self.tokenizer.encode(
                render_chat(
                    self.tokenizer, conv, tools=tools, chat_template_kwargs=chat_template_kwargs
                )
            )
            for conv in conversations
        ]
        return self.engine.generate(prompts, params or SamplingParams())
