"""`helexa bench node`: what the HTTP layer costs.

C clients send streaming chat requests back to back to a real node process (or to
`--endpoint`), whose engine runs in a model worker process; then the same workload runs on
the engine in-process through `AsyncLLM`, after the node has stopped, so the two never
compete for the CPUs. The difference is what the HTTP layer and the worker hop cost. Same prompt, greedy,
`ignore_eos`, so every request does the same work on both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from helexa.bench.scenarios import ResendOnClosed

if TYPE_CHECKING:
    from helexa.config import Config
    from helexa.engine import AsyncLLM, SamplingParams

READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,8,32, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `helexa bench node`."""
    add = parser.add_argument
    add("--model", help="model id to serve and load (default: the bundled SmolLM2)")
    add("--endpoint", metavar="URL", help="benchmark this OpenAI base URL (…/v1) instead")
    add("--threads", type=int, default=2, help="engine CPU threads, both sides (default 2)")
    add("--concurrency", type=_int_list, default=[1, 8, 32], help="clients (default 1,8,32)")
    add("--requests", type=int, help="requests per level (default max(8, 2 x clients))")
    add("--max-tokens", type=int, default=32, help="new tokens per request (default 32)")
    add("--skip-engine", action="store_true", help="measure over HTTP only")


def filler_messages() -> list[dict[str, str]]:
    """A deterministic chat of roughly 128 prompt tokens once templated."""
    notes = " ".join(
        f"Note {i}: the morning train left platform {i % 7} on time." for i in range(6)
    )
    return [{"role": "user", "content": f"Summarise these notes in one line. {notes}"}]


# -- one request ---------------------------------------------------------------------------
@dataclass(slots=True)
class Sample:
    ttft_s: float  # send → first content
    total_s: float  # send → last token
    num_tokens: int
    num_prompt_tokens: int


