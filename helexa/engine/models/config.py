"""The dimensions every decoder family shares, read from an HF-style config dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hf: dict[str, Any]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        heads = cfg["num_attention_heads"]
        # transformers >= 5 writes rope settings under "rope_parameters".
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        hidden = cfg["hidden_size"]
        return cls(
            model_type=cfg["model_type"],
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            # sparse-only models (qwen3_5_moe) state just the experts' size
            intermediate_size=cfg.get("intermediate_size") or cfg.get("moe_intermediate_size"),
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hf=cfg,
        )
