"""Generation semantics through the whole engine: stops, streaming, UTF-8, sampling, limits."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from helexa.engine import LLM, AsyncLLM, ContextLengthExceededError, SamplingParams
from helexa.engine.models import UnsupportedModelError
from tests.engine.tiny import (
    FIXTURE_MODELS,
    TOKENIZER_FILES,
    hub_snapshot,
    make_tiny_model,
    run_offline,
)
from tests.shared_fixtures import needs_shared

pytestmark = needs_shared

SMOL = FIXTURE_MODELS / "SmolLM2-135M-Instruct"


def scripted_dir(tmp_path, script: str, name: str = "scripted"):
    d = tmp_path / name
    d.mkdir()
    for f in TOKENIZER_FILES:
        shutil.copyfile(SMOL / f, d / f)
    (d / "config.json").write_text(json.dumps({"model_type": "helexa_scripted", "script": script}))
    return d


def scripted(tmp_path, script: str, **kw) -> LLM:
    return LLM(str(scripted_dir(tmp_path, script)), kv_cache_memory_mb=4, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> LLM:
    model_dir, _ = make_tiny_model("qwen3", tmp_path_factory.mktemp("tiny"))
    return LLM(str(model_dir), kv_cache_memory_mb=16)


def collect(llm: LLM, prompt, params: SamplingParams):
    """Stream one request through AsyncLLM; return its deltas."""

    async def run():
        engine = AsyncLLM(llm.engine)
        try:
            return [d async for d in engine.generate(prompt, params)]
        finally:
            engine.shutdown()

    return asyncio.run(run())


def test_scripted_model_emits_its_script_then_stops_on_eos(tmp_path):
    llm = scripted(tmp_path, "Hello there, world!")
    out = llm.generate("anything at all", SamplingParams(temperature=0.7, max_tokens=50))[0]
    assert out.text == "Hello there, world!"
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.tokenizer.eos_token_ids


def test_stop_string_across_token_boundaries_is_detected_and_not_emitted(tmp_path):
    llm = scripted(tmp_path, "The answer is forty-two, surely.")
    params = SamplingParams(max_tokens=50, stop=["y-tw"])
    out = llm.generate("q", params)[0]
    assert out.text == "The answer is fort"
    assert (out.finish_reason, out.stop_reason) == ("stop", "y-tw")
    deltas = collect(llm, "q", params)
    assert "".join(d.text for d in deltas) == "The answer is fort"
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"


def test_streamed_deltas_are_utf8_safe_and_add_up_to_the_text(tmp_path):
    text = "Emoji 🙂👍🏽 café 日本語 ok"
    llm = scripted(tmp_path, text)
    deltas = collect(llm, "q", SamplingParams(max_tokens=100))
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == text
    assert sum(len(d.token_ids) for d in deltas) == len(llm.tokenizer.encode(text)) + 1  # + eos


def test_max_tokens_ends_with_length(tmp_path):
    llm = scripted(tmp_path, "one two three four five six seven")
    out = llm.generate("q", SamplingParams(max_tokens=3))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_stop_token_ids_and_ignore_eos(tmp_path):
    llm = scripted(tmp_path, "a b c")
    b_id = llm.tokenizer.encode(" b")[0]
    out = llm.generate("q", SamplingParams(max_tokens=10, stop_token_ids=[b_id]))[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("a", "stop", b_id)
    out = llm.generate("q", SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_closing_a_stream_aborts_the_request_and_frees_its_blocks(tmp_path):
    llm = scripted(tmp_path, " ".join(["word"] * 400))
    bm = llm.engine.block_manager

    async def run():
        engine = AsyncLLM(llm.engine)
        stream = engine.generate("q", SamplingParams(max_tokens=400))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(200):
            if bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        engine.shutdown()

    asyncio.run(run())
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.has_unfinished()


def test_a_prompt_longer_than_the_context_is_refused_before_any_work(tmp_path):
    llm = scripted(tmp_path, "x", max_model_len=64)
    with pytest.raises(ContextLengthExceededError, match="maximum context length is 64 tokens"):
        llm.generate([5] * 64, SamplingParams())
    out = llm.generate([5] * 60, SamplingParams(max_tokens=32000, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"  # clamped, not refused


def test_same_seed_gives_the_same_sample_alone_or_batched(tiny):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = tiny.generate([[5, 6, 7]], p)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batched = tiny.generate([[9, 9], [5, 6, 7], [10]], [others, p, others])[1].token_ids
    assert alone == batched
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True)
    assert tiny.generate([[5, 6, 7]], other_seed)[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_reduce_to_greedy(tiny):
    greedy = tiny.generate(
        [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    for p in (
        SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True, seed=1),
        SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=12, ignore_eos=True, seed=1),
        SamplingParams(temperature=1.5, min_p=0.9999, max_tokens=12, ignore_eos=True, seed=1),
    ):
        assert tiny.generate([[1, 2, 3]], p)[0].token_ids == greedy[0].token_ids


def test_penalties_discourage_repeats(tiny):
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = tiny.generate([[4, 4, 4]], base)[0].token_ids
    penalised = tiny.generate(
        [[4, 4, 4]],
        SamplingParams(
            temperature=0,
            max_tokens=40,
            ignore_eos=True,
            presence_penalty=2.0,
            frequency_penalty=2.0,
        ),
    )[0].token_ids
    assert len(set(penalised)) > len(set(plain))
    rep = tiny.generate(
        [[4, 4, 4]],
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=5.0),
    )[0].token_ids
    assert rep != plain


def test_logprobs_report_the_chosen_token_and_top_alternatives(tiny):
    out = tiny.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy picks the top token
        assert sum(torch.tensor([v for _, v in lp.top]).exp()) <= 1.0 + 1e-5


def test_unsupported_model_type_names_it_and_the_supported_set(tmp_path):
    d = scripted_dir(tmp_path, "x")
    (d / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(
        UnsupportedModelError, match=r"unsupported model_type 'mamba'; supported: \["
    ):
        LLM(str(d))


def test_a_hub_id_resolves_offline_from_the_hf_cache(tmp_path):
    model_dir, _ = make_tiny_model("llama3", tmp_path)
    shutil.copytree(
        model_dir, hub_snapshot(tmp_path / "hub", "acme/tiny-llama"), dirs_exist_ok=True
    )
    code = (
        "from helexa.engine import LLM, SamplingParams\n"
        "llm = LLM('acme/tiny-llama', kv_cache_memory_mb=4)\n"
        "print(len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids))\n"
    )
    done = run_offline(code, HF_HUB_CACHE=str(tmp_path / "hub"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "4"
    done = run_offline(code, HF_HOME=str(tmp_path))  # → HF_HOME/hub
    assert done.returncode == 0, done.stderr[-2000:]
    done = run_offline(code, HF_HOME=str(tmp_path / "elsewhere"))
    assert done.returncode != 0 and "not in the cache" in done.stderr and "offline" in done.stderr


def test_concurrent_async_requests_match_the_sync_results_and_leave_the_loop_free(tiny):
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    # long enough to span many ticks however fast a step is on this machine
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    expected = [o.token_ids for o in tiny.generate(prompts, params)]

    async def run():
        engine = AsyncLLM(tiny.engine)
        gaps: list[float] = []
        done = asyncio.Event()

        async def ticker():
            loop = asyncio.get_running_loop()
            last = loop.time()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = loop.time()
                gaps.append(now - last)
                last = now

        async def one(p):
            return [t for d in [d async for d in engine.generate(p, params)] for t in d.token_ids]

        tick = asyncio.create_task(ticker())
        try:
            results = await asyncio.gather(*(one(p) for p in prompts))
        finally:
            done.set()
            await tick
            engine.shutdown()
        return results, gaps

    results, gaps = asyncio.run(run())
    assert results == expected
    # The loop kept ticking while the engine thread ran forward passes (generous bound:
    # a step of this tiny model takes milliseconds; a blocked loop would stall for all 128).
    assert len(gaps) > 5 and max(gaps) < 1.0


def test_scripted_model_takes_token_ids_too(tmp_path):
    d = scripted_dir(tmp_path, "unused")
    (d / "config.json").write_text(
        json.dumps({"model_type": "helexa_scripted", "script_ids": [40, 41, 42]})
    )
    llm = LLM(str(d), kv_cache_memory_mb=4)
    out = llm.generate("q", SamplingParams(max_tokens=10))[0]
    assert out.token_ids[:3] == [40, 41, 42] and out.token_ids[3] in llm.tokenizer.eos_token_ids


def test_engine_stats_report_queue_kv_and_prefix_reuse(tiny):
    engine = tiny.engine
    prompt = list(range(3, 3 + 40))
    params = SamplingParams(temperature=0, max_tokens=2)
    before = engine.stats()
    tiny.generate([prompt], params)
    tiny.generate([prompt], params)
    after = engine.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 32  # two 16-token blocks
    assert after.num_running == after.num_waiting == 0 and after.kv_usage == 0.0


def test_non_finite_logits_fail_the_step_with_a_typed_error(tmp_path):
    from helexa.engine.model_runner import NonFiniteLogitsError

    llm = scripted(tmp_path, "fine")
    model = llm.engine.runner.model
    inner = model.compute_logits
    model.compute_logits = lambda h, seqs: inner(h, seqs) * float("nan")
    with pytest.raises(NonFiniteLogitsError, match="non-finite logits"):
        llm.generate("q", SamplingParams(max_tokens=4))

    async def run():
        engine = AsyncLLM(llm.engine)
        try:
            with pytest.raises(NonFiniteLogitsError):
                async for _ in engine.generate("q", SamplingParams(max_tokens=4)):
                    pass
        finally:
            engine.shutdown()

    asyncio.run(run())
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # the failed requests gave their KV back


def test_async_llm_build_loads_on_its_own_thread_and_serves(tmp_path):
    import threading

    from helexa.engine import EngineArgs, LLMEngine

    model_dir = scripted_dir(tmp_path, "Built here.")
    threads = []

    def make() -> LLMEngine:
        threads.append(threading.current_thread())
        return LLMEngine(EngineArgs(model=str(model_dir), kv_cache_memory_mb=4))

    async def run():
        engine = await AsyncLLM.build(make)
        try:
            text = "".join([d.text async for d in engine.generate("Hi", SamplingParams())])
            return text, engine._thread
        finally:
            engine.shutdown()

    text, engine_thread = asyncio.run(run())
    assert text == "Built here."
    assert threads == [engine_thread]  # loaded where it runs


def test_async_llm_build_raises_the_load_error(tmp_path):
    from helexa.engine import EngineArgs, LLMEngine

    async def run():
        await AsyncLLM.build(lambda: LLMEngine(EngineArgs(model=str(tmp_path / "missing"))))

    with pytest.raises(FileNotFoundError, match="does not exist"):
        asyncio.run(run())
