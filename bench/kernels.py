"""The kernels at real layer shapes, Triton against naive; prints one table per group.

    python bench/kernels.py                      # on CUDA: every group at the models' shapes
    python bench/kernels.py --quick              # fewer sizes, shorter timing
    python bench/kernels.py --only attention,quant

Groups, on CUDA in bf16 (states, logits fp32):
- gdn: a Qwen3.6-27B GDN layer's kernels (hidden 5120, 16 key / 48 value heads of 128, conv
  width 4) for a prompt of T tokens (gating, conv, chunked delta rule) and a decode step of
  N sequences (conv update, recurrent delta rule), in tokens/s;
- moe: the Qwen3-30B-A3B experts (hidden 2048, 128 experts of 768, top-8) in bf16, and held
  as GGUF MoE files hold them (Q4_K gate/up, Q6_K down), in ms per call;
- attention: Qwen3-8B's paged attention (32 query / 8 kv heads of 128, blocks of 16): decode
  of 1 sequence at 1k/8k/32k tokens and of 64 at 1k, as GB/s of K and V read (2 * context *
  KVH * D * 2 bytes a row) and % of the copy bandwidth; prefill of a 4k prompt and of 8
  chunks of 512 after 4k cached, in TFLOP/s (4 * H * D per query and key it sees);
- quant: quant_matmul per quant kind at Qwen3-8B's 4096 -> 12288 (gate/up), 12288 -> 4096
  (down), 4096 -> 6144 (qkv) and 4096 -> 151936 (lm_head), beside bf16 F.linear (torch:
  cuBLAS, the baseline, in the triton column); the GEMV's rows (M = 1, 2, 4, 8) as GB/s of
  weight bytes and % of the copy bandwidth (issue 36 asks >= 70%), and the GEMM at those
  rows too ([gemm]: where it wins is where GEMV_MAX_M belongs), M=512 in TFLOP/s;
- small: RMSNorm (with residual too), rotary, SiLU-and-mul, penalties and the sampler (vocab
  151936; top_k 50, top_p 0.9) for a decode batch of 64 at hidden 4096, in µs per call.

Each figure is the best of three timed batches' means after warmup, with
torch.cuda.synchronize around each batch. The naive paths run eagerly; on CUDA the Triton
kernels (and F.linear) run as replays of a CUDA graph of 16 or more calls, as the engine's
decode steps run them, so that µs-scale kernels are timed without Python's launch cost (a
time marked * ran eagerly: its capture failed); gdn's run eagerly, as in earlier runs.
Where one call reads less than 256 MiB, the calls rotate over copies of its KV cache or
weight, so that an H100's 50 MB L2 does not serve them. The copy bandwidth is a 1 GiB device-to-device copy timed with CUDA events, read + write
bytes. On CPU there is no Triton to time (its interpreter is a correctness tool): the naive
paths (and F.linear) run at reduced sizes, and the tables say so.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import math
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from functools import partial

import torch
import torch.nn.functional as F

from helexa.bench.gpu import copy_bandwidth
from helexa.kernels.activation import naive_silu_and_mul, triton_silu_and_mul
from helexa.kernels.causal_conv1d import (
    naive_causal_conv1d,
    naive_causal_conv1d_update,
    triton_causal_conv1d,
    triton_causal_conv1d_update,
)
from helexa.kernels.filtered_sample import naive_sample, triton_sample
from helexa.kernels.fused_moe import naive_fused_moe, triton_fused_moe
from helexa.kernels.gated_delta_rule import (
    naive_chunk_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
    triton_chunk_gated_delta_rule,
    triton_fused_recurrent_gated_delta_rule,
)
from helexa.kernels.gdn_gating import naive_gdn_gating, triton_gdn_gating
from helexa.kernels.paged_attention import (
    naive_paged_decode_attention,
    naive_paged_prefill_attention,
    triton_paged_decode_attention,
    triton_paged_prefill_attention,
)
from helexa.kernels.quant_matmul import (
    GEMV_MAX_M,
    GGUF_KINDS,
    QUANT_KINDS,
    QuantWeight,
    make_gguf_blocks,
    naive_quant_matmul,
    pack_gguf,
    quantize,
    triton_quant_matmul,
)
from helexa.kernels.quant_moe import naive_quant_fused_moe, triton_quant_fused_moe
from helexa.kernels.rms_norm import naive_rms_norm, triton_rms_norm
from helexa.kernels.rotary import naive_rotary, triton_rotary
from helexa.kernels.sampling import naive_apply_penalties, triton_apply_penalties

MiB = 1 << 20
# per device: the real layer's shapes on CUDA, reduced ones on CPU. rotate: the bytes the
# rotated calls read between two reads of one copy (0: no copies)
GDN = {
    "cuda": dict(Hk=16, Hv=48, D=128, W=4, prefill=(512, 4096), decode=(1, 16, 64)),
    "cpu": dict(Hk=4, Hv=12, D=64, W=4, prefill=(64, 256), decode=(1, 4)),
}
MOE = {  # Q6_K down needs I a multiple of 256; Q4_K gate/up, H
    "cuda": dict(H=2048, I=768, E=128, k=8, T=(1, 16, 512), quant_T=(1, 256)),
    "cpu": dict(H=512, I=256, E=32, k=8, T=(1, 16, 64), quant_T=(1, 64)),
}
ATTENTION = {  # decode: (sequences, context); prefill: (sequences, new tokens each, cached)
    "cuda": dict(H=32, KVH=8, D=128, block=16,
                 decode=((1, 1024), (1, 8192), (1, 32768), (64, 1024)),
                 prefill=((1, 4096, 0), (8, 512, 4096)), rotate=256 * MiB),
    "cpu": dict(H=8, KVH=2, D=64, block=16, decode=((1, 256), (1, 1024), (8, 256)),
                prefill=((1, 256, 0), (4, 64, 256)), rotate=0),
}  # fmt: skip
QUANT = {  # shapes: (in_features, out_features); M: rows of x (up to GEMV_MAX_M: the GEMV's)
    "cuda": dict(shapes=((4096, 12288), (12288, 4096), (4096, 6144), (4096, 151936)),
                 M=(1, 2, 4, 8, 512), quick_M=(1, 8), rotate=256 * MiB),
    "cpu": dict(shapes=((512, 1536), (1536, 512)), M=(1, 64), quick_M=(1,), rotate=0),
}  # fmt: skip
SMALL = {  # N: decode rows; Hq, Hk: heads of D; O, P: each row's output and prompt tokens
    "cuda": dict(N=64, hidden=4096, Hq=32, Hk=8, D=128, I=12288, vocab=151936, O=128, P=1024),
    "cpu": dict(N=16, hidden=1024, Hq=8, Hk=2, D=128, I=2048, vocab=32768, O=32, P=256),
}
COPY_BYTES = {"cuda": 1024 * MiB, "cpu": 64 * MiB}
MAX_COPIES = 64
GRAPH_CALLS = 16  # calls per captured CUDA graph, at least (a multiple of the copies)


@dataclass
class Case:
    """One row: a naive and a fast version of one call, and the work one call does."""

    label: str
    naive: Callable[[], object] | None
    fast: Sequence[Callable[[], object]]  # Triton (torch where torch_op), one per rotated copy
    tokens: int = 0  # tokens/s
    nbytes: int = 0  # bytes the call must read: GB/s and % of the copy bandwidth
    flops: int = 0  # TFLOP/s
    torch_op: bool = False  # fast is torch's own op (a baseline; runs on CPU too)
    graph: bool = True  # fast may be captured in a CUDA graph (no host syncs)


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


def time_eager(calls: Sequence[Callable[[], object]], device: str, seconds: float) -> float:
    """Seconds per call, the calls taken in turn."""
    turn = itertools.cycle(calls)
    return timeit(lambda: next(turn)(), device, seconds)


def time_graph(calls: Sequence[Callable[[], object]], seconds: float) -> float:
    """Seconds per call, as replays of one CUDA graph of the calls in turn (GRAPH_CALLS at
    least, a multiple of len(calls)), warmed (compiled) on a side stream first."""
    per_graph = len(calls) * -(-GRAPH_CALLS // len(calls))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            calls[i % len(calls)]()
    try:
        return timeit(graph.replay, "cuda", seconds) / per_graph
    finally:
        del graph


def time_fast(case: Case, device: str, seconds: float) -> tuple[float, str]:
    """(seconds per call, mark): CUDA graph replays where the case allows, else eager ("*"
    where a capture was tried and failed)."""
    if device == "cuda" and case.graph:
        try:
            return time_graph(case.fast, seconds), ""
        except Exception as e:
            print(f"[{case.label}] CUDA graph capture failed, timing eagerly: {e!r}",
                  file=sys.stderr, flush=True)  # fmt: skip
            torch.cuda.synchronize()
            return time_eager(case.fast, device, seconds), "*"
    return time_eager(case.fast, device, seconds), ""


def num_copies(rotate: int, nbytes: int) -> int:
    """Copies of an input of `nbytes` that rotating calls read `rotate` bytes between reuses."""
    return max(1, min(MAX_COPIES, -(-rotate // max(nbytes, 1)))) if rotate else 1


# -- groups: each yields Cases; sizes default to the device's --------------------------------
def gdn_cases(device: str, dtype: torch.dtype, quick: bool, sizes: dict | None = None):
    """A GDN layer's prefill and decode kernels."""
    s = sizes or GDN[device]
    Hk, Hv, D, W = s["Hk"], s["Hv"], s["D"], s["W"]
    C = 2 * Hk * D + Hv * D  # the conv runs over q, k and v together
    rand = lambda *shape, dt=dtype: torch.randn(*shape, device=device).to(dt)  # noqa: E731
    A_log, dt_bias = rand(Hv, dt=torch.float32), rand(Hv, dt=torch.float32)
    conv_w, conv_b = rand(C, W) * 0.5, None
    for T in s["prefill"][:1] if quick else s["prefill"]:
        a, b, x = rand(T, Hv), rand(T, Hv), rand(T, C)
        q, k, v = rand(T, Hk, D), rand(T, Hk, D), rand(T, Hv, D)
        g, beta = naive_gdn_gating(A_log, a, b, dt_bias)
        h0 = torch.zeros(Hv, D, D, device=device)
        yield Case(f"gdn_gating T={T}", partial(naive_gdn_gating, A_log, a, b, dt_bias),
                   [partial(triton_gdn_gating, A_log, a, b, dt_bias)], tokens=T, graph=False)  # fmt: skip
        yield Case(f"causal_conv1d T={T} C={C}", partial(naive_causal_conv1d, x, conv_w, conv_b),
                   [partial(triton_causal_conv1d, x, conv_w, conv_b)], tokens=T, graph=False)  # fmt: skip
        yield Case(f"chunk_gated_delta_rule T={T}",
                   partial(naive_chunk_gated_delta_rule, q, k, v, g, beta, h0),
                   [partial(triton_chunk_gated_delta_rule, q, k, v, g, beta, h0)],
                   tokens=T, graph=False)  # fmt: skip
    for N in s["decode"][-1:] if quick else s["decode"]:
        rows = torch.arange(N, device=device)
        x, conv_pool = rand(N, C), rand(N, C, W - 1)
        q, k, v = rand(N, Hk, D), rand(N, Hk, D), rand(N, Hv, D)
        g, beta = -torch.rand(N, Hv, device=device), torch.rand(N, Hv, device=device)
        pool = torch.zeros(N, Hv, D, D, device=device)
        yield Case(f"causal_conv1d_update N={N}",
                   partial(naive_causal_conv1d_update, x, conv_pool, conv_w, conv_b, rows),
                   [partial(triton_causal_conv1d_update, x, conv_pool, conv_w, conv_b, rows)],
                   tokens=N, graph=False)  # fmt: skip
        yield Case(f"recurrent_gated_delta_rule N={N}",
                   partial(naive_recurrent_gated_delta_rule, q, k, v, g, beta, pool, rows),
                   [partial(triton_fused_recurrent_gated_delta_rule, q, k, v, g, beta, pool, rows)],
                   tokens=N, graph=False)  # fmt: skip


