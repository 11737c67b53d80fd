"""The engine with every kernel Triton (`kernels = "triton"`), on CPU through Triton's
interpreter: the same logits as transformers, so the paths a GPU runs are checked in CI."""

from __future__ import annotations

import pytest

import helexa.kernels as kernels
from helexa.engine import LLM, SamplingParams
from helexa.engine.cuda_graph import batch_buckets
from tests.engine.test_parity import _prompts, assert_matches_transformers
from tests.engine.tiny import make_tiny_model, make_tiny_new_family
from tests.kernels import needs_triton
from tests.shared_fixtures import needs_shared

pytestmark = needs_shared


@pytest.fixture(autouse=True)
def _auto_backend_after():
    yield
    kernels.set_backend("auto")  # the backend is process-wide


# the interpreter is slow: short contexts, and 12 decode steps (each a step of the batch,
# the short prompts decoding while the long ones still prefill)
NUM_TOKENS = 12


def _short_prompts(vocab: int) -> list[list[int]]:
    return [p[:40] for p in _prompts(vocab)]


@needs_triton
@pytest.mark.parametrize("block_size", [8, 32])
def test_dense_model_through_the_triton_kernels_matches_transformers(block_size, tmp_path):
    model_dir, hf = make_tiny_model("qwen3", tmp_path)
    # chunks of 12: later chunks attend over a cached prefix while short prompts decode
    llm = LLM(
        str(model_dir),
        kernels="triton",
        dtype="float32",
        kv_cache_memory_mb=8,
        block_size=block_size,
        max_prefill_chunk=12,
    )
    assert llm.engine.runner.use_triton
    prompts = _short_prompts(hf.config.vocab_size)
    assert_matches_transformers(llm, hf, prompts, "qwen3 triton", NUM_TOKENS)


@needs_triton
def test_hybrid_model_through_the_triton_kernels_matches_transformers(tmp_path):
    model_dir, hf = make_tiny_new_family("qwen3_5", tmp_path)
    llm = LLM(
        str(model_dir),
        kernels="triton",
        dtype="float32",
        kv_cache_memory_mb=8,
        max_prefill_chunk=12,
    )
    assert_matches_transformers(llm, hf, _short_prompts(512), "qwen3_5 triton", NUM_TOKENS)


@needs_triton
def test_a_cached_prefix_resumes_through_the_paged_prefill_kernel(tmp_path):
    model_dir, _ = make_tiny_model("qwen2", tmp_path)
    prompt = list(range(3, 60))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    naive = LLM(str(model_dir), kernels="naive", kv_cache_memory_mb=8).generate([prompt], params)
    llm = LLM(str(model_dir), kernels="triton", kv_cache_memory_mb=8)
    cold = llm.generate([prompt], params)[0]
    warm = llm.generate([[*prompt, 61, 62]], params)[0]  # 56 tokens come from the cache
    assert llm.engine.block_manager.num_prefix_hits > 0
    assert cold.token_ids == naive[0].token_ids
    fresh = LLM(str(model_dir), kernels="naive", kv_cache_memory_mb=8)
    assert warm.token_ids == fresh.generate([[*prompt, 61, 62]], params)[0].token_ids


def test_graph_buckets_cover_every_batch_size_up_to_the_maximum():
    assert batch_buckets(1) == [1]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(10_000)[-1] == 512
    for top in (3, 17, 100):
        sizes = batch_buckets(top)
        assert all(any(b >= n for b in sizes) for n in range(1, top + 1))


def test_a_cpu_engine_captures_no_graphs(tmp_path):
    model_dir, _ = make_tiny_model("qwen3", tmp_path)
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory_mb=8)
    assert llm.engine.runner.device.type == "cpu" and llm.engine.runner.graphs is None
