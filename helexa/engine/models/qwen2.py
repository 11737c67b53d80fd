"""Qwen2 / Qwen2.5: Llama with biases on q, k and v (never on o)."""

from __future__ import annotations

from helexa.engine.models.llama import Attention, DecoderLayer, LlamaForCausalLM


class Qwen2Attention(Attention):
    qkv_bias = True


class Qwen2DecoderLayer(DecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2DecoderLayer
