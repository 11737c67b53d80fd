"""Qwen3.5 / Qwen3.6 K-quant GGUF files (llama.cpp `qwen35`, `qwen35moe`) in the real files'
layout: 128-wide value heads in the converter's tiled order under 256-wide super-blocks, as
`helexa bench gguf` writes them (its own shapes, metadata, Q4_K_M types and random valid
blocks), shrunk to two layers. Every Linear keeps the file's blocks, out_proj's included (no
requantization), and the prompt step gives transformers' logits on the loader's weights.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from helexa.bench.gguf_files import _QWEN36, arch_metadata, tensor_shapes
from helexa.bench.gguf_mix import tensor_types
from helexa.bench.gguf_writer import _add, random_chunks
from helexa.engine import LLM, SamplingParams, parallel
from helexa.engine.layers.linear import MIXED, Linear
from helexa.engine.loader.gguf import load_gguf
from helexa.engine.loader.load import load_model
from helexa.engine.parallel import TensorParallel
from tests.engine.test_gguf_moe import _teacher_forced_logits
from tests.engine.test_gguf_qwen35 import grouped_value_heads
from tests.engine.test_parity import EXACT, _record_logits

VOCAB = 320
# _QWEN36's head sizes (128-wide linear-attention heads; full-attention heads 128, not 256,
# to stay small) at hidden 256; one linear and one full-attention layer. qwen35: three value
# heads per key head, as Qwen3.6-27B; qwen35moe: two, as Qwen3.6-35B-A3B.
_TINY = dict(
    _QWEN36, vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, full_attention_interval=2,
    head_dim=128, num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=2,
)  # fmt: skip
CONFIGS = {
    "qwen35": dict(_TINY, intermediate_size=512, linear_num_value_heads=6),
    "qwen35moe": dict(
        _TINY, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=256, shared_expert_intermediate_size=256, tie_word_embeddings=True,
    ),
}  # fmt: skip
PROMPTS = ([5, 17, 300, 42, 7, 99, 23], [100, *range(30, 60)])
NUM_TOKENS = 8


def write_kquant_gguf(path: Path, arch: str, **overrides) -> dict[str, str]:
    """A Q4_K_M file of CONFIGS[arch] with `overrides` (no MTP layer): the quantized tensors
    random valid blocks, the F32 ones random values that make a misplaced head show (norms
    1 + N(0, 0.1), A = -exp(N(0, 0.5)), dt_bias and conv1d N(0, 0.5), routers N(0, 0.5)).
    Returns its tensors' GGML types by GGUF name."""
    cfg = dict(CONFIGS[arch], **overrides)
    shapes = tensor_shapes(cfg, mtp=False)
    types = tensor_types(shapes, "Q4_K_M", cfg.get("num_experts", 0), cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(path, arch)
    for key, value, kind in arch_metadata(arch, cfg, mtp=False):
        _add(w, f"{arch}.{key}", value, kind)
    tokens = ["a", "b", "ab", *(f"t{i}" for i in range(3, VOCAB))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(["a b"])
    w.add_eos_token_id(2)
    gen = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        if types[name] != "F32":
            raw = np.concatenate(list(random_chunks(name, types[name], shape, gen)))
            w.add_tensor(name, raw.reshape(*shape[:-1], -1), raw_dtype=QT[types[name]])
            continue
        x = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight"):
            x = 1 + 0.1 * x
        elif name.endswith("ssm_a"):
            x = -(0.5 * x).exp()
        else:
            x = 0.5 * x
        w.add_tensor(name, x.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types


def _transformers_model(cfg: dict, weights: dict[str, torch.Tensor]):
    """transformers' Qwen3.5 (-MoE) CausalLM, float32, holding the loader's dequantized
    `weights` with the value heads put back in HF's order."""
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    weights = grouped_value_heads(weights, cfg)
    for layer in range(cfg["num_hidden_layers"]):  # HF's stacked experts: gate and up as one
        p = f"model.layers.{layer}.mlp.experts."
        if p + "gate_proj" in weights:
            gate_up = [weights.pop(p + "gate_proj"), weights.pop(p + "up_proj")]
            weights[p + "gate_up_proj"] = torch.cat(gate_up, dim=1)
    moe = "num_experts" in cfg
    config_cls = Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig
    config = config_cls(**{k: v for k, v in cfg.items() if k != "model_type"})
    assert config.rope_parameters["rope_theta"] == cfg["rope_theta"]
    model = (Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM)(config).float().eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if cfg["tie_word_embeddings"] else set()
    assert set(missing) == tied and not unexpected, (missing, unexpected)
    return model


def _file_kinds(m: Linear) -> set[str]:
    """The GGML types a Linear holds its weight in (its format where not blocks)."""
    if m.block_kind == MIXED:
        return {kind.removesuffix("x8") for kind, _ in m.block_parts}
    return {m.block_kind.removesuffix("x8")} if m.block_kind else {m.format}


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_a_k_quant_file_keeps_its_blocks_and_gives_transformers_logits(arch, tmp_path):
    path = tmp_path / f"{arch}.gguf"
    types = write_kquant_gguf(path, arch)
    assert types["blk.0.ssm_out.weight"] == "Q4_K"  # super-blocks of two 128-wide heads
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    # the same file with its K-quants widened to float (cpu_kernels "torch"): exact weights
    widened = LLM(str(path), **EXACT, autotune=False, cpu_kernels="torch")
    seen_float = _record_logits(widened)
    float_outputs = widened.generate(list(PROMPTS), params)
    llm = LLM(str(path), **EXACT, autotune=False)
    model = llm.engine.runner.model
    delta_net = model.layers[0].linear_attn
    assert delta_net.is_tiled
    # the linear-attention projections as the file holds them
    for module, tensor in (
        ("in_proj_qkv", "attn_qkv"), ("in_proj_z", "attn_gate"), ("in_proj_a", "ssm_alpha"),
        ("in_proj_b", "ssm_beta"), ("out_proj", "ssm_out"),
    ):  # fmt: skip
        lin, file_type = getattr(delta_net, module), types[f"blk.0.{tensor}.weight"]
        assert _file_kinds(lin) == {file_type}, (module, _file_kinds(lin), file_type)
    loaded = load_gguf(path)
    weights = {name: t.dequantize() for name, t in loaded.tensors.items()}
    # out_proj's very weights: its columns neither moved nor rounded again
    file_out_proj = weights["model.layers.0.linear_attn.out_proj.weight"]
    assert torch.equal(delta_net.out_proj.dequantize(), file_out_proj)
    # and no Linear anywhere in a kind the file does not hold (a requantized Q8_0, floats)
    kinds = set().union(*(_file_kinds(m) for m in model.modules() if isinstance(m, Linear)))
    assert kinds <= {"Q4_K", "Q6_K", "float"}, kinds
    routers = [m for name, m in model.named_modules() if name.endswith(("mlp.gate", "_gate"))]
    floats = {m for m in model.modules() if isinstance(m, Linear) and m.format == "float"}
    assert floats <= set(routers), "only the F32 routers are floats"

    seen = _record_logits(llm)
    outputs = llm.generate(list(PROMPTS), params)
    hf = _transformers_model(loaded.config, weights)
    for prompt, exact, out in zip(PROMPTS, float_outputs, outputs, strict=True):
        # the file's weights, widened: the prompt step to float rounding
        ref = _teacher_forced_logits(hf, prompt, exact.token_ids)
        diff = (seen_float[exact.request_id][0] - ref[0]).abs().max().item()
        assert diff <= 1e-4, f"{arch} prompt step, widened: max |Δlogits| {diff:.2e}"
        # on the blocks, prompt and decode steps quantize their activations for the K-quant
        # kernels as llama.cpp does (~3% seen): close
        ours = torch.stack(seen[out.request_id])
        ref = _teacher_forced_logits(hf, prompt, out.token_ids)
        diff = (ours - ref).abs().max().item()
        assert diff <= 0.05 * ref.abs().max().item(), f"{arch} blocks: max |Δlogits| {diff:.2e}"


def test_a_rank_holds_its_key_heads_value_heads_from_every_tile_still_quantized(
    tmp_path, monkeypatch
):
    # four key heads, three value heads each, tiled [3, 4]: rank 1 of 2 reads key heads 2
    # and 3, so holds value heads 2-3, 6-7 and 10-11, out_proj's 256 columns of each pair
    # whole Q4_K super-blocks
    path = tmp_path / "qwen35.gguf"
    heads = dict(linear_num_key_heads=4, linear_num_value_heads=12, num_attention_heads=4)
    write_kquant_gguf(path, "qwen35", **heads)  # (4 attention heads: o_proj's 256 a rank)
    whole = load_model(str(path), device=torch.device("cpu")).model.layers[0].linear_attn
    monkeypatch.setattr(parallel, "_TP", TensorParallel(1, 2))  # loading runs no collective
    half = load_model(str(path), device=torch.device("cpu")).model.layers[0].linear_attn
    assert (half.num_k_heads, half.num_v_heads) == (2, 6)
    heads = torch.tensor([2, 3, 6, 7, 10, 11])
    channels = (heads[:, None] * 128 + torch.arange(128)).reshape(-1)
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"):
        assert _file_kinds(getattr(half, name)) == _file_kinds(getattr(whole, name)), name
    w, full = half.out_proj.dequantize(), whole.out_proj.dequantize()
    assert torch.equal(w, full[:, channels])
    assert torch.equal(half.in_proj_z.dequantize(), whole.in_proj_z.dequantize()[channels])
    assert torch.equal(half.in_proj_a.dequantize(), whole.in_proj_a.dequantize()[heads])
    assert torch.equal(half.A_log, whole.A_log[heads])
    qkv, full_qkv = half.in_proj_qkv.dequantize(), whole.in_proj_qkv.dequantize()
    assert torch.equal(qkv[512:], full_qkv[1024 + channels])  # past q and k: 2 of 4 heads each
