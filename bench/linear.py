"""Micro-benchmark of the CPU linear paths at SmolLM2-135M shapes; prints tables in microseconds.

    python bench/linear.py            # kernels, fusion, and a whole decode step (a few minutes)
    python bench/linear.py --quick    # shorter decode-step timing

The box is shared, so each figure is the fastest of many short batches: the least disturbed.
Two threads stall whenever another process holds one core; on a busy box run --threads 1,
which times by the thread's CPU time and so ignores preemption.
Kernel rows reuse one weight, so it sits in cache; the decode-step table walks 30 layers of
distinct weights, as a real token does.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from helexa.engine.layers.linear import Linear, fuse
from helexa.engine.loader.gguf import GGUFTensor

HIDDEN, INTERMEDIATE, KV, VOCAB, NUM_LAYERS = 576, 1536, 192, 49152, 30
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]  # (in, out)
MS = [1, 4, 16, 128]
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}

clock = time.perf_counter  # time.thread_time with --threads 1: CPU time, blind to preemption


def timeit(fn: Callable[[], object], seconds: float = 0.3) -> float:
    """Fastest mean over short batches of calls, in microseconds.

    Batches are ~0.2 ms so that some run between the other processes' time slices.
    """
    fn()
    t = clock()
    fn()
    n = max(1, int(2e-4 / max(clock() - t, 1e-7)))
    best, num_batches = float("inf"), 0
    deadline = time.perf_counter() + seconds
    while num_batches < 5 or time.perf_counter() < deadline:
        t = clock()
        for _ in range(n):
            fn()
        best = min(best, (clock() - t) / n)
        num_batches += 1
    return best * 1e6


def fake_gguf(qtype: str, out: int, inp: int) -> GGUFTensor:
    """Random blocks of `qtype` with small f16 scales: timing does not care about the values."""
    blocks = torch.randint(0, 256, (out, inp // 32, BLOCK_BYTES[qtype]), dtype=torch.uint8)
    num_scales = 2 if qtype == "Q4_1" else 1
    scales = (torch.rand(out, inp // 32, num_scales) * 0.01).half()
    blocks[..., : 2 * num_scales] = scales.view(torch.uint8)
    return GGUFTensor("w", qtype, (out, inp), blocks.reshape(out, -1))


def linear(src: torch.Tensor | GGUFTensor, dtype: torch.dtype, quant: str | None = None) -> Linear:
    out, inp = src.shape
    lin = Linear(inp, out)
    lin.load_weight(src, dtype=dtype, quant=quant)
    return lin


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)), flush=True)


def kernels() -> None:
    """Raw ops per shape and M: what each representation costs before any module overhead."""
    bf16 = torch.bfloat16
    int4mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    int8mm = torch.ops.aten._weight_int8pack_mm
    rows = []
    for inp, out in SHAPES:
        w = torch.randn(out, inp) * 0.02
        wb = w.to(bf16)
        i8 = linear(w, torch.float32, "int8")
        i4 = linear(fake_gguf("Q4_1", out, inp), torch.float32)
        q8 = linear(fake_gguf("Q8_0", out, inp), torch.float32)
        i4_f32 = i4.scales.float()  # exact scales, but float32 takes the kernel's scalar loop
        for m in MS:
            x = torch.randn(m, inp)
            xb = x.to(bf16)
            cells = {
                "f32": timeit(partial(F.linear, x, w)),
                "bf16": timeit(partial(F.linear, xb, wb)),
                "int8": timeit(partial(int8mm, xb, i8.weight, i8.scales)),
                "int4": timeit(partial(int4mm, xb, i4.weight, 32, i4.scales)),
                # the scalar loop: time only the cheap cases
                "int4 f32": timeit(partial(int4mm, x, i4.weight, 32, i4_f32))
                if m == 1 or m * out <= 4 * 1536
                else None,
                "q8 int4x2": timeit(partial(int4mm, xb.repeat(1, 2), q8.weight, 32, q8.scales)),
                "f32->int4->f32": timeit(partial(i4, x)),
            }
            rows.append(
                [f"{inp}->{out}", str(m)] + [f"{v:.1f}" if v else "-" for v in cells.values()]
            )
    header = ["shape", "M", *cells]
    print_table(
        "kernels, µs per call (weight hot in cache; int8/int4 take bf16 activations; "
        "'q8 int4x2' = Q8_0 as int4 over a doubled input; last column = Linear.forward "
        "with float32 in/out)",
        header,
        rows,
    )


def call_each(mods: list[Linear], x: torch.Tensor) -> list[torch.Tensor]:
    return [m(x) for m in mods]


def call_fused(fused: Linear, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return fused(x).split(fused.split_sizes, dim=-1)


def step(layers: list, head: Linear, x: torch.Tensor, h: torch.Tensor) -> None:
    """The linears of one forward pass (attention and activations left out)."""
    for qkv, o, gate_up, down in layers:
        call_each(qkv, x)
        o(x)
        call_each(gate_up, x)
        down(h)
    head(x)


def fusion() -> None:
    """Separate q/k/v and gate/up Linears against one fused Linear each, as the model calls them."""
    cases = {
        "f32": lambda out, inp: linear(torch.randn(out, inp) * 0.02, torch.float32),
        "bf16": lambda out, inp: linear(torch.randn(out, inp) * 0.02, torch.bfloat16),
        "Q4_1 int4": lambda out, inp: linear(fake_gguf("Q4_1", out, inp), torch.bfloat16),
    }
    groups = {"qkv": [HIDDEN, KV, KV], "gate_up": [INTERMEDIATE, INTERMEDIATE]}
    rows = []
    for name, make in cases.items():
        for group, outs in groups.items():
            parts = [make(out, HIDDEN) for out in outs]
            fused = fuse(parts)
            dtype = torch.float32 if name == "f32" else torch.bfloat16
            for m in (1, 4, 16):
                x = torch.randn(m, HIDDEN, dtype=dtype)
                sep = timeit(partial(call_each, parts, x))
                one = timeit(partial(call_fused, fused, x))
                rows.append([name, group, str(m), f"{sep:.1f}", f"{one:.1f}"])
    print_table("fusion, µs (Linear modules)", ["weights", "group", "M", "separate", "fused"], rows)


def decode_step(quick: bool) -> None:
    """All linears of one forward over 30 distinct layers plus lm_head: the per-token cost."""
    configs = {
        # name: (layer weights, lm_head weight, activation dtype, lm_head quant)
        "f32 dense (HF-like)": ("float", "float", torch.float32, None),
        "bf16 dense": ("float", "float", torch.bfloat16, None),
        "GGUF, f32 activations": ("Q4_1", "Q8_0", torch.float32, None),
        "GGUF, bf16 activations": ("Q4_1", "Q8_0", torch.bfloat16, None),
        "GGUF, bf16, lm_head dense bf16": ("Q4_1", "float", torch.bfloat16, None),
        "GGUF, bf16, lm_head int8 (lossy)": ("Q4_1", "Q8_0", torch.bfloat16, "int8"),
    }

    def src(kind: str, qtype: str, out: int, inp: int) -> torch.Tensor | GGUFTensor:
        return torch.randn(out, inp) * 0.02 if kind == "float" else fake_gguf(qtype, out, inp)

    rows = []
    for name, (layer_kind, head_kind, dtype, head_quant) in configs.items():
        for fused in (False, True):
            layers = []
            for _ in range(NUM_LAYERS):
                qkv = [linear(src(layer_kind, "Q4_1", n, HIDDEN), dtype) for n in (HIDDEN, KV, KV)]
                gate_up = [
                    linear(src(layer_kind, "Q4_1", INTERMEDIATE, HIDDEN), dtype) for _ in "gu"
                ]
                o = linear(src(layer_kind, "Q4_1", HIDDEN, HIDDEN), dtype)
                down = linear(src(layer_kind, "Q4_1", HIDDEN, INTERMEDIATE), dtype)
                if fused:
                    qkv, gate_up = [fuse(qkv)], [fuse(gate_up)]
                layers.append((qkv, o, gate_up, down))
            head = linear(src(head_kind, "Q8_0", VOCAB, HIDDEN), dtype, head_quant)
            mods = [m for qkv, o, gu, d in layers for m in (*qkv, o, *gu, d)]
            num_bytes = sum(m.memory_bytes for m in mods) + head.memory_bytes
            cells = [name, "yes" if fused else "no", f"{num_bytes / 2**20:.0f}"]
            for m in (1, 16):
                x = torch.randn(m, HIDDEN, dtype=dtype)
                h = torch.randn(m, INTERMEDIATE, dtype=dtype)

                t_all = timeit(partial(step, layers, head, x, h), seconds=0.5 if quick else 2.0)
                t_head = timeit(partial(head, x))
                cells += [f"{t_all / 1e3:.2f}", f"{t_head / 1e3:.2f}"]
            rows.append(cells)
            del layers, head, mods
    print_table(
        "decode step: all linears of 30 layers + lm_head, ms per step",
        ["weights", "fused", "MiB", "M=1", "lm_head", "M=16", "lm_head"],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["kernels", "fusion", "decode"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the engine uses 2)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.threads == 1:
        global clock
        clock = time.thread_time
    torch.manual_seed(0)
    load = os.getloadavg()[0]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads on {os.cpu_count()} cpus "
        f"({torch.backends.cpu.get_cpu_capability()}), load average {load:.1f}, "
        f"timed by {clock.__name__}"
    )
    with torch.inference_mode():
        if args.only in (None, "kernels"):
            kernels()
        if args.only in (None, "fusion"):
            fusion()
        if args.only in (None, "decode"):
            decode_step(args.quick)


if __name__ == "__main__":
    main()
