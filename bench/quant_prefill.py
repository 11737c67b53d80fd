"""Quantized prefill GEMMs against bf16 F.linear, in TFLOP/s, on CUDA.

    python bench/quant_prefill.py                          # every kind, shape and M
    python bench/quant_prefill.py --kinds Q4_K --ms 512,4096

At Qwen3-8B's 4096 -> 12288 (gate, up), 12288 -> 4096 (down) and 4096 -> 6144 (q, k, v),
for M = 512, 1024, 2048 and 4096 rows of bf16 x and W held as Q4_K, Q6_K, Q8_0 or fp8, it
times bf16 F.linear (cuBLAS: the baseline), the fused GEMM (`triton_quant_matmul` with
gemv=False: W dequantized a tile at a time in registers) and the dense path
(`dense_quant_matmul`: W dequantized whole into the reused scratch, then F.linear), each in
TFLOP/s (2*M*N*K a call) and as a fraction of bf16; and the dequantization alone, in µs. The
dense path's figures tune quant_dequant.DENSE_MIN_M: the rows from which it beats the fused.

Each figure is the best of 3 batches' means, timed with CUDA events after warmup (compiles,
the scratch's growth); the quantized calls rotate over copies of the weight, so that the
GPU's L2 does not serve a weight the previous call read. Without CUDA it says so and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F

from helexa.kernels.quant_dequant import dense_quant_matmul, triton_dequantize
from helexa.kernels.quant_matmul import (
    GGUF_KINDS,
    QuantWeight,
    make_gguf_blocks,
    pack_gguf,
    quantize,
    triton_quant_matmul,
)

KINDS = ("Q4_K", "Q6_K", "Q8_0", "fp8")
SHAPES = ((4096, 12288), (12288, 4096), (4096, 6144))  # (in_features, out_features)
MS = (512, 1024, 2048, 4096)
ROTATE_BYTES = 256 << 20  # weights read between two reads of one copy: past an H100's L2
MAX_COPIES = 8
BATCH_SECONDS = 0.05


def tflops(m: int, n: int, k: int, seconds: float) -> float:
    """TFLOP/s of an [m, k] @ [k, n] product that took `seconds`."""
    return 2 * m * n * k / seconds / 1e12


def num_copies(nbytes: int) -> int:
    """Copies of a weight of `nbytes` that rotating calls keep ROTATE_BYTES apart."""
    return max(1, min(MAX_COPIES, -(-ROTATE_BYTES // max(nbytes, 1))))


def parse_list(text: str, allowed: Sequence, cast: Callable = str) -> list:
    """A comma-separated list, each item one of `allowed` (ValueError naming the others)."""
    items = [cast(item.strip()) for item in text.split(",") if item.strip()]
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        raise ValueError(f"got {unknown or text!r}; choose from {', '.join(map(str, allowed))}")
    return items


def make_weight(kind: str, n: int, k: int) -> QuantWeight:
    """A random [n, k] weight of `kind` on CUDA: valid random GGUF blocks, or quantized."""
    if kind in GGUF_KINDS:
        return pack_gguf(make_gguf_blocks(kind, n, k, device="cuda"), kind, (n, k))
    return quantize(torch.randn(n, k, device="cuda") * 0.02, kind)


def seconds_per_call(calls: Sequence[Callable[[], object]]) -> float:
    """The best of 3 batches' mean seconds a call, the calls taken in turn, after warmup."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for call in calls:
        call()
    end.record()
    end.synchronize()
    once = start.elapsed_time(end) / 1e3 / len(calls)
    reps = max(len(calls), int(BATCH_SECONDS / max(once, 1e-7)))
    best = float("inf")
    for _ in range(3):
        start.record()
        for i in range(reps):
            calls[i % len(calls)]()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / reps)
    return best


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)), flush=True)


def run(kinds: Sequence[str], ms: Sequence[int]) -> None:
    header = ["weight", "K->N", "M", "bf16 TF/s", "fused TF/s", "fused/bf16", "dense TF/s",
              "dense/bf16", "dequant µs"]  # fmt: skip
    rows = []
    for k, n in SHAPES:
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in ms}
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        bf16 = {m: seconds_per_call([partial(F.linear, x, w)]) for m, x in xs.items()}
        del w
        for kind in kinds:
            qw = make_weight(kind, n, k)
            weights = [qw] + [qw.map(torch.clone) for _ in range(num_copies(qw.nbytes) - 1)]
            out = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
            dequant = seconds_per_call([partial(triton_dequantize, q, out) for q in weights])
            del out
            for m, x in xs.items():
                fused = seconds_per_call(
                    [partial(triton_quant_matmul, x, q, gemv=False) for q in weights]
                )
                dense = seconds_per_call([partial(dense_quant_matmul, x, q) for q in weights])
                base = tflops(m, n, k, bf16[m])
                rows.append([
                    kind, f"{k}->{n}", str(m), f"{base:.0f}",
                    f"{tflops(m, n, k, fused):.0f}", f"{bf16[m] / fused:.0%}",
                    f"{tflops(m, n, k, dense):.0f}", f"{bf16[m] / dense:.0%}",
                    f"{dequant * 1e6:.1f}",
                ])  # fmt: skip
            del weights, qw
    print_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"of {', '.join(KINDS)}")
    parser.add_argument("--ms", default=",".join(map(str, MS)), help="rows of x")
    args = parser.parse_args(argv)
    try:
        kinds = parse_list(args.kinds, KINDS)
        ms = parse_list(args.ms, range(1, 1 << 20), int)
    except ValueError as e:
        parser.error(str(e))
    if not torch.cuda.is_available():
        print(
            "bench/quant_prefill.py times CUDA kernels, and this host has no CUDA device "
            "(torch.cuda.is_available() is False); run it on a GPU host",
            file=sys.stderr,
        )
        return 2
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} "
          f"SMs); torch {torch.__version__}; x bf16, fp32 accumulation")  # fmt: skip
    torch.manual_seed(0)
    run(kinds, ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
