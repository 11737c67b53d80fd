"""The native block matmul (layers/native.py) on GGUF weights in the file's row order and
interleaved in 8s ("x8"), at SmolLM2-135M's shapes, with the weights cold: each timed call
takes the next of enough copies to pass ~96 MB, as a decode step streams every layer's
weights from memory. Prints microseconds and GB/s of weight read per call.

    python bench/native_blocks.py [--threads 2] [--rows 1,4,8,16]
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch

from helexa.engine.layers import native

SHAPES = [("Q4_1", 960, 576), ("Q4_1", 576, 576), ("Q4_1", 3072, 576), ("Q4_1", 576, 1536)]
SHAPES += [("Q8_0", 49152, 576)]  # (kind, out, in): fused qkv, o, fused gate/up, down, lm_head


def file_blocks(kind: str, n: int, k: int) -> torch.Tensor:
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)).reshape(n, -1)


def cold_time(x: torch.Tensor, weights: list[torch.Tensor], kind: str, n: int) -> float:
    """Seconds a call, the best of 3 runs of ~0.3 s cycling through `weights`."""
    best = float("inf")
    for _ in range(3):
        t0, calls = time.perf_counter(), 0
        while time.perf_counter() - t0 < 0.3:
            for w in weights:
                native.matmul(x, w, kind, n)
            calls += len(weights)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,8,16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available():
        raise SystemExit("no native kernels here (no C compiler)")
    print("| weight | rows | file order µs (GB/s) | x8 µs (GB/s) | x8 speed-up |")
    print("|---|---|---|---|---|")
    for kind, n, k in SHAPES:
        raw = file_blocks(kind, n, k)
        copies = [raw.clone() for _ in range(max(1, int(96e6 // raw.nbytes)))]
        x8 = [native.interleave(w, kind)[0] for w in copies]
        gb = raw.nbytes / 1e9
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k)
            a, b = cold_time(x, copies, kind, n), cold_time(x, x8, f"{kind}x8", n)
            print(
                f"| {kind} {n}x{k} | {m} | {a * 1e6:.1f} ({gb / a:.1f}) | "
                f"{b * 1e6:.1f} ({gb / b:.1f}) | {a / b:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
