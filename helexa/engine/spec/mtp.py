"""The multi-token-prediction head of Qwen3.5 / Qwen3.6 checkpoints (vLLM's "mtp" method):
one more decoder layer, trained to read the target's last hidden state at position i with
the embedding of token i+1 and to predict token i+2.

At position i (vLLM's Qwen3_5MultiTokenPredictor):
  e = pre_fc_norm_embedding(embed_tokens(token[i+1]))
  h = pre_fc_norm_hidden(target_hidden[i])      # the target's output, after its final norm
  x = fc([e, h])                                # [2H] -> [H]: the embedding first
  x = layers.0(x)                               # a full-attention layer of the target's kind
  out = norm(x)                                 # logits: the target's lm_head(out)
The head shares the target's embed_tokens, lm_head and rotary; its own weights are the
checkpoint's `mtp.*` tensors (its RMSNorms, as the target's, store offsets from one).
Under tensor parallel the head is built whole (`parallel.unsharded`) and runs on rank 0
alone, as a draft model does: the target's embeddings and lm_head are split by vocabulary
there (each lookup a collective of every rank), so rank 0 holds whole copies of them
(`WholeVocab`, read from the checkpoint) for the head, and reads the target's hidden states,
which every rank holds whole after each layer's all-reduce. For a
draft past the first, `out` stands in for the target's hidden state at the next position
(vLLM does the same when a draft is longer than the checkpoint's MTP layers).

`naive_mtp` is the head in plain float32 torch, over a whole sequence, straight from the
checkpoint's tensors; `naive_propose` drafts with it: the references the tests hold the
engine's head and drafter to.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from helexa.engine.layers.attention import AttentionContext, PagedAttention
from helexa.engine.layers.linear import Linear
from helexa.engine.layers.norm import RMSNorm
from helexa.engine.layers.rotary import RotaryEmbedding
from helexa.engine.loader import prequant
from helexa.engine.loader.hf import iter_safetensors, read_json, safetensors_files
from helexa.engine.loader.load import default_dtype
from helexa.engine.models.llama import (
    Embedding,
    _fuse,
    _load_one,
    _owner,
    _share_tied,
    _stacked_names,
)
from helexa.engine.models.qwen3_5 import Qwen3_5ForCausalLM
from helexa.engine.parallel import tp, unsharded

if TYPE_CHECKING:
    from helexa.engine.engine_args import EngineArgs
    from helexa.engine.loader.load import LoadedModel

PREFIX = "mtp."


class WholeVocab(nn.Module):
    """The target's embeddings and lm_head, whole, for a head that runs on rank 0 alone under
    tensor parallel (the target's own are split by vocabulary across the ranks)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(vocab_size, hidden_size)
        self.lm_head = Linear(hidden_size, vocab_size, False)

    def compute_logits(self, hidden: torch.Tensor, seqs: list | None = None) -> torch.Tensor:
        return self.lm_head(hidden)

    def load(self, weights, target: Qwen3_5ForCausalLM, *, dtype: torch.dtype, quant, dense):
        """From the checkpoint's (name, tensor) pairs, the target's embeddings and lm_head
        (its tied table for both where the config ties them)."""
        found: dict[str, torch.Tensor] = {}
        for name, w in weights:
            path = next(
                (name[len(p) :] for p in target.weight_prefixes if name.startswith(p)), name
            )
            if path in ("embed_tokens.weight", "lm_head.weight"):
                found[path.split(".")[0]] = w
        tied = target.config.tie_word_embeddings
        if "embed_tokens" not in found or not (tied or "lm_head" in found):
            raise ValueError("the checkpoint's embed_tokens / lm_head weights were not found")
        _load_one(self.embed_tokens, "weight", found["embed_tokens"], dtype, None, False)
        head = found["embed_tokens"] if tied else found["lm_head"]
        _load_one(self.lm_head, "weight", head, dtype, quant, dense)
        if tied:
            _share_tied(self.embed_tokens, self.lm_head)


class MtpHead(nn.Module):
    """The head's own layers; the target's embeddings, lm_head and rotary it reads are held
    outside its submodules (they belong to the target, and are counted once). `vocab`: whole
    copies of the embeddings and lm_head to read instead (under tensor parallel), a submodule
    (the head's own memory)."""

    def __init__(self, target: Qwen3_5ForCausalLM, vocab: WholeVocab | None = None) -> None:
        super().__init__()
        cfg = target.config
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        # the target's layer class, built as a full-attention layer whatever its index
        full = dataclasses.replace(cfg, hf={**cfg.hf, "layer_types": ["full_attention"]})
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps)
        self.fc = Linear(2 * hidden, hidden)
        self.layers = nn.ModuleList([target.layer_cls(full, 0)])
        self.norm = RMSNorm(hidden, eps)
        self.__dict__["target"] = target  # past nn.Module.__setattr__: not a submodule
        if vocab is not None:
            self.vocab = vocab
        # where the embeddings and lm_head are read: the target's, or whole copies
        self.__dict__["reads"] = target if vocab is None else vocab

    @property
    def rotary(self) -> RotaryEmbedding:
        return self.target.rotary

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [self.layers[0].self_attn.attn]

    def forward(
        self,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """next_ids [n] (the token after each position), hidden [n, H] (the target's at each
        position, or the head's own for a later draft) -> the head's out [n, H]."""
        e = self.pre_fc_norm_embedding.forward(self.reads.embed_tokens(next_ids))
        h = self.pre_fc_norm_hidden.forward(hidden.to(e.dtype))
        x = self.fc.forward(torch.cat((e, h), dim=-1))
        x, residual = self.layers[0].forward(x, None, ctx)
        return self.norm.forward_residual(x, residual)[0]

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.reads.compute_logits(out, None)

    def load_weights(self, weights, *, dtype: torch.dtype, quant: str | None, dense: bool):
        """Place the checkpoint's `mtp.*` tensors (as the target places its own: norms get
        their offset from one, experts stacked, a quant kind applied alike)."""
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        offset = self.target.norm_weight_offset
        for name, src in weights:
            path = name.removeprefix(PREFIX)
            mod_path, kind = _owner(modules, path)
            mod = modules[mod_path]
            if mod is self or not kind:
                raise ValueError(f"unexpected MTP weight {name!r}")
            if hasattr(mod, "load_stacked"):  # moe.Experts: one tensor for all experts
                mod.load_stacked(kind, src, dtype=dtype, quant=quant, dense=dense)
                loaded.update(_stacked_names(mod_path, kind, mod.num_experts))
                continue
            _load_one(mod, kind, src, dtype, quant, dense, offset)
            loaded.add(path)
        # what the target expects of its own modules, asked of the head's (a whole
        # vocabulary's copies are loaded on their own)
        expected = [
            n
            for n in Qwen3_5ForCausalLM._expected_weights(self)  # type: ignore[arg-type]
            if not n.startswith("vocab.")
        ]
        missing = sorted(set(expected) - loaded)
        if missing:
            raise ValueError(
                f"checkpoint is missing {len(missing)} MTP weights, e.g. "
                f"{[PREFIX + m for m in missing[:3]]}"
            )
        _fuse(self)


def load_mtp(args: EngineArgs, device: torch.device, target: LoadedModel) -> MtpHead:
    """The target checkpoint's MTP head, loaded on `device` as the target was; ValueError
    where there is none to load (another family, a GGUF file, no `mtp.*` tensors)."""
    model = target.model
    if not isinstance(model, Qwen3_5ForCausalLM):
        raise ValueError(
            f"speculative_method 'mtp' needs a checkpoint with a multi-token-prediction head "
            f"(Qwen3.5 / Qwen3.6); {target.config.model_type!r} has none"
        )
    if target.source_format != "safetensors":
        raise ValueError(
            f"speculative_method 'mtp' reads the MTP head from the HF safetensors checkpoint; "
            f"this model is a {target.source_format} file, which does not carry it here: "
            "load the HF checkpoint, or use speculative_method 'ngram'"
        )
    layers = target.config.hf.get("mtp_num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"an MTP head of {layers} layers is not supported; supported: 1")
    hf_cfg = read_json(target.path / "config.json")
    split = tp().enabled  # the target's vocabulary is split: the head reads whole copies
    vocab_names = ("embed_tokens.weight", "lm_head.weight")
    names = (
        (n, w)
        for n, w in iter_safetensors(safetensors_files(target.path))
        if n.startswith(PREFIX) or (split and n.endswith(vocab_names))
    )
    tensors = list(
        prequant.gather(((n, w.to(device)) for n, w in names), prequant.scheme_of(hf_cfg))
    )
    own = [(n, w) for n, w in tensors if n.startswith(PREFIX)]
    if not own:
        raise ValueError(
            f"speculative_method 'mtp': the checkpoint at {target.path} has no MTP weights "
            f"({PREFIX}*); use speculative_method 'ngram', or a checkpoint that ships them"
        )
    dtype = args.torch_dtype(device) or default_dtype(device)  # the target's, as the engine
    dense = args.cpu_dense_copy and device.type == "cpu"
    with unsharded() if split else contextlib.nullcontext():  # rank 0's whole head
        vocab = None
        if split:
            cfg = model.config
            vocab = WholeVocab(cfg.vocab_size, cfg.hidden_size)
            others = [(n, w) for n, w in tensors if not n.startswith(PREFIX)]
            vocab.load(others, model, dtype=dtype, quant=args.quant, dense=dense)
        head = MtpHead(model, vocab)
        head.load_weights(own, dtype=dtype, quant=args.quant, dense=dense)
    return head.to(device).eval()


# -- the reference, in plain torch ----------------------------------------------------------


def naive_mtp(
    weights: dict[str, torch.Tensor],
    cfg: dict,
    embed: torch.Tensor,
    next_ids: torch.Tensor,
    hidden: torch.Tensor,
) -> torch.Tensor:
    """The head over a whole sequence from position 0, in float32: `weights` the checkpoint's
    `mtp.*` tensors (names without the prefix, norms as stored), `cfg` the text config,
    `embed` the target's table, next_ids [n] the token after each position, hidden [n, H]
    the target's final hidden states -> out [n, H] (see the module's docstring)."""
    w = {k: v.float() for k, v in weights.items()}
    eps = cfg.get("rms_norm_eps", 1e-6)

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w[name])

    e = norm(embed.float()[next_ids], "pre_fc_norm_embedding.weight")
    h = norm(hidden.float(), "pre_fc_norm_hidden.weight")
    x = torch.cat((e, h), dim=-1) @ w["fc.weight"].T
    p = "layers.0."
    x = x + _naive_attention(w, cfg, norm(x, p + "input_layernorm.weight"), norm)
    x = x + _naive_mlp(w, cfg, norm(x, p + "post_attention_layernorm.weight"))
    return norm(x, "norm.weight")


def _naive_attention(w: dict, cfg: dict, x: torch.Tensor, norm) -> torch.Tensor:
    """Qwen3.5's gated full attention, causal over positions 0..n-1."""
    p = "layers.0.self_attn."
    n, heads, kv = x.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    qg = (x @ w[p + "q_proj.weight"].T).view(n, heads, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]
    k = (x @ w[p + "k_proj.weight"].T).view(n, kv, d)
    v = (x @ w[p + "v_proj.weight"].T).view(n, kv, d)
    q, k = norm(q, p + "q_norm.weight"), norm(k, p + "k_norm.weight")
    rope = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
    rd = int(d * rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    inv = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd)
    angles = torch.arange(n, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(),) * 2, -1)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        r = t[..., :rd]
        half = torch.cat((-r[..., rd // 2 :], r[..., : rd // 2]), -1)
        return torch.cat((r * cos[:, None] + half * sin[:, None], t[..., rd:]), -1)

    q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    return (o * torch.sigmoid(gate.reshape(n, heads * d))) @ w[p + "o_proj.weight"].T


def _naive_mlp(w: dict, cfg: dict, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU; for qwen3_5_moe, the renormalised top-k experts and the gated shared expert."""
    p = "layers.0.mlp."

    def swiglu(q: str, x: torch.Tensor) -> torch.Tensor:
        gate, up = x @ w[q + "gate_proj.weight"].T, x @ w[q + "up_proj.weight"].T
        return (F.silu(gate) * up) @ w[q + "down_proj.weight"].T

    if p + "gate.weight" not in w:
        return swiglu(p, x)
    probs = (x @ w[p + "gate.weight"].T).softmax(-1)
    top, ids = probs.topk(cfg["num_experts_per_tok"], dim=-1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        for weight, e in zip(top[row].tolist(), ids[row].tolist(), strict=True):
            xe = x[row : row + 1]
            if p + "experts.gate_up_proj" in w:  # transformers' fused layout: [E, 2I, H]
                gate, up = (xe @ w[p + "experts.gate_up_proj"][e].T).chunk(2, dim=-1)
                y = (F.silu(gate) * up) @ w[p + "experts.down_proj"][e].T
            else:
                y = swiglu(f"{p}experts.{e}.", xe)
            out[row] += weight * y[0]
    shared = swiglu(p + "shared_expert.", x)
    return out + torch.sigmoid(x @ w[p + "shared_expert_gate.weight"].T) * shared


def naive_propose(
    weights: dict[str, torch.Tensor],
    cfg: dict,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    tokens: list[int],
    hidden: torch.Tensor,
    k: int,
) -> tuple[list[int], list[torch.Tensor]]:
    """The head's k drafts after `tokens` (n of them; hidden [n-1, H], the target's at
    positions 0..n-2), each the argmax of its logits, the head's own out standing in for the
    target's hidden state past the last; and the logits of each draft."""
    ids, hid = list(tokens[1:]), hidden.float()
    drafts: list[int] = []
    logits: list[torch.Tensor] = []
    for _ in range(k):
        out = naive_mtp(weights, cfg, embed, torch.tensor(ids), hid)
        row = out[-1] @ lm_head.float().T
        drafts.append(int(row.argmax()))
        logits.append(row)
        ids.append(drafts[-1])
        hid = torch.cat((hid, out[-1:]))
    return drafts, logits
