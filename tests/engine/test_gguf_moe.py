"""A Qwen3-MoE GGUF (llama.cpp arch `qwen3moe`) runs through the engine like transformers does."""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from helexa.engine import LLM, SamplingParams
from helexa.engine.layers import native
from helexa.engine.layers.linear import Linear
from helexa.engine.layers.moe import Experts
from helexa.engine.loader.gguf import load_gguf
from tests.engine.test_gguf_parity import _gguf_name
from tests.engine.test_parity import (
    EXACT,
    _hf_greedy,
    _record_logits,
    assert_same_greedy_run,
)
from tests.engine.tiny import tiny_hf_model

PROMPT_LENGTHS = (1, 7, 37, 90)
NUM_TOKENS = 32
VOCAB = 512


def _gguf_tensors(hf) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's names: HF's fused gate_up_proj [E, 2I, H] becomes
    ffn_gate_exps and ffn_up_exps [E, I, H], down_proj [E, H, I] ffn_down_exps."""
    out = {}
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy().copy()
        if name.endswith("mlp.experts.gate_up_proj"):
            n = name.split(".")[2]
            out[f"blk.{n}.ffn_gate_exps.weight"], out[f"blk.{n}.ffn_up_exps.weight"] = np.split(
                a, 2, axis=1
            )
        elif name.endswith("mlp.experts.down_proj"):
            out[f"blk.{name.split('.')[2]}.ffn_down_exps.weight"] = a
        else:
            out[_gguf_name(name)] = a
    return out


def write_qwen3moe_gguf(
    hf, path: Path, *, expert_qtype: str | None = None, dense_ffn_length: bool = True
) -> Path:
    """`hf` as llama.cpp's converter writes a qwen3moe file; `expert_qtype` quantizes the
    stacked experts (3-D tensors) the way llama-quantize would."""
    cfg = hf.config
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(4096)
    w.add_embedding_length(cfg.hidden_size)
    if dense_ffn_length:
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    # a toy byte-level vocab (prompts are token ids); one merge, as the writer skips none
    tokens = ["a", "b", "ab", *(f"t{i}" for i in range(3, cfg.vocab_size))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(["a b"])
    w.add_eos_token_id(2)
    for name, a in _gguf_tensors(hf).items():
        if expert_qtype and name.endswith("_exps.weight"):
            w.add_tensor(
                name, gguf.quants.quantize(a, QT[expert_qtype]), raw_dtype=QT[expert_qtype]
            )
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("qwen3_moe", vocab_size=VOCAB, mlp_only_layers=[])  # all sparse


@pytest.fixture(scope="module")
def hf_greedy(hf) -> dict[int, tuple[list[int], torch.Tensor]]:
    """transformers' greedy tokens and logits per prompt length."""
    return {len(p): _hf_greedy(hf, p) for p in _prompts()}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _run(path: Path) -> tuple[LLM, dict[int, tuple[list[int], torch.Tensor]]]:
    """Greedy tokens and per-step logits of each prompt, batched and prefilled in small chunks."""
    llm = LLM(str(path), **EXACT)
    seen = _record_logits(llm)
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    return llm, {
        len(p): (out.token_ids, torch.stack(seen[out.request_id]))
        for p, out in zip(prompts, outputs, strict=True)
    }


def test_qwen3moe_file_maps_to_an_all_sparse_qwen3_moe_config(hf, tmp_path):
    path = write_qwen3moe_gguf(hf, tmp_path / "moe.gguf", dense_ffn_length=False)
    model = load_gguf(path)
    expected = {
        "model_type": "qwen3_moe",
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "intermediate_size": 32,  # no feed_forward_length: the experts' size
        "norm_topk_prob": True,  # llama.cpp always renormalises qwen3moe's top-k
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "head_dim": 32,
        "tie_word_embeddings": False,
    }
    assert {k: model.config[k] for k in expected} == expected
    gate_up = hf.model.layers[1].mlp.experts.gate_up_proj.detach()
    up = model.tensors["model.layers.1.mlp.experts.up_proj"]
    assert up.shape == (6, 32, 64)
    assert torch.equal(up.dequantize(), gate_up[:, 32:])
    assert model.tensors["model.layers.1.mlp.gate.weight"].shape == (6, 64)


def test_qwen3moe_gguf_matches_transformers_for_a_mixed_batch(hf, hf_greedy, tmp_path):
    llm, ours = _run(write_qwen3moe_gguf(hf, tmp_path / "moe-f32.gguf"))
    assert llm.engine.loaded.source_format == "gguf"
    assert llm.engine.runner.model.config.model_type == "qwen3_moe"
    for n, (tokens, logits) in ours.items():
        ref_tokens, ref_logits = hf_greedy[n]
        assert_same_greedy_run(tokens, logits, ref_tokens, ref_logits, f"prompt len {n}")


