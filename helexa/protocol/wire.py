"""The node ↔ gateway contract, in one place: the headers the gateway stamps, the budget
header's format and parser, the price formula, the output default both sides assume, the
speculative decoding a load may ask for, and server-sent events (encoded by the node,
parsed by the gateway). No I/O."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from helexa.errors import insufficient_quota
from helexa.protocol.openai import ChatCompletionRequest, CompletionRequest

# Headers the gateway stamps for a node (clients' own `x-helexa-*` are dropped on the way).
ACCOUNT_HEADER = "x-helexa-account-id"
KEY_HEADER = "x-helexa-key-id"
BUDGET_HEADER = "x-helexa-budget"
# On every proxied request: the node leaves per-principal caps of anonymous gateway
# traffic to the gateway instead of counting them by client address.
VIA_HEADER = "x-helexa-via"
SECRET_HEADER = "x-helexa-gateway-secret"  # deprecated: the gateway sends Authorization
REQUEST_ID_HEADER = "x-request-id"
# The gateway's name for one proxied request: the node keeps that request's final usage
# under it (`GET /v1/exchanges/{id}/usage`), tokens a cut stream never delivered included.
EXCHANGE_HEADER = "x-helexa-exchange"
_EXCHANGE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def is_exchange_id(value: str) -> bool:
    """Whether `value` may name an exchange: 1–64 characters of `[A-Za-z0-9_-]`."""
    return _EXCHANGE_ID.fullmatch(value) is not None


def exchange_usage_path(exchange_id: str) -> str:
    """The node's route that answers an exchange's final usage."""
    return f"/v1/exchanges/{exchange_id}/usage"


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` value, if that is what it is: how
    clients present keys to the gateway, and the gateway its key to a node."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


# When a request names no output limit, generation stops after this many tokens.
DEFAULT_MAX_OUTPUT_TOKENS = 8192
# The gateway's estimate of a prompt's tokens before the node has tokenized it.
CHARS_PER_TOKEN = 4
# A load's speculative decoding (`POST /models/load`, a catalogue entry): vLLM's method
# names ("off": none for this model, whatever the node's [engine] says), and the most
# tokens one draft may propose.
SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp", "off")
MAX_SPECULATIVE_TOKENS = 16


def cost_usd(
    prompt_tokens: int, completion_tokens: int, in_price: float, out_price: float
) -> float:
    """What tokens cost at prices in USD per 1M prompt and output tokens."""
    return (prompt_tokens * in_price + completion_tokens * out_price) / 1e6


@dataclass(slots=True, frozen=True)
class Price:
    """A model's prices, USD per 1M tokens: prompt tokens computed afresh (`input`),
    generated (`output`), read from the prefix cache (`cache_read`) and computed and stored
    there for later requests (`cache_write`)."""

    input: float = 0.0
    output: float = 0.0
    cache_read: float = 0.0
    cache_write: float = 0.0

    def cost(
        self, prompt_tokens: int, completion_tokens: int, cached: int = 0, cache_written: int = 0
    ) -> float:
        """What a request's tokens cost: of its prompt, `cached` read from the cache and
        `cache_written` stored in it, the rest at the input price."""
        cached = min(cached, prompt_tokens)
        cache_written = min(cache_written, prompt_tokens - cached)
        fresh = prompt_tokens - cached - cache_written
        return (
            fresh * self.input
            + cached * self.cache_read
            + cache_written * self.cache_write
            + completion_tokens * self.output
        ) / 1e6

    @property
    def bound(self) -> tuple[float, float]:
        """(prompt, output) prices a budget reserves at before the node says what it
        cached: each prompt token at the dearest of its three prices, so a reservation is
        never below what the request is booked at."""
        return max(self.input, self.cache_read, self.cache_write), self.output


FREE = Price()  # a model the catalogue does not price (one instance: making one costs ~1 µs)


def output_room(
    prompt_tokens: int,
    tokens_left: int | None,
    cost_left: float | None,
    in_price: float,
    out_price: float,
) -> int | None:
    """Output tokens that fit after the prompt in what a budget has left (None: it sets no
    bound); 0 or less when not one fits."""
    room: int | None = None
    if tokens_left is not None:
        room = tokens_left - prompt_tokens
    if cost_left is not None:
        left = cost_left - cost_usd(prompt_tokens, 0, in_price, 0.0)
        if left < 0:
            return 0
        if out_price > 0:
            by_cost = math.floor(left / cost_usd(0, 1, 0.0, out_price))
            room = by_cost if room is None else min(room, by_cost)
    return room


@dataclass(slots=True, frozen=True)
class SpendBudget:
    tokens: int | None = None
    cost: float | None = None
    in_price: float = 0.0  # USD per 1M prompt tokens
    out_price: float = 0.0  # USD per 1M output tokens

    @classmethod
    def parse(cls, value: str) -> SpendBudget:
        fields: dict[str, str] = {}
        for part in value.split(";"):
            name, sep, raw = part.strip().partition("=")
            if not sep or name not in ("tokens", "cost", "in", "out"):
                raise ValueError(f"expected tokens=N; cost=USD; in=P; out=P, got {value!r}")
            fields[name] = raw.strip()
        try:
            budget = cls(
                tokens=int(fields["tokens"]) if "tokens" in fields else None,
                cost=float(fields["cost"]) if "cost" in fields else None,
                in_price=float(fields.get("in", 0)),
                out_price=float(fields.get("out", 0)),
            )
        except ValueError:
            raise ValueError(f"expected numbers, got {value!r}") from None
        numbers = (budget.cost or 0.0, budget.in_price, budget.out_price)
        if not all(math.isfinite(x) and x >= 0 for x in numbers):
            raise ValueError(f"expected finite non-negative numbers, got {value!r}")
        return budget

    def header(self) -> str:
        """The `x-helexa-budget` value `parse` reads back."""
        parts = [f"tokens={self.tokens}"] if self.tokens is not None else []
        parts += [f"cost={self.cost!r}"] if self.cost is not None else []
        return "; ".join([*parts, f"in={self.in_price!r}", f"out={self.out_price!r}"])

    def max_output(self, prompt_tokens: int) -> int | None:
        """Output tokens the budget leaves after the prompt (None: no limit from it)."""
        return output_room(prompt_tokens, self.tokens, self.cost, self.in_price, self.out_price)

    def apply(self, req: ChatCompletionRequest | CompletionRequest, prompt_tokens: int) -> None:
        """Lower the request's output limit to what the budget covers (split over `n`)."""
        room = self.max_output(prompt_tokens)
        if room is None:
            return
        per_choice = room // req.n
        if per_choice < 1:
            raise insufficient_quota(
                f"the key's remaining budget does not cover this request: the prompt has "
                f"{prompt_tokens} tokens"
            )
        limit = req.output_limit
        capped = per_choice if limit is None else min(limit, per_choice)
        req.max_tokens = capped
        if isinstance(req, ChatCompletionRequest):
            req.max_completion_tokens = capped


