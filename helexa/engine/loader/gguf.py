"""Load a GGUF file: HF-named (still quantized) tensors, an HF-style config and the tokenizer.

The file is memory-mapped through `gguf.GGUFReader`; tensors are torch views of that map and
are only dequantized when a layer asks for them.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import tokenizers
import torch
from tokenizers import decoders, models, normalizers, pre_tokenizers

from helexa.engine.loader import gguf_qwen35
from helexa.engine.loader.dequant import check_format
from helexa.engine.loader.gguf_tensor import GGUFTensor
from helexa.engine.tokenizer import Tokenizer

# llama.cpp architecture (`general.architecture`) -> HF `model_type` of the family that runs it
MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "qwen35": "qwen3_5_text",  # Qwen3.5 / Qwen3.6: Gated DeltaNet and gated attention
    "qwen35moe": "qwen3_5_moe_text",
}
SUPPORTED_ARCHS = tuple(MODEL_TYPES)
# Architectures whose files need more than the shared tables below: a module with
# `config(meta, arch, config)`, the HF keys of its own metadata, and `restore(tensors, config)`,
# its own tensor names and the converter's rewrites undone.
ARCH_FILES = {"qwen35": gguf_qwen35, "qwen35moe": gguf_qwen35}

# GGUF tensor stem -> HF module name; suffixes (.weight/.bias) carry over unchanged.
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    # Llama 3.x: per-frequency rope divisors in place of rope_scaling metadata
    "rope_freqs": "model.rotary_emb.freq_factors",
}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the MoE router [E, H]
}
# llama.cpp's stacked expert tensors [E, out, in] -> the HF-style stacked name the MoE layer
# loads (no `.weight`: it splits them into its per-expert Linears by rows, still quantized).
EXPERT_NAMES = {
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",  # --fuse-gate-up-exps: [E, 2I, H]
}
# `{arch}.<key>` -> HF config key, for the keys MoE files carry (each only where present)
MOE_KEYS = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


@dataclass(slots=True)
class GGUFModel:
    """Everything a GGUF file holds that the engine needs to build and run the model."""

    config: dict[str, Any]  # an HF config.json equivalent
    tensors: dict[str, GGUFTensor]  # keyed by HF name
    tokenizer: Tokenizer


def load_gguf(path: str | os.PathLike[str]) -> GGUFModel:
    """Read `path` (memory-mapped) into HF-named tensors, an HF config and a tokenizer."""
    # copy-on-write: tensors are writable views for torch, yet the file is never modified
    reader = gguf.GGUFReader(path, "c")
    meta = {name: field.contents() for name, field in reader.fields.items()}
    if int(meta.get("split.no", 0) or 0) != 0:
        count = int(meta.get("split.count", 0) or 0)
        raise ValueError(
            f"{Path(path).name} is part {int(meta['split.no']) + 1} of a {count}-part GGUF: "
            "load its first part (`...-00001-of-...gguf`); the others are read beside it"
        )
    arch = meta["general.architecture"]
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {list(SUPPORTED_ARCHS)}"
        )
    raw = {t.name: t for part in _parts(Path(path), meta, reader) for t in part}
    tensors = _split_gate_up(raw)
    config = _config(meta, arch, tensors)
    if (arch_file := ARCH_FILES.get(arch)) is not None:
        config = arch_file.config(meta, arch, config)
        tensors = arch_file.restore(tensors, config)
    if arch == "llama":  # only llama.cpp's llama converter permutes Q/K
        for tensor in tensors.values():
            _unpermute_qk(tensor, config)
    return GGUFModel(config=config, tensors=tensors, tokenizer=_tokenizer(meta, Path(path)))


_SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def _parts(path: Path, meta: dict[str, Any], first: Any) -> list[list[GGUFTensor]]:
    """Each part's tensors: the file alone, or, for a file llama.cpp split (`split.count`
    parts named `<stem>-0000k-of-0000n.gguf`, the metadata in the first), every part's. The
    path must be the first part; a part missing is an error naming it."""
    count = int(meta.get("split.count", 1) or 1)
    if count <= 1:
        return [list(map(_raw_tensor, first.tensors))]
    m = _SPLIT_NAME.match(path.name)
    if m is None:
        raise ValueError(
            f"{path.name} is the first of {count} GGUF parts, but not named as one "
            "(`<name>-00001-of-0000N.gguf`): its other parts cannot be found"
        )
    names = [f"{m['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [n for n in names[1:] if not (path.parent / n).exists()]
    if missing:
        raise ValueError(
            f"{path.name} is the first of {count} parts; missing beside it: {', '.join(missing)}"
        )
    parts = [list(map(_raw_tensor, first.tensors))]
    for name in names[1:]:
        reader = gguf.GGUFReader(path.parent / name, "c")
        parts.append(list(map(_raw_tensor, reader.tensors)))
    return parts


def _sentencepiece(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """A SentencePiece BPE vocabulary (`tokenizer.ggml.model` "llama": Llama 2, Mistral,
    and every model llama.cpp converts from a tokenizer.model) as the tokenizer
    transformers' LlamaConverter builds from the .model file: BPE with byte fallback, whose
    merges are every split of a piece into two pieces, ranked by the merged piece's score as
    SentencePiece merges them (the highest first); spaces as "▁", one in front of the text
    where `add_space_prefix` says (SentencePiece's add_dummy_prefix)."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] not in (_NORMAL, _USER_DEFINED) or len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            if a in vocab and b in vocab:
                ranked.append((-scores[i], i, vocab[a], vocab[b], (a, b)))
    ranked.sort()
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and unk_id < len(tokens) else None
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab, merges=[m[-1] for m in ranked], unk_token=unk, fuse_unk=True,
            byte_fallback=True,
        )
    )  # fmt: skip
    steps = [normalizers.Replace(" ", _SPACE)]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend(_SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace(_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1 if meta.get("tokenizer.ggml.add_space_prefix", True) else 0, 0),
        ]
    )
    return _with_typed_tokens(backend, tokens, types)


def hf_name(gguf_name: str) -> str:
    """The HF name of a GGUF tensor; names the table does not know stay as they are."""
    if m := _BLOCK_RE.fullmatch(gguf_name):
        if m[2] in BLOCK_NAMES:
            return f"model.layers.{m[1]}.{BLOCK_NAMES[m[2]]}.{m[3]}"
        if m[2] in EXPERT_NAMES and m[3] == "weight":
            return f"model.layers.{m[1]}.{EXPERT_NAMES[m[2]]}"
    if (m := _GLOBAL_RE.fullmatch(gguf_name)) and m[1] in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[m[1]]}.{m[2]}"
    return gguf_name


def _split_gate_up(tensors: dict[str, GGUFTensor]) -> dict[str, GGUFTensor]:
    """Fused stacked experts [E, 2I, H] (gate rows, then up rows) as gate_proj and up_proj
    [E, I, H], by whole rows of bytes."""
    out = {}
    for name, t in tensors.items():
        if not name.endswith(".experts.gate_up_proj"):
            out[name] = t
            continue
        experts, rows, cols = t.shape
        data = t.data.reshape(experts, rows, -1)
        for i, proj in enumerate(("gate_proj", "up_proj")):
            half = data[:, i * rows // 2 : (i + 1) * rows // 2].reshape(experts * rows // 2, -1)
            part = GGUFTensor(
                name[: -len("gate_up_proj")] + proj, t.qtype, (experts, rows // 2, cols), half
            )
            out[part.name] = part
    return out


def _raw_tensor(t: Any) -> GGUFTensor:
    qtype = t.tensor_type.name
    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
    check_format(qtype, shape)
    # every dim but the innermost counts rows: stacked experts [E, out, in] are E*out rows
    rows = math.prod(shape[:-1])
    data = torch.from_numpy(t.data.view(np.uint8)).reshape(rows, -1)
    return GGUFTensor(name=hf_name(t.name), qtype=qtype, shape=shape, data=data)


def unpermute_qk_rows(data: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: rows [head, dim/2, 2] -> [head, 2, dim/2].

    llama.cpp's converter interleaves each head's rotary halves (its rope rotates adjacent
    pairs); HF rotates halves. Rows are whole quant blocks, so this works on raw bytes too.
    """
    rows = data.shape[0]
    assert rows % (2 * num_heads) == 0, f"{rows} rows do not split into {num_heads} heads"
    heads = data.reshape(num_heads, rows // num_heads // 2, 2, *data.shape[1:])
    return heads.transpose(1, 2).reshape(data.shape).contiguous()


def _unpermute_qk(tensor: GGUFTensor, config: dict[str, Any]) -> None:
    module = tensor.name.rsplit(".", 2)[-2]
    if module not in ("q_proj", "k_proj"):
        return
    heads = config["num_attention_heads" if module == "q_proj" else "num_key_value_heads"]
    rows = tensor.shape[0]
    # a bias is a single row of bytes; give each element its own row so it permutes too
    by_rows = tensor.data.reshape(rows, -1)
    tensor.data = unpermute_qk_rows(by_rows, heads).reshape(tensor.data.shape)


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _config(meta: dict[str, Any], arch: str, tensors: dict[str, GGUFTensor]) -> dict[str, Any]:
    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden, heads = key("embedding_length"), key("attention.head_count")
    config = {
        "model_type": MODEL_TYPES[arch],
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", hidden // heads),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": key("context_length"),
        # the embedding's rows, not the token list: converters pad the vocab to this
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0],
        # llama.cpp writes output.weight only when it is not the embedding matrix
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
        "rope_scaling": _rope_scaling(meta, arch),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if key("expert_count"):
        config.update(_moe_config(key))
        # sparse-only files may state no dense size (or 0): fall back to the experts' size
        config["intermediate_size"] = config["intermediate_size"] or config.get(
            "moe_intermediate_size"
        )
    return config


def _moe_config(key: Callable[..., Any]) -> dict[str, Any]:
    """HF MoE keys from `{arch}.expert_*`. llama.cpp builds qwen3moe with every layer sparse
    and the top-k weights renormalised (the released Qwen3-MoE configs' norm_topk_prob), so
    those are the defaults; `expert_weights_norm`, where a file states it, wins."""
    moe = {hf_key: key(gguf_key) for gguf_key, hf_key in MOE_KEYS.items() if key(gguf_key)}
    moe["norm_topk_prob"] = bool(key("expert_weights_norm", True))
    moe["decoder_sparse_step"] = 1
    moe["mlp_only_layers"] = []
    return moe


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """HF `rope_scaling` from `{arch}.rope.scaling.*`; None when the file states none.

    Llama 3.1-style files state no keys: they ship the scaled frequencies as `rope_freqs.weight`.
    """
    prefix = f"{arch}.rope.scaling."
    kind = meta.get(prefix + "type", "none")
    if kind == "none" and prefix + "factor" not in meta:
        return None
    scaling: dict[str, Any] = {"rope_type": "linear" if kind == "none" else kind}
    for gguf_key, hf_key in (
        ("factor", "factor"),
        ("original_context_length", "original_max_position_embeddings"),
        ("attn_factor", "attention_factor"),
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
    ):
        if (value := meta.get(prefix + gguf_key)) is not None:
            scaling[hf_key] = _f32(value) if isinstance(value, float) else value
    return scaling


# ---- tokenizer -------------------------------------------------------------------------------

# Split regexes of the pre-tokenizers llama.cpp names in `tokenizer.ggml.pre` (from llama-vocab.cpp
# and the models' tokenizer.json files).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's (llama.cpp's `qwen35`, transformers' Qwen3_5Tokenizer): Qwen2's, with combining
# marks (\p{M}) kept inside words
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True, slots=True)
class _PreTokenizer:
    split: str | None = None  # None: GPT-2's own regex inside ByteLevel
    individual_digits: bool = False  # SmolLM: every digit its own pre-token
    ignore_merges: bool = False  # a pre-token already in the vocab is one token (Llama 3)
    nfc: bool = False  # Qwen2's tokenizer.json normalizes to NFC first

    def apply(self, backend: tokenizers.Tokenizer) -> None:
        steps: list[pre_tokenizers.PreTokenizer] = []
        if self.individual_digits:
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        if self.split:
            steps.append(pre_tokenizers.Split(tokenizers.Regex(self.split), behavior="isolated"))
        steps.append(
            pre_tokenizers.ByteLevel(
                add_prefix_space=False, trim_offsets=False, use_regex=self.split is None
            )
        )
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
        if self.nfc:
            backend.normalizer = normalizers.NFC()


_LLAMA3 = _PreTokenizer(split=_LLAMA3_SPLIT, ignore_merges=True)
_QWEN2 = _PreTokenizer(split=_QWEN2_SPLIT, nfc=True)
PRE_TOKENIZERS = {
    "default": _PreTokenizer(),
    "gpt2": _PreTokenizer(),
    "smollm": _PreTokenizer(individual_digits=True),
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "qwen35": _PreTokenizer(split=_QWEN35_SPLIT, nfc=True),
    "tekken": _PreTokenizer(split=_TEKKEN_SPLIT, ignore_merges=True),
}

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's types
_SPACE = "\u2581"  # SentencePiece's "▁": a space inside a piece


def _tokenizer(meta: dict[str, Any], gguf_path: Path) -> Tokenizer:
    """The tokenizer the metadata describes; a tokenizer.json beside the file wins for the vocab."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    beside = gguf_path.with_name("tokenizer.json")
    backend = tokenizers.Tokenizer.from_file(str(beside)) if beside.is_file() else _bpe(meta)

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and token_id < len(tokens) else None

    stop_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    return Tokenizer(
        backend=backend,
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        pad_token=token("padding_token_id"),
        unk_token=token("unknown_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=_chat_template(meta),
        eos_token_ids={
            meta[f"tokenizer.ggml.{k}"] for k in stop_keys if f"tokenizer.ggml.{k}" in meta
        },
    )


def _chat_template(meta: dict[str, Any]) -> str | dict[str, str] | None:
    """`tokenizer.chat_template`, or {name: template} when `tokenizer.chat_template.<name>` exist."""
    prefix = "tokenizer.chat_template."
    named = {k.removeprefix(prefix): v for k, v in meta.items() if k.startswith(prefix)}
    default = meta.get("tokenizer.chat_template")
    if not named:
        return default
    return named if default is None else {"default": default, **named}


def _bpe(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """Byte-level BPE from `tokenizer.ggml.tokens`/`merges`, split the way `pre` says; a
    SentencePiece vocabulary (`llama`) as `_sentencepiece` builds it."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        return _sentencepiece(meta)
    if kind != "gpt2":
        raise ValueError(
            f"cannot build a tokenizer from GGUF tokenizer model {kind!r} (supported: "
            "['gpt2', 'llama']); put the model's tokenizer.json beside the .gguf file"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"unknown GGUF pre-tokenizer {pre!r}; supported: {sorted(PRE_TOKENIZERS)}; "
            "put the model's tokenizer.json beside the .gguf file"
        )
    spec = PRE_TOKENIZERS[pre]
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    # byte-level tokens contain no spaces (a space is spelled "Ġ"), so each merge splits once
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=spec.ignore_merges)
    )
    spec.apply(backend)
    backend.decoder = decoders.ByteLevel()
    return _with_typed_tokens(backend, tokens, meta.get("tokenizer.ggml.token_type", ()))


def _with_typed_tokens(
    backend: tokenizers.Tokenizer, tokens: list[str], types
) -> tokenizers.Tokenizer:
    """`backend` with the vocabulary's control tokens (special) and user-defined ones added:
    matched whole, before any splitting."""
    typed = list(zip(tokens, types, strict=False))
    backend.add_special_tokens(
        [
            tokenizers.AddedToken(t, special=True, normalized=False)
            for t, k in typed
            if k == _CONTROL
        ]
    )
    backend.add_tokens(
        [tokenizers.AddedToken(t, normalized=False) for t, k in typed if k == _USER_DEFINED]
    )
    return backend
