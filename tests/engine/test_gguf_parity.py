"""A GGUF written from a tiny HF checkpoint runs through the engine like the original."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from helexa.engine import LLM, SamplingParams
from tests.engine.test_parity import _hf_greedy, _record_logits
from tests.engine.tiny import FIXTURE_MODELS, hub_snapshot, make_tiny_model, run_offline
from tests.shared_fixtures import needs_shared

pytestmark = needs_shared

# HF module suffix → llama.cpp tensor name (the inverse of the loader's table).
BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # qwen3moe's router
}
GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_name(hf: str) -> str:
    module, _, kind = hf.rpartition(".")
    if module in GLOBAL:
        return f"{GLOBAL[module]}.{kind}"
    _, _, n, rest = module.split(".", 3)
    return f"blk.{n}.{BLOCK[rest]}.{kind}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter interleaves rotary halves of Q/K rows for llama."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _llama3_rope_factors(cfg) -> np.ndarray:
    """What llama.cpp's converter stores as `rope_freqs` for llama3 rope scaling."""
    rope = cfg.rope_parameters
    factor, old = rope["factor"], rope["original_max_position_embeddings"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    inv = 1.0 / rope["rope_theta"] ** (
        np.arange(0, cfg.head_dim, 2, dtype=np.float32) / cfg.head_dim
    )
    out = []
    for wavelen in 2 * np.pi / inv:
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf_from_hf(hf_model, arch: str, path: Path) -> Path:
    cfg = hf_model.config
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(4096)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    tokens = [f"t{i}" for i in range(cfg.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges([])
    w.add_eos_token_id(2)
    if (cfg.rope_parameters or {}).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(cfg))
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().float().numpy().copy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            a = _permute(a, cfg.num_attention_heads)
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            a = _permute(a, cfg.num_key_value_heads)
        w.add_tensor(_gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # the tokenizer.json beside the file wins over the toy vocab in the metadata
    shutil.copyfile(
        FIXTURE_MODELS / "SmolLM2-135M-Instruct" / "tokenizer.json", path.parent / "tokenizer.json"
    )
    return path


@pytest.mark.parametrize(
    ("family", "arch"),
    [("smollm2", "llama"), ("llama3", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")],
)
def test_a_gguf_of_a_tiny_model_matches_transformers(family, arch, tmp_path):
    _, hf = make_tiny_model(family, tmp_path, head_dim=16)
    out_dir = tmp_path / "gguf"
    out_dir.mkdir()
    path = write_gguf_from_hf(hf, arch, out_dir / f"{family}.gguf")
    # transformers' own float32 throughout (CUDA's default would be bfloat16: test_parity.py)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=8, kv_cache_dtype="float32")
    assert llm.engine.loaded.source_format == "gguf"
    seen = _record_logits(llm)
    prompt = [5, 17, 300, 42, 7, 99, 23]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    ref_tokens, ref_logits = _hf_greedy(hf, prompt)
    diff = (torch.stack(seen[out.request_id]) - ref_logits).abs().max().item()
    assert diff <= 1e-4, f"{family} via GGUF: max |Δlogits| {diff:.2e}"
    assert out.token_ids == ref_tokens


def test_llama3_rope_freqs_from_gguf_reproduce_the_scaled_rotary_table(tmp_path):
    _, hf = make_tiny_model("llama3", tmp_path, head_dim=16)
    (tmp_path / "gguf").mkdir()
    llm = LLM(
        str(write_gguf_from_hf(hf, "llama", tmp_path / "gguf" / "l3.gguf")), kv_cache_memory_mb=8
    )
    positions = torch.arange(0, 4096, 7).unsqueeze(0)
    ref_cos, _ = hf.model.rotary_emb(torch.zeros(1, 1, 16), positions)
    ours = llm.engine.runner.model.rotary.cos[positions[0]]
    torch.testing.assert_close(ours, ref_cos[0], atol=1e-5, rtol=0)
    # and the factors matter: without them the table differs at long range
    plain = 1.0 / 500000.0 ** (torch.arange(0, 16, 2).float() / 16)
    assert not torch.allclose(ours[-1, :8], torch.cos(positions[0, -1] * plain), atol=1e-3)


def test_a_gguf_hub_repo_loads_only_the_named_quantization(tmp_path):
    _, hf = make_tiny_model("qwen3", tmp_path, head_dim=16)
    snap = hub_snapshot(tmp_path / "hub", "acme/tiny-GGUF")
    for quant in ("Q4_K_M", "Q8_0"):
        write_gguf_from_hf(hf, "qwen3", snap / f"tiny-{quant}.gguf")
    code = (
        "import sys\nfrom helexa.engine import LLM\n"
        "llm = LLM('acme/tiny-GGUF', gguf_quant=sys.argv[1] or None, kv_cache_memory_mb=4)\n"
        "print(llm.engine.loaded.path.name)\n"
    )

    def load(quant: str):
        return run_offline(code, quant, HF_HUB_CACHE=str(tmp_path / "hub"))

    done = load("Q8_0")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "tiny-Q8_0.gguf"
    done = load("")
    assert done.returncode != 0 and "one file per quantization" in done.stderr
    done = load("Q6_K")
    assert done.returncode != 0
