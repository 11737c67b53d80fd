"""Every Triton kernel against its naive twin on this machine: `python -m helexa.kernels.selftest`.

    python -m helexa.kernels.selftest                 # CUDA if present, else CPU (interpreter)
    python -m helexa.kernels.selftest --device cpu --dtype bfloat16

Seeded inputs at awkward sizes (T=63, head and channel dims 60, E=6 experts, top-2); one line
per kernel: name, device, shapes, max abs error, max relative error (to the reference's
largest magnitude), ok/FAIL. Exits 1 on any FAIL, 2 when triton is missing. `--perturb NAME`
scales that kernel's Triton output by 1.01, to see a FAIL (the selftest's own test).
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

KERNEL_MODULES = ("causal_conv1d", "gdn_gating", "fused_moe", "gated_delta_rule")
KERNELS = (
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "causal_conv1d",
    "causal_conv1d_update",
    "gdn_gating",
    "fused_moe",
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
    conv, gating, moe, gdr = (
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

    def chunk(triton: bool) -> list[torch.Tensor]:
        fn = gdr.triton_chunk_gated_delta_rule if triton else gdr.naive_chunk_gated_delta_rule
        return list(fn(q, k, v, g, beta, h0))

    dq, dk, dv = randn(N, Hk, D), randn(N, Hk, D), randn(N, Hv, D)
    dg, dbeta = g[:N].clone(), beta[:N].clone()
    pool = randn(S, Hv, D, D, scale=0.1, dt=torch.float32)

    def recurrent(triton: bool) -> list[torch.Tensor]:
        fn = (
            gdr.triton_fused_recurrent_gated_delta_rule
            if triton
            else gdr.naive_recurrent_gated_delta_rule
        )
        state = pool.clone()
        return [fn(dq, dk, dv, dg, dbeta, state, rows), state]

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

    return [
        Case("chunk_gated_delta_rule", f"q,k[{T},{Hk},{D}] v[{T},{Hv},{D}]", chunk),
        Case("fused_recurrent_gated_delta_rule", f"q,k[{N},{Hk},{D}] pool[{S},{Hv},..]", recurrent),
        Case("causal_conv1d", f"x[{T},{C}] w[{C},{W}]", conv_prompt, tight=True),
        Case("causal_conv1d_update", f"x[{N},{C}] pool[{S},{C},{W - 1}]", conv_step, tight=True),
        Case("gdn_gating", f"a,b[{T},{Hv}]", gates, tight=True),
        Case("fused_moe", f"x[{T},{D}] w13[{E},{2 * I},{D}] top{K}", experts),
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
    parser.add_argument("--perturb", choices=KERNELS, help="spoil one kernel's output (tests)")
    args = parser.parse_args(argv)
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
