"""Every Triton kernel against its naive twin on this machine: `python -m helexa.kernels.selftest`.

    python -m helexa.kernels.selftest                 # CUDA if present, else CPU (interpreter)
    python -m helexa.kernels.selftest --device cpu --dtype bfloat16

Seeded inputs at awkward sizes (T=63, head and channel dims 60, E=6 experts, top-2, KV cache
blocks of 16 with GQA group 2); one line per kernel: name, device, shapes, max abs error, max
relative error (to the reference's largest magnitude), ok/FAIL. Exits 1 on any FAIL, 2 when
triton is missing. `--only NAME[,NAME…]` checks those kernels alone (under the interpreter
every kernel takes a minute or two); `--perturb NAME` scales that kernel's Triton output by
1.01, to see a FAIL (the selftest's own test).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .quant_pack import QUANT_KINDS

LAYER_KERNELS = (  # layer_cases()
    "rms_norm",
    "fused_add_rms_norm",
    "rotary",
    "silu_and_mul",
    "apply_penalties",
    "apply_token_bitmask",
    "sample",
)
KERNEL_MODULES = (
    "causal_conv1d", "gdn_gating", "fused_moe", "gated_delta_rule", "paged_attention", "kv_store",
)  # fmt: skip
KERNELS = (
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    # value heads in llama.cpp's tiled order (a qwen35 GGUF's): key head j % Hk
    "chunk_gated_delta_rule[tiled]",
    "fused_recurrent_gated_delta_rule[tiled]",
    "causal_conv1d",
    "causal_conv1d_update",
    "gdn_gating",
    "fused_moe",
    "paged_decode_attention",
    "paged_prefill_attention",
    "store_kv",
    *(
        f"quant_{kernel}[{kind}]"
        for kind in QUANT_KINDS
        for kernel in ("gemv", "gemm", "dequantize")
    ),
    "quant_fused_moe",
    *LAYER_KERNELS,
)
# Max error relative to the reference's scale. fp32: the kernels reorder fp32 sums (and the
# chunked delta rule solves its triangular system another way); bf16: a few bf16 roundings
# (on CPU, Triton's interpreter truncates fp32 -> bf16, up to one ulp, 2^-7 relative).
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2}
TOLERANCE_TIGHT = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # elementwise kernels


@dataclass
class Case:
    """One kernel's comparison: run(triton?) returns every output the two must agree on."""

    name: str
    shapes: str
    run: Callable[[bool], list[torch.Tensor]]
    tight: bool = False


