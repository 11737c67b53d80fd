"""OpenAI Responses shapes for a `Generation`: the response object and its named SSE events.

Streaming, each output item opens (`response.output_item.added`), grows (reasoning summary
text, output text, function-call arguments) and closes (`response.output_item.done`) in
the order the model produced it; `response.completed` (or `.incomplete` when the output
limit cut it, `.failed` on an error) carries the whole response last.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from helexa.errors import HelexaError
from helexa.node.generation import Generation
from helexa.protocol.assistant_output import Pieces, ToolCallOut
from helexa.protocol.blocks import OneBlockOpen


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesView(OneBlockOpen[dict[str, Any]]):
    """One generation seen through the Responses API (always a single choice)."""

    def __init__(self, gen: Generation, echo: dict[str, Any]) -> None:
        super().__init__()
        assert gen.req.n == 1, "the Responses API has one output"
        self.gen = gen
        self.echo = echo
        self.id = _item_id("resp")
        self.created_at = int(time.time())
        self.items: list[dict[str, Any]] = []
        self._item: dict[str, Any] | None = None  # the reasoning or message item growing
        self._seq = 0

    # -- the response object -----------------------------------------------------------
    def response(self, status: str) -> dict[str, Any]:
        incomplete = status == "incomplete"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.gen.served.id,
            "output": self.items if status != "in_progress" else [],
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "previous_response_id": None,
            **self.echo,
            "text": self.echo.get("text") or {"format": {"type": "text"}},
            "usage": self.usage if status != "in_progress" else None,
        }

    @property
    def usage(self) -> dict[str, Any]:
        u = self.gen.usage
        return {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": dict(u["prompt_tokens_details"]),
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {
                "reasoning_tokens": u["completion_tokens_details"]["reasoning_tokens"]
            },
            "total_tokens": u["total_tokens"],
        }

    def final_status(self) -> str:
        return "incomplete" if self.gen.choices[0].finish_reason == "length" else "completed"

    def whole(self) -> dict[str, Any]:
        """The non-streaming body, once the answer is complete."""
        out = self.gen.choices[0].output
        assert out is not None
        if out.reasoning_text:
            self.items.append(_reasoning_item(_item_id("rs"), out.reasoning, "completed"))
        if out.content_text:
            self.items.append(_message_item(_item_id("msg"), out.content, "completed"))
        self.items += [_call_item(c, "completed") for c in out.calls]
        return self.response(self.final_status())

    # -- events ------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def opening(self) -> list[dict[str, Any]]:
        return [
            self.event("response.created", response=self.response("in_progress")),
            self.event("response.in_progress", response=self.response("in_progress")),
        ]

    def delta(self, pieces: Pieces) -> list[dict[str, Any]]:
        """The events for what one engine step added."""
        events: list[dict[str, Any]] = []
        if pieces.reasoning:
            events += self.grow("reasoning", pieces.reasoning)
        if pieces.content:
            events += self.grow("message", pieces.content)
        for call in pieces.calls:
            events += self.close()
            events += self._call(call)
        return events

    def closing(self) -> list[dict[str, Any]]:
        events = self.close()
        status = self.final_status()
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self.event(kind, response=self.response(status))]

    def failed(self, error: HelexaError) -> dict[str, Any]:
        self.close()  # what was said stays in the output; its events no longer matter
        body = self.response("failed")
        body["error"] = {"code": error.code or error.type, "message": error.message}
        if "usage" in error.extra:  # what was spent before it failed (the gateway bills it)
            body["error"]["usage"] = error.extra["usage"]
        return self.event("response.failed", response=body)

    # -- the one open item (OneBlockOpen): reasoning or a message ------------------------
    def _opened(self, kind: str, fields: dict[str, Any] | None) -> list[dict[str, Any]]:
        if kind == "reasoning":
            item = _reasoning_item(_item_id("rs"), "", "in_progress")
            item["summary"] = []
        else:
            item = _message_item(_item_id("msg"), "", "in_progress")
            item["content"] = []
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        added = self.event(
            "response.output_item.added", output_index=where["output_index"], item=dict(item)
        )
        item["_text"] = []
        self._item = item
        if kind == "reasoning":
            part = {"type": "summary_text", "text": ""}
            return [
                added,
                self.event(
                    "response.reasoning_summary_part.added", **where, summary_index=0, part=part
                ),
            ]
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            added,
            self.event("response.content_part.added", **where, content_index=0, part=part),
        ]

    def _grown(self, kind: str, text: str) -> list[dict[str, Any]]:
        item = self._item
        assert item is not None
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        item["_text"].append(text)
        if kind == "reasoning":
            return [
                self.event(
                    "response.reasoning_summary_text.delta", **where, summary_index=0, delta=text
                )
            ]
        return [
            self.event(
                "response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]
            )
        ]

    def _closed(self, kind: str) -> list[dict[str, Any]]:
        item, self._item = self._item, None
        assert item is not None
        text = "".join(item.pop("_text"))
        index = self.items.index(item)
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "reasoning":
            done = _reasoning_item(item["id"], text, "completed")
            part = done["summary"][0]
            events = [
                self.event(
                    "response.reasoning_summary_text.done", **where, summary_index=0, text=text
                ),
                self.event(
                    "response.reasoning_summary_part.done", **where, summary_index=0, part=part
                ),
            ]
        else:
            done = _message_item(item["id"], text, "completed")
            part = done["content"][0]
            events = [
                self.event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                ),
                self.event("response.content_part.done", **where, content_index=0, part=part),
            ]
        self.items[index] = done
        return [*events, self.event("response.output_item.done", output_index=index, item=done)]

    def _call(self, call: ToolCallOut) -> list[dict[str, Any]]:
        done = _call_item(call, "completed")
        self.items.append(done)
        index = len(self.items) - 1
        where = {"item_id": done["id"], "output_index": index}
        added = {**done, "arguments": "", "status": "in_progress"}
        return [
            self.event("response.output_item.added", output_index=index, item=added),
            self.event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self.event(
                "response.function_call_arguments.done",
                **where,
                name=call.name,
                arguments=call.arguments,
            ),
            self.event("response.output_item.done", output_index=index, item=done),
        ]


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [{"type": "summary_text", "text": text}],
        "status": status,
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _call_item(call: ToolCallOut, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": "fc_" + call.id.removeprefix("call_"),
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }
