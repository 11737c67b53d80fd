"""Tiny random HF checkpoints built from the real fixture configs, for parity tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.shared_fixtures import FIXTURE_MODELS

# Fixture config → what it exercises.
FAMILIES = {
    "smollm2": "SmolLM2-135M-Instruct",  # llama, GQA 9/3 → shrunk 4/2, tied
    "llama3": "Llama-3.2-3B-Instruct",  # llama, rope_scaling llama3, tied
    "qwen2": "Qwen2.5-0.5B-Instruct",  # qkv bias, tied
    "qwen2_untied": "DeepSeek-R1-Distill-Qwen-32B",  # qkv bias, untied lm_head
    "qwen3": "Qwen3-0.6B",  # q/k RMSNorm, explicit head_dim
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def shrunk_config(family: str, **overrides) -> dict:
    cfg = json.loads((FIXTURE_MODELS / FAMILIES[family] / "config.json").read_text())
    cfg.update(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        initializer_range=0.2,  # peaked logits: greedy ties become rare
    )
    if "head_dim" in cfg:
        cfg["head_dim"] = 32  # != hidden/heads, as in Qwen3
    cfg.pop("torch_dtype", None)
    cfg.update(overrides)
    return cfg


def make_tiny_model(family: str, root: Path, *, seed: int = 0, shard: bool = False, **overrides):
    """Write an HF-layout dir (config, safetensors, SmolLM2 tokenizer); return (dir, hf_model)."""
    import transformers

    cfg_dict = shrunk_config(family, **overrides)
    config = transformers.AutoConfig.for_model(**cfg_dict)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # Random norms too, so a misplaced norm weight cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    out = root / family
    model.save_pretrained(out, safe_serialization=True, max_shard_size="200KB" if shard else "2GB")
    for f in TOKENIZER_FILES:
        shutil.copyfile(FIXTURE_MODELS / "SmolLM2-135M-Instruct" / f, out / f)
    return out, model


def hub_snapshot(hub: Path, repo_id: str, revision: str = "abc123") -> Path:
    """An empty snapshot dir laid out as huggingface_hub caches `repo_id` under `hub`."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    return snap


def run_offline(code: str, *args: str, **env: str):
    """Run `code` in a fresh interpreter with HF_HUB_OFFLINE=1 plus `env` (hub settings
    are read at import time, so each case needs its own process)."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


# ---- the families without a fixture config: built from transformers' config classes --------

HYBRID_TEXT = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two value heads per key head, as the real models group them
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_conv_kernel_dim=4,
    # both layer types, neither first nor only
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_hidden_layers=4,
    rms_norm_eps=1e-6,
    # 0.1, not 0.2: at 0.2 a random hybrid model amplifies fp32 rounding (l2-normed q/k of
    # near-zero vectors) so much that transformers' own chunked and recurrent paths differ
    # by 8e-4 in the logits; at 0.1 they agree to 3e-5, so a 1e-4 bound still means something
    initializer_range=0.1,
    max_position_embeddings=4096,
)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)  # 6: not a power of 2
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)


def _hf_model(kind: str, vocab_size: int, **overrides):
    """An HF model of `kind` with tiny random weights; text-only kinds are CausalLMs.
    `overrides` change qwen3_moe's config."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_5 import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5TextConfig,
    )
    from transformers.models.qwen3_5_moe import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    text = dict(HYBRID_TEXT, vocab_size=vocab_size, tie_word_embeddings=False)
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            norm_topk_prob=True,
            initializer_range=0.2,
            max_position_embeddings=4096,
            # a dense layer between sparse ones, unless overridden (a GGUF cannot state it)
            **{"mlp_only_layers": [1], **MOE, **overrides},
        )
        return Qwen3MoeForCausalLM(config)
    if kind == "qwen3_5":
        config = Qwen3_5Config(text_config=dict(text, intermediate_size=96), vision_config=VISION)
        return Qwen3_5ForConditionalGeneration(config)
    if kind == "qwen3_5_text":
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text, intermediate_size=96))
    if kind == "qwen3_5_moe":
        moe = dict(text, **MOE, shared_expert_intermediate_size=48)
        config = Qwen3_5MoeConfig(text_config=moe, vision_config=VISION)
        return Qwen3_5MoeForConditionalGeneration(config)
    raise ValueError(kind)


def tiny_hf_model(kind: str, *, seed: int = 0, vocab_size: int = 512, **overrides):
    """`kind` with tiny random weights, in fp32 and eval mode (see _hf_model)."""
    torch.manual_seed(seed)
    model = _hf_model(kind, vocab_size, **overrides).float()
    with torch.no_grad():  # random norms and gating parameters, so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def make_tiny_new_family(
    kind: str, root: Path, *, seed: int = 0, vocab_size: int = 512, tokenizer: str = "Qwen3-0.6B"
):
    """Write `kind` (qwen3_moe, qwen3_5, qwen3_5_text, qwen3_5_moe) as save_pretrained lays it
    out, with a fixture tokenizer; return (dir, hf_model)."""
    model = tiny_hf_model(kind, seed=seed, vocab_size=vocab_size)
    out = root / kind
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(FIXTURE_MODELS / tokenizer / f, out / f)
    return out, model


# The Qwen3-0.6B tokenizer's vision tokens: the tiny vision models below use its ids
VISION_TOKENS = dict(
    image_token_id=151655, vision_start_token_id=151652, vision_end_token_id=151653
)
VISION_VOCAB = 151936  # Qwen3's embedding rows: every id the tokenizer knows has a row


def make_tiny_vision_model(kind: str, root: Path, *, seed: int = 0):
    """`kind` (qwen3_5, qwen3_5_moe) in the ConditionalGeneration layout with a small vision
    tower, the Qwen3 tokenizer (vocab rows for all its ids) and the real Qwen3.5 template as
    chat_template.jinja; return (dir, hf_model)."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5_moe import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    text = dict(HYBRID_TEXT, vocab_size=VISION_VOCAB, tie_word_embeddings=False)
    vision = dict(VISION, depth=2)
    torch.manual_seed(seed)
    if kind == "qwen3_5":
        config = Qwen3_5Config(
            text_config=dict(text, intermediate_size=96), vision_config=vision, **VISION_TOKENS
        )
        model = Qwen3_5ForConditionalGeneration(config)
    elif kind == "qwen3_5_moe":
        moe = dict(text, **MOE, shared_expert_intermediate_size=48)
        config = Qwen3_5MoeConfig(text_config=moe, vision_config=vision, **VISION_TOKENS)
        model = Qwen3_5MoeForConditionalGeneration(config)
    else:
        raise ValueError(kind)
    model = model.float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    out = root / f"{kind}_vision"
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(FIXTURE_MODELS / "Qwen3-0.6B" / f, out / f)
    shutil.copyfile(FIXTURE_MODELS / "Qwen3.5-4B" / "Qwen3.5-4B.jinja", out / "chat_template.jinja")
    return out, model