def cases(device: str, dtype: torch.dtype) -> list[Case]:
    # by module path: the package's causal_conv1d, fused_moe and gdn_gating are the dispatcher's
    conv, gating, moe, gdr, paged, kv = (
        importlib.import_module(f"{__package__}.{name}") for name in KERNEL_MODULES
    )

    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int, scale: float = 1.0, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    T, N, S, Hk, Hv, D, C, W, E, I, K = 63, 5, 8, 2, 4, 60, 60, 4, 6, 40, 2  # noqa: E741
    rows = torch.randperm(S, generator=gen)[:N].to(device)

    q, k, v = randn(T, Hk, D), randn(T, Hk, D), randn(T, Hv, D)
    g = -torch.rand(T, Hv, generator=gen).to(device)  # log-decays in (-1, 0]
    beta = torch.rand(T, Hv, generator=gen).to(device)
    h0 = randn(Hv, D, D, scale=0.1, dt=torch.float32)

    def chunk(triton: bool, tiled: bool = False) -> list[torch.Tensor]:
        fn = gdr.triton_chunk_gated_delta_rule if triton else gdr.naive_chunk_gated_delta_rule
        return list(fn(q, k, v, g, beta, h0, tiled=tiled))

    dq, dk, dv = randn(N, Hk, D), randn(N, Hk, D), randn(N, Hv, D)
    dg, dbeta = g[:N].clone(), beta[:N].clone()
    pool = randn(S, Hv, D, D, scale=0.1, dt=torch.float32)

    def recurrent(triton: bool, tiled: bool = False) -> list[torch.Tensor]:
        fn = (
            gdr.triton_fused_recurrent_gated_delta_rule
            if triton
            else gdr.naive_recurrent_gated_delta_rule
        )
        state = pool.clone()
        return [fn(dq, dk, dv, dg, dbeta, state, rows, tiled=tiled), state]

    x, cw, cb, c0 = randn(T, C), randn(C, W, scale=0.5), randn(C, scale=0.1), randn(C, W - 1)

    def conv_prompt(triton: bool) -> list[torch.Tensor]:
        fn = conv.triton_causal_conv1d if triton else conv.naive_causal_conv1d
        return list(fn(x, cw, cb, c0))

    xs, conv_pool = randn(N, C), randn(S, C, W - 1)

    def conv_step(triton: bool) -> list[torch.Tensor]:
        fn = conv.triton_causal_conv1d_update if triton else conv.naive_causal_conv1d_update
        state = conv_pool.clone()
        return [fn(xs, state, cw, cb, rows), state]

    a, b = randn(T, Hv, scale=8), randn(T, Hv)  # a reaches softplus's linear range
    A_log, dt_bias = randn(Hv, dt=torch.float32), randn(Hv, dt=torch.float32)

    def gates(triton: bool) -> list[torch.Tensor]:
        fn = gating.triton_gdn_gating if triton else gating.naive_gdn_gating
        return list(fn(A_log, a, b, dt_bias))

    mx, w13, w2 = randn(T, D), randn(E, 2 * I, D, scale=D**-0.5), randn(E, D, I, scale=I**-0.5)
    topk_weights, topk_ids = torch.rand(T, E, generator=gen).to(device).softmax(-1).topk(K)

    def experts(triton: bool) -> list[torch.Tensor]:
        fn = moe.triton_fused_moe if triton else moe.naive_fused_moe
        return [fn(mx, w13, w2, topk_weights, topk_ids)]

    # paged attention: block size 16, GQA group 2, D=60; 5 rows, one a padding row (0 tokens),
    # over permuted blocks; tables of 32 blocks (512 tokens) so that decode splits the context
    BS, Hq, Hkv, MB = 16, 4, 2, 32
    k_cache, v_cache = randn(N * MB, BS, Hkv, D), randn(N * MB, BS, Hkv, D)
    tables = torch.randperm(N * MB, generator=gen).view(N, MB).to(device, torch.int32)
    lens = torch.tensor([1, 63, 200, 0, 317], dtype=torch.int32, device=device)
    pq = randn(N, Hq, D)

    def paged_decode(triton: bool) -> list[torch.Tensor]:
        fn = paged.triton_paged_decode_attention if triton else paged.naive_paged_decode_attention
        return [fn(pq, k_cache, v_cache, tables, lens, D**-0.5)]

    # prefill: a whole prompt of 63, then chunks of 17 and 1 after cached prefixes of 40 and 64
    chunks = [63, 17, 1]
    cu = torch.tensor([0, 63, 80, 81], dtype=torch.int32, device=device)
    totals = torch.tensor([63, 57, 65], dtype=torch.int32, device=device)
    fq = randn(sum(chunks), Hq, D)

    def paged_prefill(triton: bool) -> list[torch.Tensor]:
        fn = paged.triton_paged_prefill_attention if triton else paged.naive_paged_prefill_attention
        return [fn(fq, k_cache, v_cache, cu, totals, tables[:3], D**-0.5, max(chunks))]

    # a prompt's K/V into fresh caches at scattered slots, padding rows (slot -1) skipped
    store_slots = torch.randperm(N * MB * BS, generator=gen)[:T].to(device)
    store_slots[::7] = -1
    new_k, new_v = randn(T, Hkv, D), randn(T, Hkv, D)

    def store(triton: bool) -> list[torch.Tensor]:
        fn = kv.triton_store_kv if triton else kv.naive_store_kv
        kc, vc = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        fn(new_k, new_v, kc, vc, store_slots)
        return [kc, vc]

    return [
        Case("chunk_gated_delta_rule", f"q,k[{T},{Hk},{D}] v[{T},{Hv},{D}]", chunk),
        Case("fused_recurrent_gated_delta_rule", f"q,k[{N},{Hk},{D}] pool[{S},{Hv},..]", recurrent),
        Case(
            "chunk_gated_delta_rule[tiled]",
            f"q,k[{T},{Hk},{D}] v[{T},{Hv},{D}]",
            lambda triton: chunk(triton, tiled=True),
        ),
        Case(
            "fused_recurrent_gated_delta_rule[tiled]",
            f"q,k[{N},{Hk},{D}] pool[{S},{Hv},..]",
            lambda triton: recurrent(triton, tiled=True),
        ),
        Case("causal_conv1d", f"x[{T},{C}] w[{C},{W}]", conv_prompt, tight=True),
        Case("causal_conv1d_update", f"x[{N},{C}] pool[{S},{C},{W - 1}]", conv_step, tight=True),
        Case("gdn_gating", f"a,b[{T},{Hv}]", gates, tight=True),
        Case("fused_moe", f"x[{T},{D}] w13[{E},{2 * I},{D}] top{K}", experts),
        Case(
            "paged_decode_attention", f"q[{N},{Hq},{D}] kv[{N * MB},{BS},{Hkv},{D}]", paged_decode
        ),
        Case("paged_prefill_attention", f"q[{sum(chunks)},{Hq},{D}] chunks{chunks}", paged_prefill),
        Case("store_kv", f"k,v[{T},{Hkv},{D}] -> kv[{N * MB},{BS},{Hkv},{D}]", store, tight=True),
        *quant_cases(device, dtype, gen),
        *layer_cases(device, dtype),
    ]