def _round_trip(a: np.ndarray, qtype: str) -> np.ndarray:
    """`a` as a `qtype` file holds it: quantized by llama.cpp's rules, read back as floats."""
    return gguf.quants.dequantize(gguf.quants.quantize(a, QT[qtype]), QT[qtype]).reshape(a.shape)


def _teacher_forced_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """`model`'s logits at each step of `prompt` + `tokens`, for the tokens: [len(tokens), V]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    return logits[len(prompt) - 1 : -1]


# the least share of steps where our token is also float32 transformers' greedy pick
FLOAT_AGREEMENT = {"Q8_0": 0.9, "Q4_0": 0.5}


@pytest.mark.parametrize("qtype", list(FLOAT_AGREEMENT))
def test_quantized_experts_stay_quantized_and_generate_close_to_float(qtype, hf, tmp_path):
    llm, ours = _run(write_qwen3moe_gguf(hf, tmp_path / f"moe-{qtype}.gguf", expert_qtype=qtype))
    model = llm.engine.runner.model
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert len(experts) == 3
    for e in experts:
        assert e.w13 is None  # never widened into the stacked float path
        formats = {lin.format for lin in e.modules() if isinstance(lin, Linear)}
        if e.qw13 is None:  # the CPU's own: the file's blocks (native kernels) or torch's int4
            assert formats == ({"blocks"} if native.enabled() else {"int4"}), formats
        else:  # an accelerator's blocks as the file holds them, stacked for the fused kernel
            assert formats == {"quant"} and e.qw13.kind == qtype, (formats, e.qw13.kind)
    assert model.layers[0].mlp.gate.format == "float"  # the router was written F32

    # transformers on the weights the file holds, fed our tokens: the CPU kernels reproduce
    # them to bf16- or int8-activation precision (a near-tied router may flip at a step or two)
    held = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in held.named_parameters():
            if ".experts." in name:
                p.copy_(torch.from_numpy(_round_trip(p.numpy(), qtype)))
    agree = 0
    for prompt in _prompts():
        tokens, logits = ours[len(prompt)]
        step_diff = (logits - _teacher_forced_logits(held, prompt, tokens)).abs().amax(-1)
        assert step_diff.median() <= 0.1, f"{qtype} len {len(prompt)}: Δ {step_diff.tolist()}"
        # against float32 weights: our pick is mostly transformers' greedy pick too
        float_logits = _teacher_forced_logits(hf, prompt, tokens)
        agree += (float_logits.argmax(-1) == torch.tensor(tokens)).sum().item()
    share = agree / (NUM_TOKENS * len(PROMPT_LENGTHS))
    assert share >= FLOAT_AGREEMENT[qtype], f"{qtype}: {share:.0%} of steps pick the float token"


def test_an_unsupported_moe_architecture_is_rejected_by_name(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "qwen2moe.gguf", "qwen2moe")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        ValueError,
        match=r"unsupported GGUF architecture 'qwen2moe'; supported: \[.*'qwen3moe', .*'qwen35moe'\]",
    ):
        LLM(str(tmp_path / "qwen2moe.gguf"), kv_cache_memory_mb=8)


def test_stacked_quantized_experts_follow_the_model_to_another_device(hf, tmp_path, monkeypatch):
    # On an accelerator each expert's blocks are stacked into the Experts' qw13/qw2 and the
    # expert Linears keep none; load_model's model.to(device) must move the stack and leave
    # those Linears be (it tried to dequantize them: every quantized MoE failed to load on
    # CUDA, first seen on an H100). Built here in the accelerator's layout on the CPU, where
    # the naive kernels serve it, then moved to the meta device.
    import helexa.engine.layers.linear as linear
    import helexa.engine.models.llama as llama

    for module in (linear, llama):
        monkeypatch.setattr(module, "kernel_layout", lambda device: True)
    path = write_qwen3moe_gguf(hf, tmp_path / "moe-Q8_0.gguf", expert_qtype="Q8_0")
    model = LLM(str(path), device="cpu", kv_cache_memory_mb=8).engine.runner.model
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and all(e.qw13 is not None and e.qw13.kind == "Q8_0" for e in experts)
    model.to("meta")
    assert {t.device.type for e in experts for t in (*e.qw13.tensors, *e.qw2.tensors)} == {"meta"}
