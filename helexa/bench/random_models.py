"""Models in the shapes of real checkpoints, with random weights made on the device.

`helexa bench gpu` needs Qwen3-0.6B, Qwen3-8B, Qwen3-30B-A3B and the hybrid Qwen3.6-27B and
Qwen3.6-35B-A3B (Gated DeltaNet + gated full attention) without downloading them:
speed depends on the shapes and on how the weights are held, not on their values. Each
preset is the few config.json numbers that fix the shapes. The helexa model is built by
its family from that dict and fed random tensors through `load_weights`, generated on the
target device (so 16 GB of Qwen3-8B never pass through host RAM); the HF transformers
model is built from the same dict with its own random init.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from helexa.engine.layers.gated_deltanet import GatedDeltaNet, RMSNormGated
from helexa.engine.layers.linear import Linear
from helexa.engine.layers.moe import Experts
from helexa.engine.layers.norm import RMSNorm
from helexa.engine.loader.gguf import GGUFTensor
from helexa.engine.loader.load import LoadedModel
from helexa.engine.models import MODEL_REGISTRY
from helexa.engine.models.llama import Embedding
from helexa.engine.tokenizer import Tokenizer

FORMATS = ("bf16", "q4_k")
INIT_STD = 0.02  # HF's initializer_range: keeps 36 layers' activations finite
_QWEN3 = dict(
    model_type="qwen3",
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
    attention_bias=False,
    vocab_size=151936,
    bos_token_id=151643,
    eos_token_id=151645,
)
_MOE = dict(  # what Qwen3's MoE checkpoints add: every layer sparse, top-k renormalized
    model_type="qwen3_moe",
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
_TINY = dict(
    _QWEN3,
    vocab_size=1024,
    bos_token_id=None,
    eos_token_id=1023,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
# The text_config of Qwen/Qwen3.6-27B's and Qwen/Qwen3.6-35B-A3B's config.json: hybrid,
# three Gated DeltaNet layers then one gated full-attention layer. No copy of either
# config.json is among the fixtures; the numbers are those public code quotes from them,
# found with a code search: a test suite asserting its Qwen3.6-27B and -35B-A3B presets
# against the released config.json files, a Qwen3_5Config written out for the 27B, and
# THUDM/slime's scripts/models/qwen3.5-27B.sh (Qwen3.5-27B: the same shapes). The
# tokenizer is Qwen3.5's (vocab 248320). gguf_files.py writes files of these presets.
QWEN36_TEXT = dict(
    head_dim=256,
    rms_norm_eps=1e-6,
    rope_theta=10_000_000.0,
    partial_rotary_factor=0.25,
    max_position_embeddings=262144,
    vocab_size=248320,
    full_attention_interval=4,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    tie_word_embeddings=False,
)
# Qwen3.5's tokenizer; eos is the synthetic tokenizer's last id
_QWEN36 = dict(QWEN36_TEXT, bos_token_id=None, eos_token_id=248319)
_TINY_HYBRID = dict(  # 3 Gated DeltaNet layers then gated attention, 256 wide for Q4_K
    _QWEN36,
    vocab_size=1024,
    eos_token_id=1023,
    max_position_embeddings=4096,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
)
# config.json numbers of each checkpoint (Qwen3-0.6B from its config.json; Qwen3-8B and
# Qwen3-30B-A3B from theirs on the Hub). Tiny presets: the same families, small enough for
# a CPU in seconds; 256 wide because a Q4_K block spans 256 weights of a row.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        _QWEN3,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        _QWEN3,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": dict(
        _QWEN3,
        **_MOE,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        tie_word_embeddings=False,
    ),
    # text_config of Qwen/Qwen3.6-27B and -35B-A3B (QWEN36_TEXT's sources)
    "qwen3.6-27b": dict(
        _QWEN36,
        model_type="qwen3_5",
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        linear_num_value_heads=48,
    ),
    "qwen3.6-35b-a3b": dict(
        _QWEN36,
        model_type="qwen3_5_moe",
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        linear_num_value_heads=32,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
    ),
    "tiny-dense": dict(_TINY, tie_word_embeddings=True),
    "tiny-moe": dict(
        _TINY,
        **_MOE,
        moe_intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
    "tiny-hybrid": dict(_TINY_HYBRID, model_type="qwen3_5", intermediate_size=512),
    "tiny-hybrid-moe": dict(
        _TINY_HYBRID,
        model_type="qwen3_5_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
    ),
}
HYBRID_TYPES = ("qwen3_5", "qwen3_5_moe")


def active_fraction(cfg: dict[str, Any]) -> float:
    """Share of the expert weights one token reads (1.0 for dense models)."""
    experts = cfg.get("num_experts") or 0
    return cfg["num_experts_per_tok"] / experts if experts else 1.0


# -- the helexa model ------------------------------------------------------------------
def build_skeleton(cfg: dict[str, Any], tokenizer: Tokenizer | None = None) -> nn.Module:
    """The family's model for `cfg`, holding no weights yet (cheap even for 30B)."""
    return MODEL_REGISTRY[cfg["model_type"]].build(cfg, tokenizer)