def quant_cases(device: str, dtype: torch.dtype, gen: torch.Generator) -> list[Case]:
    """Per quant kind: the GEMV kernel at 1 and 5 rows, the GEMM at 33, on a [40, 256] weight
    (random valid GGUF blocks, or a random weight quantized)."""
    qm = importlib.import_module(f"{__package__}.quant_matmul")
    dq = importlib.import_module(f"{__package__}.quant_dequant")
    N, K = 40, 256
    xs = {m: (torch.randn(m, K, generator=gen)).to(device, dtype) for m in (1, 5, 33)}
    bias = (torch.randn(N, generator=gen) * 0.1).to(device, dtype)
    out = []
    for kind in QUANT_KINDS:
        if kind in qm.GGUF_KINDS:
            qw = qm.pack_gguf(qm.make_gguf_blocks(kind, N, K, generator=gen), kind, (N, K))
        else:
            qw = qm.quantize(torch.randn(N, K, generator=gen) * 0.02, kind)
        qw = qw.to(device)

        def gemv(triton: bool, qw=qw) -> list[torch.Tensor]:
            fn = qm.triton_quant_matmul if triton else qm.naive_quant_matmul
            return [fn(xs[1], qw), fn(xs[5], qw, bias)]

        def gemm(triton: bool, qw=qw) -> list[torch.Tensor]:
            fn = qm.triton_quant_matmul if triton else qm.naive_quant_matmul
            return [fn(xs[33], qw, bias)]

        out.append(Case(f"quant_gemv[{kind}]", f"x[1|5,{K}] w[{N},{K}]", gemv))
        out.append(Case(f"quant_gemm[{kind}]", f"x[33,{K}] w[{N},{K}]", gemm))

        def dequantize(triton: bool, qw=qw) -> list[torch.Tensor]:
            if triton:  # in the dtype the dense prefill path reads, as the reference rounds
                return [dq.triton_dequantize(qw, dtype=dtype)]
            return [qm.naive_dequantize(qw).to(dtype)]

        out.append(Case(f"quant_dequantize[{kind}]", f"w[{N},{K}]", dequantize, tight=True))

    # routed experts over stacked quantized weights: Q4_K gate/up, Q6_K down (as GGUF MoE files)
    moe = importlib.import_module(f"{__package__}.quant_moe")
    E, H, I, top_k = 6, 256, 256, 2  # noqa: E741
    w13 = qm.pack_gguf(
        qm.make_gguf_blocks("Q4_K", E * 2 * I, H, generator=gen), "Q4_K", (E * 2 * I, H)
    )
    w2 = qm.pack_gguf(qm.make_gguf_blocks("Q6_K", E * H, I, generator=gen), "Q6_K", (E * H, I))
    w13, w2 = w13.to(device), w2.to(device)
    mx = torch.randn(9, H, generator=gen).to(device, dtype)
    weights, ids = torch.rand(9, E, generator=gen).to(device).softmax(-1).topk(top_k)

    def experts(triton: bool) -> list[torch.Tensor]:
        fn = moe.triton_quant_fused_moe if triton else moe.naive_quant_fused_moe
        return [fn(mx, w13, w2, weights, ids)]

    out.append(Case("quant_fused_moe", f"x[9,{H}] Q4_K/Q6_K E{E} I{I} top{top_k}", experts))
    return out


