"""Pre-quantized checkpoints for the tests, written in each format's on-disk layout by plain
loops that follow the formats' own packers (AutoAWQ's GEMM `from_linear`, AutoGPTQ/GPTQModel's
`pack`, transformers' FP8 block quantization), independently of helexa's readers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of an int32 holds output 8c + this
FP8_MAX = 448.0
# the Linears a quantizer converts (AWQ, GPTQ and FP8 leave embeddings, norms, lm_head alone)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def as_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values 0 .. 2^32-1 as the int32 of the same bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def quantize_groups(
    w: torch.Tensor, group: int, *, sym: bool, gen: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] as 4-bit (codes [out, in], zeros [out, groups] int, scales [out, groups]
    fp16) with w ~ (q - z) * s, groups of `group` inputs (-1: whole rows): asymmetric min/max
    (AWQ's and GPTQ's sym=False), or symmetric with z = 8 (GPTQ's sym=True)."""
    out, inp = w.shape
    g = inp if group == -1 else group
    blocks = w.float().reshape(out, inp // g, g)
    if sym:
        scale = (blocks.abs().amax(-1) / 7.5).half().float()
        zero = torch.full_like(scale, 8)
    else:
        lo, hi = blocks.amin(-1), blocks.amax(-1)
        scale = ((hi - lo) / 15).half().float()
        zero = (-lo / scale).round().clamp(0, 15)
    codes = (blocks / scale[..., None] + zero[..., None]).round().clamp(0, 15)
    return codes.reshape(out, inp).to(torch.int64), zero.to(torch.int64), scale.half()


def dequantize_groups(codes, zeros, scales, group: int) -> torch.Tensor:
    """(q - z) * s element by element, as the formats define it: float32 [out, in]."""
    g = codes.shape[1] if group == -1 else group
    z = zeros.repeat_interleave(g, dim=1).float()
    s = scales.repeat_interleave(g, dim=1).float()
    return (codes.float() - z) * s


def pack_awq(codes, zeros, scales) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM layout: qweight [in, out/8], qzeros [groups, out/8], scales [groups,
    out], eight values an int32 along the output in AWQ_ORDER."""
    iw, iz = codes.t(), zeros.t()  # [in, out], [groups, out]
    qweight = torch.zeros(iw.shape[0], iw.shape[1] // 8, dtype=torch.int64)
    qzeros = torch.zeros(iz.shape[0], iz.shape[1] // 8, dtype=torch.int64)
    for col in range(iw.shape[1] // 8):
        for i in range(8):
            qweight[:, col] |= iw[:, col * 8 + AWQ_ORDER[i]] << (4 * i)
            qzeros[:, col] |= iz[:, col * 8 + AWQ_ORDER[i]] << (4 * i)
    return {
        "qweight": as_int32(qweight),
        "qzeros": as_int32(qzeros),
        "scales": scales.t().contiguous(),
    }


def pack_gptq(codes, zeros, scales, group: int, *, v1: bool) -> dict[str, torch.Tensor]:
    """GPTQ's layout: qweight [in/8, out] (eight inputs an int32, input 8r + i at bits 4i of
    row r), qzeros [groups, out/8] (output 8c + i at bits 4i), scales [groups, out], g_idx.
    v1 (checkpoint_format "gptq") stores z - 1."""
    out, inp = codes.shape
    iw = codes.t()  # [in, out]
    qweight = torch.zeros(inp // 8, out, dtype=torch.int64)
    for row in range(inp // 8):
        for i in range(8):
            qweight[row] |= iw[row * 8 + i] << (4 * i)
    stored = ((zeros - 1) & 0xF if v1 else zeros).t()  # [groups, out]
    qzeros = torch.zeros(stored.shape[0], out // 8, dtype=torch.int64)
    for col in range(out // 8):
        for i in range(8):
            qzeros[:, col] |= stored[:, col * 8 + i] << (4 * i)
    g = inp if group == -1 else group
    return {
        "qweight": as_int32(qweight),
        "qzeros": as_int32(qzeros),
        "scales": scales.t().contiguous(),
        "g_idx": (torch.arange(inp) // g).to(torch.int32),
    }


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]):
    """transformers' block FP8: per block amax / 448 as weight_scale_inv [ceil(out/bn),
    ceil(in/bk)] (edge blocks short), the weight e4m3 of w / scale. Returns (fp8, scale_inv,
    dequantized float32)."""
    out, inp = w.shape
    bn, bk = block
    scale = torch.empty(-(-out // bn), -(-inp // bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            scale[i, j] = part.abs().amax() / FP8_MAX
    full = scale.repeat_interleave(bn, 0)[:out].repeat_interleave(bk, 1)[:, :inp]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def quantize_checkpoint(src: Path, dst: Path, ref: Path, method: str, **opts) -> dict[str, str]:
    """Write `src` (a float HF dir) quantized by `method` to `dst` (its config's
    quantization_config as the quantizer writes it), and to `ref` the float checkpoint of
    the same weights dequantized; return {tensor: held as} for the projections."""
    tensors = load_file(str(src / "model.safetensors"))
    quant, deq = {}, {}
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS):
            quant[name] = deq[name] = w
            continue
        if method == "fp8":
            q, scale, deq[name] = quantize_fp8_blocks(w, opts["block"])
            quant[name], quant[f"{module}.weight_scale_inv"] = q, scale
            continue
        group, sym = opts["group_size"], opts.get("sym", False)
        codes, zeros, scales = quantize_groups(w, group, sym=sym)
        deq[name] = dequantize_groups(codes, zeros, scales, group)
        if method == "awq":
            parts = pack_awq(codes, zeros, scales)
        else:
            parts = pack_gptq(codes, zeros, scales, group, v1=opts.get("v1", True))
        quant.update({f"{module}.{k}": v for k, v in parts.items()})
    config = json.loads((src / "config.json").read_text())
    for out in (dst, ref):
        out.mkdir(parents=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors" and f.name != "config.json":
                shutil.copyfile(f, out / f.name)
    (ref / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = quantization_config(method, **opts)
    (dst / "config.json").write_text(json.dumps(config))
    save_file(quant, str(dst / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in deq.items()}, str(ref / "model.safetensors"))
    return {k: str(v.dtype) for k, v in quant.items()}


def quantization_config(method: str, **opts) -> dict:
    """config.json's quantization_config as each quantizer writes it."""
    if method == "fp8":  # transformers' FineGrainedFP8Config / DeepSeek-V3, Qwen3-FP8
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(opts["block"]),
        }
    if method == "awq":  # AutoAWQ through transformers' AwqConfig
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": opts["group_size"],
            "version": "gemm",
            "zero_point": True,
            "modules_to_not_convert": None,
        }
    return {  # GPTQModel / AutoGPTQ through transformers' GPTQConfig
        "quant_method": "gptq",
        "bits": 4,
        "group_size": opts["group_size"],
        "desc_act": False,
        "sym": opts.get("sym", False),
        "damp_percent": 0.01,
        "true_sequential": True,
        "checkpoint_format": "gptq" if opts.get("v1", True) else "gptq_v2",
    }
