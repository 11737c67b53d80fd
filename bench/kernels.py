"""The kernels at real layer shapes, Triton against naive; prints one table.

    python bench/kernels.py            # on CUDA: Qwen3.6-27B GDN and Qwen3-30B-A3B MoE shapes
    python bench/kernels.py --quick    # fewer sizes, shorter timing

On CUDA, in bf16 (states fp32): a GDN layer's kernels (hidden 5120, 16 key / 48 value heads of
128, conv width 4) for a prompt of T tokens (gating, conv, chunked delta rule) and a decode
step of N sequences (conv update, recurrent delta rule), in tokens/s; the MoE experts (hidden
2048, 128 experts of 768, top-8) in ms per call. Each figure is the best of three timed
batches' means after warmup, with torch.cuda.synchronize around each batch. On CPU there is no Triton to time
(its interpreter is a correctness tool): the naive paths run at reduced sizes, and the table
says so.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from helexa.kernels.causal_conv1d import (
    naive_causal_conv1d,
    naive_causal_conv1d_update,
    triton_causal_conv1d,
    triton_causal_conv1d_update,
)
from helexa.kernels.fused_moe import naive_fused_moe, triton_fused_moe
from helexa.kernels.gated_delta_rule import (
    naive_chunk_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
    triton_chunk_gated_delta_rule,
    triton_fused_recurrent_gated_delta_rule,
)
from helexa.kernels.gdn_gating import naive_gdn_gating, triton_gdn_gating

# per device: the real layer's shapes on CUDA, reduced ones on CPU
GDN = {"cuda": dict(Hk=16, Hv=48, D=128, W=4), "cpu": dict(Hk=4, Hv=12, D=64, W=4)}
MOE = {"cuda": dict(H=2048, I=768, E=128, k=8), "cpu": dict(H=512, I=192, E=32, k=8)}
PREFILL = {"cuda": (512, 4096), "cpu": (64, 256)}
DECODE = {"cuda": (1, 16, 64), "cpu": (1, 4)}
MOE_TOKENS = {"cuda": (1, 16, 512), "cpu": (1, 16, 64)}


def timeit(fn: Callable[[], object], device: str, seconds: float) -> float:
    """Seconds per call: the best of 3 batches' means, each batch about `seconds / 3` long,
    after warmup (the best, since a shared box only ever adds time)."""

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(2):  # compile, autotune, allocate
        fn()
    sync()
    t = time.perf_counter()
    fn()
    sync()
    reps = max(1, min(1000, int(seconds / 3 / max(time.perf_counter() - t, 1e-6))))
    best = float("inf")
    for _ in range(3):
        sync()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def gdn_cases(device: str, dtype: torch.dtype, quick: bool):
    """(label, tokens per call, naive fn, triton fn) for a GDN layer's prefill and decode."""
    s = GDN[device]
    Hk, Hv, D, W = s["Hk"], s["Hv"], s["D"], s["W"]
    C = 2 * Hk * D + Hv * D  # the conv runs over q, k and v together
    rand = lambda *shape, dt=dtype: torch.randn(*shape, device=device).to(dt)  # noqa: E731
    A_log, dt_bias = rand(Hv, dt=torch.float32), rand(Hv, dt=torch.float32)
    conv_w, conv_b = rand(C, W) * 0.5, None
    for T in PREFILL[device][:1] if quick else PREFILL[device]:
        a, b, x = rand(T, Hv), rand(T, Hv), rand(T, C)
        q, k, v = rand(T, Hk, D), rand(T, Hk, D), rand(T, Hv, D)
        g, beta = naive_gdn_gating(A_log, a, b, dt_bias)
        h0 = torch.zeros(Hv, D, D, device=device)
        yield (f"gdn_gating T={T}", T, partial(naive_gdn_gating, A_log, a, b, dt_bias),
               partial(triton_gdn_gating, A_log, a, b, dt_bias))  # fmt: skip
        yield (f"causal_conv1d T={T} C={C}", T, partial(naive_causal_conv1d, x, conv_w, conv_b),
               partial(triton_causal_conv1d, x, conv_w, conv_b))  # fmt: skip
        yield (f"chunk_gated_delta_rule T={T}", T,
               partial(naive_chunk_gated_delta_rule, q, k, v, g, beta, h0),
               partial(triton_chunk_gated_delta_rule, q, k, v, g, beta, h0))  # fmt: skip
    for N in DECODE[device][-1:] if quick else DECODE[device]:
        rows = torch.arange(N, device=device)
        x, conv_pool = rand(N, C), rand(N, C, W - 1)
        q, k, v = rand(N, Hk, D), rand(N, Hk, D), rand(N, Hv, D)
        g, beta = -torch.rand(N, Hv, device=device), torch.rand(N, Hv, device=device)
        pool = torch.zeros(N, Hv, D, D, device=device)
        yield (f"causal_conv1d_update N={N}", N,
               partial(naive_causal_conv1d_update, x, conv_pool, conv_w, conv_b, rows),
               partial(triton_causal_conv1d_update, x, conv_pool, conv_w, conv_b, rows))  # fmt: skip
        yield (f"recurrent_gated_delta_rule N={N}", N,
               partial(naive_recurrent_gated_delta_rule, q, k, v, g, beta, pool, rows),
               partial(triton_fused_recurrent_gated_delta_rule, q, k, v, g, beta, pool, rows))  # fmt: skip


def moe_cases(device: str, dtype: torch.dtype, quick: bool):
    """(label, tokens per call, naive fn, triton fn) for the routed experts."""
    s = MOE[device]
    H, I, E, k = s["H"], s["I"], s["E"], s["k"]  # noqa: E741
    w13 = (torch.randn(E, 2 * I, H, device=device) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device=device) * I**-0.5).to(dtype)
    for T in MOE_TOKENS[device][::2] if quick else MOE_TOKENS[device]:
        x = torch.randn(T, H, device=device).to(dtype)
        weights, ids = torch.randn(T, E, device=device).softmax(-1).topk(k, dim=-1)
        yield (f"fused_moe T={T} E={E} top{k}", T,
               partial(naive_fused_moe, x, w13, w2, weights, ids),
               partial(triton_fused_moe, x, w13, w2, weights, ids))  # fmt: skip


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, shorter timing")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with_triton = device == "cuda"
    dtype = torch.bfloat16
    seconds = 0.1 if args.quick else 0.5
    torch.manual_seed(0)
    rows = []
    for cases in (gdn_cases(device, dtype, args.quick), moe_cases(device, dtype, args.quick)):
        for label, num_tokens, naive, triton in cases:
            t_naive = timeit(naive, device, seconds)
            t_triton = timeit(triton, device, seconds) if with_triton else None
            best = t_triton if t_triton is not None else t_naive
            rows.append([
                label,
                f"{t_naive * 1e3:.3f}",
                f"{t_triton * 1e3:.3f}" if t_triton is not None else "-",
                f"{t_naive / t_triton:.1f}x" if t_triton is not None else "-",
                f"{num_tokens / best:,.0f}",
            ])  # fmt: skip
    where = (
        torch.cuda.get_device_name()
        if with_triton
        else "CPU: naive only, at reduced sizes (Triton has no CPU backend)"
    )
    print_table(
        f"kernels, bf16, ms per call ({where})",
        ["kernel", "naive ms", "triton ms", "speedup", "tokens/s (fastest)"],
        rows,
    )


if __name__ == "__main__":
    main()
