"""One chat or completions request run on a served model, as OpenAI response objects.

The web layer parses and admits; this module renders the prompt, runs the `n` choices on
the engine, and shapes what comes back: a whole response, or the chunks of an SSE stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from helexa.engine.async_engine import EngineDeadError
from helexa.engine.chat_template import TemplateRenderError, render_chat
from helexa.engine.model_runner import NonFiniteLogitsError
from helexa.engine.sampling_params import SamplingParams
from helexa.engine.sequence import RequestOutput, TokenLogprob
from helexa.errors import (
    HelexaError,
    context_length_exceeded,
    service_unavailable,
    template_render_failed,
    vision_unsupported,
)
from helexa.node.metrics import NodeMetrics
from helexa.node.registry import RECOVERY_RETRY_AFTER_S, ModelRegistry, ServedModel
from helexa.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    has_image_parts,
    template_messages,
    template_tools,
    to_sampling_params,
)

log = logging.getLogger(__name__)
_SEED_MASK = (1 << 64) - 1


def prepare_prompt(
    served: ServedModel, req: ChatCompletionRequest | CompletionRequest
) -> list[int]:
    """Prompt token ids: the chat template rendered, or the raw prompt encoded. Raises the
    400/422 `HelexaError` when the prompt cannot run (too long, images, template error).
    Runs off the event loop: rendering and tokenizing a long conversation takes a while."""
    tok = served.engine.tokenizer
    if isinstance(req, ChatCompletionRequest):
        if has_image_parts(req):
            raise vision_unsupported(served.id)
        tools = template_tools(req)
        try:
            text = render_chat(
                tok,
                template_messages(req),
                tools=tools,
                chat_template_kwargs=req.chat_template_kwargs,
            )
        except TemplateRenderError as e:
            raise template_render_failed(str(e)) from None
        ids = tok.encode(_utf8(text, "messages"))
    elif isinstance(req.prompt, str):
        ids = tok.encode(_utf8(req.prompt, "prompt"), add_special_tokens=True)
    else:
        ids = list(req.prompt)
    # The embedding table is the bound: a tokenizer may know more ids than the model has.
    vocab = min(tok.vocab_size, served.engine.loaded.config.vocab_size or tok.vocab_size)
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise HelexaError(
            400,
            "invalid_request_error",
            f"prompt token id {bad} is outside the model's vocabulary (size {vocab})",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
        )
    if not ids:
        raise HelexaError(400, "invalid_request_error", "the prompt is empty", param="prompt")
    if len(ids) >= served.max_model_len:
        raise context_length_exceeded(served.max_model_len, len(ids))
    return ids


def _utf8(text: str, param: str) -> str:
    """`text` if it is valid Unicode; JSON lets a lone surrogate (\\ud800) through."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HelexaError(
            400,
            "invalid_request_error",
            f"{param} contains invalid Unicode (a lone surrogate at character {e.start})",
            param=param,
        ) from None
    return text


def choice_params(req: ChatCompletionRequest | CompletionRequest) -> list[SamplingParams]:
    """One SamplingParams per choice; with a seed, choice i uses seed + i so the n choices
    differ yet the whole response is reproducible."""
    base = to_sampling_params(req)
    if base.seed is None:
        return [base] + [dataclasses.replace(base) for _ in range(req.n - 1)]
    return [dataclasses.replace(base, seed=(base.seed + i) & _SEED_MASK) for i in range(req.n)]


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    num_chars: int = 0  # len("".join(text)), kept as it grows
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


class Generation:
    """The engine side of one request: n choices merged into one stream of deltas."""

    def __init__(
        self,
        registry: ModelRegistry,
        served: ServedModel,
        req: ChatCompletionRequest | CompletionRequest,
        prompt_ids: list[int],
        metrics: NodeMetrics,
    ) -> None:
        self.registry = registry
        self.served = served
        self.req = req
        self.prompt_ids = prompt_ids
        self.metrics = metrics
        self.is_chat = isinstance(req, ChatCompletionRequest)
        self.id = ("chatcmpl-" if self.is_chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(req.n)]
        # completions `echo`: the prompt as text, put before each choice's text
        self.echo_text = ""
        if isinstance(req, CompletionRequest) and req.echo:
            prompt = req.prompt
            self.echo_text = (
                prompt if isinstance(prompt, str) else served.engine.tokenizer.decode(prompt)
            )
        self.num_cached_tokens = 0
        self._params = choice_params(req)
        model = served.id
        # metric children bound once: _account runs for every delta of every request
        self._ttft = metrics.ttft.labels(model)
        self._itl = metrics.itl.labels(model)
        self._t0 = time.monotonic()
        self._t_last: float | None = None
        self._recorded = False

    # -- running -------------------------------------------------------------------
    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, delta) as the engine produces them; an engine fault becomes the
        HelexaError the client should see."""
        try:
            async for item in self._deltas():
                yield item
        finally:
            if not self._recorded:  # aborted: the client left or the engine failed
                self._record_finish()

    async def _deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            if self.registry.take_debug_poison(self.served.id):
                raise NonFiniteLogitsError("fault injected by HELEXA_DEBUG_POISON")
            if self.req.n == 1:
                async for out in self.served.llm.generate(
                    self.prompt_ids, self._params[0], f"{self.id}-0"
                ):
                    self._account(0, out)
                    yield 0, out
            else:
                async for i, out in self._merged():
                    self._account(i, out)
                    yield i, out
        except NonFiniteLogitsError as e:
            self.registry.report_fault(self.served.id, e)
            raise service_unavailable(
                f"model {self.served.id!r} hit a device fault and is reloading; retry shortly",
                RECOVERY_RETRY_AFTER_S,
                code="model_recovering",
            ) from None
        except EngineDeadError:
            raise service_unavailable(
                f"model {self.served.id!r} was unloaded while this request ran",
                RECOVERY_RETRY_AFTER_S,
            ) from None
        except HelexaError:
            raise
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:
            log.exception("request %s on %s failed", self.id, self.served.id)
            raise HelexaError(
                500, "server_error", f"generation failed: {type(e).__name__}: {e}"
            ) from None

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for out in self.served.llm.generate(
                    self.prompt_ids, self._params[i], f"{self.id}-{i}"
                ):
                    queue.put_nowait((i, out))
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                queue.put_nowait((i, e))
            else:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(self.req.n)]
        try:
            live = len(tasks)
            while live:
                i, item = await queue.get()
                if item is None:
                    live -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _account(self, i: int, out: RequestOutput) -> None:
        now = time.monotonic()
        n = len(out.token_ids)
        if n:
            if self._t_last is None:
                self._ttft.observe(now - self._t0)
            else:
                self._itl.observe((now - self._t_last) / n)
            self._t_last = now
        c = self.choices[i]
        c.text.append(out.text)
        c.num_chars += len(out.text)
        c.num_tokens += n
        if out.logprobs:
            c.logprobs.extend(out.logprobs)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.finished:
            c.finish_reason = out.finish_reason
            c.stop_reason = out.stop_reason
            if all(ch.finish_reason for ch in self.choices):
                self._record_finish()

    def _record_finish(self) -> None:
        self._recorded = True
        m, model = self.metrics, self.served.id
        m.prompt_tokens.labels(model).inc(len(self.prompt_ids))
        m.generation_tokens.labels(model).inc(sum(c.num_tokens for c in self.choices))
        for c in self.choices:
            m.success.labels(model, c.finish_reason or "abort").inc()

    @property
    def usage(self) -> dict[str, Any]:
        prompt = len(self.prompt_ids)
        completion = sum(c.num_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": 0},
        }
