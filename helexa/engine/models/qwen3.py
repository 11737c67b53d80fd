"""Qwen3 (dense): Llama with per-head RMSNorm on q and k before rotary."""

from __future__ import annotations

from helexa.engine.models.llama import Attention, DecoderLayer, LlamaForCausalLM


class Qwen3Attention(Attention):
    qk_norm = True


class Qwen3DecoderLayer(DecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
