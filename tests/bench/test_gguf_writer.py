"""`helexa bench gguf`: files in real checkpoints' shapes, read back as llama.cpp and helexa
read them. The mix expectations are llama.cpp's rules worked by hand (llama-quant.cpp's
use_more_bits: the first and last eighth of the layers, and every third between)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers

from helexa.bench.gguf_files import _QWEN36, PRESETS, Preset, tensor_shapes, with_layers
from helexa.bench.gguf_mix import tensor_types
from helexa.bench.gguf_writer import write_gguf
from helexa.cli import main as helexa_main
from helexa.engine.loader.gguf import load_gguf
from tests.shared_fixtures import FIXTURE_MODELS, need_shared

QWEN3_TOKENIZER = FIXTURE_MODELS / "Qwen3-0.6B"
QWEN35_TEMPLATE = FIXTURE_MODELS / "Qwen3.5-4B" / "Qwen3.5-4B.jinja"
# use_more_bits(i, 28): i < 3, i >= 24, (i - 3) % 3 == 2
MORE_BITS_28 = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27}


def _types(preset: str, mix: str, **cut) -> dict[str, str]:
    p = PRESETS[preset]
    cfg = with_layers(p.config, cut.get("layers"))
    shapes = tensor_shapes(cfg)
    n_blocks = cfg["num_hidden_layers"] + cfg.get("mtp_num_hidden_layers", 0)
    return tensor_types(shapes, mix, cfg.get("num_experts", 0), n_blocks)


def _layers_of(types: dict[str, str], suffix: str, qtype: str) -> set[int]:
    return {int(n.split(".")[1]) for n, t in types.items() if n.endswith(suffix) and t == qtype}


# -- the mix rules ---------------------------------------------------------------------------
@pytest.mark.parametrize("mix, base", [("Q4_K_M", "Q4_K"), ("Q5_K_M", "Q5_K")])
def test_k_m_mixes_give_q6_k_to_attn_v_and_ffn_down_where_use_more_bits_says(mix, base):
    types = _types("qwen3-0.6b", mix)
    assert _layers_of(types, "attn_v.weight", "Q6_K") == MORE_BITS_28
    assert _layers_of(types, "ffn_down.weight", "Q6_K") == MORE_BITS_28
    assert _layers_of(types, "attn_v.weight", base) == set(range(28)) - MORE_BITS_28
    assert {types[f"blk.9.{w}.weight"] for w in ("attn_q", "attn_k", "ffn_up")} == {base}
    assert types["token_embd.weight"] == "Q6_K"  # tied: the embedding is the output too
    assert types["blk.0.attn_q_norm.weight"] == types["output_norm.weight"] == "F32"


def test_an_untied_model_keeps_its_embedding_at_the_base_type_and_its_output_at_q6_k():
    types = _types("qwen3-8b", "Q4_K_M")
    assert (types["token_embd.weight"], types["output.weight"]) == ("Q4_K", "Q6_K")


@pytest.mark.parametrize("mix", ["Q6_K", "Q8_0"])
def test_single_type_mixes_quantize_every_weight_alike(mix):
    types = _types("qwen3.6-35b-a3b", mix, layers=4)
    assert {t for n, t in types.items() if t != "F32"} == {mix}
    assert types["output.weight"] == mix
    floats = {n.split(".", 2)[-1] for n, t in types.items() if t == "F32"}
    assert {"ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "ffn_gate_inp.weight"} <= floats


def test_qwen36_counts_its_delta_net_qkv_and_the_mtp_layer_among_attn_v():
    types = _types("qwen3.6-27b", "Q4_K_M")
    # 65 attn_v-like tensors (48 attn_qkv, 16 attn_v, the MTP block's attn_v) and 65 ffn_down:
    # use_more_bits(i, 65) is i < 8, i >= 56, (i - 8) % 3 == 2
    more = set(range(8)) | set(range(10, 56, 3)) | set(range(56, 65))
    qkv = _layers_of(types, "attn_qkv.weight", "Q6_K")
    assert qkv | _layers_of(types, "attn_v.weight", "Q6_K") == more
    assert _layers_of(types, "ffn_down.weight", "Q6_K") == more
    assert types["blk.64.nextn.eh_proj.weight"] == types["blk.2.attn_gate.weight"] == "Q4_K"


def test_moe_ffn_down_takes_its_layer_from_the_name_so_experts_and_shared_expert_agree():
    types = _types("qwen3.6-35b-a3b", "Q4_K_M")
    # 41 blocks: i < 5, i >= 35, (i - 5) % 3 == 2
    more = set(range(5)) | set(range(7, 35, 3)) | set(range(35, 41))
    assert _layers_of(types, "ffn_down_exps.weight", "Q6_K") == more
    assert _layers_of(types, "ffn_down_shexp.weight", "Q6_K") == more
    assert types["blk.5.ffn_gate_exps.weight"] == types["blk.5.ffn_up_shexp.weight"] == "Q4_K"


def test_rows_that_are_not_whole_blocks_fall_back_as_llama_cpp_does():
    shapes = {
        "token_embd.weight": (100, 64),
        "output.weight": (100, 64),
        "blk.0.attn_v.weight": (64, 64),
        "blk.0.attn_q.weight": (64, 64),
        "blk.0.ffn_down.weight": (64, 48),
    }
    types = tensor_types(shapes, "Q4_K_M", 0, 1)
    assert types["output.weight"] == "Q8_0"  # the output's own rule
    assert types["blk.0.attn_v.weight"] == "Q8_0"  # Q6_K -> Q8_0
    assert types["blk.0.attn_q.weight"] == "Q5_0"  # Q4_K -> Q5_0
    assert types["blk.0.ffn_down.weight"] == "F16"  # 48 is not even a 32-block
    assert tensor_types(shapes, "Q5_K_M", 0, 1)["blk.0.attn_q.weight"] == "Q5_1"


def test_an_eight_expert_model_gets_the_mixtral_exceptions():
    shapes = {
        n: (256, 256)
        for n in ("blk.0.attn_v.weight", "blk.0.attn_k.weight", "blk.0.attn_output.weight")
    }
    types = tensor_types(dict(shapes, **{"output.weight": (256, 256)}), "Q4_K_M", 8, 1)
    assert [types[n] for n in shapes] == ["Q8_0", "Q8_0", "Q5_K"]


# -- files written and read back ---------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_file(tmp_path_factory) -> Path:
    """qwen3-0.6b cut to one layer, written through the command line."""
    need_shared(QWEN3_TOKENIZER)
    path = tmp_path_factory.mktemp("gguf") / "qwen3.gguf"
    argv = ["bench", "gguf", "--preset", "qwen3-0.6b", "--layers", "1", "--out", str(path)]
    assert helexa_main([*argv, "--tokenizer", str(QWEN3_TOKENIZER)]) == 0
    return path


def _read(path: Path) -> tuple[dict, dict]:
    """(name -> (type, ne shape), in file order; metadata key -> value)."""
    reader = gguf.GGUFReader(path)
    tensors = {t.name: (t.tensor_type.name, tuple(int(x) for x in t.shape)) for t in reader.tensors}
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return tensors, meta


@pytest.fixture(scope="module")
def qwen3_read(qwen3_file) -> tuple[dict, dict]:
    return _read(qwen3_file)


def test_the_qwen3_file_holds_the_converters_tensors_with_the_mix_types(qwen3_read):
    got = qwen3_read[0]
    assert got == {
        "output_norm.weight": ("F32", (1024,)),
        "token_embd.weight": ("Q6_K", (1024, 151936)),
        "blk.0.attn_k.weight": ("Q4_K", (1024, 1024)),
        "blk.0.attn_k_norm.weight": ("F32", (128,)),
        "blk.0.attn_norm.weight": ("F32", (1024,)),
        "blk.0.attn_output.weight": ("Q4_K", (2048, 1024)),
        "blk.0.attn_q.weight": ("Q4_K", (1024, 2048)),
        "blk.0.attn_q_norm.weight": ("F32", (128,)),
        "blk.0.attn_v.weight": ("Q6_K", (1024, 1024)),
        "blk.0.ffn_down.weight": ("Q6_K", (3072, 1024)),
        "blk.0.ffn_gate.weight": ("Q4_K", (1024, 3072)),
        "blk.0.ffn_norm.weight": ("F32", (1024,)),
        "blk.0.ffn_up.weight": ("Q4_K", (1024, 3072)),
    }
    assert list(got)[:3] == [
        "output_norm.weight", "token_embd.weight", "blk.0.attn_k.weight",
    ]  # fmt: skip


def test_the_qwen3_file_states_the_hyperparameters_and_the_real_tokenizer(qwen3_read):
    meta = qwen3_read[1]
    assert {k: v for k, v in meta.items() if k.startswith("qwen3.")} == {
        "qwen3.block_count": 1,
        "qwen3.context_length": 40960,
        "qwen3.embedding_length": 1024,
        "qwen3.feed_forward_length": 3072,
        "qwen3.attention.head_count": 16,
        "qwen3.attention.head_count_kv": 8,
        "qwen3.rope.freq_base": 1e6,
        "qwen3.attention.layer_norm_rms_epsilon": pytest.approx(1e-6),
        "qwen3.attention.key_length": 128,
        "qwen3.attention.value_length": 128,
    }
    assert (meta["general.architecture"], meta["general.file_type"]) == ("qwen3", 15)
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"]) == ("gpt2", "qwen2")
    tokens, kinds = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == 151936 and len(meta["tokenizer.ggml.merges"]) == 151387
    # <|im_end|> is special (CONTROL), <think> an added plain token (USER_DEFINED), then pads
    assert (tokens[151645], kinds[151645]) == ("<|im_end|>", gguf.TokenType.CONTROL)
    assert (tokens[151667], kinds[151667]) == ("<think>", gguf.TokenType.USER_DEFINED)
    assert (tokens[151935], kinds[151935]) == ("[PAD151935]", gguf.TokenType.UNUSED)
    ids = [meta[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "padding")]
    assert ids == [151643, 151645, 151643]
    assert meta["tokenizer.ggml.add_bos_token"] is meta["tokenizer.ggml.add_eos_token"] is False
    assert "<think>" in meta["tokenizer.chat_template"]


def test_helexa_loads_the_qwen3_file_and_tokenizes_as_the_real_tokenizer(qwen3_file):
    model = load_gguf(qwen3_file)
    assert model.config["num_hidden_layers"] == 1 and model.config["tie_word_embeddings"]
    text = "Hello, world! <think>naïve café 12345</think><|im_start|>user\n"
    real = tokenizers.Tokenizer.from_file(str(QWEN3_TOKENIZER / "tokenizer.json"))
    assert model.tokenizer.encode(text) == real.encode(text).ids
    assert model.tokenizer.eos_token == "<|im_end|>"
    # random blocks are valid and sized like trained weights
    w = model.tensors["model.layers.0.mlp.down_proj.weight"].dequantize().numpy()
    assert np.isfinite(w).all() and 0.01 < w.std() < 0.04 and abs(w.mean()) < 0.002


def test_a_qwen36_file_holds_delta_net_and_attention_layers_experts_and_the_mtp_block(tmp_path):
    tokenizer = need_shared(FIXTURE_MODELS / "SmolLM2-135M-Instruct")  # small: a quick file
    # the 35B-A3B's layout at a width a test can afford
    small = dict(_QWEN36, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                 linear_num_value_heads=4, vocab_size=49152, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=256,
                 shared_expert_intermediate_size=256)  # fmt: skip
    preset = Preset("qwen35moe", small, "Qwen3.6 tiny", "tiny", "")
    template = QWEN35_TEMPLATE.read_text(encoding="utf-8")
    path = tmp_path / "moe.gguf"
    done = write_gguf(path, preset, "Q4_K_M", tokenizer, chat_template=template)
    got, meta = _read(path)
    assert got == {n: (done.types[n], s[::-1]) for n, s in tensor_shapes(small).items()}
    # five blocks: use_more_bits(i, 5) is i == 2 or i >= 4
    assert got["blk.0.attn_qkv.weight"] == ("Q4_K", (256, 1024))  # q, k of 2x128; v 4x128
    assert got["blk.2.attn_qkv.weight"] == ("Q6_K", (256, 1024))
    assert got["blk.0.ssm_conv1d.weight"] == ("F32", (4, 1024))
    assert got["blk.3.attn_q.weight"] == ("Q4_K", (256, 512))  # q and its gate
    assert got["blk.3.ffn_down_exps.weight"] == ("Q4_K", (256, 256, 4))
    assert got["blk.4.ffn_down_exps.weight"] == ("Q6_K", (256, 256, 4))
    assert got["blk.4.nextn.eh_proj.weight"] == ("Q4_K", (512, 256))
    assert "blk.0.attn_q.weight" not in got and "blk.4.ssm_a" not in got
    assert meta["qwen35moe.attention.recurrent_layers"] == [True, True, True, False, False]
    assert meta["qwen35moe.nextn_predict_layers"] == 1 and meta["qwen35moe.block_count"] == 5
    assert meta["qwen35moe.rope.dimension_sections"] == [11, 11, 10, 0]
    assert meta["qwen35moe.rope.dimension_count"] == 16
    assert meta["tokenizer.ggml.pre"] == "qwen35"
    assert "tokenizer.ggml.bos_token_id" not in meta  # Qwen3.6 names none
    assert meta["tokenizer.chat_template"] == template
