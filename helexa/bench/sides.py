"""`helexa bench engine --sides`: batch-1 decode tok/s of the three ways to reach the
engine, side by side: (a) the engine driven by add_request/step, as `bench engine` and the
node's loop drive it; (b) `LLM.generate`, the public Python API, built as a user builds it
(`LLM(model)`, EngineArgs defaults); (c) a real node process over HTTP, one streamed chat
completion at a time. Every side's KV pool is `--kv-cache-mb`: its size does not change a
batch-1 decode, and three CPU default pools (up to 2 GiB each) crowd a small machine.

One phase after another, each freed before the next, so that a GPU holds one model at a
time: (a) on the bench's engine; (b) on an `LLM`, whose own engine is also driven by
add_request/step (b's loop) to tell the API's cost from its settings'; (c) a node.
Each figure is tokens/s after the first token, greedy and at temperature 1.0 (the
default `SamplingParams`), the median of `--decode-repeats` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from helexa.bench.node import filler_messages, http_request, wait_ready, write_node_config
from helexa.bench.settings import engine_settings

if TYPE_CHECKING:
    from helexa.config import Config
    from helexa.engine import EngineArgs, LLMEngine, SamplingParams

MODES = {"greedy": 0.0, "temperature 1.0": 1.0}


@dataclass(slots=True)
class SideFigures:
    """One side's batch-1 decode tok/s per sampling mode (every run kept)."""

    name: str
    samples: dict[str, list[float]] = field(default_factory=dict)
    settings: str = ""

    def tok_s(self, mode: str) -> float | None:
        runs = self.samples.get(mode)
        return statistics.median(runs) if runs else None


def _params(temperature: float, n: int) -> SamplingParams:
    from helexa.engine import SamplingParams

    return SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True)


def _measure(side: SideFigures, repeats: int, timed: Callable[[float], float]) -> None:
    """Warm up once per mode, then `repeats` rounds over the modes."""
    for t in MODES.values():
        timed(t)
    for _ in range(repeats):
        for mode, t in MODES.items():
            side.samples.setdefault(mode, []).append(timed(t))
    text = ", ".join(f"{m} {side.tok_s(m):.1f}" for m in MODES)
    print(f"  [{side.name}] batch-1 decode tok/s: {text}", flush=True)


def engine_loop(engine: LLMEngine, prompt: list[int], n: int) -> Callable[[float], float]:
    """(a): tok/s after the first token, the engine stepped by hand."""

    def timed(temperature: float) -> float:
        seq = engine.add_request(prompt, _params(temperature, n))
        while seq.num_output_tokens == 0:
            engine.step()
        t1 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        assert seq.num_output_tokens == n
        return (n - 1) / (time.perf_counter() - t1)

    return timed


def llm_generate(llm, prompt: list[int], n: int) -> Callable[[float], float]:
    """(b): `generate` of n tokens less `generate` of 1, over the n - 1 tokens between. The
    one-token call is timed three times and its quickest taken: one slow spell of a busy
    machine in it could otherwise leave the difference at nothing, or below."""

    def timed(temperature: float) -> float:
        first = []
        for _ in range(3):
            t0 = time.perf_counter()
            llm.generate(prompt, _params(temperature, 1))
            first.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        (out,) = llm.generate(prompt, _params(temperature, n))
        t2 = time.perf_counter()
        assert len(out.token_ids) == n
        return (n - 1) / max((t2 - t1) - min(first), 1e-9)

    return timed


