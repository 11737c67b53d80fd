"""Which GGML type each tensor of a GGUF gets in a llama.cpp quantization mix.

A mirror of llama.cpp's `llama_tensor_get_type` (src/llama-quant.cpp, as vendored in
llama-cpp-python 0.3.36) for the mixes `helexa bench gguf` writes: Q4_K_M, Q5_K_M, Q6_K
and Q8_0, from a BF16/F16 conversion. The rules, as the quantizer applies them:

- Only 2-D/3-D tensors whose names end in "weight" are quantized, never norms, the MoE
  router (ffn_gate_inp) or ssm_conv1d; those stay as the converter wrote them (F32).
- output.weight, and token_embd.weight when there is no output.weight (tied embeddings),
  get Q6_K (Q8_0 in a Q8_0 file, or when its rows are not whole 256-blocks).
- Q4_K_M and Q5_K_M give Q6_K to the attn_v-like tensors (attn_v, and the linear-attention
  layers' attn_qkv) and to ffn_down where `use_more_bits` says so: the first and last
  eighth of them, and every third one between.
- A model of exactly 8 experts (Mixtral) gets Q8_0 attn_v/attn_k and Q5_K attn_output.
- A type whose block does not divide the row falls back: Q4_K -> Q5_0, Q5_K -> Q5_1,
  Q6_K -> Q8_0, and to F16 when even 32 does not divide it.

Counters run over the tensors in the loader's order (non-block tensors first, then by
layer, names sorted within a layer), which is also the order llama-quantize writes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# llama_ftype: the mix's default type and its general.file_type number
MIXES = {"Q4_K_M": ("Q4_K", 15), "Q5_K_M": ("Q5_K", 17), "Q6_K": ("Q6_K", 18), "Q8_0": ("Q8_0", 7)}
# weights per block of each type that can appear
BLOCK_SIZE = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q8_0": 32, "Q5_0": 32, "Q5_1": 32}
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_LAYER = re.compile(r"blk\.(\d+)\.")


def layer_of(name: str) -> int:
    """The block a tensor belongs to, -1 for token_embd, output and the like."""
    m = _LAYER.match(name)
    return int(m[1]) if m else -1


def loader_order(names: Sequence[str]) -> list[str]:
    """`names` as llama.cpp's loader sorts them (its weight_name_comparer)."""
    return sorted(names, key=lambda n: (layer_of(n), n))


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    return (
        i_layer < n_layers // 8
        or i_layer >= 7 * n_layers // 8
        or ((i_layer - n_layers // 8) % 3 == 2)
    )


def category(name: str) -> str:
    """tensor_get_category: substring tests, in llama.cpp's order."""
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for part, cat in (
        ("attn_qkv.weight", "attn_qkv"),
        ("attn_kv_b.weight", "attn_kv_b"),
        ("attn_v.weight", "attn_v"),
        ("attn_k.weight", "attn_k"),
        ("attn_q.weight", "attn_q"),
        ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"),
        ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):
        if part in name:
            return cat
    return "other"


def is_quantizable(name: str, ndim: int) -> bool:
    """tensor_allows_quantization, for the names the Qwen architectures use."""
    return (
        ndim >= 2
        and name.endswith("weight")
        and "_norm.weight" not in name
        and "ffn_gate_inp.weight" not in name
        and "ssm_conv1d" not in name
    )


def tensor_types(
    shapes: dict[str, tuple[int, ...]], mix: str, n_expert: int, n_layer: int
) -> dict[str, str]:
    """The type of every tensor in `shapes` (name -> numpy shape, rows last) in `mix`;
    tensors the quantizer leaves alone are "F32". `n_layer` counts every block (MTP ones
    too: the file's block_count)."""
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; supported: {list(MIXES)}")
    default = MIXES[mix][0]
    names = loader_order(list(shapes))
    tied = "output.weight" not in shapes
    n_attn_v = sum(category(n) in ("attn_v", "attn_qkv", "attn_kv_b") for n in names)
    i_attn_v = i_ffn_down = 0
    types: dict[str, str] = {}
    for name in names:
        shape = shapes[name]
        if not is_quantizable(name, len(shape)):
            types[name] = "F32"
            continue
        cat, row = category(name), shape[-1]
        new = default
        if cat == "output" or (tied and cat == "token_embd"):
            if row % BLOCK_SIZE[default]:
                new = "Q8_0"
            elif default != "Q8_0":
                new = "Q6_K"
        elif cat in ("attn_v", "attn_qkv", "attn_kv_b"):
            if mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(i_attn_v, n_attn_v):
                new = "Q6_K"
            if n_expert == 8:
                new = "Q8_0"
            i_attn_v += 1
        elif cat == "attn_k" and n_expert == 8:
            new = "Q8_0"
        elif cat == "ffn_down":
            # MoE files name the layer (experts are not one tensor per layer in every model)
            i_layer = layer_of(name) if n_expert > 1 else i_ffn_down
            if mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(i_layer, n_layer):
                new = "Q6_K"
            i_ffn_down += 1
        elif cat == "attn_output" and n_expert == 8 and mix == "Q4_K_M":
            new = "Q5_K"
        if row % BLOCK_SIZE[new]:
            new = FALLBACK.get(new, new)
            if row % BLOCK_SIZE[new]:
                new = "F16"
        types[name] = new
    return types