# -- server-sent events --------------------------------------------------------------------

SSE_DONE = b"data: [DONE]\n\n"
_LINE_BREAKS = ("\u2028", "\u2029", "\x85")  # legal in JSON strings; some splitters break on them


def sse_data(obj: Any) -> bytes:
    """One unnamed event (OpenAI's chunks): `data: <json>`."""
    return b"data: " + _json(obj).encode() + b"\n\n"


def sse_event(name: str, obj: Any) -> bytes:
    """One named event (Anthropic's and the Responses API's): `event: <name>` + `data:`."""
    return f"event: {name}\ndata: {_json(obj)}\n\n".encode()


def _json(obj: Any) -> str:
    payload = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    for char in _LINE_BREAKS:
        payload = payload.replace(char, f"\\u{ord(char):04x}")
    return payload


@dataclass(slots=True, frozen=True)
class SSEEvent:
    name: str | None  # the `event:` line, if any
    data: str  # the `data:` lines joined


class SSEReader:
    """An SSE byte stream in, however it is split into chunks; whole events out. Each
    chunk is split once (a node's chunk often holds many events), and an event of one
    `data:` line, what every node and gateway stream sends, is read without a line split."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        buffer = self.buffer + chunk if self.buffer else chunk
        if b"\r" in buffer:  # CRLF line ends (a "\r" at the end waits for its "\n")
            buffer = buffer.replace(b"\r\n", b"\n")
        blocks = buffer.split(b"\n\n")
        self.buffer = blocks.pop()  # what follows the last blank line: not yet an event
        events = []
        for block in blocks:
            if block.startswith(b"data:") and b"\n" not in block:
                data = block[5:].removeprefix(b" ")
                events.append(SSEEvent(None, data.decode("utf-8", "replace")))
                continue
            name, lines = None, []
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    lines.append(line[5:].removeprefix(b" "))
                elif line.startswith(b"event:"):
                    name = line[6:].strip().decode("utf-8", "replace")
            if lines:
                events.append(SSEEvent(name, b"\n".join(lines).decode("utf-8", "replace")))
        return events
