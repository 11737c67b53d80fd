"""What `helexa bench run` measures and how: the SPEC's scenarios, the target, prompts of
a given size in the target's own tokens, and one sample of a scenario over HTTP.

- `chat-128`, `chat-4096`: one streamed chat at a time with a prompt of that many tokens:
  time to the first token, and the stream's decode rate over its first-to-last token window.
- `throughput-c1`, `-c4`, `-c16`: that many clients at once, each streaming chats back to
  back (two rounds' worth of requests); completion tokens over the wall time.
`quick()` makes a scenario short: 16 new tokens, one round (named `…-quick`, so its samples
never mix with full ones). Every request asks for `max_tokens` with `ignore_eos` (vLLM,
llama.cpp and helexa honour it; others stop where their model stops, and the completion
tokens they report are what the rates count) at temperature 0.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from helexa.bench.history import Build
from helexa.protocol.wire import SSEReader

REQUEST_TIMEOUT_S = 900.0  # a 4096-token prefill on a CPU node takes a while
MIN_DECODE_WINDOW_S = 0.01  # below this the chunks arrived together: no rate to speak of
FALLBACK_TOKENS_PER_NOTE = 16.0  # when the target reports no usage to calibrate with


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    prompt_tokens: int
    max_tokens: int
    concurrency: int = 1
    requests: int = 1  # per sample

    @property
    def is_chat(self) -> bool:
        return self.name.startswith("chat-")


SCENARIOS = {
    "chat-128": Scenario("chat-128", 128, 256),
    "chat-4096": Scenario("chat-4096", 4096, 256),
    "throughput-c1": Scenario("throughput-c1", 128, 128, 1, 2),
    "throughput-c4": Scenario("throughput-c4", 128, 128, 4, 8),
    "throughput-c16": Scenario("throughput-c16", 128, 128, 16, 32),
}


def quick(s: Scenario) -> Scenario:
    """The short version: 16 tokens an answer, one round of requests."""
    return Scenario(f"{s.name}-quick", s.prompt_tokens, 16, s.concurrency, s.concurrency)


def pick_scenarios(names: list[str] | None, is_quick: bool) -> list[Scenario]:
    chosen = [n.strip() for arg in names or [] for n in arg.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    picked = [SCENARIOS[n] for n in dict.fromkeys(chosen)] or list(SCENARIOS.values())
    return [quick(s) for s in picked] if is_quick else picked


class ResendOnClosed(httpx.AsyncBaseTransport):
    """The benches' transport: a request that meets a kept-alive connection the server had
    already closed (llama-server closes each after a streamed answer) is sent once more, on
    a fresh connection, instead of failing the sample."""

    def __init__(self, max_connections: int) -> None:
        limits = httpx.Limits(max_connections=max_connections)
        self.inner = httpx.AsyncHTTPTransport(limits=limits)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self.inner.handle_async_request(request)
        except httpx.RemoteProtocolError:
            return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


# -- the target ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Target:
    name: str
    url: str  # as given
    root: str  # scheme://host[:port][/prefix], where /version lives
    v1: str  # root + /v1

    @classmethod
    def parse(cls, url: str, name: str | None) -> Target:
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"--target {url!r}: expected a base URL like http://host:13131/v1")
        path = parts.path.rstrip("/").removesuffix("/v1")
        root = urlunsplit((parts.scheme, parts.netloc, path, "", ""))
        return cls(name or parts.netloc, url, root, root + "/v1")


async def read_build(client: httpx.AsyncClient, target: Target) -> tuple[Build, dict | None]:
    """The target's build: helexa's git sha and dirty flag, else another server's version
    string (vLLM, Ollama, llama.cpp), else "unknown"."""
    for path, key in (("/version", "version"), ("/api/version", "version"), ("/props", None)):
        try:
            r = await client.get(target.root + path, timeout=10)
            body = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            continue
        if not isinstance(body, dict):
            continue
        if isinstance(body.get("git_sha"), str) and body["git_sha"]:
            return Build(body["git_sha"], bool(body.get("git_dirty"))), body
        if key is None and isinstance(body.get("build_info"), str):  # llama.cpp's /props
            return Build(body["build_info"], False), {"build_info": body["build_info"]}
        if key is not None and isinstance(body.get(key), str) and body[key]:
            return Build(body[key], False), body
    return Build("unknown", False), None


async def list_models(client: httpx.AsyncClient, target: Target) -> list[str]:
    r = await client.get(target.v1 + "/models", timeout=30)
    _raise_for(r, "GET /v1/models")
    return [m["id"] for m in r.json().get("data", []) if isinstance(m, dict) and "id" in m]


def _raise_for(r: httpx.Response, what: str) -> None:
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:300]
        raise RequestFailed(f"{what}: HTTP {r.status_code}: {message}")


class RequestFailed(Exception):
    """A request the target refused or broke off: the cell fails, the run goes on."""


# -- prompts -------------------------------------------------------------------------------
CITIES = ("Oslo", "Lima", "Porto", "Quito", "Turku", "Hobart", "Dakar", "Sapporo", "Cusco")


def notes(n: int) -> str:
    """`n` distinct, deterministic sentences to fill a prompt."""
    return " ".join(
        f"Note {i}: the {i % 12 + 1} o'clock train from {CITIES[i % len(CITIES)]} left "
        f"platform {i % 9 + 1} carrying {i * 7 % 300 + 20} passengers."
        for i in range(n)
    )


def prompt(n_notes: int, pad: int = 0) -> str:
    """A chat prompt of `n_notes` notes and `pad` filler words (a token each in the usual
    BPE vocabularies), led by a nonce so no server can reuse a cached prefix from an
    earlier sample."""
    return (
        f"[{uuid.uuid4().hex[:8]}] Read these notes, then write a long and detailed essay "
        f"about every one of them.\n{notes(n_notes)}" + " more" * pad
    )


def chat_body(model: str, text: str, max_tokens: int, *, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def prompt_tokens(
    client: httpx.AsyncClient, target: Target, model: str, n_notes: int, pad: int = 0
) -> int | None:
    """The prompt tokens the target counts for such a chat (a one-token chat)."""
    r = await client.post(
        target.v1 + "/chat/completions",
        json=chat_body(model, prompt(n_notes, pad), 1, stream=False),
        timeout=REQUEST_TIMEOUT_S,
    )
    _raise_for(r, f"a one-token chat with {model}")
    count = (r.json().get("usage") or {}).get("prompt_tokens")
    return count if isinstance(count, int) and count > 0 else None


@dataclass(slots=True)
class Calibration:
    """Prompts of a given size in one model's tokens, found with one-token chats (which
    also warm the model up): a straight line through two prompts says what a note costs and
    what the chat template adds; each size then takes the most notes that stay within it,
    topped up with filler words (a tokenizer is not quite linear). Sizes are fitted when
    first asked for, so a size the model cannot take fails only its own scenarios."""

    client: httpx.AsyncClient
    target: Target
    model: str
    line: tuple[float, float] | None = None  # (template tokens, tokens per note)
    measured: bool = True  # False: the target reports no usage, sizes are estimates
    prompts: dict[int, tuple[int, int]] = field(default_factory=dict)  # tokens → notes, pad

    async def prompt_for(self, tokens: int) -> tuple[int, int]:
        """(notes, filler words) for a prompt of `tokens` tokens."""
        if tokens not in self.prompts:
            self.prompts[tokens] = await self._fit(tokens)
        return self.prompts[tokens]

    async def _count(self, n_notes: int) -> int | None:
        return await prompt_tokens(self.client, self.target, self.model, n_notes)

    async def _fit(self, tokens: int) -> tuple[int, int]:
        if self.line is None:
            low, high = await self._count(8), None
            if low is not None:
                high = await self._count(40)
            if low is None or high is None or high <= low:
                self.measured = False
                self.line = (30.0, FALLBACK_TOKENS_PER_NOTE)
            else:
                per_note = (high - low) / 32
                self.line = (low - 8 * per_note, per_note)
        base, per_note = self.line
        n = max(1, int((tokens - base) / per_note))
        if not self.measured:
            return n, 0
        got = await self._count(n)
        for _ in range(3):  # step back until the notes fit, then fill the rest
            if got is None or got <= tokens or n == 1:
                break
            n = max(1, n - math.ceil((got - tokens) / per_note))
            got = await self._count(n)
        return n, max(0, tokens - got) if got is not None else 0


# -- one request, one sample ---------------------------------------------------------------
@dataclass(slots=True)
class Stream:
    """One streamed chat's timings (seconds from sending it) and token counts."""

    ttft: float
    first: float
    last: float
    total: float
    events: int  # chunks that carried text (content or reasoning)
    completion_tokens: int
    prompt_tokens: int

    @property
    def decode_tok_s(self) -> float | None:
        window = self.last - self.first
        if self.completion_tokens < 2 or self.events < 2 or window < MIN_DECODE_WINDOW_S:
            return None
        return (self.completion_tokens - 1) / window


