"""The engine's warm-up (engine/warmup.py): on any device it leaves the engine as it found it;
on CUDA, the first request after load compiles no kernel (gpu-marked, skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from helexa.engine import LLM, SamplingParams
from helexa.engine.warmup import warm_up
from tests.engine.test_parity import _prompts
from tests.engine.tiny import make_tiny_model
from tests.shared_fixtures import needs_shared

pytestmark = needs_shared
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_warm_up_leaves_no_request_no_count_and_the_same_tokens(tmp_path):
    model_dir, _ = make_tiny_model("qwen3", tmp_path)
    llm = LLM(str(model_dir), kv_cache_memory_mb=16, enable_prefix_caching=False)
    engine = llm.engine
    prompts = _prompts(512)[:3]
    before = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    engine.num_generated_tokens = 5  # as if it had served before: reset to a fresh engine's
    assert warm_up(engine) >= 0
    stats = engine.stats()
    assert not engine.has_unfinished()
    assert (stats.num_generated_tokens, stats.num_running, stats.num_waiting) == (0, 0, 0)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions) == (0, 0, 0)
    assert stats.kv_usage == 0  # every warm-up block went back
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == before


def test_warm_up_refuses_a_busy_engine(tmp_path):
    model_dir, _ = make_tiny_model("qwen3", tmp_path)
    llm = LLM(str(model_dir), kv_cache_memory_mb=16)
    llm.engine.add_request(_prompts(512)[0], GREEDY)
    with pytest.raises(RuntimeError, match="idle"):
        warm_up(llm.engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_first_requests_on_cuda_compile_no_kernel(tmp_path):
    from triton import knobs

    model_dir, _ = make_tiny_model("qwen3", tmp_path)
    llm = LLM(str(model_dir), device="cuda", kv_cache_memory_mb=64)
    compiled: list[str] = []

    def seen(*, repr: str, **_: object) -> None:  # a specialization this process lacked
        compiled.append(repr)

    knobs.runtime.jit_cache_hook = seen
    try:
        prompts = _prompts(512)[:2]
        llm.generate(prompts[0], SamplingParams(max_tokens=16, ignore_eos=True))
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    finally:
        knobs.runtime.jit_cache_hook = None
    assert compiled == []
