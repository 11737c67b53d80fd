"""Llama family (Llama 2/3, SmolLM2): the decoder the Qwen files build on."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from helexa import kernels
from helexa.engine.layers import native
from helexa.engine.layers.attention import AttentionContext, PagedAttention
from helexa.engine.layers.linear import (
    Linear,
    as_dense,
    column_parallel,
    fuse,
    int4_scales,
    kernel_layout,
    lm_head,
    planned_rows,
    row_parallel,
)
from helexa.engine.layers.norm import RMSNorm
from helexa.engine.layers.rotary import RotaryEmbedding
from helexa.engine.loader.gguf_shard import take_shard
from helexa.engine.models.config import ModelConfig
from helexa.engine.parallel import Shard, all_reduce, head_shard, tp, vocab_range
from helexa.kernels.quant_pack import GGUF_KINDS, QuantWeight, naive_dequantize

if TYPE_CHECKING:
    from helexa.engine.layers.linear import WeightSource
    from helexa.engine.tokenizer import Tokenizer


class Attention(nn.Module):
    qkv_bias: bool | None = None  # None: follow config.attention_bias
    qk_norm = False
    q_parts = 1  # per head, q_proj yields the query (Qwen3.5: and an output gate)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, d, qp = cfg.num_heads, cfg.head_dim, self.q_parts
        kvh, hidden = cfg.num_kv_heads, cfg.hidden_size
        bias = cfg.attention_bias if self.qkv_bias is None else self.qkv_bias
        # Tensor parallel: this rank's query heads and the KV heads they read (see
        # parallel.head_shard); q/k/v column-parallel by head, o_proj row-parallel.
        s = head_shard(h, kvh)
        q_rows, kv_rows = [(s.q_start * d * qp, s.q_end * d * qp)], [(s.kv_start * d, s.kv_end * d)]
        self.q_proj = column_parallel(hidden, h * d * qp, bias, rows=q_rows)
        self.k_proj = column_parallel(hidden, kvh * d, bias, rows=kv_rows)
        self.v_proj = column_parallel(hidden, kvh * d, bias, rows=kv_rows)
        self.o_proj = row_parallel(
            h * d, hidden, cfg.attention_bias and self.qkv_bias is None, what="attention heads"
        )
        h, kvh = s.q_end - s.q_start, s.kv_end - s.kv_start
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        if self.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.attn = PagedAttention(h, kvh, d, scale=d**-0.5)

    def fuse_projections(self) -> None:
        """Replace q/k/v by one matmul when their weights are held alike."""
        try:
            self.qkv_proj = fuse([self.q_proj, self.k_proj, self.v_proj])
        except ValueError:
            return
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        # x: [num_tokens, hidden]
        n = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        if hasattr(self, "qkv_proj"):
            qkv = self.qkv_proj.forward(x)
        else:  # weights held differently could not be fused (rare)
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        attn = self.attn
        if self.q_parts == 1 and ctx.cos is not None and native.usable(qkv, ctx.cos):
            norms = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
            eps = self.q_norm.eps if self.qk_norm else 0.0
            if _native_decode_step(ctx) and native.usable(caches=(attn.k_cache, attn.v_cache)):
                o = native.decode_attention(  # one C call for what follows (decode steps)
                    qkv, h, kvh, d, *norms, eps, ctx.cos, ctx.sin, ctx.slot_mapping,
                    attn.k_cache, attn.v_cache, ctx.decode_blocks, ctx.decode_lens, attn.scale,
                )  # fmt: skip
                return self.o_proj.forward(o)
            # prompt steps: the heads' norms and rotary in place, the rows over threads
            qkv = qkv.contiguous()
            native.qk_prepare(qkv, h, kvh, d, *norms, eps, ctx.cos, ctx.sin)
            q, k, v = qkv.view(n, h + 2 * kvh, d).split([h, kvh, kvh], dim=1)
        else:
            q, k, v = qkv.view(n, h + 2 * kvh, d).split([h, kvh, kvh], dim=1)
            if self.qk_norm:
                q, k = self.q_norm.forward(q), self.k_norm.forward(k)
            q, k = kernels.rotary(q, k, ctx.cos, ctx.sin)
        o = self.attn.forward(q, k, v, ctx)  # [num_tokens, num_heads, head_dim]
        return self.o_proj.forward(o.reshape(n, -1))


def _native_decode_step(ctx: AttentionContext) -> bool:
    """Whether the step is one the native CPU kernels may take whole: decode rows only, with
    their lengths on the torch path's block tables, and rotary tables."""
    return ctx.all_decode and ctx.decode_lens is not None and ctx.cos is not None


