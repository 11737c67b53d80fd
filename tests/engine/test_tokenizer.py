"""load_hf_tokenizer against transformers on the real upstream tokenizer fixtures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helexa.engine.tokenizer import load_hf_tokenizer, read_chat_template

transformers = pytest.importorskip("transformers")

TRICKY_TEXTS = [
    "Hello world",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "inline<|endoftext|>special<|im_end|>tokens",
    '<think>\nmaybe</think>\n\n<tool_call>\n{"name": "f"}\n</tool_call>',
    "  leading and trailing spaces  ",
    "12345 3.14159 1,000,000 x2024y 007",
    "emoji 🤖👍🏽 and a family 👨‍👩‍👧",
    "中文测试，日本語のテキスト 한국어",
    "def f(x):\n\treturn x**2  # comment\n\n\n",
    "don't I'LL we're",
    "\r\n\r\n  \n",
    "ﬁ café é",
    "",
]
MODELS = ["SmolLM2-135M-Instruct", "Qwen3-0.6B", "Qwen2.5-0.5B-Instruct"]


@pytest.fixture(scope="module")
def loaded(fixtures_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """(ours, transformers') per model, each loaded once for the module."""
    pairs = {}
    for name in MODELS:
        src = fixtures_dir / "models" / name
        copy = tmp_path_factory.mktemp(name)
        for f in src.iterdir():
            shutil.copyfile(f, copy / f.name)
        pairs[name] = (load_hf_tokenizer(src), transformers.AutoTokenizer.from_pretrained(copy))
    return pairs


@pytest.mark.parametrize("model", MODELS)
def test_encode_and_decode_match_transformers_on_tricky_text(loaded: dict, model: str) -> None:
    ours, hf = loaded[model]
    for text in TRICKY_TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text, add_special_tokens=False).input_ids, text
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text


@pytest.mark.parametrize("model", MODELS)
def test_vocab_and_special_tokens_match_transformers(loaded: dict, model: str) -> None:
    ours, hf = loaded[model]
    assert ours.vocab_size == len(hf)
    assert ours.bos_token == hf.bos_token
    assert ours.eos_token == hf.eos_token
    assert ours.pad_token == hf.pad_token
    assert ours.unk_token == hf.unk_token
    assert ours.add_bos_token is False


def test_qwen25_without_tokenizer_json_keeps_added_token_ids(loaded: dict) -> None:
    ours, _ = loaded["Qwen2.5-0.5B-Instruct"]
    assert ours.token_to_id("<|endoftext|>") == 151643
    assert ours.token_to_id("<|im_end|>") == 151645
    assert ours.token_to_id("<tool_call>") == 151657
    assert ours.encode("<tool_call>") == [151657]
    # <tool_call> is an added token but not a special one: decode keeps it.
    assert ours.decode([151657, 151645]) == "<tool_call>"


def test_qwen3_eos_ids_include_generation_config_list(loaded: dict) -> None:
    ours, _ = loaded["Qwen3-0.6B"]
    assert ours.eos_token == "<|im_end|>"
    assert ours.eos_token_ids == {151645, 151643}
    assert ours.token_to_id("<think>") == 151667


def test_template_variables_come_from_tokenizer_config(loaded: dict) -> None:
    smol, _ = loaded["SmolLM2-135M-Instruct"]
    assert smol.bos_token == "<|im_start|>"
    assert smol.extra["additional_special_tokens"] == ["<|im_start|>", "<|im_end|>"]
    assert isinstance(smol.chat_template, str) and "SmolLM" in smol.chat_template


def test_gpt2_style_vocab_and_merges_match_tokenizer_json(
    loaded: dict, fixtures_dir: Path, tmp_path: Path
) -> None:
    from_json, _ = loaded["SmolLM2-135M-Instruct"]
    src = fixtures_dir / "models" / "SmolLM2-135M-Instruct"
    for f in src.iterdir():
        if f.name != "tokenizer.json":
            shutil.copyfile(f, tmp_path / f.name)
    from_merges = load_hf_tokenizer(tmp_path)
    assert from_merges.vocab_size == from_json.vocab_size
    for text in TRICKY_TEXTS:
        assert from_merges.encode(text) == from_json.encode(text), text


def test_llama3_post_processor_bos_is_added_once(byte_tokenizer_dir) -> None:
    model_dir = byte_tokenizer_dir("Llama-3.2-3B-Instruct", prepend="<|begin_of_text|>")
    tok = load_hf_tokenizer(model_dir)
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)

    assert tok.bos_token == "<|begin_of_text|>" and tok.bos_token_id == 128000
    assert tok.eos_token == "<|eot_id|>"
    assert tok.add_bos_token is True
    assert tok.encode("hi", add_special_tokens=True) == hf("hi").input_ids
    assert tok.encode("hi", add_special_tokens=True)[:2] == [128000, tok.encode("h")[0]]
    assert tok.encode("<|begin_of_text|>hi", add_special_tokens=True).count(128000) == 1
    assert 128000 not in tok.encode("hi")
    assert tok.eos_token_ids == {128001, 128008, 128009}
    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert tok.chat_template == config["chat_template"]


def test_add_bos_token_from_tokenizer_config_with_added_token_dicts(byte_tokenizer_dir) -> None:
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    tok = load_hf_tokenizer(byte_tokenizer_dir("DeepSeek-R1-Distill-Qwen-32B", specials=[bos, eos]))
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (bos, eos, eos, None)
    assert tok.add_bos_token is True
    assert tok.encode("hi", add_special_tokens=True)[0] == tok.bos_token_id
    assert tok.encode(bos + "hi", add_special_tokens=True).count(tok.bos_token_id) == 1
    # eos: the token's own id, generation_config's and config.json's.
    assert tok.eos_token_ids == {tok.eos_token_id, 151643}


def test_directory_without_tokenizer_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_hf_tokenizer(tmp_path)


def _write(path: Path, data: object) -> None:
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")


def test_chat_template_precedence_jinja_then_json_then_tokenizer_config(tmp_path: Path) -> None:
    _write(tmp_path / "tokenizer_config.json", {"chat_template": "from config"})
    _write(tmp_path / "chat_template.json", {"chat_template": "from json"})
    _write(tmp_path / "chat_template.jinja", "from jinja")
    assert read_chat_template(tmp_path) == "from jinja"
    (tmp_path / "chat_template.jinja").unlink()
    assert read_chat_template(tmp_path) == "from json"
    (tmp_path / "chat_template.json").unlink()
    assert read_chat_template(tmp_path) == "from config"
    _write(tmp_path / "tokenizer_config.json", {})
    assert read_chat_template(tmp_path) is None


def test_named_templates_from_a_list_and_from_additional_files(tmp_path: Path) -> None:
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    _write(tmp_path / "tokenizer_config.json", {"chat_template": named})
    assert read_chat_template(tmp_path) == {"default": "D", "tool_use": "T"}

    _write(tmp_path / "chat_template.jinja", "J")
    (tmp_path / "additional_chat_templates").mkdir()
    _write(tmp_path / "additional_chat_templates" / "rag.jinja", "R")
    assert read_chat_template(tmp_path) == {"default": "J", "rag": "R"}