def node_chat(url: str, model: str, n: int) -> Callable[[float], float]:
    """(c): one streamed chat completion; tokens after the first over the time after it."""

    def timed(temperature: float) -> float:
        body = {
            "model": model,
            "messages": filler_messages(),
            "max_tokens": n,
            "temperature": temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

        async def one():
            async with httpx.AsyncClient(timeout=600) as client:
                return await http_request(client, url, body)

        s = asyncio.run(one())
        assert s.num_tokens == n, (s.num_tokens, n)
        return (s.num_tokens - 1) / (s.total_s - s.ttft_s)

    return timed


@contextlib.contextmanager
def node(cfg: Config, model: str, args: argparse.Namespace) -> Iterator[str]:
    """A `helexa serve --role node` on a loopback port, serving `model`; its /v1 URL."""
    with tempfile.TemporaryDirectory(prefix="helexa-bench-sides-") as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        config, log_path = Path(tmp) / "node.toml", Path(tmp) / "node.log"
        # the KV pool of (a) and (b): the node's default (up to 2 GiB on the CPU) says nothing
        # about batch-1 decode, and three pools that size do not fit beside a busy machine
        write_node_config(config, cfg, model, port, args, {"kv_cache_memory_mb": args.kv_cache_mb})
        env = {k: v for k, v in os.environ.items() if k != "HELEXA_CONFIG"}
        cmd = [sys.executable, "-m", "helexa.cli", "serve", "--role", "node", "--config"]
        with log_path.open("wb") as log:
            proc = subprocess.Popen([*cmd, str(config)], stdout=log, stderr=log, env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(proc, base, log_path)
            yield base + "/v1/chat/completions"
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def format_sides(sides: list[SideFigures]) -> str:
    """Markdown: a row per sampling mode, a column per side, each with its ratio to (a)."""
    head = ["batch-1 decode (tok/s)", *(s.name for s in sides)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode in MODES:
        base = sides[0].tok_s(mode)
        cells = []
        for i, side in enumerate(sides):
            value = side.tok_s(mode)
            if value is None:
                cells.append("–")
            elif i == 0 or not base:
                cells.append(f"{value:.1f}")
            else:
                cells.append(f"{value:.1f} ({value / base:.2f}x)")
        lines.append(f"| {mode} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(args: argparse.Namespace, cfg: Config, eargs: EngineArgs) -> int:
    """The three sides, one after another; the table; 0 on success."""
    from helexa.engine import LLM, LLMEngine
    from helexa.engine.loader.load import BUNDLED_MODEL_ID

    n, repeats = args.decode_tokens, args.decode_repeats
    sides: list[SideFigures] = []
    engine = LLMEngine(eargs)
    tok = engine.tokenizer
    special = set(tok.backend.get_added_tokens_decoder()) | tok.eos_token_ids
    vocab = min(tok.vocab_size, engine.loaded.config.vocab_size)
    prompt = random.Random(args.seed).choices([i for i in range(vocab) if i not in special], k=64)
    path = str(engine.loaded.path)

    sides.append(SideFigures("(a) engine add_request/step", settings=_settings(engine)))
    _measure(sides[-1], repeats, engine_loop(engine, prompt, n))
    engine.shutdown()
    del engine

    # as a user builds it: EngineArgs' defaults, but for the KV pool, (a)'s (--kv-cache-mb)
    llm = LLM(path, kv_cache_memory_mb=args.kv_cache_mb)
    try:
        sides.append(SideFigures("(b) LLM.generate", settings=_settings(llm.engine)))
        _measure(sides[-1], repeats, llm_generate(llm, prompt, n))
        sides.append(SideFigures("(b) its engine, add_request/step"))
        _measure(sides[-1], repeats, engine_loop(llm.engine, prompt, n))
    finally:
        llm.close()
        del llm

    model = args.model or BUNDLED_MODEL_ID
    with node(cfg, model, args) as url:
        sides.append(SideFigures("(c) node, HTTP stream"))
        _measure(sides[-1], repeats, node_chat(url, model, n))

    print()
    print(format_sides(sides))
    print()
    print(
        f"{n} new tokens, ignore_eos; tok/s after the first token; median of {repeats} runs "
        "after a warm-up. (a), (b): a 64-token random prompt; (c): a ~128-token chat"
    )
    for side in sides:
        if side.settings:
            print(f"{side.name}: {side.settings}")
    print("(c) node: [engine] of this config, num_threads from --threads")
    return 0


def _settings(engine: LLMEngine) -> str:
    s = engine_settings(engine)
    keep = ("dtype", "linear_weights", "max_num_seqs", "enable_prefix_caching")
    extra = {"device": engine.runner.device, "threads": engine.args.num_threads}
    return ", ".join(f"{k}={v}" for k, v in {**extra, **{k: s[k] for k in keep}}.items())