class MLP(nn.Module):
    """SwiGLU. Tensor parallel splits the intermediate size: gate/up column-parallel, down
    row-parallel. `partial`: down_proj's output is left as this rank's partial sum, for an
    owner that adds several up before one all-reduce (MoE experts, the shared expert)."""

    def __init__(
        self, cfg: ModelConfig, intermediate_size: int | None = None, *, partial: bool = False
    ) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        hidden, bias = cfg.hidden_size, cfg.mlp_bias
        self.gate_proj = column_parallel(hidden, inter, bias, what="intermediate_size")
        self.up_proj = column_parallel(hidden, inter, bias, what="intermediate_size")
        self.down_proj = row_parallel(
            inter, hidden, bias, reduce=not partial, what="intermediate_size"
        )

    def fuse_projections(self) -> None:
        try:
            self.gate_up_proj = fuse([self.gate_proj, self.up_proj])
        except ValueError:
            return
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate_up = self.gate_up_proj.forward(x)
            if native.usable(gate_up):
                return self.down_proj.forward(native.silu_mul(gate_up))
            return self.down_proj.forward(kernels.silu_and_mul(gate_up))
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj.forward(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    attention_cls: type[Attention] = Attention

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_cls(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.make_mlp(cfg, index)

    def make_mlp(self, cfg: ModelConfig, index: int) -> nn.Module:
        return MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: AttentionContext,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last layer's output (the embeddings for the first, residual None); residual:
        the residual stream before that output was added. Returns this layer's (x, residual):
        each norm adds the pending output into the stream as it normalises (one kernel on
        CUDA; on CPU the same `x + residual` as an unfused layer). `rows`: only those rows'
        outputs are wanted (see `output_rows`)."""
        if _native_decode_step(ctx):
            plan = self.native_layer_plan()
            if (
                plan is not None
                and plan.rows_ok[min(planned_rows(x.shape[0]), len(plan.rows_ok) - 1)]
                and native.usable(x, ctx.cos, caches=(plan.attn.k_cache, plan.attn.v_cache))
            ):
                return output_rows(*native.decode_layer(plan, x, residual, ctx), rows)
        # .forward() directly: Module.__call__'s hook machinery costs ~3 µs a call, and
        # decode makes hundreds of these calls per token.
        x, residual = self.input_layernorm.forward_residual(x, residual)
        x, residual = output_rows(self.self_attn.forward(x, ctx), residual, rows)
        if not x.shape[0]:
            return x, residual
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual

    def native_layer_plan(self) -> native.LayerPlan | None:
        """The layer as one C call (native.layer_plan), built at the first decode step; None
        where it cannot be."""
        plan = self.__dict__.get("native_plan", False)
        if plan is False:
            plan = native.layer_plan(self, Attention, MLP, Linear) if native.enabled() else None
            self.__dict__["native_plan"] = plan  # not a submodule
        return plan


def output_rows(
    x: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, residual) at `rows` alone, or as they are (None). A prompt step reads the hidden
    states of its sampled rows only: its last layer's attention runs over every row (their
    K/V are cached for the steps after) and the rest of the layer over those rows alone, as
    llama.cpp does: SmolLM2-135M's 1024-token prompt skips 5.4 of its 217 GFLOP of GEMMs."""
    return (x, residual) if rows is None else (x[rows], residual[rows])


class Embedding(nn.Module):
    """Token embeddings: a float table; on the CPU, GGUF blocks held packed like a Linear's
    (`packed`, shared with a tied lm_head), of which a step unpacks only the rows it looks
    up; on an accelerator, GGUF blocks kept quantized (`qweight`), likewise."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.weight: torch.Tensor | None = None
        self.qweight: QuantWeight | None = None
        self.hold(None)
        self.row_scales: torch.Tensor | None = None  # a packed table's unrounded pairs
        self.dtype = torch.float32

    def hold(self, table: Linear | None) -> None:
        """Look rows up in `table` (a packed Linear). It is kept out of the submodules: a
        tied lm_head is the same object, and belongs to the model."""
        self.__dict__["packed"] = table  # past nn.Module.__setattr__, which would register it

    def load_weight(self, src: WeightSource, *, dtype: torch.dtype, quant: str | None = None):
        shape = (self.vocab_size, self.hidden_size)
        assert tuple(src.shape) == shape, tuple(src.shape)
        self.dtype = dtype
        quantized = not isinstance(src, torch.Tensor) and src.qtype in GGUF_KINDS
        if quantized and kernel_layout(src.data.device):
            if not kernels.check_shape(src.qtype, shape):
                self.qweight = kernels.pack_gguf(src.data, src.qtype, shape)
                return
        elif quantized:
            table = Linear(self.hidden_size, self.vocab_size)
            table.load_weight(src, dtype=dtype)
            if table.format != "float" and table.can_read_rows():
                self.hold(table)
                # lookups read the pairs unrounded: bf16's 0.2% on every embedding turned
                # SmolLM2's "Paris" into "L'Étoile, la Marseillaise…" (the lm_head's
                # matmul keeps the kernel's bf16 ones)
                self.row_scales = int4_scales(src) if table.format == "int4" else None
                return
        self.weight = as_dense(src).to(dtype).contiguous()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            flat = ids.reshape(-1)
            x = self.packed.rows(flat, self.row_scales).to(self.dtype)
            return x.reshape(*ids.shape, self.hidden_size)
        if self.qweight is None:
            return self.weight[ids]
        return naive_dequantize(self.qweight.rows(ids)).to(self.dtype)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        if self.packed is not None and fn(torch.empty(0)).device.type != "cpu":
            # CPU packing cannot follow onto an accelerator: the table as floats goes
            ids = torch.arange(self.vocab_size)
            self.weight = self.packed.rows(ids, self.row_scales).to(self.dtype)
            self.hold(None)
            self.row_scales = None
        if self.weight is not None:
            self.weight = fn(self.weight)
        if self.qweight is not None:
            self.qweight = self.qweight.map(fn)
        return super()._apply(fn, recurse)


class VocabParallelEmbedding(Embedding):
    """Tensor parallel: this rank's rows of the table (`vocab_range`, zero rows past the
    vocabulary), held as an Embedding holds a whole one (GGUF blocks stay quantized); ids
    outside them look up zeros, and the ranks' lookups are summed."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        shard = Shard(0, vocab_size, (vocab_range(vocab_size),))
        super().__init__(shard.size, hidden_size)  # vocab_size: this rank's rows
        self.shard, self.start = shard, shard.ranges[0][0]

    def load_weight(self, src: WeightSource, *, dtype: torch.dtype, quant: str | None = None):
        full = self.shard.full_shape((self.vocab_size, self.hidden_size))
        assert tuple(src.shape) == full, tuple(src.shape)
        super().load_weight(take_shard(self.shard, src), dtype=dtype, quant=quant)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.vocab_size)
        x = Embedding.forward(self, local.masked_fill(outside, 0))  # [num_tokens, hidden]
        return all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