def weight_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every weight `load_weights` expects, by name, with its shape; a tied lm_head is
    the embedding and is left out."""
    modules = dict(model.named_modules())
    tied = model.config.tie_word_embeddings
    shapes: dict[str, tuple[int, ...]] = {}
    for name in model._expected_weights():
        path, kind = _owner(modules, name)
        mod = modules[path]
        if path == "lm_head" and tied:
            continue
        if isinstance(mod, Linear):
            shapes[name] = (
                (mod.out_features,) if kind == "bias" else (mod.out_features, mod.in_features)
            )
        elif isinstance(mod, Embedding):
            shapes[name] = (mod.vocab_size, mod.hidden_size)
        elif isinstance(mod, RMSNorm | RMSNormGated):
            shapes[name] = tuple(mod.weight.shape)
        elif isinstance(mod, GatedDeltaNet):  # conv1d.weight is HF's [conv_dim, 1, kernel]
            conv = (mod.conv_dim, 1, mod.conv_kernel)
            shapes[name] = conv if kind == "conv1d.weight" else (mod.num_v_heads,)
        else:
            raise ValueError(f"no random init for {name!r} ({type(mod).__name__})")
    return shapes


def _owner(modules: dict[str, nn.Module], name: str) -> tuple[str, str]:
    """(module path, tensor name) of a weight; GatedDeltaNet's "conv1d.weight" is one name."""
    path, kind = name.rsplit(".", 1)
    if path not in modules:
        path, sub, kind = name.rsplit(".", 2)
        kind = f"{sub}.{kind}"
    return path, kind


def param_counts(cfg: dict[str, Any]) -> tuple[int, int]:
    """(total parameters, parameters one token reads: only the routed experts of an MoE),
    embeddings included, from the shapes the family builds for `cfg`."""
    shapes = weight_shapes(build_skeleton(cfg))
    total = sum(math.prod(s) for s in shapes.values())
    experts = sum(math.prod(s) for n, s in shapes.items() if ".experts." in n)
    return total, total - experts + round(experts * active_fraction(cfg))


def random_weights(
    model: nn.Module, fmt: str, device: torch.device, seed: int
) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """(name, weight) for `load_weights`: norms 1, Linear/embedding weights N(0, 0.02) in
    bf16, or (Linears) as Q4_K blocks when `fmt` is "q4_k"; Gated DeltaNet's A_log and
    dt_bias 0 (a decay of exp(-softplus(a))); made on `device` one at a time."""
    if fmt == "q4_k":
        from helexa.kernels.quant_matmul import make_gguf_blocks

    modules = dict(model.named_modules())
    offset = getattr(model, "norm_weight_offset", 0.0)  # Qwen3.5 stores its norms as w - 1
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for name, shape in weight_shapes(model).items():
        mod = modules[_owner(modules, name)[0]]
        if isinstance(mod, RMSNorm):
            yield name, torch.full(shape, 1.0 - offset, device=device, dtype=torch.bfloat16)
        elif isinstance(mod, RMSNormGated):
            yield name, torch.ones(shape, device=device, dtype=torch.bfloat16)
        elif name.endswith((".bias", ".A_log", ".dt_bias")):
            yield name, torch.zeros(shape, device=device, dtype=torch.bfloat16)
        elif fmt == "q4_k" and isinstance(mod, Linear):
            raw = make_gguf_blocks("Q4_K", *shape, generator=gen, device=device)
            yield name, GGUFTensor(name, "Q4_K", shape, raw)
        else:
            w = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
            yield name, w.mul_(INIT_STD)


def estimate_weight_bytes(cfg: dict[str, Any], fmt: str) -> int:
    """Bytes the weights will take on the device: all bf16, or for "q4_k" the Linears as
    GGUF Q4_K blocks (the GPU's packing differs by a few %) beside a bf16 embedding."""
    shapes = weight_shapes(build_skeleton(cfg))
    if fmt == "bf16":
        return sum(2 * math.prod(s) for s in shapes.values())
    from helexa.kernels.quant_matmul import gguf_nbytes

    total = 0
    for name, shape in shapes.items():
        quantized = len(shape) == 2 and "embed_tokens" not in name and "conv1d" not in name
        total += gguf_nbytes("Q4_K", shape) if quantized else 2 * math.prod(shape)
    if cfg["tie_word_embeddings"]:  # the lm_head's own Q4_K copy
        total += gguf_nbytes("Q4_K", (cfg["vocab_size"], cfg["hidden_size"]))
    return total


def kv_bytes_per_token(cfg: dict[str, Any]) -> int:
    """K and V in bf16 of every attention layer (a hybrid's every interval-th layer)."""
    layers = cfg["num_hidden_layers"] // cfg.get("full_attention_interval", 1)
    return 2 * layers * cfg["num_key_value_heads"] * cfg["head_dim"] * 2