async def stream_chat(client: httpx.AsyncClient, target: Target, body: dict[str, Any]) -> Stream:
    t0 = time.perf_counter()
    first = last = None
    events, usage = 0, None
    async with client.stream(
        "POST", target.v1 + "/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S
    ) as r:
        if r.status_code != 200:
            await r.aread()
            _raise_for(r, body["model"])
        reader = SSEReader()
        async for raw in r.aiter_bytes():
            for event in reader.feed(raw):
                if event.data.strip() == "[DONE]":  # the last event: the body ends here
                    continue
                chunk = _event_json(event.data, body["model"])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                delta = ((chunk.get("choices") or [{}])[0] or {}).get("delta") or {}
                if any(delta.get(k) for k in ("content", "reasoning_content", "reasoning")):
                    now = time.perf_counter() - t0
                    first = now if first is None else first
                    last = now
                    events += 1
    total = time.perf_counter() - t0
    if first is None or last is None:
        raise RequestFailed(f"{body['model']}: the stream ended without a token")
    usage = usage or {}
    completion = usage.get("completion_tokens")
    return Stream(
        ttft=first,
        first=first,
        last=last,
        total=total,
        events=events,
        completion_tokens=completion if isinstance(completion, int) else events,
        prompt_tokens=usage.get("prompt_tokens") or 0,
    )


