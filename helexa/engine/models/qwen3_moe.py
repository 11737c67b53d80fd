"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3 attention, sparse expert MLPs."""

from __future__ import annotations

from torch import nn

from helexa.engine.layers.moe import SparseMoE, sparse_moe
from helexa.engine.models.config import ModelConfig
from helexa.engine.models.llama import MLP, LlamaForCausalLM
from helexa.engine.models.qwen3 import Qwen3DecoderLayer


def num_experts(hf: dict) -> int:
    # config.json says num_experts; transformers 5 writes num_local_experts for qwen3_moe
    return hf.get("num_experts") or hf.get("num_local_experts") or 0


def moe_block(cfg: ModelConfig, *, norm_topk_prob: bool, shared: bool = False) -> SparseMoE:
    """The sparse MLP of a layer as the config describes it (router top-k, normalisation,
    Qwen3.5's gated shared expert). Experts are `partial`: under tensor parallel the block
    sums the ranks' outputs once, after combining them."""
    hf = cfg.hf
    inter = hf["moe_intermediate_size"]
    return sparse_moe(
        cfg.hidden_size,
        [MLP(cfg, inter, partial=True) for _ in range(num_experts(hf))],
        top_k=hf["num_experts_per_tok"],
        norm_topk_prob=norm_topk_prob,
        shared_expert=(
            MLP(cfg, hf["shared_expert_intermediate_size"], partial=True) if shared else None
        ),
    )


def is_sparse_layer(cfg: ModelConfig, index: int) -> bool:
    hf = cfg.hf
    step = hf.get("decoder_sparse_step") or 1
    return (
        index not in (hf.get("mlp_only_layers") or [])
        and num_experts(hf) > 0
        and (index + 1) % step == 0
    )


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, cfg: ModelConfig, index: int) -> nn.Module:
        if not is_sparse_layer(cfg, index):
            return MLP(cfg)
        # HF's default is no renormalisation; the released checkpoints turn it on
        return moe_block(cfg, norm_topk_prob=bool(cfg.hf.get("norm_topk_prob", False)))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