def make_weight(kind: str, out_features: int, in_features: int, device: str) -> QuantWeight:
    """A random weight of `kind`: valid random GGUF blocks, or a random weight quantized."""
    if kind in GGUF_KINDS:
        raw = make_gguf_blocks(kind, out_features, in_features, device=device)
        return pack_gguf(raw, kind, (out_features, in_features))
    return quantize(torch.randn(out_features, in_features, device=device) * 0.02, kind)


def clone_weight(qw: QuantWeight) -> QuantWeight:
    tensors = {f.name: getattr(qw, f.name) for f in fields(qw)}
    return replace(qw, **{k: t.clone() for k, t in tensors.items() if isinstance(t, torch.Tensor)})


def moe_cases(device: str, dtype: torch.dtype, quick: bool, sizes: dict | None = None):
    """The routed experts: bf16 weights, then Q4_K gate/up with Q6_K down."""
    s = sizes or MOE[device]
    H, I, E, k = s["H"], s["I"], s["E"], s["k"]  # noqa: E741
    w13 = (torch.randn(E, 2 * I, H, device=device) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device=device) * I**-0.5).to(dtype)
    routes = {}
    for T in sorted({*s["T"], *s["quant_T"]}):
        routes[T] = torch.randn(T, E, device=device).softmax(-1).topk(k, dim=-1)
    for T in s["T"][::2] if quick else s["T"]:
        x = torch.randn(T, H, device=device).to(dtype)
        weights, ids = routes[T]
        yield Case(f"fused_moe T={T} E={E} top{k}",
                   partial(naive_fused_moe, x, w13, w2, weights, ids),
                   [partial(triton_fused_moe, x, w13, w2, weights, ids)], tokens=T)  # fmt: skip
    del w13, w2
    qw13, qw2 = make_weight("Q4_K", E * 2 * I, H, device), make_weight("Q6_K", E * H, I, device)
    for T in s["quant_T"]:
        x = torch.randn(T, H, device=device).to(dtype)
        weights, ids = routes[T]
        yield Case(f"quant_fused_moe Q4_K/Q6_K T={T} E={E} top{k}",
                   partial(naive_quant_fused_moe, x, qw13, qw2, weights, ids),
                   [partial(triton_quant_fused_moe, x, qw13, qw2, weights, ids)], tokens=T)  # fmt: skip