def state_bytes(cfg: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> int:
    """Recurrent state one sequence holds (the runner's conv state in `dtype`, ssm state in
    fp32); 0 for attention-only models. A decode step reads and writes all of it."""
    if cfg["model_type"] not in HYBRID_TYPES:
        return 0
    from helexa.engine.model_runner import ModelRunner

    with torch.device("meta"):
        return ModelRunner.state_bytes_per_slot(build_skeleton(cfg), dtype)


def build_random_model(
    name: str, cfg: dict[str, Any], fmt: str, device: torch.device, seed: int = 0
) -> LoadedModel:
    """What `load_model` returns, for a preset with random weights in `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; supported: {list(FORMATS)}")
    tokenizer = synthetic_tokenizer(cfg["vocab_size"], cfg.get("eos_token_id"))
    model = build_skeleton(cfg, tokenizer)
    weights = random_weights(model, fmt, device, seed)
    model.load_weights(weights, dtype=torch.bfloat16, dense_copies=False)
    model.post_load()
    model = model.to(device).eval()
    return LoadedModel(model, tokenizer, model.config, Path(f"random:{name}"), "random")


def weight_bytes(model: nn.Module, cfg: dict[str, Any]) -> tuple[int, int]:
    """(bytes the weights hold on the device, bytes one decoded token reads). The second
    leaves out the input embedding table (a token reads one row of it) unless the
    lm_head shares it, and counts only top-k of E experts. KV caches, recurrent state
    (see `state_bytes`) and rotary tables are not weights."""
    from helexa.engine.layers.attention import PagedAttention
    from helexa.engine.layers.rotary import RotaryEmbedding

    expert_mods = {id(m) for e in model.modules() if isinstance(e, Experts) for m in e.modules()}
    embed_mods = {id(m) for m in model.modules() if isinstance(m, Embedding)}
    seen: dict[tuple[int, int], float] = {}  # (address, bytes) -> share read per token
    held: dict[tuple[int, int], None] = {}
    frac = active_fraction(cfg)
    for mod in model.modules():
        if isinstance(mod, PagedAttention | RotaryEmbedding):
            continue
        for t in _held_tensors(mod):
            if isinstance(mod, GatedDeltaNet) and _is_state(mod, t):
                continue
            key = (t.data_ptr(), t.nbytes)
            held[key] = None
            if id(mod) in embed_mods:
                continue
            seen[key] = frac if id(mod) in expert_mods else 1.0
    return sum(n for _, n in held), round(sum(n * share for (_, n), share in seen.items()))


def _is_state(mod: GatedDeltaNet, t: torch.Tensor) -> bool:
    return any(t is s for s in (mod.conv_state, mod.ssm_state))


def _held_tensors(mod: nn.Module) -> list[torch.Tensor]:
    """The module's own tensors: parameters, buffers, plain attributes, and those of packed
    weights (a Linear's `qweight` lists its own in `.tensors`)."""
    held = [*mod._parameters.values(), *mod._buffers.values()]
    for value in vars(mod).values():
        if isinstance(value, torch.Tensor):
            held.append(value)
        elif isinstance(getattr(value, "tensors", None), list):
            held.extend(value.tensors)
    return [t for t in held if isinstance(t, torch.Tensor) and t.device.type != "meta"]


# -- the tokenizer -----------------------------------------------------------------------
def synthetic_tokenizer(vocab_size: int, eos_id: int | None = None) -> Tokenizer:
    """A word-level tokenizer of `vocab_size` made-up tokens ("t0", "t1", ...) with one
    special eos: enough for the engine (eos ids, special ids, detokenizing output)."""
    import tokenizers
    from tokenizers import AddedToken, models, pre_tokenizers

    eos_id = eos_id if eos_id is not None and 0 <= eos_id < vocab_size else vocab_size - 1
    eos = "<|endoftext|>"
    vocab = {f"t{i}": i for i in range(vocab_size)}
    del vocab[f"t{eos_id}"]
    vocab[eos] = eos_id
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=eos))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(eos, special=True, normalized=False)])
    return Tokenizer(backend=backend, eos_token=eos, pad_token=eos, eos_token_ids={eos_id})


# -- HF transformers -----------------------------------------------------------------------
def build_hf_model(cfg: dict[str, Any], device: torch.device, seed: int = 0) -> nn.Module:
    """The same shapes as an HF transformers model: its own random init, bf16, SDPA."""
    import transformers

    config = transformers.AutoConfig.for_model(**cfg)
    config.pad_token_id = cfg.get("eos_token_id")
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return model.to(device).eval()  # a no-op unless the init ignored the default device


def hf_weight_bytes(model: nn.Module, cfg: dict[str, Any]) -> tuple[int, int]:
    """`weight_bytes` for an HF model: (held, read per decoded token)."""
    held = read = 0.0
    tied = cfg.get("tie_word_embeddings", False)
    for name, p in model.named_parameters():  # a tied lm_head is listed once, as the embedding
        held += p.nbytes
        if "embed_tokens" in name and not tied:
            continue
        read += p.nbytes * (active_fraction(cfg) if ".experts." in name else 1.0)
    return int(held), round(read)
