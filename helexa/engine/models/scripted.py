"""`helexa_scripted`: a test architecture that emits a fixed script, one token per step.

config.json: {"model_type": "helexa_scripted", "script": "<text>"} (or "script_ids").
It runs a real (tiny) attention layer over the paged KV cache and its logits go through
the real sampler, so protocol tests exercise the whole pipeline deterministically:
the script's tokens in order, then eos, whatever the prompt.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from helexa.engine.layers.attention import AttentionContext, PagedAttention
from helexa.engine.models.config import ModelConfig
from helexa.engine.tokenizer import Tokenizer

_HIDDEN = 8
_PEAK = 1e4  # far above any penalty or temperature the sampler can apply


def scripted_hf_config(cfg: dict) -> dict:
    """Fill in the dimensions of the tiny internal layer."""
    return {
        "max_position_embeddings": 32768,
        **cfg,
        "hidden_size": _HIDDEN,
        "intermediate_size": _HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": _HIDDEN,
        "vocab_size": cfg.get("vocab_size", 0),
    }


class ScriptedForCausalLM(nn.Module):
    # Nothing is read from the checkpoint: the script is in config.json.
    source_format: str | None = "scripted"

    @classmethod
    def build(
        cls, hf_config: dict[str, Any], tokenizer: Tokenizer, *, max_position: int | None = None
    ) -> ScriptedForCausalLM:
        """The model for a `helexa_scripted` config.json; the tokenizer encodes its script."""
        return cls(ModelConfig.from_hf(scripted_hf_config(hf_config)), tokenizer)

    def __init__(self, cfg: ModelConfig, tokenizer: Tokenizer):
        super().__init__()
        self.config = cfg
        hf = cfg.hf
        if "script_ids" in hf:
            self.script_ids = [int(t) for t in hf["script_ids"]]
        elif "script" in hf:
            self.script_ids = tokenizer.encode(hf["script"])
        else:
            raise ValueError("helexa_scripted config needs 'script' or 'script_ids'")
        eos = hf.get("eos_token_id", tokenizer.eos_token_id)
        if eos is None:
            eos = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None
        if eos is None:
            raise ValueError("helexa_scripted: tokenizer has no eos token; set eos_token_id")
        self.eos_id = int(eos[0] if isinstance(eos, list) else eos)
        self.vocab_size = max(tokenizer.vocab_size, cfg.vocab_size, self.eos_id + 1)
        self.attn = PagedAttention(1, 1, _HIDDEN, scale=_HIDDEN**-0.5)
        self.embed = nn.Embedding(self.vocab_size, _HIDDEN)
        nn.init.normal_(self.embed.weight, generator=torch.Generator().manual_seed(0))
        self.embed.weight.requires_grad_(False)

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [self.attn]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        x = self.embed(input_ids).to(self.attn_dtype).unsqueeze(1)  # [n, 1, hidden]
        return self.attn(x, x, x, ctx).squeeze(1)

    def compute_logits(self, hidden: torch.Tensor, seqs: list | None = None) -> torch.Tensor:
        assert seqs is not None and len(seqs) == hidden.shape[0]
        logits = torch.zeros(hidden.shape[0], self.vocab_size, dtype=torch.float32)
        for i, seq in enumerate(seqs):
            step = seq.num_output_tokens
            token = self.script_ids[step] if step < len(self.script_ids) else self.eos_id
            logits[i, token] = _PEAK
        return logits.to(hidden.device)

    def load_weights(
        self,
        weights: Iterable,
        *,
        dtype: torch.dtype,
        quant: str | None = None,
        dense_copies: bool = False,
    ) -> None:
        self.attn_dtype = dtype

    def post_load(self) -> None:
        pass
