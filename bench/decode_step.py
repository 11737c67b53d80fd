"""Where a CPU decode step's time goes: the bundled SmolLM2 (or --model) decoding one or more
sequences greedily, each step timed whole and in its parts with `perf_counter` wrappers
around the native layer stack, the lm_head's matmul, the model's forward and the runner.
What is left of the step around those is the per-token Python overhead. Prints a line per
round of --steps steps; the context grows by that much each round.

    python bench/decode_step.py [--threads 2] [--batch 1] [--rounds 5] [--steps 100]
                                [--kv-dtype auto|float32|float16]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from helexa.engine import LLM, SamplingParams
from helexa.engine.layers import native


def timed(acc: dict[str, float], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - t0

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="local dir or .gguf (default: the bundled SmolLM2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100, help="timed steps a round")
    ap.add_argument("--kv-dtype", default="auto", help="[engine] kv_cache_dtype")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(
        args.model,
        kv_cache_memory_mb=256,
        enable_prefix_caching=False,
        kv_cache_dtype=args.kv_dtype,
    )
    engine = llm.engine
    acc = dict.fromkeys(("layers", "head", "forward", "runner"), 0.0)
    native.decode_layers = timed(acc, "layers", native.decode_layers)
    native.matmul = timed(acc, "head", native.matmul)  # a decode step's only other matmul
    model_cls, runner_cls = type(engine.runner.model), type(engine.runner)
    model_cls.forward = timed(acc, "forward", model_cls.forward)
    runner_cls.run = timed(acc, "runner", runner_cls.run)
    params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    seqs = [engine.add_request(list(range(100 + i, 164 + i)), params) for i in range(args.batch)]
    for _ in range(10):  # the prompts and a few tokens, untimed
        engine.step()
    print(f"batch {args.batch}, {args.threads} threads; ms a step:")
    for _ in range(args.rounds):
        for k in acc:
            acc[k] = 0.0
        n, t0 = args.steps, time.perf_counter()
        for _ in range(n):
            engine.step()
        step = (time.perf_counter() - t0) / n * 1e3
        ms = {k: v / n * 1e3 for k, v in acc.items()}
        overhead = step - ms["layers"] - ms["head"]
        print(
            f"  context {seqs[0].num_tokens:5d}: step {step:.2f}  layers {ms['layers']:.2f}  "
            f"lm_head {ms['head']:.2f}  | Python: runner {ms['runner'] - ms['forward'] - ms['head']:.2f}"
            f"  forward {ms['forward'] - ms['layers']:.2f}  engine {step - ms['runner']:.2f}"
            f"  = {overhead:.2f} ({overhead / step:.0%})",
            flush=True,
        )
    for s in seqs:
        engine.abort(s.request_id)


if __name__ == "__main__":
    main()