def layer_cases(device: str, dtype: torch.dtype) -> list[Case]:
    """The decoder's small ops at T=63 (norm over 100, heads of 64 with a partial rotary of
    32, I=100) and the sampler's kernels over a vocabulary of 1000 (always fp32): the rows
    mix greedy, temperature, top-k, top-p and min-p; the sampled tokens compare one-hot, so
    any difference is a FAIL."""
    norm, rope, act, smp, race = (
        importlib.import_module(f"{__package__}.{name}")
        for name in ("rms_norm", "rotary", "activation", "sampling", "filtered_sample")
    )
    gen = torch.Generator().manual_seed(1)  # its own: the other cases' inputs stay as they were

    def randn(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

    T, H, Hq, Hk, D, R, I, N, V = 63, 100, 4, 2, 64, 32, 100, 12, 1000  # noqa: E741
    x, residual, weight = randn(T, H), randn(T, H), 1 + randn(H) / 10
    q, k, _ = randn(T, Hq + 2 * Hk, D).split([Hq, Hk, Hk], dim=1)  # views of a fused qkv
    cos, sin = randn(T, 1, R), randn(T, 1, R)
    gate_up = randn(T, 2 * I)

    def rms_norm(triton: bool) -> list[torch.Tensor]:
        fn = norm.triton_rms_norm if triton else norm.naive_rms_norm
        return [fn(x, weight, 1e-6)]

    def fused_add_rms_norm(triton: bool) -> list[torch.Tensor]:
        fn = norm.triton_rms_norm if triton else norm.naive_rms_norm
        return list(fn(x, weight, 1e-6, residual))

    def rotary(triton: bool) -> list[torch.Tensor]:
        return list((rope.triton_rotary if triton else rope.naive_rotary)(q, k, cos, sin))

    def silu_and_mul(triton: bool) -> list[torch.Tensor]:
        return [(act.triton_silu_and_mul if triton else act.naive_silu_and_mul)(gate_up)]

    logits = randn(N, V, dt=torch.float32) * 3
    pairs = torch.randint(0, V, (2, 300), generator=gen).to(device, torch.int32)
    pairs[0] %= N  # (row, token): 200 output tokens, then 100 of the prompt
    rep, freq, pres = (1 + randn(N, dt=torch.float32).abs() / 4, randn(N, dt=torch.float32),
                       randn(N, dt=torch.float32))  # fmt: skip

    def penalties(triton: bool) -> list[torch.Tensor]:
        out = logits.clone()
        fn = smp.triton_apply_penalties if triton else smp.naive_apply_penalties
        fn(out, pairs[0], pairs[1], 200, rep, freq, pres)
        return [out]

    words = torch.randint(-(2**31), 2**31, (N, (V + 31) // 32), generator=gen, dtype=torch.int64)
    bitmask = words.to(torch.int32).to(device)  # random bits; V = 1000 leaves a partial word

    def token_bitmask(triton: bool) -> list[torch.Tensor]:
        out = logits.clone()
        (smp.triton_apply_token_bitmask if triton else smp.naive_apply_token_bitmask)(out, bitmask)
        return [out.isinf().float(), out.nan_to_num(neginf=0.0)]

    noise = torch.empty(N, V).exponential_(generator=gen).to(device)
    temperature = torch.tensor([0, 1, 0.7, 1, 1, 1, 0.8, 1, 1.3, 1, 0.5, 1], device=device)
    top_k = torch.tensor([0, 0, 0, 5, 50, 0, 0, 40, 0, 1, 200, 999], device=device)
    top_p = torch.tensor([1, 1, 1, 1, 1, 0.5, 1, 0.8, 0.9, 1, 0.95, 0.3], device=device)
    min_p = torch.tensor([0, 0, 0, 0, 0, 0, 0.1, 0.02, 0, 0, 0, 0], device=device)

    def sample(triton: bool) -> list[torch.Tensor]:
        fn = race.triton_sample if triton else race.naive_sample
        tokens = fn(logits, noise, temperature, top_k, top_p, min_p)
        return [torch.nn.functional.one_hot(tokens, V).float()]

    return [
        Case("rms_norm", f"x[{T},{H}]", rms_norm),
        Case("fused_add_rms_norm", f"x,residual[{T},{H}]", fused_add_rms_norm),
        Case("rotary", f"q[{T},{Hq},{D}] k[{T},{Hk},{D}] rot{R}", rotary),
        Case("silu_and_mul", f"x[{T},{2 * I}]", silu_and_mul),
        Case("apply_penalties", f"logits[{N},{V}] pairs[300]", penalties, tight=True),
        Case("apply_token_bitmask", f"logits[{N},{V}] bitmask", token_bitmask, tight=True),
        Case("sample", f"logits[{N},{V}]", sample, tight=True),
    ]


def compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[float, float]:
    """(max abs error, max abs error / max |reference|), the worst over all outputs."""
    max_abs = max_rel = 0.0
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape, f"shape {tuple(g.shape)} != {tuple(w.shape)}"
        err = (g.double() - w.double()).abs().max().item() if w.numel() else 0.0
        scale = w.double().abs().max().item() if w.numel() else 1.0
        max_abs, max_rel = max(max_abs, err), max(max_rel, err / max(scale, 1e-12))
    return max_abs, max_rel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helexa.kernels.selftest", description=__doc__)
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda if present")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--only", help="comma-separated kernel names: check only these")
    parser.add_argument("--perturb", choices=KERNELS, help="spoil one kernel's output (tests)")
    args = parser.parse_args(argv)
    only = set(KERNELS)
    if args.only is not None:
        only = {name.strip() for name in args.only.split(",") if name.strip()}
        if unknown := sorted(only - set(KERNELS)):
            parser.error(f"--only: unknown kernel(s) {', '.join(unknown)}; known: {KERNELS}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("selftest: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if importlib.util.find_spec("triton") is None:
        print("selftest: triton is not installed (pip install 'triton>=3.0')", file=sys.stderr)
        return 2
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads TRITON_INTERPRET when it is imported and when each kernel is defined,
        # and `python -m` has imported the package (so triton and the kernels): run again
        argv = sys.argv[1:] if argv is None else argv
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        return subprocess.run(
            [sys.executable, "-m", f"{__package__}.selftest", *argv], env=env
        ).returncode
    dtype = getattr(torch, args.dtype)
    failed = 0
    for case in cases(device, dtype):
        if case.name not in only:
            continue
        line = f"{case.name:<33} {device:<4} {args.dtype:<8} {case.shapes:<36}"
        try:
            want = case.run(False)
            got = case.run(True)
        except Exception as e:  # a kernel that does not run is a FAIL, not the end of the run
            failed += 1
            print(f"{line} FAIL: {type(e).__name__}: {e}", flush=True)
            continue
        if case.name == args.perturb:
            got = [t * 1.01 for t in got]
        max_abs, max_rel = compare(got, want)
        ok = max_rel <= (TOLERANCE_TIGHT if case.tight else TOLERANCE)[dtype]
        failed += not ok
        print(
            f"{line} max_abs {max_abs:.2e}  max_rel {max_rel:.2e}  {'ok' if ok else 'FAIL'}",
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