async def http_request(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Sample:
    """One streaming chat request, its SSE parsed by hand."""
    t0 = time.perf_counter()
    ttft, num_tokens, num_prompt_tokens = None, 0, 0
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: error event mid-stream: {chunk['error']}")
            choice = (chunk.get("choices") or [{}])[0]
            if ttft is None and choice.get("delta", {}).get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
                num_prompt_tokens = chunk["usage"]["prompt_tokens"]
    total = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError(f"{url}: the stream ended without any content")
    return Sample(ttft, total, num_tokens or body["max_tokens"], num_prompt_tokens)


async def engine_request(llm: AsyncLLM, prompt: list[int], params: SamplingParams) -> Sample:
    """The same request on the engine: time to the first delta with text, and to the last."""
    t0 = time.perf_counter()
    ttft, num_tokens = None, 0
    async for out in llm.generate(prompt, params):
        if ttft is None and out.text:
            ttft = time.perf_counter() - t0
        num_tokens += len(out.token_ids)
    assert ttft is not None, "the engine produced no text"
    return Sample(ttft, time.perf_counter() - t0, num_tokens, len(prompt))


# -- one level -----------------------------------------------------------------------------
def cpu_seconds(pids: list[int]) -> tuple[float, float]:
    """(busy CPU-seconds of the whole machine, steal included; those of `pids`) so far."""
    tick = os.sysconf("SC_CLK_TCK")
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
        ours = 0
        for pid in pids:
            with open(f"/proc/{pid}/stat") as g:
                stat = g.read().rsplit(")", 1)[1].split()  # from field 3, "state"
            ours += int(stat[11]) + int(stat[12])  # utime + stime
        return (sum(v[:3]) + sum(v[5:8])) / tick, ours / tick
    return 0.0, 0.0


@dataclass(slots=True)
class Level:
    where: str  # "http" | "engine"
    concurrency: int
    wall_s: float
    samples: list[Sample]
    others_cpus: float  # CPUs the rest of the machine took meanwhile (others + steal)

    @property
    def req_s(self) -> float:
        return len(self.samples) / self.wall_s

    @property
    def tok_s(self) -> float:
        return sum(s.num_tokens for s in self.samples) / self.wall_s

    def ttft_ms(self, q: float) -> float:
        """Nearest-rank percentile of TTFT, in ms."""
        xs = sorted(s.ttft_s for s in self.samples)
        return 1000 * xs[max(0, math.ceil(q * len(xs)) - 1)]

    @property
    def itl_ms(self) -> float:
        """Mean over requests of (last token − first content) / (tokens − 1)."""
        return 1000 * statistics.mean(
            (s.total_s - s.ttft_s) / max(1, s.num_tokens - 1) for s in self.samples
        )


async def run_level(
    where: str,
    one: Callable[[], Awaitable[Sample]],
    concurrency: int,
    num_requests: int,
    pids: list[int],
) -> Level:
    """`concurrency` clients taking requests from a shared count until `num_requests` ran;
    `pids` (this process and the server) are left out of the rest of the machine's CPU."""
    left = num_requests
    samples: list[Sample] = []

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            samples.append(await one())

    (machine0, ours0), t0 = cpu_seconds(pids), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    (machine1, ours1), wall = cpu_seconds(pids), time.perf_counter() - t0
    others = max(0.0, (machine1 - machine0) - (ours1 - ours0)) / wall
    level = Level(where, concurrency, wall, samples, others)
    print(
        f"  [{where}] {concurrency} clients, {len(samples)} requests: {level.req_s:.2f} req/s, "
        f"{level.tok_s:.1f} out tok/s, TTFT p50 {level.ttft_ms(0.5):.0f} ms / "
        f"p99 {level.ttft_ms(0.99):.0f} ms, ITL {level.itl_ms:.1f} ms; "
        f"rest of machine {others:.2f} CPUs",
        flush=True,
    )
    return level


def _num_requests(args: argparse.Namespace, concurrency: int) -> int:
    return args.requests or max(8, 2 * concurrency)


# -- the two sides -------------------------------------------------------------------------
async def bench_http(
    base_url: str, model: str, args: argparse.Namespace, server_pid: int | None = None
) -> list[Level]:
    """Every level against `base_url` (…/v1), after one warm-up request."""
    url = base_url.rstrip("/") + "/chat/completions"
    body = {
        "model": model,
        "messages": filler_messages(),
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    transport = ResendOnClosed(max(args.concurrency) + 4)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, transport=transport) as client:

        def one() -> Awaitable[Sample]:
            return http_request(client, url, body)

        print(f"  [http] warm-up: {(await one()).num_prompt_tokens} prompt tokens", flush=True)
        pids = [os.getpid(), *([server_pid] if server_pid else [])]
        if server_pid:  # the node's model workers are the server too
            pids += await worker_pids(client, base_url)
        return [
            await run_level("http", one, c, _num_requests(args, c), pids) for c in args.concurrency
        ]


async def worker_pids(client: httpx.AsyncClient, base_url: str) -> list[int]:
    """Every model worker's pid, from the node's `GET /models` (none when it will not say)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        entries = (await client.get(root + "/models")).json()
        return [w["pid"] for m in entries for w in m.get("workers", [])]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return []


async def bench_engine(cfg: Config, model: str, args: argparse.Namespace) -> list[Level]:
    """Every level on an in-process `AsyncLLM`, the prompt rendered as the node renders it."""
    from helexa.engine import AsyncLLM, EngineArgs, LLMEngine, SamplingParams
    from helexa.engine.chat_template import render_chat

    engine_args = EngineArgs.from_config(cfg.engine, model, num_threads=args.threads)
    llm = await AsyncLLM.build(lambda: LLMEngine(engine_args))  # as the node builds it
    engine = llm.engine
    try:
        prompt = engine.tokenizer.encode(render_chat(engine.tokenizer, filler_messages()))
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

        def one() -> Awaitable[Sample]:
            return engine_request(llm, prompt, params)

        print(f"  [engine] warm-up: {(await one()).num_prompt_tokens} prompt tokens", flush=True)
        return [
            await run_level("engine", one, c, _num_requests(args, c), [os.getpid()])
            for c in args.concurrency
        ]
    finally:
        await asyncio.to_thread(llm.shutdown)


# -- the node process ----------------------------------------------------------------------
def _toml(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else json.dumps(value)


def write_node_config(
    path: Path,
    cfg: Config,
    model: str,
    port: int,
    args: argparse.Namespace,
    engine_overrides: dict[str, object] | None = None,
) -> None:
    """A node config: loopback port, one model, admission wide enough, `cfg`'s [engine] with
    `engine_overrides` over it."""
    room = max(64, 2 * max(args.concurrency))
    node = {
        "listen": f"127.0.0.1:{port}",
        "default_models": [model],
        "state_dir": str(path.parent / "state"),
        "max_running_requests": room,
        "max_waiting_requests": room,
    }
    engine = {f.name: getattr(cfg.engine, f.name) for f in fields(cfg.engine)}
    engine = {**engine, "num_threads": args.threads, **(engine_overrides or {})}
    engine = {k: v for k, v in engine.items() if v is not None}
    lines = ["[node]", *(f"{k} = {_toml(v)}" for k, v in node.items())]
    lines += ["[engine]", *(f"{k} = {_toml(v)}" for k, v in engine.items())]
    path.write_text("\n".join(lines) + "\n")


def wait_ready(proc: subprocess.Popen, base_url: str, log_path: Path) -> None:
    """Poll /health until activation is "ready"; raise with the node's log if it never is."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"node exited with {proc.returncode}:\n{log_path.read_text()}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            activation = httpx.get(base_url + "/health", timeout=5).json()["activation"]
            if activation["state"] == "ready":
                if activation["failed"]:
                    raise RuntimeError(f"node failed to load: {activation['failed']}")
                return
        time.sleep(0.2)
    raise TimeoutError(f"node not ready in {READY_TIMEOUT_S:.0f}s:\n{log_path.read_text()}")


def run_node(cfg: Config, model: str, args: argparse.Namespace, tmp: Path) -> list[Level]:
    """Start a node, benchmark it over HTTP, always stop it with SIGTERM."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config, log_path = tmp / "node.toml", tmp / "node.log"
    write_node_config(config, cfg, model, port, args)
    env = {k: v for k, v in os.environ.items() if k != "HELEXA_CONFIG"}
    cmd = [sys.executable, "-m", "helexa.cli", "serve", "--role", "node", "--config", str(config)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        wait_ready(proc, base_url, log_path)
        print(f"node ready on {base_url} in {time.perf_counter() - t0:.1f}s", flush=True)
        return asyncio.run(bench_http(base_url + "/v1", model, args, proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            print("node ignored SIGTERM for 60s; killed", flush=True)
            proc.kill()
            proc.wait()
        alarms = (" WARNING ", " ERROR ", " CRITICAL ", "Traceback", '"level": "warn')
        lines = log_path.read_text(errors="replace").splitlines()
        noisy = [ln for ln in lines if any(a in ln for a in alarms)]
        print(f"node exited with {proc.returncode}; {len(noisy)} warning/error log lines")
        for line in noisy[-10:]:
            print(f"  node log: {line[:300]}")


# -- report and entry ----------------------------------------------------------------------
def format_table(levels: list[Level]) -> str:
    """Markdown: a row per level and side, then the HTTP overhead on TTFT p50 per level."""
    head = "| clients | where | req/s | out tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL (ms) |"
    rows = [head + " rest of machine (CPUs) |", "|---|---|---|---|---|---|---|---|"]
    for lv in sorted(levels, key=lambda lv: (lv.concurrency, lv.where != "http")):
        rows.append(
            f"| {lv.concurrency} | {lv.where} | {lv.req_s:.2f} | {lv.tok_s:.1f} | "
            f"{lv.ttft_ms(0.5):.0f} | {lv.ttft_ms(0.99):.0f} | {lv.itl_ms:.1f} | "
            f"{lv.others_cpus:.2f} |"
        )
    by = {(lv.where, lv.concurrency): lv for lv in levels}
    overheads = []
    for c in sorted({lv.concurrency for lv in levels}):
        if ("http", c) in by and ("engine", c) in by:
            h, e = by["http", c].ttft_ms(0.5), by["engine", c].ttft_ms(0.5)
            overheads.append(
                f"HTTP overhead on TTFT p50, {c} clients: {h - e:+.0f} ms ({h / e - 1:+.0%})"
            )
    worst = max(lv.others_cpus for lv in levels)
    if worst > 0.25:
        overheads.append(f"CONTENDED: the rest of the machine took up to {worst:.2f} CPUs")
    return "\n".join(rows) + ("\n\n" + "\n".join(overheads) if overheads else "")


def main(args: argparse.Namespace, cfg: Config) -> int:
    """Benchmark over HTTP, then in-process; print the tables; 0 on success."""
    from helexa.engine.loader.load import BUNDLED_MODEL_ID

    for name in ("threads", "requests", "max_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    model = args.model or BUNDLED_MODEL_ID
    print(
        f"model {model}, {args.threads} threads, clients {args.concurrency}, "
        f"{args.max_tokens} tokens a request, {os.cpu_count()} CPUs",
        flush=True,
    )
    if args.endpoint:
        if not args.model:
            models = httpx.get(args.endpoint.rstrip("/") + "/models", timeout=30).json()["data"]
            model = models[0]["id"]
        levels = asyncio.run(bench_http(args.endpoint, model, args))
    else:
        with tempfile.TemporaryDirectory(prefix="helexa-bench-node-") as tmp:
            levels = run_node(cfg, model, args, Path(tmp))
    if not args.skip_engine and (args.model or not args.endpoint):
        levels += asyncio.run(bench_engine(cfg, model, args))
    print()
    print(format_table(levels))
    return 0
