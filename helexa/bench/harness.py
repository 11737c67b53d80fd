"""`helexa bench run`: the SPEC's scenarios against any OpenAI-compatible server, every
sample filed in the database under the build the server reports; `helexa bench report`.

Scenarios (docs/benchmarks.md § Bench history):
- `chat-128`, `chat-4096`: one streamed chat at a time with a prompt of that many tokens (as
  the target's own tokenizer counts them, calibrated per model): time to the first token,
  and the stream's decode rate over its first-to-last token window.
- `throughput-c1`, `-c4`, `-c16`: that many clients at once, each streaming chats back to
  back (two rounds' worth of requests); completion tokens over the wall time.
`--quick` runs the same scenarios with short answers and one round (named `…-quick`, so
they never mix with full samples). Every request asks for `max_tokens` with `ignore_eos`
(vLLM, llama.cpp and helexa honour it; others stop where their model stops, and the
completion tokens they report are what the rates count) at temperature 0.

The target's build is read from `/version` (helexa, vLLM), `/api/version` (Ollama) or
`/props` (llama.cpp's `build_info`): a (target, build, model, scenario) cell that already
holds `--samples` samples is skipped, so a steady fleet costs a few cheap requests until a
new build ships.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from helexa.bench import history
from helexa.bench.history import Build

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from helexa.config import Config

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


@dataclass(frozen=True, slots=True)
class Calibration:
    """How many notes and filler words make a prompt of each size, as the target's
    tokenizer and chat template count tokens; `measured` is False where the target reports
    no usage."""

    prompts: dict[int, tuple[int, int]]  # tokens → (notes, filler words)
    measured: bool


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


async def calibrate(
    client: httpx.AsyncClient, target: Target, model: str, sizes: set[int]
) -> Calibration:
    """One-token chats (which also warm the model up): what a note costs and what the
    template adds, a straight line through two prompts; then per size, the most notes that
    stay within it, topped up with filler words (a tokenizer is not quite linear)."""
    low, high = await prompt_tokens(client, target, model, 8), None
    if low is not None:
        high = await prompt_tokens(client, target, model, 40)
    if low is None or high is None or high <= low:
        base, per_note = 30.0, FALLBACK_TOKENS_PER_NOTE
        return Calibration({t: (max(1, int((t - base) / per_note)), 0) for t in sizes}, False)
    per_note = (high - low) / 32
    base = low - 8 * per_note
    prompts = {}
    for tokens in sorted(sizes):
        n = max(1, int((tokens - base) / per_note))
        got = await prompt_tokens(client, target, model, n)
        for _ in range(3):  # step back until the notes fit, then fill the rest
            if got is None or got <= tokens or n == 1:
                break
            n = max(1, n - math.ceil((got - tokens) / per_note))
            got = await prompt_tokens(client, target, model, n)
        prompts[tokens] = (n, max(0, tokens - got) if got is not None else 0)
    return Calibration(prompts, True)


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
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                raise RequestFailed(
                    f"{body['model']}: a stream event is not JSON: {data[:200]}"
                ) from None
            if "error" in chunk:
                raise RequestFailed(f"{body['model']}: error mid-stream: {chunk['error']}")
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


async def measure(
    client: httpx.AsyncClient,
    target: Target,
    model: str,
    scenario: Scenario,
    calibration: Calibration,
) -> dict[str, Any]:
    """One sample of `scenario`: the columns of a `bench_samples` row."""
    n_notes, pad = calibration.prompts[scenario.prompt_tokens]
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


# -- the run -------------------------------------------------------------------------------
def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--target", required=True, metavar="URL", help="OpenAI base URL: http://host:13131/v1")
    add("--target-name", metavar="NAME", help="what to file samples under (default: host:port)")
    add(
        "--scenario",
        action="append",
        metavar="NAME",
        help=f"run only these (repeatable, or comma-separated): {', '.join(SCENARIOS)}",
    )
    add(
        "--model",
        action="append",
        metavar="ID",
        help="models to bench (default: the first the target lists)",
    )
    add("--samples", type=int, metavar="N", help="samples per cell (default 3; --quick: 1)")
    add("--quick", action="store_true", help="short answers and one round: a smoke test")
    add(
        "--api-key",
        default=os.environ.get("HELEXA_BENCH_API_KEY"),
        help="Bearer key for the target (default: $HELEXA_BENCH_API_KEY)",
    )
    add("--sha", help="the build to file samples under when the target reports none")


def pick_scenarios(names: list[str] | None, is_quick: bool) -> list[Scenario]:
    chosen = [n.strip() for arg in names or [] for n in arg.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    picked = [SCENARIOS[n] for n in dict.fromkeys(chosen)] or list(SCENARIOS.values())
    return [quick(s) for s in picked] if is_quick else picked


@dataclass(slots=True)
class Plan:
    model: str
    scenario: Scenario
    taken: int
    needed: int


async def run(args: argparse.Namespace, sessions: sessionmaker[Session]) -> int:
    from tqdm import tqdm

    target = Target.parse(args.target, args.target_name)
    scenarios = pick_scenarios(args.scenario, args.quick)
    samples = args.samples if args.samples is not None else (1 if args.quick else 3)
    if samples < 1:
        raise ValueError("--samples must be at least 1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(s.concurrency for s in scenarios) + 4)
    async with httpx.AsyncClient(headers=headers, limits=limits) as client:
        try:
            build, info = await read_build(client, target)
            models = args.model or (await list_models(client, target))[:1]
        except httpx.HTTPError as e:
            raise ValueError(f"{target.url}: cannot reach the target: {e}") from None
        except RequestFailed as e:
            raise ValueError(f"{target.url}: {e}") from None
        if build.sha == "unknown" and args.sha:
            build = Build(args.sha, False)
        elif args.sha and args.sha != build.sha:
            raise ValueError(f"--sha {args.sha}: the target reports build {build.label}")
        if not models:
            raise ValueError(f"{target.url}: the target lists no models; pass --model")
        print(f"bench {target.name} ({target.v1}) at build {build.label}", flush=True)
        if build.sha == "unknown":
            print(
                "  the target reports no build: samples are filed under 'unknown' "
                "(pass --sha to name it)",
                flush=True,
            )
        plans = []
        for model in models:
            for scenario in scenarios:
                taken = history.samples_taken(sessions, target.name, build, model, scenario.name)
                plans.append(Plan(model, scenario, taken, max(0, samples - taken)))
                if taken >= samples:
                    print(
                        f"  skip {scenario.name} · {model}: {taken} of {samples} samples "
                        f"at {build.label} already",
                        flush=True,
                    )
        todo = [p for p in plans if p.needed]
        if not todo:
            print("nothing to do: every cell has its samples", flush=True)
            return 0
        run_id = history.start_run(
            sessions,
            target=target.name,
            target_url=target.url,
            build=build,
            build_info=info,
            host=socket.gethostname(),
            quick=args.quick,
        )
        failed = 0
        bar = tqdm(
            total=sum(p.needed for p in todo),
            unit="sample",
            file=sys.stderr,
            disable=None,
            dynamic_ncols=True,
        )
        try:
            calibrations: dict[str, Calibration] = {}
            for plan in todo:
                bar.set_description(f"{plan.scenario.name} · {plan.model}"[-60:])
                rows: list[dict[str, Any]] = []
                try:
                    if plan.model not in calibrations:
                        sizes = {s.prompt_tokens for s in scenarios}
                        calibrations[plan.model] = await calibrate(
                            client, target, plan.model, sizes
                        )
                        if not calibrations[plan.model].measured:
                            bar.write(
                                f"  {plan.model}: no usage counts to calibrate prompts "
                                "with; prompt sizes are estimates"
                            )
                    for _ in range(plan.needed):
                        row = await measure(
                            client, target, plan.model, plan.scenario, calibrations[plan.model]
                        )
                        history.record_sample(
                            sessions,
                            run_id,
                            target=target.name,
                            sha=build.sha,
                            dirty=build.dirty,
                            model=plan.model,
                            scenario=plan.scenario.name,
                            **row,
                        )
                        rows.append(row)
                        bar.update(1)
                except (RequestFailed, httpx.HTTPError) as e:
                    failed += 1
                    bar.update(plan.needed - len(rows))
                    bar.write(f"  FAILED {plan.scenario.name} · {plan.model}: {e}{_hint(e, plan)}")
                    continue
                bar.write(
                    f"  {plan.scenario.name} · {plan.model}: {summary(rows)} "
                    f"({plan.taken + len(rows)} of {samples} samples at {build.label})"
                )
        finally:
            bar.close()
            history.finish_run(sessions, run_id)
        print(
            f"run #{run_id}: {sum(p.needed for p in todo)} samples planned, "
            f"{failed} cell(s) failed",
            flush=True,
        )
        return 1 if failed else 0


def _hint(error: Exception, plan: Plan) -> str:
    if plan.scenario.concurrency > 1 and "HTTP 429" in str(error):
        return (
            " (the target caps one client's concurrent requests: on a helexa node set [node] "
            "per_principal_max = 0, or bench through a gateway with a key)"
        )
    return ""


def summary(rows: list[dict[str, Any]]) -> str:
    """The medians of this run's samples of one cell, in words."""
    parts = []
    for metric, (label, _) in history.METRICS.items():
        values = [r[metric] for r in rows if r.get(metric) is not None]
        if values:
            parts.append(f"{label} {history.format_value(metric, statistics.median(values))}")
    return ", ".join(parts) or "no figures"


def main_run(args: argparse.Namespace, cfg: Config) -> int:
    from helexa.db.session import open_database

    engine, sessions = open_database(cfg)
    try:
        return asyncio.run(run(args, sessions))
    finally:
        engine.dispose()


# -- the report ----------------------------------------------------------------------------
def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--target-name", metavar="NAME", help="only this target")
    add("--model", metavar="ID", help="only this model")
    add("--scenario", metavar="NAME", help="only this scenario")


def main_report(args: argparse.Namespace, cfg: Config) -> int:
    from helexa.db.session import open_database

    engine, sessions = open_database(cfg)
    try:
        series = history.history(
            sessions, target=args.target_name, model=args.model, scenario=args.scenario
        )
    finally:
        engine.dispose()
    print(history.report(series))
    return 0
