"""One inference request's path through the node, without HTTP.

drain check → bounds → model → admission check (a full queue answers before any
tokenizing) → prompt (rendered and tokenized off the event loop) → the gateway's budget →
permit → generation → release. `admit` walks it up to the permit and returns a `Run`,
which owns the permit from then on and releases it in one place, `Run.end`, however the
answer ends: complete, failed, cancelled, closed early, or a stream never started.

`notes` is what the request's log line should say (model, token counts, finish reason,
TTFT, error status); the web layer passes its per-request state and logs it.

Money: an answer that fails after the engine ran carries what it spent as `usage` in its
error object, and a request the gateway named (`exchange`) has its final usage recorded
when its run ends, however it ends: for a cut request, once the engine's final count on it
has come (`Generation.when_settled`, a step later).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator, Callable, MutableMapping
from contextlib import aclosing
from typing import Any

from helexa.errors import HelexaError
from helexa.node import openai_out
from helexa.node.admission import Permit
from helexa.node.exchanges import NOTHING_RAN, Exchange, Usage
from helexa.node.generation import Generation, prepare_prompt, render_prompt
from helexa.node.responses_out import ResponsesView
from helexa.node.service import Node
from helexa.protocol.limits import check_bounds
from helexa.protocol.openai import ChatCompletionRequest, CompletionRequest
from helexa.protocol.wire import SSE_DONE, SpendBudget, sse_data, sse_event

log = logging.getLogger(__name__)

Notes = MutableMapping[str, Any]


async def admit(
    node: Node,
    req: ChatCompletionRequest | CompletionRequest,
    *,
    principal: str | None,
    budget: SpendBudget | None = None,
    echo: dict[str, Any] | None = None,
    notes: Notes,
    exchange: Exchange | None = None,
) -> Run:
    """Admit `req` and hold a running slot for it. `principal`: who is calling, for the
    per-principal cap (None: the gateway's anonymous traffic); `budget`: the gateway's
    reservation, which may lower the output limit; `echo`: the Responses API fields the
    answer repeats, when it is to be answered in that API's shapes; `exchange`: the
    gateway's name for the request, ended with what it spent (nothing, if refused here)."""
    try:
        notes["model"] = req.model
        node.refuse_if_draining("the node is shutting down; retry on another node")
        check_bounds(req)
        served = node.registry.get(req.model)
        served.admission.check(principal)
        prompt = await asyncio.to_thread(prepare_prompt, served, req)
        notes["prompt_tokens"] = len(prompt.ids)
        if budget is not None:
            budget.apply(req, len(prompt.ids))  # the output the gateway's reservation covers
        gen = Generation(node.registry, served, req, prompt, node.metrics)
        view = ResponsesView(gen, echo) if echo is not None else None
        permit = await served.admission.acquire(principal)
    except BaseException:
        if exchange is not None:
            exchange.end(NOTHING_RAN)
        raise
    return Run(gen, view, permit, notes, exchange)


async def complete(
    node: Node,
    req: ChatCompletionRequest | CompletionRequest,
    *,
    principal: str | None,
    budget: SpendBudget | None = None,
    echo: dict[str, Any] | None = None,
    notes: Notes,
    exchange: Exchange | None = None,
) -> dict[str, Any]:
    """Admit `req` (as `admit`) and return its whole answer; cancelling it at any point
    leaves the queue or stops the generation, and frees what it held."""
    run = await admit(
        node, req, principal=principal, budget=budget, echo=echo, notes=notes, exchange=exchange
    )
    return await run.whole()


class Run:
    """One admitted request: its generation, the answer's shape, and the permit it holds
    until `end`."""

    __slots__ = ("exchange", "gen", "notes", "permit", "view")

    def __init__(
        self,
        gen: Generation,
        view: ResponsesView | None,
        permit: Permit,
        notes: Notes,
        exchange: Exchange | None = None,
    ) -> None:
        self.gen = gen
        self.view = view
        self.permit = permit
        self.notes = notes
        self.exchange = exchange

    async def whole(self) -> dict[str, Any]:
        """Generate to the end and return the whole answer; cancelling it aborts the
        generation and frees its KV. An error after the engine ran carries the usage."""
        try:
            async with aclosing(self.gen.deltas()) as deltas:
                async for _ in deltas:
                    pass
            return openai_out.full_response(self.gen) if self.view is None else self.view.whole()
        except HelexaError as e:
            raise self.billed(e) from None
        finally:
            self.end()

    def billed(self, error: HelexaError) -> HelexaError:
        """`error` with what the engine spent as its `usage`, in this answer's API's shape,
        once the engine has run the request (the gateway bills errors from it too)."""
        if self.gen.has_run:
            error.extra["usage"] = self.gen.usage if self.view is None else self.view.usage
        return error

    def stream(self) -> AnswerStream:
        """The answer as server-sent events, generated as they are read."""
        return AnswerStream(self)

    def end(self) -> None:
        """Release the slot and note how the answer ended; once, whatever calls it first."""
        if self.permit.is_released:
            return
        gen, notes = self.gen, self.notes
        reasons = {c.finish_reason or "abort" for c in gen.choices}
        notes["finish_reason"] = ",".join(sorted(reasons))
        if gen.ttft_s is not None:
            notes["ttft_ms"] = gen.ttft_s * 1000
        settle = self.exchange.settle_later() if self.exchange is not None else None
        if not gen.is_settled:  # cut: the log line waits for the engine's count (NodeGuard)
            notes["settling"] = []
        gen.when_settled(lambda: self._settled(settle))
        self.permit.release()

    def _settled(self, settle: Callable[[Usage], None] | None) -> None:
        """The engine's count is final: what the request spent goes to its exchange and
        its log line (a cut one's, held until now, is written)."""
        spent, notes = self.gen.spent(), self.notes
        notes["prompt_tokens"] = spent.prompt_tokens
        notes["completion_tokens"] = spent.completion_tokens
        if settle is not None:
            settle(spent)
        for write in notes.pop("settling", ()):
            write()


class AnswerStream:
    """A streamed answer's SSE body: OpenAI chunks ending in `[DONE]`, or the Responses
    API's named events. Its run ends when the body ends, fails, is closed part-way (the
    client left), or is dropped without ever being read (an async generator never started
    runs no `finally`, hence the finalizer)."""

    __slots__ = ("__weakref__", "_body")

    def __init__(self, run: Run) -> None:
        self._body = _openai_events(run) if run.view is None else _responses_events(run)
        weakref.finalize(self, run.end)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._body  # the generator itself: no wrapper call per chunk


async def _openai_events(run: Run) -> AsyncIterator[bytes]:
    gen = run.gen
    try:
        for chunk in openai_out.opening_chunks(gen):
            yield sse_data(chunk)
        # closed here, not whenever it is collected: a cut stream stops the engine now
        async with aclosing(gen.deltas()) as deltas:
            async for i, out in deltas:
                for chunk in openai_out.delta_chunks(gen, i, out):
                    yield sse_data(chunk)
        if gen.req.include_usage:
            yield sse_data(openai_out.usage_chunk(gen))
    except HelexaError as e:  # headers are gone: the error travels as an SSE event
        log.warning("stream %s failed: %s", gen.id, e.message)
        run.notes["error"] = e.status
        yield sse_data(run.billed(e).to_envelope())
    finally:
        run.end()
    yield SSE_DONE


async def _responses_events(run: Run) -> AsyncIterator[bytes]:
    """Named events (`event: response.output_text.delta`), no `[DONE]`: the API's own."""
    gen, view = run.gen, run.view
    assert view is not None
    try:
        for e in view.opening():
            yield sse_event(e["type"], e)
        async with aclosing(gen.deltas()) as deltas:
            async for _, _out in deltas:
                for e in view.delta(gen.choices[0].last):
                    yield sse_event(e["type"], e)
        for e in view.closing():
            yield sse_event(e["type"], e)
    except HelexaError as e:
        log.warning("stream %s failed: %s", view.id, e.message)
        run.notes["error"] = e.status
        failed = view.failed(run.billed(e))
        yield sse_event(failed["type"], failed)
    finally:
        run.end()


async def tokenize(
    node: Node, req: ChatCompletionRequest | CompletionRequest, notes: Notes
) -> dict[str, Any]:
    """The prompt's token ids as a generation would see them (vLLM's `/tokenize` shape)."""
    notes["model"] = req.model
    check_bounds(req)
    served = node.registry.get(req.model)
    prompt = await asyncio.to_thread(render_prompt, served, req)
    return {"count": len(prompt.ids), "max_model_len": served.max_model_len, "tokens": prompt.ids}