def attention_cases(device: str, dtype: torch.dtype, quick: bool, sizes: dict | None = None):
    """Paged decode (one token per sequence over its whole context) and prefill (new chunks
    over a cached prefix), block tables over permuted blocks."""
    s = sizes or ATTENTION[device]
    H, KVH, D, bs = s["H"], s["KVH"], s["D"], s["block"]
    scale = D**-0.5
    decode, prefill = s["decode"], s["prefill"]
    if quick:
        decode, prefill = (decode[0], decode[-1]), prefill[-1:]

    def cache(num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (num_blocks, bs, KVH, D)
        return (torch.randn(shape, device=device, dtype=dtype),
                torch.randn(shape, device=device, dtype=dtype))  # fmt: skip

    for N, ctx in decode:
        per_seq = -(-ctx // bs)
        nbytes = N * 2 * ctx * KVH * D * torch.finfo(dtype).bits // 8  # K and V, every row
        copies = num_copies(s["rotate"], nbytes)  # each a disjoint set of the cache's blocks
        k_cache, v_cache = cache(copies * N * per_seq)
        tables = torch.randperm(copies * N * per_seq, device=device).to(torch.int32)
        tables = tables.view(copies, N, per_seq)
        lens = torch.full((N,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(N, H, D, device=device, dtype=dtype)
        args = [(q, k_cache, v_cache, tables[c], lens, scale) for c in range(copies)]
        yield Case(f"paged_decode N={N} ctx={ctx}", partial(naive_paged_decode_attention, *args[0]),
                   [partial(triton_paged_decode_attention, *a) for a in args],
                   nbytes=nbytes)  # fmt: skip
        del k_cache, v_cache, args
    for B, L, cached in prefill:
        ctx = cached + L
        per_seq = -(-ctx // bs)
        k_cache, v_cache = cache(B * per_seq)
        tables = torch.randperm(B * per_seq, device=device).to(torch.int32).view(B, per_seq)
        cu = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=device)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(B * L, H, D, device=device, dtype=dtype)
        seen = B * (L * cached + L * (L + 1) // 2)  # (query, key) pairs under the causal mask
        args = (q, k_cache, v_cache, cu, lens, tables, scale, L)
        what = f"{B}x{L}" + (f" after {cached} cached" if cached else "")
        yield Case(f"paged_prefill {what}", partial(naive_paged_prefill_attention, *args),
                   [partial(triton_paged_prefill_attention, *args)],
                   flops=4 * H * D * seen)  # fmt: skip
        del k_cache, v_cache, args


def quant_cases(device: str, dtype: torch.dtype, quick: bool, sizes: dict | None = None):
    """quant_matmul per kind (and bf16 F.linear) at each shape: the GEMV's rows as bandwidth
    (weight bytes read), more rows as TFLOP/s."""
    s = sizes or QUANT[device]
    rows = s.get("quick_M", s["M"]) if quick else s["M"]
    for K, N in s["shapes"][:1] if quick else s["shapes"]:
        xs = {M: torch.randn(M, K, device=device, dtype=dtype) for M in rows}
        for kind in ("bf16", *QUANT_KINDS):
            if kind == "bf16":
                w = (torch.randn(N, K, device=device) * 0.02).to(dtype)
                weights = [w] + [w.clone() for _ in range(num_copies(s["rotate"], w.nbytes) - 1)]
                nbytes, naive, fast, torch_op = w.nbytes, None, F.linear, True
                label = "F.linear bf16 [torch]"
            else:
                qw = make_weight(kind, N, K, device)
                copies = num_copies(s["rotate"], qw.nbytes)
                weights = [qw] + [clone_weight(qw) for _ in range(copies - 1)]
                naive, fast, torch_op = naive_quant_matmul, triton_quant_matmul, False
                nbytes = qw.nbytes
                label = f"quant_matmul {kind}"
            for M, x in xs.items():
                gemv = M <= GEMV_MAX_M
                yield Case(f"{label} {K}->{N} M={M}",
                           partial(naive, x, weights[0]) if naive is not None else None,
                           [partial(fast, x, w) for w in weights],
                           nbytes=nbytes if gemv else 0, flops=0 if gemv else 2 * M * N * K,
                           torch_op=torch_op)  # fmt: skip
                if gemv and M > 1 and not torch_op and not quick:  # the GEMM at these rows:
                    # where it beats the GEMV is where GEMV_MAX_M belongs
                    yield Case(f"{label} [gemm] {K}->{N} M={M}",
                               partial(naive, x, weights[0]),
                               [partial(fast, x, w, gemv=False) for w in weights],
                               nbytes=nbytes)  # fmt: skip
            del weights


def small_cases(device: str, dtype: torch.dtype, quick: bool, sizes: dict | None = None):
    """A decode batch's small kernels: norm, rotary, SiLU-and-mul, penalties, sampler."""
    s = sizes or SMALL[device]
    N, hidden, Hq, Hk, D, I, V = s["N"], s["hidden"], s["Hq"], s["Hk"], s["D"], s["I"], s["vocab"]  # noqa: E741
    O, P = s["O"], s["P"]  # noqa: E741
    rand = lambda *shape, dt=dtype: torch.randn(*shape, device=device).to(dt)  # noqa: E731
    x, residual, weight = rand(N, hidden), rand(N, hidden), 1 + rand(hidden) / 10
    yield Case(f"rms_norm N={N} H={hidden}", partial(naive_rms_norm, x, weight, 1e-6),
               [partial(triton_rms_norm, x, weight, 1e-6)])  # fmt: skip
    yield Case(f"fused_add_rms_norm N={N} H={hidden}",
               partial(naive_rms_norm, x, weight, 1e-6, residual),
               [partial(triton_rms_norm, x, weight, 1e-6, residual)])  # fmt: skip
    q, k, _ = rand(N, Hq + 2 * Hk, D).split([Hq, Hk, Hk], dim=1)  # views of a fused qkv
    cos, sin = rand(N, 1, D), rand(N, 1, D)
    yield Case(f"rotary N={N} q{Hq} k{Hk} D={D}", partial(naive_rotary, q, k, cos, sin),
               [partial(triton_rotary, q, k, cos, sin)])  # fmt: skip
    gate_up = rand(N, 2 * I)
    yield Case(f"silu_and_mul N={N} I={I}", partial(naive_silu_and_mul, gate_up),
               [partial(triton_silu_and_mul, gate_up)])  # fmt: skip
    # penalties, in place (repeated calls keep penalising: the work is the same): each row's
    # O output tokens, then its P prompt tokens, as flat (row, token) pairs
    logits = rand(N, V, dt=torch.float32) * 3
    row_of = torch.arange(N, device=device, dtype=torch.int32)
    rows = torch.cat([row_of.repeat_interleave(O), row_of.repeat_interleave(P)])
    tokens = torch.randint(0, V, (N * (O + P),), device=device, dtype=torch.int32)
    rep, freq, pres = (torch.full((N,), v, device=device) for v in (1.1, 0.1, 0.1))
    pen_args = (rows, tokens, N * O, rep, freq, pres)
    yield Case(f"apply_penalties N={N} V={V} pairs={N * (O + P)}",
               partial(naive_apply_penalties, logits.clone(), *pen_args),
               [partial(triton_apply_penalties, logits.clone(), *pen_args)])  # fmt: skip
    noise = torch.empty(N, V, device=device).exponential_()
    params = (torch.full((N,), 0.7, device=device), torch.full((N,), 50, device=device),
              torch.full((N,), 0.9, device=device), torch.zeros(N, device=device))  # fmt: skip
    yield Case(f"sample N={N} V={V} top_k=50 top_p=0.9",
               partial(naive_sample, logits, noise, *params),
               [partial(triton_sample, logits, noise, *params)])  # fmt: skip


# group -> (cases, time unit, what it runs)
GROUPS: dict[str, tuple[Callable[..., Iterator[Case]], str, str]] = {
    "gdn": (gdn_cases, "ms", "a Qwen3.6-27B GDN layer"),
    "moe": (moe_cases, "ms", "Qwen3-30B-A3B experts, bf16 and Q4_K/Q6_K"),
    "attention": (attention_cases, "µs", "Qwen3-8B paged attention, blocks of 16"),
    "quant": (quant_cases, "µs", "Qwen3-8B MLP projections, quantized and bf16"),
    "small": (small_cases, "µs", "a decode batch's norm, rotary, activation, sampler"),
}
NEEDS_BANDWIDTH = ("attention", "quant")


def fig(x: float) -> str:
    """A rate: whole numbers from 100 up, else 3 significant digits (6 decimals at most)."""
    if x >= 100 or x <= 0:
        return f"{x:,.0f}"
    return f"{x:.{min(6, 2 - math.floor(math.log10(x)))}f}"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)), flush=True)


def run_group(
    name: str,
    device: str,
    dtype: torch.dtype,
    quick: bool,
    seconds: float,
    bandwidth: float | None,
    with_triton: bool,
    sizes: dict | None = None,
) -> None:
    """Times every case of the group (at `sizes`, else the device's) and prints its table; a
    case that fails prints `error` in its row (the traceback to stderr) and the rest run."""
    cases_of, unit, what = GROUPS[name]
    scale = 1e3 if unit == "ms" else 1e6
    rows, metrics, modes = [], set(), set()

    def fmt(t: float | None) -> str:
        return "-" if t is None else f"{t * scale:,.{3 if unit == 'ms' else 1}f}"

    cases = cases_of(device, dtype, quick, sizes)
    while True:
        try:
            case = next(cases, None)
        except Exception:
            traceback.print_exc()
            rows.append(["(building the next case failed: see stderr)"] + [""] * 4)
            break
        if case is None:
            break
        print(f"[{name}] {case.label}", file=sys.stderr, flush=True)
        try:
            t_naive = timeit(case.naive, device, seconds) if case.naive is not None else None
            t_fast, mark = None, ""
            if with_triton or case.torch_op:
                t_fast, mark = time_fast(case, device, seconds)
        except Exception as e:
            traceback.print_exc()
            rows.append([case.label, "error", type(e).__name__, "", ""])
            del case
            if device == "cuda":
                torch.cuda.empty_cache()
            continue
        if t_fast is not None:
            modes.add("*" if mark else "graph" if device == "cuda" and case.graph else "eager")
        best = t_fast if t_fast is not None else t_naive
        figures = {}
        if case.tokens:
            figures["tokens/s"] = f"{case.tokens / best:,.0f}"
        if case.nbytes:
            figures["GB/s"] = fig(case.nbytes / best / 1e9)
            if bandwidth:
                figures["% copy bw"] = f"{100 * case.nbytes / best / bandwidth:.0f}%"
        if case.flops:
            figures["TFLOP/s"] = fig(case.flops / best / 1e12)
        metrics |= figures.keys()
        speedup = f"{fig(t_naive / t_fast)}x" if t_naive is not None and t_fast else "-"
        rows.append([case.label, fmt(t_naive), fmt(t_fast) + mark, speedup, figures])
        del case
    del cases
    if device == "cuda":
        torch.cuda.empty_cache()
    order = [m for m in ("tokens/s", "GB/s", "% copy bw", "TFLOP/s") if m in metrics]
    header = ["kernel", f"naive {unit}", f"triton {unit}", "speedup"]
    header += [f"{m} (fastest)" if m == "tokens/s" else m for m in order]
    table = []
    for r in rows:
        figures = r[4] if isinstance(r[4], dict) else {}
        table.append(r[:4] + [figures.get(m, "-") for m in order])
    table = [r + [""] * (len(header) - len(r)) for r in table]
    if device == "cuda":
        where = torch.cuda.get_device_name()
    elif with_triton:
        where = "CPU, Triton through its interpreter"
    else:
        where = "CPU: naive only, at reduced sizes; Triton (its interpreter) not timed"
    print_table(f"{name}: {what}, bf16, {unit} per call ({where})", header, table)
    notes = []
    if any(r[0].startswith("F.linear") for r in rows):
        notes.append("F.linear rows: torch's bf16 matmul in the triton column, the baseline")
    if with_triton:
        said = {
            "graph": "CUDA graph replays",
            "eager": "eager calls",
            "*": "* eager: capture failed",
        }
        notes.append(
            "triton column: " + ", ".join(said[m] for m in ("graph", "eager", "*") if m in modes)
        )
    for note in notes:
        print(f"  {note}")


def versions() -> str:
    def version(pkg: str) -> str:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return f"torch {torch.__version__}, triton {version('triton')}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, shorter timing")
    parser.add_argument(
        "--only", metavar="NAME[,NAME]", help=f"groups to run, of {', '.join(GROUPS)} (all)"
    )
    args = parser.parse_args(argv)
    groups = list(GROUPS) if not args.only else [g.strip() for g in args.only.split(",")]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        parser.error(f"unknown group(s) {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    seconds = 0.1 if args.quick else 0.5
    torch.manual_seed(0)
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        print(f"device: {props.name} (sm_{props.major}{props.minor}, "
              f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB); "
              f"{versions()}")  # fmt: skip
    else:
        print(f"device: CPU (no CUDA: naive paths at reduced sizes); {versions()}")
    bandwidth = None
    if any(g in NEEDS_BANDWIDTH for g in groups):
        nbytes = COPY_BYTES[device]
        bandwidth = copy_bandwidth(torch.device(device), nbytes)
        print(f"copy bandwidth: {bandwidth / 1e9:,.0f} GB/s ({nbytes // MiB} MiB "
              f"device-to-device copy, read + write bytes)", flush=True)  # fmt: skip
    for group in groups:
        run_group(group, device, dtype, args.quick, seconds, bandwidth, device == "cuda")
    return 0


if __name__ == "__main__":
    sys.exit(main())
