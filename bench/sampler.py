"""The Triton sampler's time per call at Qwen's vocabulary, by batch size and row mix.

    python bench/sampler.py                       # 1, 16 and 64 rows over 151,936 tokens
    python bench/sampler.py --rows 64 --iters 500

Each figure is µs per call from CUDA events around --iters calls after a warm-up: "eager" as
the engine calls it today (Python launches included, where they outlast the GPU's work),
"graph" as replays of a CUDA graph of those calls (the GPU's time alone). Mixes: "mixed"
(greedy, temperature only, top-k, top-p, min-p and all combined, row by row), "top-k+top-p"
(every row top_k 50, top_p 0.9, as bench/kernels.py), "temperature" (no filter: the race
only). Each mix is checked once against naive_sample (the sort) before it is timed.
Needs CUDA: on a CPU host there is only Triton's interpreter, a correctness tool.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from helexa.kernels.filtered_sample import naive_sample, triton_sample

# temperature, top_k, top_p, min_p
MIXES = {
    "mixed": [
        (0.0, 0, 1.0, 0.0),
        (1.0, 0, 1.0, 0.0),
        (0.7, 20, 1.0, 0.0),
        (1.0, 0, 0.9, 0.0),
        (1.0, 0, 1.0, 0.05),
        (0.7, 20, 0.8, 0.0),
        (0.6, 50, 0.95, 0.02),
        (1.0, 1, 1.0, 0.0),
    ],
    "top-k+top-p": [(0.7, 50, 0.9, 0.0)],
    "temperature": [(0.8, 0, 1.0, 0.0)],
}


def llm_like_logits(num_rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """A background of small logits and, per row, 64 spread-out likely ones."""
    logits = torch.randn(num_rows, vocab, generator=gen) * 2
    top = torch.rand(num_rows, vocab, generator=gen).argsort(dim=-1)[:, :64]
    spikes = 22.0 - 0.25 * torch.arange(64.0) + 0.05 * torch.rand(num_rows, 64, generator=gen)
    return logits.scatter_(1, top, spikes)


def inputs(mix: str, num_rows: int, vocab: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    configs = (MIXES[mix] * num_rows)[:num_rows]
    temperature, top_k, top_p, min_p = zip(*configs, strict=True)
    logits = llm_like_logits(num_rows, vocab, gen)
    noise = torch.empty(num_rows, vocab).exponential_(generator=gen)
    params = (
        torch.tensor(temperature),
        torch.tensor(top_k, dtype=torch.int32),
        torch.tensor(top_p),
        torch.tensor(min_p),
    )
    return tuple(t.cuda() for t in (logits, noise, *params))


def time_eager(fn: Callable[[], object], iters: int) -> float:
    """µs per call, CUDA events around iters calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def time_graph(fn: Callable[[], object], iters: int) -> float:
    """µs per call, replaying a CUDA graph of 10 calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm in the side stream, as torch's docs ask before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return time_eager(graph.replay, max(iters // 10, 1)) / 10


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16,64", help="batch sizes, comma-separated")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        why = "on the CPU the Triton sampler runs only in Triton's interpreter, a correctness tool"
        print(f"bench/sampler.py needs CUDA: {why}; nothing to time here", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, vocab {args.vocab}, µs per call")
    print(f"{'mix':<12} {'rows':>4} {'eager':>9} {'graph':>9}  matches naive")
    for mix in MIXES:
        for num_rows in (int(r) for r in args.rows.split(",")):
            x = inputs(mix, num_rows, args.vocab)
            same = torch.equal(triton_sample(*x), naive_sample(*x))
            for _ in range(10):
                triton_sample(*x)
            eager = time_eager(lambda x=x: triton_sample(*x), args.iters)
            try:
                graph = f"{time_graph(lambda x=x: triton_sample(*x), args.iters):9.1f}"
            except RuntimeError as e:  # a capture that fails: say so, keep the eager figure
                graph = f"{'failed':>9}"
                print(f"  graph capture failed: {e}", file=sys.stderr)
            print(f"{mix:<12} {num_rows:>4} {eager:9.1f} {graph}  {'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
