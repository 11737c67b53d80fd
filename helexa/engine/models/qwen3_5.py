"""Qwen3.5 / Qwen3.6 (`qwen3_5`, `qwen3_5_moe`): a hybrid of Gated DeltaNet linear attention
and gated full attention, as HF ships them.

- `layer_types` says which layers mix tokens with `linear_attn` (GatedDeltaNet, a recurrent
  state per sequence) and which with `self_attn` (paged KV cache). Typically three of four
  are linear.
- Full attention: q_proj yields each head's query and an output gate side by side; q/k get a
  per-head RMSNorm; rotary covers only the first `partial_rotary_factor` of each head; the
  output is multiplied by sigmoid(gate) before o_proj. Text positions are the same on M-RoPE's
  three axes, so M-RoPE reduces to plain rotary here.
- RMSNorms are `(1 + w)`: the stored weights are offsets from one (`norm_weight_offset`).
- The conditional-generation checkpoint keeps the decoder under `model.language_model.*` and a
  vision tower under `model.visual.*` (helexa/engine/vision/tower.py), loaded when its
  config has a `vision_config` and its weights are there: the model then takes images, and
  positions them with M-RoPE (vision/mrope.py; text alone reduces it to plain rotary). The
  text-only layouts (`qwen3_5_text`, `qwen3_5_moe_text`) keep the decoder under `model.*`.
- `qwen3_5_moe`: every layer's MLP is sparse, top-k renormalised, plus a gated shared expert.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from helexa import kernels
from helexa.engine.layers.attention import AttentionContext, PagedAttention
from helexa.engine.layers.gated_deltanet import GatedDeltaNet
from helexa.engine.layers.norm import RMSNorm
from helexa.engine.layers.rotary import RotaryEmbedding
from helexa.engine.models.config import ModelConfig
from helexa.engine.models.llama import MLP, Attention, LlamaForCausalLM, output_rows
from helexa.engine.models.qwen3_moe import moe_block
from helexa.engine.vision.inputs import VisionProfile
from helexa.engine.vision.tower import VisionTower

if TYPE_CHECKING:
    from helexa.engine.tokenizer import Tokenizer

LAYER_TYPES = ("linear_attention", "full_attention")
VISUAL_PREFIX = "model.visual."
MROPE_SECTION = (11, 11, 10)  # the reference's default: t, h, w frequencies of 32


def rotary_dim(cfg: ModelConfig) -> int:
    rope = cfg.hf.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", cfg.hf.get("partial_rotary_factor", 1.0))
    return int(cfg.head_dim * factor)


class GatedAttention(Attention):
    """Full attention of Qwen3.5: output gated per element by sigmoid(q_proj's gate half)."""

    qk_norm = True
    q_parts = 2

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        # x: [num_tokens, hidden]
        n = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        if hasattr(self, "qkv_proj"):
            qkv = self.qkv_proj.forward(x)
        else:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        qg, k, v = qkv.split([h * 2 * d, kvh * d, kvh * d], dim=-1)
        qg = qg.view(n, h, 2 * d)  # per head: query, then gate
        q, gate = qg[..., :d], qg[..., d:]
        q, k = self.q_norm.forward(q), self.k_norm.forward(k.view(n, kvh, d))
        q, k = kernels.rotary(q, k, ctx.cos, ctx.sin)  # cos, sin [n, 1, rotary_dim]: partial
        o = self.attn.forward(q, k, v.view(n, kvh, d), ctx)  # [n, h, d]
        o = o.reshape(n, h * d) * torch.sigmoid(gate.reshape(n, h * d))
        return self.o_proj.forward(o)


class Qwen3_5DecoderLayer(nn.Module):
    sparse = False  # qwen3_5_moe: a routed MLP with a shared expert

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.layer_type = cfg.hf["layer_types"][index]
        if self.layer_type not in LAYER_TYPES:
            raise ValueError(
                f"unsupported layer type {self.layer_type!r}; supported: {LAYER_TYPES}"
            )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_linear = self.layer_type == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg.hf, cfg.hidden_size, cfg.rms_norm_eps)
        else:
            self.self_attn = GatedAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.sparse:
            self.mlp: nn.Module = moe_block(cfg, norm_topk_prob=True, shared=True)
        else:
            self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: AttentionContext,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As llama.DecoderLayer.forward: the residual add fused into each norm; the mixer
        over every row (its cache and recurrent state take them all), the rest over `rows`."""
        mixer = self.linear_attn if self.is_linear else self.self_attn
        x, residual = self.input_layernorm.forward_residual(x, residual)
        x, residual = output_rows(mixer.forward(x, ctx), residual, rows)
        if not x.shape[0]:
            return x, residual
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual


class Qwen3_5MoeDecoderLayer(Qwen3_5DecoderLayer):
    sparse = True


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3_5DecoderLayer
    weight_prefixes = ("model.language_model.", "model.")
    skipped_weight_prefixes = ("model.visual.", "mtp.")
    norm_weight_offset = 1.0

    @classmethod
    def build(
        cls, hf_config: dict[str, Any], tokenizer: Tokenizer, *, max_position: int | None = None
    ) -> Qwen3_5ForCausalLM:
        """From config.json: the decoder's settings sit in `text_config` when there is one."""
        text = dict(hf_config.get("text_config") or hf_config)
        text["model_type"] = hf_config["model_type"]
        text.setdefault("tie_word_embeddings", hf_config.get("tie_word_embeddings", False))
        num_layers = text["num_hidden_layers"]
        if len(text.get("layer_types") or ()) < num_layers:
            interval = text.get("full_attention_interval", 4)
            text["layer_types"] = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(num_layers)
            ]
        model = cls(ModelConfig.from_hf(text), max_position=max_position)
        if hf_config.get("vision_config") is not None:
            model.visual = VisionTower(hf_config["vision_config"])
            rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
            model.rotary.with_mrope(list(rope.get("mrope_section") or MROPE_SECTION))
        return model

    def __init__(self, cfg: ModelConfig, max_position: int | None = None) -> None:
        super().__init__(cfg, max_position)
        self.rotary = RotaryEmbedding(
            rotary_dim(cfg), self.max_position, cfg.rope_theta, cfg.rope_scaling
        )
        self.visual: VisionTower | None = None  # build(): with the checkpoint's vision_config
        self.vision_profile: VisionProfile | None = None  # set by the loader with the tower

    def load_weights(
        self, weights: Iterable[tuple[str, Any]], *, dtype: torch.dtype, **kwargs: Any
    ) -> None:
        """The decoder's weights as every model's; `model.visual.*` into the tower, kept in
        `dtype` unquantized (a few hundred MB beside a decoder of billions). A checkpoint
        without them serves text only."""
        if self.visual is None:
            super().load_weights(weights, dtype=dtype, **kwargs)
            return
        tower: list[tuple[str, torch.Tensor]] = []

        def decoder() -> Iterable[tuple[str, Any]]:
            for name, src in weights:
                if name.startswith(VISUAL_PREFIX):
                    tower.append((name[len(VISUAL_PREFIX) :], src))
                else:
                    yield name, src

        super().load_weights(decoder(), dtype=dtype, **kwargs)
        if not tower:
            self.visual = None
            return
        self.visual.to(dtype)
        missing = sorted(
            {n for n, _ in self.visual.named_parameters()} - self.visual.load_weights(tower)
        )
        if missing:
            raise ValueError(
                f"checkpoint is missing {len(missing)} vision tower weights, e.g. {missing[:3]}"
            )

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers if hasattr(layer, "self_attn")]

    @property
    def recurrent_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.layers if hasattr(layer, "linear_attn")]


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    layer_cls = Qwen3_5MoeDecoderLayer
