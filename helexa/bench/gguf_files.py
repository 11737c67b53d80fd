"""GGUF files to measure with: real checkpoints' shapes, random but valid blocks.

Speed depends on the shapes and on how the weights are held, not on their values, so
`helexa bench gguf` writes what llama.cpp's convert_hf_to_gguf.py and llama-quantize would
make of a real checkpoint (same tensor names, shapes, metadata keys and per-tensor types
of the mix, see gguf_mix) with random blocks (quant_pack.make_gguf_blocks) and the real
tokenizer in the metadata. llama.cpp loads such a file like the real one, so helexa and
llama-bench can be measured on the very same file.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helexa.bench.gguf_mix import loader_order
from helexa.bench.random_models import PRESETS as QWEN3_PRESETS
from helexa.bench.random_models import QWEN36_TEXT

# Qwen3.6's numbers are random_models' presets (their text_config; the sources are cited
# there), with what only the file needs: the M-RoPE sections and the one MTP layer.
_GGUF_ONLY = dict(mrope_section=[11, 11, 10], mtp_num_hidden_layers=1)
_QWEN36 = dict(QWEN36_TEXT, **_GGUF_ONLY)


@dataclass(frozen=True, slots=True)
class Preset:
    """A checkpoint to imitate: its architecture as llama.cpp names it and its config."""

    arch: str  # general.architecture
    config: dict[str, Any]  # config.json numbers (Qwen3.6: its text_config)
    name: str  # general.name
    size_label: str
    hub_id: str  # where its tokenizer lives


PRESETS = {
    "qwen3-0.6b": Preset("qwen3", QWEN3_PRESETS["qwen3-0.6b"], "Qwen3 0.6B", "0.6B", "Qwen/Qwen3-0.6B"),
    "qwen3-8b": Preset("qwen3", QWEN3_PRESETS["qwen3-8b"], "Qwen3 8B", "8B", "Qwen/Qwen3-8B"),
    "qwen3.6-27b": Preset(
        "qwen35", dict(QWEN3_PRESETS["qwen3.6-27b"], **_GGUF_ONLY),
        "Qwen3.6 27B", "27B", "Qwen/Qwen3.6-27B",
    ),
    "qwen3.6-35b-a3b": Preset(
        "qwen35moe", dict(QWEN3_PRESETS["qwen3.6-35b-a3b"], **_GGUF_ONLY),
        "Qwen3.6 35B A3B", "35B-A3B", "Qwen/Qwen3.6-35B-A3B",
    ),
}  # fmt: skip
# llama.cpp's pre-tokenizer names (convert_hf_to_gguf's get_vocab_base_pre) per architecture
PRE_TOKENIZER = {"qwen3": "qwen2", "qwen35": "qwen35", "qwen35moe": "qwen35"}


def is_recurrent(cfg: dict[str, Any], layer: int) -> bool:
    """A Gated DeltaNet layer (llama.cpp's recurrent layer): not every interval-th layer,
    nor an MTP block."""
    if "linear_num_value_heads" not in cfg or layer >= cfg["num_hidden_layers"]:
        return False
    return (layer + 1) % cfg["full_attention_interval"] != 0


def num_blocks(cfg: dict[str, Any], mtp: bool) -> int:
    """block_count: the layers, and the MTP layers the converter appends after them."""
    return cfg["num_hidden_layers"] + (cfg.get("mtp_num_hidden_layers", 0) if mtp else 0)


# -- tensors -------------------------------------------------------------------------------
def tensor_shapes(cfg: dict[str, Any], mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor the converter writes for `cfg`, by GGUF name, as numpy shapes
    ([out, in]; experts [n_expert, out, in]: GGUF's ne reversed), in the loader's order."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hybrid = "linear_num_value_heads" in cfg
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (cfg["vocab_size"], h),
        "output_norm.weight": (h,),
    }
    if not cfg["tie_word_embeddings"]:
        shapes["output.weight"] = (cfg["vocab_size"], h)
    n_layer = cfg["num_hidden_layers"]
    for i in range(num_blocks(cfg, mtp)):
        p = f"blk.{i}."
        shapes[p + "attn_norm.weight"] = (h,)
        shapes[p + ("post_attention_norm.weight" if hybrid else "ffn_norm.weight")] = (h,)
        if is_recurrent(cfg, i):
            shapes.update({p + k: s for k, s in _delta_net(cfg).items()})
        else:  # Qwen3.6's attention projects a per-head output gate along with q
            q_rows = n_head * d * (2 if hybrid else 1)
            shapes[p + "attn_q.weight"] = (q_rows, h)
            shapes[p + "attn_k.weight"] = (n_kv * d, h)
            shapes[p + "attn_v.weight"] = (n_kv * d, h)
            shapes[p + "attn_output.weight"] = (h, n_head * d)
            shapes[p + "attn_q_norm.weight"] = (d,)
            shapes[p + "attn_k_norm.weight"] = (d,)
        shapes.update({p + k: s for k, s in _ffn(cfg).items()})
        if i >= n_layer:  # the MTP block: a full-attention layer with its own head-in
            shapes[p + "nextn.eh_proj.weight"] = (h, 2 * h)
            for norm in ("enorm", "hnorm", "shared_head_norm"):
                shapes[p + f"nextn.{norm}.weight"] = (h,)
    return {name: shapes[name] for name in loader_order(list(shapes))}


def _delta_net(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, n_v = cfg["hidden_size"], cfg["linear_num_value_heads"]
    key_dim = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    value_dim = n_v * cfg["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    return {
        "attn_qkv.weight": (conv_dim, h),
        "attn_gate.weight": (value_dim, h),
        "ssm_conv1d.weight": (conv_dim, cfg["linear_conv_kernel_dim"]),
        "ssm_dt.bias": (n_v,),
        "ssm_a": (n_v,),
        "ssm_beta.weight": (n_v, h),
        "ssm_alpha.weight": (n_v, h),
        "ssm_norm.weight": (cfg["linear_value_head_dim"],),
        "ssm_out.weight": (h, value_dim),
    }


def _ffn(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h = cfg["hidden_size"]
    if "num_experts" not in cfg:
        i = cfg["intermediate_size"]
        return {"ffn_gate.weight": (i, h), "ffn_up.weight": (i, h), "ffn_down.weight": (h, i)}
    e, i = cfg["num_experts"], cfg["moe_intermediate_size"]
    s = cfg["shared_expert_intermediate_size"]
    return {
        "ffn_gate_inp.weight": (e, h),
        "ffn_gate_exps.weight": (e, i, h),
        "ffn_up_exps.weight": (e, i, h),
        "ffn_down_exps.weight": (e, h, i),
        "ffn_gate_inp_shexp.weight": (h,),
        "ffn_gate_shexp.weight": (s, h),
        "ffn_up_shexp.weight": (s, h),
        "ffn_down_shexp.weight": (h, s),
    }


def with_layers(cfg: dict[str, Any], num_layers: int | None) -> dict[str, Any]:
    """`cfg` cut to its first `num_layers` layers (None: as it is)."""
    if num_layers is None:
        return cfg
    if not 1 <= num_layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"--layers must be in 1..{cfg['num_hidden_layers']}; got {num_layers}")
    return dict(cfg, num_hidden_layers=num_layers)


# -- metadata ------------------------------------------------------------------------------
def arch_metadata(arch: str, cfg: dict[str, Any], mtp: bool) -> Iterator[tuple[str, Any, str]]:
    """(key, value, GGUF type) of the model's hyperparameters, in the converter's order."""
    n_blocks, moe, hybrid = num_blocks(cfg, mtp), "num_experts" in cfg, arch != "qwen3"
    u32 = "uint32"
    yield "block_count", n_blocks, u32
    yield "context_length", cfg["max_position_embeddings"], u32
    yield "embedding_length", cfg["hidden_size"], u32
    if not moe:
        yield "feed_forward_length", cfg["intermediate_size"], u32
    yield "attention.head_count", cfg["num_attention_heads"], u32
    yield "attention.head_count_kv", cfg["num_key_value_heads"], u32
    if hybrid:  # padded to the four sections llama.cpp reads
        sections = list(cfg["mrope_section"])
        yield "rope.dimension_sections", sections + [0] * (4 - len(sections)), "int32"
    yield "rope.freq_base", cfg["rope_theta"], "float32"
    yield "attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"], "float32"
    if moe:
        yield "expert_count", cfg["num_experts"], u32
        yield "expert_used_count", cfg["num_experts_per_tok"], u32
    yield "attention.key_length", cfg["head_dim"], u32
    yield "attention.value_length", cfg["head_dim"], u32
    if moe:
        yield "expert_feed_forward_length", cfg["moe_intermediate_size"], u32
        yield "expert_shared_feed_forward_length", cfg["shared_expert_intermediate_size"], u32
    if not hybrid:
        return
    if n_blocks > cfg["num_hidden_layers"]:
        yield "nextn_predict_layers", n_blocks - cfg["num_hidden_layers"], u32
    yield "ssm.conv_kernel", cfg["linear_conv_kernel_dim"], u32
    yield "ssm.state_size", cfg["linear_key_head_dim"], u32
    yield "ssm.group_count", cfg["linear_num_key_heads"], u32
    yield "ssm.time_step_rank", cfg["linear_num_value_heads"], u32
    yield "ssm.inner_size", cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"], u32
    yield "attention.recurrent_layers", [is_recurrent(cfg, i) for i in range(n_blocks)], "bool"
    yield "full_attention_interval", cfg["full_attention_interval"], u32
    yield "rope.dimension_count", int(cfg["head_dim"] * cfg["partial_rotary_factor"]), u32


def vocab(tokenizer_dir: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """tokenizer.ggml.tokens and token_type as the converter's get_vocab_base makes them:
    ids the tokenizer lacks up to `vocab_size` are "[PAD<id>]" (UNUSED), added tokens are
    CONTROL when special or shaped "<|...|>", else USER_DEFINED; the rest NORMAL."""
    import tokenizers
    from gguf import TokenType

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = tok.get_added_tokens_decoder()
    if max(by_id) >= vocab_size:
        raise ValueError(f"the tokenizer has id {max(by_id)}, beyond vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            continue
        token = by_id[i]
        tokens.append(token)
        if i not in added:
            types.append(TokenType.NORMAL)
        elif added[i].special or (token.startswith("<|") and token.endswith("|>")):
            types.append(TokenType.CONTROL)
        else:
            types.append(TokenType.USER_DEFINED)
    return tokens, [int(t) for t in types]


def special_vocab(tokenizer_dir: Path, n_vocab: int, arch: str, chat_template: str | None) -> Any:
    """The converter's gguf.SpecialVocab for the tokenizer: merges, bos/eos/padding ids,
    add_*_token flags and the chat template (`chat_template` replacing the tokenizer's)."""
    import json

    import gguf

    special = gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=n_vocab)
    if arch != "qwen3":  # Qwen3.6's config.json names no bos token
        special.special_token_ids.pop("bos", None)
    # the converter's newer SpecialVocab (gguf-py in llama.cpp) states both flags for a
    # byte-level post-processor, where the released gguf package leaves eos out
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    processor = tokenizer.get("post_processor") or {}
    if any(p.get("type") == "ByteLevel" for p in processor.get("processors", [processor])):
        special.add_special_token.setdefault("bos", False)
        special.add_special_token.setdefault("eos", False)
    if chat_template is not None:
        special.chat_template = chat_template
    return special