def _event_json(data: str, model: str) -> dict[str, Any]:
    """A stream event's JSON; RequestFailed for one that is not JSON or carries an error."""
    try:
        chunk = json.loads(data)
    except ValueError:
        raise RequestFailed(f"{model}: a stream event is not JSON: {data[:200]}") from None
    if not isinstance(chunk, dict):
        raise RequestFailed(f"{model}: a stream event is not an object: {data[:200]}")
    if "error" in chunk:
        raise RequestFailed(f"{model}: error mid-stream: {chunk['error']}")
    return chunk


async def measure(
    client: httpx.AsyncClient,
    target: Target,
    model: str,
    scenario: Scenario,
    calibration: Calibration,
) -> dict[str, Any]:
    """One sample of `scenario`: the columns of a `bench_samples` row."""
    n_notes, pad = await calibration.prompt_for(scenario.prompt_tokens)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(scenario.requests):
        queue.put_nowait(i)
    streams: list[Stream] = []

    async def client_loop() -> None:
        while not queue.empty():
            queue.get_nowait()
            body = chat_body(model, prompt(n_notes, pad), scenario.max_tokens, stream=True)
            streams.append(await stream_chat(client, target, body))

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(scenario.concurrency)))
    wall = time.perf_counter() - t0
    completion = sum(s.completion_tokens for s in streams)
    rates = [r for r in (s.decode_tok_s for s in streams) if r is not None]
    return {
        "concurrency": scenario.concurrency,
        "requests": len(streams),
        "prompt_tokens": round(statistics.median(s.prompt_tokens for s in streams)),
        "completion_tokens": completion,
        "ttft_ms": statistics.median(s.ttft for s in streams) * 1000,
        "decode_tok_s": statistics.median(rates) if scenario.is_chat and rates else None,
        "tok_s": None if scenario.is_chat else completion / wall,
        "req_s": None if scenario.is_chat else len(streams) / wall,
        "latency_ms": statistics.median(s.total for s in streams) * 1000,
        "wall_s": wall,
    }
