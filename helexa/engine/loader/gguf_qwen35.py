"""Qwen3.5 / Qwen3.6 GGUF files (llama.cpp `qwen35`, `qwen35moe`) back in the HF layout.

llama.cpp's converter (convert_hf_to_gguf.py; conversion/qwen.py's Qwen3_5TextModel and
Qwen3_5MoeTextModel, through _LinearAttentionVReorderBase and Qwen3NextModel) renames the
hybrid layers' tensors and rewrites some of them. `restore` undoes each rewrite, so the
qwen3_5 family loads the file as it loads the HF checkpoint it came from:

- RMSNorm weights are stored as 1 + w (every `*norm.weight` but the gated norm's
  `ssm_norm`): one is taken off again (the family adds it back, `norm_weight_offset`).
- A_log is stored as A = -exp(A_log) (`ssm_a`): A_log = log(-A).
- dt_bias is stored as `ssm_dt.bias`; conv1d.weight [C, 1, K] squeezed to [C, K].
- Where a key head has several value heads (r = Hv / Hk > 1), the value heads are reordered
  from grouped by key head, [Hk, r], to tiled, [r, Hk] (for ggml's broadcast): in the v rows
  of in_proj_qkv, the v channels of conv1d, the rows of in_proj_z, in_proj_a and in_proj_b,
  A_log, dt_bias, and the columns of out_proj. That is left as it is: the config says
  `linear_value_head_order = "tiled"` and the layer runs its value heads in that order
  (gated_deltanet.py), so every tensor loads as the file holds it. (Undoing it would move
  out_proj's columns, which a K-quant's 256-wide super-blocks over 128-wide heads cut.)
- The MTP head rides along as extra blocks past the decoder (`nextn_predict_layers`): dropped,
  as helexa serves without it.
- `--fuse-qkv` writes a full-attention layer's q (with its gate), k and v as one `attn_qkv`:
  split again (a linear-attention layer's `attn_qkv` is its in_proj_qkv).

Metadata: `ssm.group_count` key heads, `ssm.time_step_rank` value heads, `ssm.state_size` the
key head dim, `ssm.inner_size` all value channels, `ssm.conv_kernel`; `attention.recurrent_layers`
(else `full_attention_interval`) the layer types; `rope.dimension_count` the rotary part of a
head. `rope.dimension_sections` (M-RoPE) is not read: text positions are the same on its
three axes, where it is plain rotary.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from helexa.engine.loader.gguf_tensor import GGUFTensor

# GGUF block tensor -> HF name within the layer, for the names gguf.py's shared table leaves
NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
_LAYER_RE = re.compile(r"(?:blk|model\.layers)\.(\d+)\.(.+)")


def config(meta: dict[str, Any], arch: str, base: dict[str, Any]) -> dict[str, Any]:
    """`base` (gguf.py's shared keys) plus the hybrid layers' HF keys from `{arch}.*`."""

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    num_layers = key("block_count") - key("nextn_predict_layers", 0)
    recurrent = key("attention.recurrent_layers")
    interval = key("full_attention_interval", 4)
    if recurrent is None:
        recurrent = [(i + 1) % interval != 0 for i in range(num_layers)]
    num_v_heads, head_dim = key("ssm.time_step_rank"), base["head_dim"]
    cfg = {
        **base,
        "num_hidden_layers": num_layers,
        "layer_types": [
            "linear_attention" if r else "full_attention" for r in recurrent[:num_layers]
        ],
        "full_attention_interval": interval,
        "linear_num_key_heads": key("ssm.group_count"),
        "linear_num_value_heads": num_v_heads,
        "linear_key_head_dim": key("ssm.state_size"),
        "linear_value_head_dim": key("ssm.inner_size") // num_v_heads,
        "linear_conv_kernel_dim": key("ssm.conv_kernel"),
        "partial_rotary_factor": key("rope.dimension_count", head_dim) / head_dim,
        "linear_value_head_order": "tiled",  # the converter's order, kept (module docstring)
    }
    if shared := key("expert_shared_feed_forward_length"):
        cfg["shared_expert_intermediate_size"] = shared
    return cfg


def restore(tensors: dict[str, GGUFTensor], cfg: dict[str, Any]) -> dict[str, GGUFTensor]:
    """The file's tensors under HF names and in HF layouts, the value heads left in the
    file's order (see the module docstring)."""
    heads, out = _Heads(cfg), {}
    for name, t in tensors.items():
        m = _LAYER_RE.fullmatch(name)
        if m and int(m[1]) >= cfg["num_hidden_layers"]:
            continue  # the MTP head
        if m:
            layer, rest = int(m[1]), m[2]
            if rest == "attn_qkv.weight":
                rest = (
                    "linear_attn.in_proj_qkv.weight"
                    if cfg["layer_types"][layer] == "linear_attention"
                    else "self_attn.qkv_proj.weight"
                )
            t = replace(t, name=f"model.layers.{layer}.{NAMES.get(rest, rest)}")
        for restored in _restore(t, heads):
            out[restored.name] = restored
    return out


class _Heads:
    """The full-attention head counts of a config, to split a fused attn_qkv."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg["head_dim"]


def _restore(t: GGUFTensor, h: _Heads) -> list[GGUFTensor]:
    for suffix, fix in _FIXES.items():
        if t.name.endswith(suffix):
            return fix(t, h)
    if t.name.endswith("norm.weight"):  # input/post-attention, q/k and the final RMSNorm
        return [_floats(t, t.dequantize() - 1)]  # stored as 1 + w
    return [t]


def _as_stored(t: GGUFTensor, h: _Heads) -> list[GGUFTensor]:
    return [t]


def _a_log(t: GGUFTensor, h: _Heads) -> list[GGUFTensor]:
    return [_floats(t, torch.log(-t.dequantize()))]  # stored as A = -exp(A_log)


def _conv1d(t: GGUFTensor, h: _Heads) -> list[GGUFTensor]:
    return [replace(t, shape=(t.shape[0], 1, t.shape[1]))]  # HF's [C, 1, K]; same rows


def _fused_qkv(t: GGUFTensor, h: _Heads) -> list[GGUFTensor]:
    """A full-attention layer's one attn_qkv: q (each head's query and gate), k, v by rows."""
    prefix = t.name.removesuffix("qkv_proj.weight")
    sizes = {"q_proj": 2 * h.heads * h.head_dim, "k_proj": h.kv_heads * h.head_dim}
    sizes["v_proj"] = sizes["k_proj"]
    out, start = [], 0
    for proj, size in sizes.items():
        part = _rows(t, torch.arange(start, start + size))
        out.append(replace(part, name=f"{prefix}{proj}.weight"))
        start += size
    return out


def _shared_expert_gate(t: GGUFTensor, h: _Heads) -> list[GGUFTensor]:
    return [replace(t, shape=(1, t.shape[-1]))]  # HF's Linear(hidden, 1); llama.cpp reads [H]


_FIXES: dict[str, Callable[[GGUFTensor, _Heads], list[GGUFTensor]]] = {
    "linear_attn.norm.weight": _as_stored,  # the gated norm: a plain scale, not 1 + w
    "linear_attn.A_log": _a_log,
    "linear_attn.conv1d.weight": _conv1d,
    "self_attn.qkv_proj.weight": _fused_qkv,
    "mlp.shared_expert_gate.weight": _shared_expert_gate,
}


def _rows(t: GGUFTensor, index: torch.Tensor) -> GGUFTensor:
    """Rows `index` of a 2-D tensor, as raw bytes (each row is whole blocks)."""
    assert len(t.shape) == 2, (t.name, t.shape)
    return replace(t, shape=(len(index), t.shape[1]), data=t.data[index])


def _floats(t: GGUFTensor, w: torch.Tensor) -> GGUFTensor:
    """`t` replaced by the float32 values `w` (of any shape)."""
    w = w.float().contiguous()
    rows = w.shape[:-1].numel()
    return replace(t, qtype="F32", shape=tuple(w.shape), data=w.view(torch.uint8).reshape(rows, -1))