def embedding(vocab_size: int, hidden_size: int) -> Embedding:
    """The token embeddings: vocab-parallel under tensor parallel, else the whole table."""
    if not tp().enabled:
        return Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size)


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer; HF checkpoint names map onto module paths one to one."""

    layer_cls: type[DecoderLayer] = DecoderLayer
    # HF names that carry nothing we need.
    ignored_weight_suffixes = ("rotary_emb.inv_freq",)
    # Weights come from the checkpoint (safetensors or GGUF); see models/__init__.py.
    source_format: str | None = None

    @classmethod
    def build(
        cls, hf_config: dict[str, Any], tokenizer: Tokenizer, *, max_position: int | None = None
    ) -> LlamaForCausalLM:
        """The model for a checkpoint's config.json (GGUF metadata in the same keys)."""
        return cls(ModelConfig.from_hf(hf_config), max_position=max_position)

    def __init__(self, cfg: ModelConfig, max_position: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([self.layer_cls(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = lm_head(cfg.hidden_size, cfg.vocab_size)
        self.max_position = max_position or cfg.max_position_embeddings
        self.rotary = RotaryEmbedding(
            cfg.head_dim, self.max_position, cfg.rope_theta, cfg.rope_scaling
        )

    # -- what the runner needs -------------------------------------------------------
    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    # forward returns the hidden states of ctx.output_rows alone when it is set
    selects_output_rows = True

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden: [num_tokens, hidden], or
        # [len(ctx.output_rows), hidden] where the runner set output_rows
        x = self.embed_tokens(input_ids)
        if ctx.splice is not None:  # an image's pad rows take the vision tower's output
            x = x.index_copy(0, ctx.splice_rows, ctx.splice.to(x.dtype))
        residual = None
        stack = self._native_stack() if _native_decode_step(ctx) else None
        if (
            stack is not None
            and stack.rows_ok[min(planned_rows(x.shape[0]), len(stack.rows_ok) - 1)]
            and native.usable(x, ctx.cos, caches=stack.caches)
        ):
            x, residual = native.decode_layers(stack, x, ctx)  # every layer, one C call
            x, residual = output_rows(x, residual, ctx.output_rows)
        else:
            *layers, last = self.layers
            for layer in layers:
                x, residual = layer.forward(x, residual, ctx)
            x, residual = last.forward(x, residual, ctx, ctx.output_rows)
        return self.norm.forward_residual(x, residual)[0]

    def _native_stack(self) -> native.StackPlan | None:
        """Every layer's native plan as one (native.stack_plan) where each layer has one;
        rebuilt when the KV caches it points at were replaced."""
        stack = self.__dict__.get("native_stack", False)
        if stack is False or (stack is not None and not stack.fits()):
            plans = [getattr(layer, "native_layer_plan", lambda: None)() for layer in self.layers]
            ok = plans and all(p is not None for p in plans)
            stack = native.stack_plan(plans) if ok else None
            self.__dict__["native_stack"] = stack  # not a submodule
        return stack

    def compute_logits(self, hidden: torch.Tensor, seqs: list | None = None) -> torch.Tensor:
        # hidden: [num_seqs, hidden] -> [num_seqs, vocab]
        return self.lm_head(hidden)

    # -- weights -------------------------------------------------------------------
    # Checkpoint name prefixes that lead to the decoder; the first that matches is cut.
    weight_prefixes: tuple[str, ...] = ("model.",)
    # Checkpoint parts that are not served (a vision tower, MTP heads), by name prefix.
    skipped_weight_prefixes: tuple[str, ...] = ()
    # (1+w) RMSNorms (Qwen3.5) store offsets from one: added once at load.
    norm_weight_offset = 0.0

    def load_weights(
        self,
        weights: Iterable[tuple[str, WeightSource]],
        *,
        dtype: torch.dtype,
        quant: str | None = None,
        dense_copies: bool = False,
    ) -> None:
        """Place HF-named tensors: `model.layers.0.self_attn.q_proj.weight` → module path."""
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        embed_src = None
        for name, src in weights:
            if name.endswith(self.ignored_weight_suffixes) or name.startswith(
                self.skipped_weight_prefixes
            ):
                continue
            path = next((name[len(p) :] for p in self.weight_prefixes if name.startswith(p)), name)
            if path == "rotary_emb.freq_factors.weight":
                cfg = self.config
                self.rotary = RotaryEmbedding(
                    cfg.head_dim, self.max_position, cfg.rope_theta, freq_factors=as_dense(src)
                )
                continue
            mod_path, kind = _owner(modules, path)
            if mod_path == "embed_tokens":
                embed_src = src
            if mod_path == "lm_head" and self.config.tie_word_embeddings:
                continue
            mod = modules[mod_path]
            if mod is self or not kind:
                raise ValueError(f"unexpected weight {name!r} for {self.config.model_type}")
            if hasattr(mod, "load_stacked"):  # moe.Experts: one tensor for all experts
                mod.load_stacked(kind, src, dtype=dtype, quant=quant, dense=dense_copies)
                loaded.update(_stacked_names(mod_path, kind, mod.num_experts))
                continue
            _load_one(mod, kind, src, dtype, quant, dense_copies, self.norm_weight_offset)
            loaded.add(path)
        if self.config.tie_word_embeddings:
            if embed_src is None:
                raise ValueError("tied embeddings but no model.embed_tokens.weight")
            self.lm_head.load_weight(embed_src, dtype=dtype, quant=quant, dense_copy=dense_copies)
            _share_tied(self.embed_tokens, self.lm_head)
            loaded.add("lm_head.weight")
        missing = sorted(set(self._expected_weights()) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")

    def post_load(self) -> None:
        """Fuse same-input projections (q/k/v, gate/up) into single matmuls."""
        _fuse(self)

    def _expected_weights(self) -> list[str]:
        names = []
        for path, mod in self.named_modules():
            if isinstance(mod, Linear):
                names.append(f"{path}.weight")
                if mod.has_bias:
                    names.append(f"{path}.bias")
            elif isinstance(mod, RMSNorm | Embedding):
                names.append(f"{path}.weight")
            elif hasattr(mod, "PARAMS"):  # a layer that loads its own tensors (load_param)
                names.extend(f"{path}.{p}" for p in mod.PARAMS)
        return names


def _share_tied(embed: Embedding, lm_head: Linear) -> None:
    """A tied lm_head and the embeddings read one copy of the table when both hold it the
    same way (quantized blocks of one kind, or floats of one dtype)."""
    if embed.qweight is not None and lm_head.qweight is not None:
        if embed.qweight.kind == lm_head.qweight.kind:
            lm_head.qweight = embed.qweight
        return
    packed = embed.packed
    if packed is not None and (lm_head.format, lm_head.k_repeat, lm_head.block_kind) == (
        packed.format,
        packed.k_repeat,
        packed.block_kind,
    ):
        embed.hold(lm_head)  # the lm_head's table serves the lookups too
        return
    w = lm_head.weight
    if embed.weight is not None and lm_head.format == "float" and _alike(w, embed.weight):
        embed.weight = w


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device and a.shape == b.shape


def _fuse(module: nn.Module) -> None:
    """Call `fuse_projections` on the outermost modules that have one (each owns its subtree)."""
    for child in list(module.children()):
        if hasattr(child, "fuse_projections"):
            child.fuse_projections()
        else:
            _fuse(child)


def _owner(modules: dict[str, nn.Module], path: str) -> tuple[str, str]:
    """The deepest module on `path` and the rest of the name: ("layers.0.linear_attn",
    "conv1d.weight") for a parameter a module keeps under a sub-name; ("", path) when no
    module but the root is on it."""
    head, rest = path, ""
    while head:
        if head in modules:
            return head, rest
        head, _, last = head.rpartition(".")
        rest = f"{last}.{rest}" if rest else last
    return "", path


def _stacked_names(mod_path: str, kind: str, num_experts: int) -> list[str]:
    projs = ("gate_proj", "up_proj") if kind == "gate_up_proj" else (kind,)
    return [f"{mod_path}.{e}.{p}.weight" for e in range(num_experts) for p in projs]


def _load_one(
    mod: nn.Module,
    kind: str,
    src,
    dtype: torch.dtype,
    quant: str | None,
    dense: bool,
    norm_offset: float = 0.0,
) -> None:
    if isinstance(mod, Linear):
        if kind == "weight":
            mod.load_weight(src, dtype=dtype, quant=quant, dense_copy=dense)
        else:
            mod.load_bias(as_dense(src), dtype=dtype)
    elif isinstance(mod, Embedding):
        mod.load_weight(src, dtype=dtype)
    elif isinstance(mod, RMSNorm):
        w = as_dense(src).float() + norm_offset
        assert w.shape == mod.weight.shape, (tuple(w.shape), tuple(mod.weight.shape))
        mod.weight.data = w.to(dtype).contiguous()
    elif hasattr(mod, "load_param"):  # GatedDeltaNet's conv, A_log, dt_bias; RMSNormGated
        mod.load_param(kind, src, dtype)
    else:
        raise ValueError(f"no loader for {type(mod).__name__}.{kind}")
