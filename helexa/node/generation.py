"""One chat or completions request run on a served model.

`node/serving.py` admits; this module renders the prompt and runs the `n` choices on the
engine, keeping what `openai_out` and `responses_out` shape into answers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from helexa.engine.async_engine import EngineDeadError
from helexa.engine.chat_template import TemplateRenderError, render_chat
from helexa.engine.grammar import OutputGrammar
from helexa.engine.sequence import RequestOutput, TokenLogprob
from helexa.engine.vision.inputs import ImageInput
from helexa.engine.worker_client import AbortedOutput, WorkerFaultError
from helexa.errors import (
    HelexaError,
    context_length_exceeded,
    service_unavailable,
    template_render_failed,
    tool_choice_not_satisfied,
    vision_unsupported,
)
from helexa.node.exchanges import NOTHING_RAN, Usage
from helexa.node.images import expand_image_pads, load_images
from helexa.node.metrics import NodeMetrics
from helexa.node.registry import RECOVERY_RETRY_AFTER_S, ModelRegistry
from helexa.node.sampling import choice_params
from helexa.node.served import ServedModel
from helexa.node.structured import output_grammar
from helexa.protocol.assistant_output import AssistantOutput, Pieces
from helexa.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    has_image_parts,
    template_messages,
    template_tools,
)
from helexa.protocol.tool_calls import tool_schemas

log = logging.getLogger(__name__)
# Requests from this `user` fail where HELEXA_DEBUG_FAULT says, alone (tests only).
DEBUG_FAULT_USER = "helexa-debug-fault"
# Readers of cut requests still awaiting the engine's final count: referenced until done.
_SETTLING: set[asyncio.Task] = set()


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: list[int]
    opens_reasoning: bool = False  # the template left a reasoning block open
    # structured output: what the answer must match (helexa.node.structured), None: free
    grammar: OutputGrammar | None = None
    # decoded and resized, in prompt order; `ids` holds each one's run of pad tokens
    images: tuple[ImageInput, ...] = ()


def prepare_prompt(served: ServedModel, req: ChatCompletionRequest | CompletionRequest) -> Prompt:
    """The prompt, checked to fit the context, and the grammar its answer must match:
    raises the 400/422 `HelexaError` when it cannot run (too long, images, template error,
    a schema the grammar engine cannot build). Runs off the event loop: rendering and
    tokenizing a long conversation, and checking a grammar, take a while."""
    prompt = render_prompt(served, req)
    if len(prompt.ids) >= served.max_model_len:
        raise context_length_exceeded(served.max_model_len, len(prompt.ids))
    return prompt


def render_prompt(served: ServedModel, req: ChatCompletionRequest | CompletionRequest) -> Prompt:
    """Prompt token ids: the chat template rendered, or the raw prompt encoded; a vision
    model's images decoded and each one's placeholder widened to its run of pad tokens,
    so the context check and `prompt_tokens` count them."""
    tok = served.tokenizer
    opens = False
    images: list[ImageInput] = []
    profile = served.vision
    if isinstance(req, ChatCompletionRequest):
        if has_image_parts(req):
            if profile is None:
                raise vision_unsupported(served.id)
            images = load_images(req, profile, served.image_limits)
        tools = template_tools(req)
        try:
            text = render_chat(
                tok,
                template_messages(req),
                tools=tools,
                chat_template_kwargs=req.template_kwargs(),
            )
        except TemplateRenderError as e:
            raise template_render_failed(str(e)) from None
        opens = served.reasoning_markers is not None and served.reasoning_markers.opened_by(text)
        ids = tok.encode(_utf8(text, "messages"))
    elif isinstance(req.prompt, str):
        ids = tok.encode(_utf8(req.prompt, "prompt"), add_special_tokens=True)
    else:
        ids = list(req.prompt)
    if profile is not None:  # each image's placeholder widened to its run of pads
        param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        ids = expand_image_pads(ids, images, profile, param)
    # The embedding table is the bound: a tokenizer may know more ids than the model has.
    vocab = served.vocab_size
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
    for param, token_ids in (
        ("logit_bias", req.logit_bias),
        ("stop_token_ids", req.stop_token_ids),
    ):
        unknown = sorted(t for t in token_ids or () if t >= vocab)
        if unknown:
            raise HelexaError(
                400,
                "invalid_request_error",
                f"{param}: token ids {unknown[:5]} are outside the model's vocabulary "
                f"(size {vocab})",
                param=param,
            )
    grammar = output_grammar(served, req, opens_reasoning=opens)
    return Prompt(ids, opens, grammar, tuple(images))


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


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)  # as decoded
    num_chars: int = 0  # len("".join(text)), kept as it grows
    num_tokens: int = 0  # generated, as the engine reported them (read or not)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # chat: the text split into reasoning, content and tool calls; `last` is what the
    # latest delta added
    output: AssistantOutput | None = None
    last: Pieces = field(default_factory=Pieces)


class Generation:
    """The engine side of one request: n choices merged into one stream of deltas."""

    def __init__(
        self,
        registry: ModelRegistry,
        served: ServedModel,
        req: ChatCompletionRequest | CompletionRequest,
        prompt: Prompt,
        metrics: NodeMetrics,
    ) -> None:
        self.registry = registry
        self.served = served
        self.req = req
        self.prompt_ids = prompt.ids
        self.images = list(prompt.images) or None
        self.metrics = metrics
        self.is_chat = isinstance(req, ChatCompletionRequest)
        self.id = ("chatcmpl-" if self.is_chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(req.n)]
        if isinstance(req, ChatCompletionRequest):
            for c in self.choices:
                c.output = assistant_output(served, req, prompt)
        # completions `echo`: the prompt as text, put before each choice's text
        self.echo_text = ""
        if isinstance(req, CompletionRequest) and req.echo:
            given = req.prompt
            self.echo_text = given if isinstance(given, str) else served.tokenizer.decode(given)
        self.num_cached_tokens = 0
        self.num_cache_written_tokens = 0  # of the prompt, stored in the prefix cache
        # of a request cut before its first token: the prompt tokens its engine had computed
        self.num_prompt_computed = 0
        self._params = choice_params(req)
        if prompt.grammar is not None:
            self._params = [dataclasses.replace(p, grammar=prompt.grammar) for p in self._params]
        if self.is_chat and served.markers_are_special:
            self._params = [dataclasses.replace(p, skip_special_tokens=False) for p in self._params]
        fault = registry.cfg.node.debug_fault
        if fault is not None and req.user == DEBUG_FAULT_USER:
            self._params = [dataclasses.replace(p, debug_fault=fault) for p in self._params]
        if self._one_call_only(req):  # the first call's end marker ends the answer
            assert served.tool_call_markers is not None
            end = served.tool_call_markers.end
            self._params = [dataclasses.replace(p, stop=[*p.stop, end]) for p in self._params]
        model = served.id
        # metric children bound once: _account runs for every delta of every request
        self._ttft = metrics.ttft.labels(model)
        self._itl = metrics.itl.labels(model)
        self._t0 = 0.0  # set when deltas() starts: TTFT counts from generation, not queueing
        self._t_last: float | None = None
        self.ttft_s: float | None = None  # until the first generated token
        self._recorded = False
        self._cut = False  # deltas() has ended: no choice starts any more
        self._readers: list[asyncio.Task] = []
        self._on_settled: list[Callable[[], None]] = []

    # -- running -------------------------------------------------------------------
    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, delta) as the engine produces them; an engine fault becomes the
        HelexaError the client should see. Close it (or cancel its reader) to abort.

        Each choice's engine deltas are read by a task of their own as soon as they reach
        the node, whatever the pace of this iterator's reader: the token count then holds
        every token the engine reported, those a slow or departed client never got
        included. When it ends before its choices do, each one still running is aborted
        and its reader goes on to the engine's final report on it (the deltas that were on
        their way, and how much of the prompt a cut prefill had computed); the count is
        final once the readers have settled (`when_settled`): the worker's next step, however
        long a loaded machine takes over it (worker_client.WorkerClient.abort).
        Ending waits for that, unless it is cancelled again meanwhile."""
        self._t0 = time.monotonic()
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
        self._readers = readers = [
            asyncio.create_task(self._read(i, queue)) for i in range(self.req.n)
        ]
        for t in readers:
            t.add_done_callback(self._reader_done)
        try:
            live = len(readers)
            while live:
                i, item = await queue.get()
                if item is None:
                    live -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    self._account(i, item)
                    yield i, item
        except Exception as e:
            raise self._client_error(e) from None
        finally:
            self._cut = True
            pending = set()
            for i, t in enumerate(readers):  # the client left or the engine failed
                if not t.done():
                    pending.add(t)
                    self.served.llm.abort(self._request_id(i))
            if pending:
                _SETTLING.update(pending)
                await asyncio.wait(pending)  # if cancelled, they settle on their own

    def _request_id(self, i: int) -> str:
        return f"{self.id}-{i}"

    @property
    def is_settled(self) -> bool:
        """Whether every count is final: no reader is still awaiting the engine."""
        return all(t.done() for t in self._readers)

    def when_settled(self, callback: Callable[[], None]) -> None:
        """Call `callback` once every count is final: now if it is (or no choice ever ran),
        else when the last reader settles (at the worker's report on its abort)."""
        if self.is_settled:
            self._settle()
            callback()
        else:
            self._on_settled.append(callback)

    def _reader_done(self, task: asyncio.Task) -> None:
        _SETTLING.discard(task)
        if self.is_settled:
            self._settle()

    def _settle(self) -> None:
        if self._readers and not self._recorded:  # cut: the client left or the engine failed
            self._record_finish()
        callbacks, self._on_settled = self._on_settled, []
        for callback in callbacks:
            callback()

    async def _read(self, i: int, queue: asyncio.Queue) -> None:
        """Choice `i`'s engine deltas into `queue`, counted as they arrive; then None, or
        the exception that ended them. After `abort`, its last delta is the engine's report
        (`AbortedOutput`). Cancelling it aborts the choice in the engine, uncounted."""
        if self._cut:  # ended before this choice started: it never runs
            return
        c = self.choices[i]
        try:
            async for out in self.served.llm.generate(
                self.prompt_ids, self._params[i], self._request_id(i), images=self.images
            ):
                c.num_tokens += len(out.token_ids)
                self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
                self.num_cache_written_tokens = max(
                    self.num_cache_written_tokens, out.num_cache_written_tokens
                )
                if isinstance(out, AbortedOutput):
                    self.num_prompt_computed = max(
                        self.num_prompt_computed, out.num_computed_prompt_tokens
                    )
                queue.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            queue.put_nowait((i, e))
        else:
            queue.put_nowait((i, None))

    def _client_error(self, error: Exception) -> HelexaError:
        """What the client sees of an error that ended this request."""
        if isinstance(error, HelexaError):
            return error
        if isinstance(error, WorkerFaultError):  # the registry heard it too, and reloads
            return service_unavailable(
                f"model {self.served.id!r} hit a device fault and is reloading; retry shortly",
                RECOVERY_RETRY_AFTER_S,
                code="model_recovering",
            )
        if isinstance(error, EngineDeadError):
            return service_unavailable(
                f"model {self.served.id!r} was unloaded while this request ran",
                RECOVERY_RETRY_AFTER_S,
            )
        # this request alone: the cause stays in the log
        log.error("request %s on %s failed", self.id, self.served.id, exc_info=error)
        return HelexaError(
            500,
            "server_error",
            f"generation failed for this request (request id {self.id}); "
            "the cause is in the node's log",
        )

    def _account(self, i: int, out: RequestOutput) -> None:
        now = time.monotonic()
        n = len(out.token_ids)
        if n:
            if self._t_last is None:
                self.ttft_s = now - self._t0
                self._ttft.observe(self.ttft_s)
            else:
                self._itl.observe((now - self._t_last) / n)
            self._t_last = now
        c = self.choices[i]
        c.text.append(out.text)
        c.num_chars += len(out.text)
        if out.logprobs:
            c.logprobs.extend(out.logprobs)
        finish_reason = out.finish_reason
        if c.output is not None:
            c.last = c.output.feed(out.text, n)
            if out.finished:
                c.last = _joined(c.last, c.output.finish())
                finish_reason = self._chat_finish(c.output, finish_reason)
        if out.finished:
            c.finish_reason = finish_reason
            c.stop_reason = out.stop_reason
            if all(ch.finish_reason for ch in self.choices):
                self._record_finish()

    def _one_call_only(self, req: ChatCompletionRequest | CompletionRequest) -> bool:
        """`parallel_tool_calls: false` on a request whose tool calls are parsed."""
        return (
            isinstance(req, ChatCompletionRequest)
            and not req.parallel_tool_calls
            and self.served.tool_call_markers is not None
            and template_tools(req) is not None
        )

    def _chat_finish(self, output: AssistantOutput, reason: str | None) -> str | None:
        """The finish reason of a chat answer: `tool_calls` when it called tools. An
        answer without the call `tool_choice` demanded is refused, not passed off."""
        assert isinstance(self.req, ChatCompletionRequest)
        forced = self.req.forced_tool
        if forced is not None and reason == "stop":
            names = {c.name for c in output.calls}
            if not names or (forced != "*" and forced not in names):
                raise tool_choice_not_satisfied(forced, names, output.held_text)
        return "tool_calls" if output.calls and reason == "stop" else reason

    def _record_finish(self) -> None:
        self._recorded = True
        m, model = self.metrics, self.served.id
        m.prompt_tokens.labels(model).inc(self.num_prompt_spent)  # as `spent` counts them
        m.generation_tokens.labels(model).inc(sum(c.num_tokens for c in self.choices))
        for c in self.choices:
            m.success.labels(model, c.finish_reason or "abort").inc()

    @property
    def usage(self) -> dict[str, Any]:
        prompt = self.num_prompt_spent
        completion = sum(c.num_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            # cache_write_tokens: OpenRouter's name for prompt tokens stored for reuse
            "prompt_tokens_details": {
                "cached_tokens": self.num_cached_tokens,
                "cache_write_tokens": self.num_cache_written_tokens,
            },
            "completion_tokens_details": {"reasoning_tokens": self.num_reasoning_tokens},
        }

    @property
    def num_reasoning_tokens(self) -> int:
        return sum(c.output.num_reasoning_tokens for c in self.choices if c.output is not None)

    @property
    def num_prompt_spent(self) -> int:
        """The prompt tokens the engine spent: the whole prompt once it has generated a
        token; for a request cut before that, what its engine reported having computed
        (prefix-cache hits included: a chunked prefill cut part-way, or 0)."""
        if any(c.num_tokens for c in self.choices):
            return len(self.prompt_ids)
        return self.num_prompt_computed

    @property
    def has_run(self) -> bool:
        """Whether the engine spent anything on this request: it has reported a token (so
        its prompt was prefilled), or part of the prompt computed when it was cut. What an
        answer that failed or was cut after this point cost is worth telling; before it,
        nothing was spent that the node can vouch for."""
        return self.num_prompt_spent > 0

    def spent(self) -> Usage:
        """What the engine spent on this request so far (final once settled: see
        `when_settled`)."""
        if not self.has_run:
            return NOTHING_RAN
        return Usage(
            prompt_tokens=self.num_prompt_spent,
            completion_tokens=sum(c.num_tokens for c in self.choices),
            cached_tokens=self.num_cached_tokens,
            cache_write_tokens=self.num_cache_written_tokens,
            reasoning_tokens=self.num_reasoning_tokens,
        )


def assistant_output(
    served: ServedModel, req: ChatCompletionRequest, prompt: Prompt
) -> AssistantOutput:
    """The parser of one chat answer: reasoning split when the vocabulary has markers,
    tool calls parsed when the request offers tools."""
    tools = template_tools(req)
    return AssistantOutput(
        served.reasoning_markers,
        served.tool_call_markers if tools else None,
        tool_schemas(tools),
        in_reasoning=prompt.opens_reasoning,
        include_thinking=req.include_thinking,
        hold_content=req.forced_tool is not None,
    )


def _joined(a: Pieces, b: Pieces) -> Pieces:
    return Pieces(a.reasoning + b.reasoning, a.content + b.content, a.calls + b.calls)
