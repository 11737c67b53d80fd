"""A GGUF whose vocabulary is SentencePiece's (`tokenizer.ggml.model` "llama": Llama 2,
Mistral, every model llama.cpp converts from a tokenizer.model) is tokenized exactly as
SentencePiece tokenizes it, token for token on awkward strings, from the GGUF's metadata
alone. The reference is the sentencepiece library on a BPE model trained here (byte
fallback, digits split, whitespace kept, as Llama 2's), written into a GGUF the way
llama.cpp's converter writes one: pieces, scores and types."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from helexa.engine.loader.gguf import load_gguf
from tests.engine.test_gguf import TRICKY_TEXTS

spm = pytest.importorskip("sentencepiece")

REPO = Path(__file__).resolve().parents[2]
AWKWARD = [
    *TRICKY_TEXTS,
    "Hello world",
    " one leading space",
    "two  spaces   and\ttabs\t\tinside",
    "\n\nnewlines first",
    "mixed 東京 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and zero\u200bwidth",
    "the theory of the thermometer: there, then, these",
    "x" * 50,
]  # not "<s>" as text: a special token's string in a prompt is that token here, as in HF


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("spm")
    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md"))))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp / "m"), model_type="bpe", vocab_size=1200,
        byte_fallback=True, split_digits=True, character_coverage=0.9995,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, minloglevel=2,
    )  # fmt: skip
    return tmp / "m.model"


def _gguf_of(model: Path, path: Path) -> Path:
    """A tiny llama GGUF carrying the SentencePiece vocabulary as llama.cpp writes it."""
    sp = spm.SentencePieceProcessor(model_file=str(model))
    n = sp.get_piece_size()
    tokens, scores, types = [], [], []
    for i in range(n):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        kind = gguf.TokenType.NORMAL
        if sp.is_unknown(i):
            kind = gguf.TokenType.UNKNOWN
        elif sp.is_control(i):
            kind = gguf.TokenType.CONTROL
        elif sp.is_byte(i):
            kind = gguf.TokenType.BYTE
        elif sp.is_unused(i):
            kind = gguf.TokenType.UNUSED
        types.append(kind)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    w.add_tensor("token_embd.weight", np.zeros((n, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_sentencepiece_gguf_tokenizes_as_sentencepiece_does(sentencepiece_model, tmp_path):
    sp = spm.SentencePieceProcessor(model_file=str(sentencepiece_model))
    ours = load_gguf(_gguf_of(sentencepiece_model, tmp_path / "spm.gguf")).tokenizer
    for text in AWKWARD:
        want = sp.encode(text)
        assert ours.encode(text) == want, (text, [sp.id_to_piece(i) for i in want])
        assert ours.decode(want) == sp.decode(want), text
    assert any(sp.is_byte(i) for text in AWKWARD for i in sp.encode(text))  # bytes fell back
    assert ours.bos_token == "<s>" and ours.eos_token == "</s>"
    assert ours.encode("hi", add_special_tokens=True)[0] == sp.bos_id()
