"""Speculative decoding with prompt lookup (issue 38, the n-gram drafter): greedy output is
token for token the same with speculation on and off, in mixed batches where some rows do
not speculate, under preemption, with stop strings and max_tokens cutting a draft; sampled
output has the target's distribution (a chi-square test against the exact probabilities)
and a seed gives the same tokens every run; the incremental n-gram index proposes what the
plain scan does."""

from __future__ import annotations

import random
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from helexa.engine import LLM, SamplingParams
from helexa.engine.spec.ngram import NgramIndex, propose
from helexa.engine.spec.verify import accepted
from tests.engine.tiny import make_tiny_model, make_tiny_new_family
from tests.kernels import needs_triton
from tests.shared_fixtures import needs_shared

pytestmark = pytest.mark.usefixtures("check_every_draft")

SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1)
# a small KV pool (the tiny models need little): an engine's default takes up to 2 GiB on the
# CPU, and CI's workers and their node processes run out of memory beside each other
EXACT = dict(
    dtype="float32", kv_cache_dtype="float32", block_size=16, max_prefill_chunk=24,
    kv_cache_memory_mb=16,
)  # fmt: skip


def test_the_index_proposes_what_the_scan_does_as_tokens_grow():
    rng = random.Random(0)
    for _ in range(20):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 80))]
        index = NgramIndex(2, 4)
        for size in range(1, len(tokens) + 1):
            assert index.propose(tokens[:size], 3) == propose(tokens[:size], 3, 2, 4)


def test_the_longest_latest_match_is_proposed():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert propose(tokens, 3, 2, 3) == [7, 8, 5]  # "2 3" last seen before "7 8 5"
    assert propose([5, 1, 2, 3, 4, 1, 2, 3], 2, 1, 3) == [4, 1]  # "1 2 3" beats "3"
    assert propose([1, 2, 3], 2, 1, 2) == []


def test_a_row_keeps_the_agreeing_drafts_then_the_targets_choice():
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accepted([5], [4, 4]) == [4]
    assert accepted([], [3]) == [3]


def assert_three_token_distribution(
    counts: dict[tuple[int, ...], int], probs: Callable[[list[int]], dict[int, float]], runs: int
) -> None:
    """Sampled three-token answers (`counts` by answer, of `runs`) have the distribution that
    `probs` (the exact next-token probabilities after a prefix) gives: every answer is one it
    allows, and a chi-square test, outcomes expected fewer than 5 times pooled into one cell."""
    exact: dict[tuple[int, ...], float] = {}
    for a, pa in probs([]).items():
        for b, pb in probs([a]).items():
            for c, pc in probs([a, b]).items():
                exact[(a, b, c)] = pa * pb * pc
    assert set(counts) <= set(exact)
    small = [k for k, p in exact.items() if p * runs < 5]
    cells = [(counts.get(k, 0), p * runs) for k, p in exact.items() if k not in small]
    if small:
        cells.append((sum(counts.get(k, 0) for k in small), sum(exact[k] for k in small) * runs))
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    # at most 26 degrees of freedom: 60 is past the 0.9999 quantile
    assert chi2 < 60, (chi2, len(cells))


def _repetitive(vocab: int, seed: int) -> list[int]:
    """A prompt that repeats itself: its continuation often reappears in it."""
    rng = random.Random(seed)
    unit = [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 12))]
    return (unit * 6)[: rng.randrange(30, 70)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return {
        "llama": make_tiny_model("smollm2", root)[0],
        "qwen3": make_tiny_model("qwen3", root)[0],
        "qwen3_moe": make_tiny_new_family("qwen3_moe", root)[0],
    }


@needs_shared
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_greedy_tokens_are_the_same_with_and_without_speculation(models, family):
    prompts = [_repetitive(512, s) for s in range(6)]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # max_tokens mid-draft
        SamplingParams(temperature=0, max_tokens=16, min_tokens=20, ignore_eos=True),  # none
        SamplingParams(temperature=0, logprobs=2, max_tokens=12, ignore_eos=True),  # no draft
        SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    ]
    with LLM(str(models[family]), **EXACT) as plain:
        expected = plain.generate(prompts, params)
    # a pool of 12 blocks: the batch preempts and recomputes as it grows
    for extra in ({}, {"num_kv_blocks": 12}):
        with LLM(str(models[family]), **EXACT, **SPEC, **extra) as spec:
            got = spec.generate(prompts, params)
            assert [o.token_ids for o in got] == [o.token_ids for o in expected], extra
            assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
            # the row asking for logprobs decoded one token a step; its batch-mates' shapes
            # differ, so its logprobs may differ in float rounding
            for a, b in zip(got[3].logprobs, expected[3].logprobs, strict=True):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert spec.engine.scheduler.num_draft_tokens > 0
            if extra:
                assert spec.engine.scheduler.num_preemptions > 0


@needs_shared
def test_a_stop_string_inside_an_accepted_draft_ends_the_text_where_it_would(models):
    prompt = _repetitive(512, 1)
    with LLM(str(models["llama"]), **EXACT) as plain:
        free = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]
    stop = free.text[len(free.text) // 2 :][:3]
    params = SamplingParams(temperature=0, max_tokens=40, stop=[stop])
    with LLM(str(models["llama"]), **EXACT) as plain:
        expected = plain.generate([prompt], params)[0]
    with LLM(str(models["llama"]), **EXACT, **SPEC) as spec:
        got = spec.generate([prompt], params)[0]
    assert (got.text, got.finish_reason, got.stop_reason) == (
        expected.text,
        expected.finish_reason,
        expected.stop_reason,
    )


def _gemm_past_one_row(llm: LLM) -> None:
    """Plans as a busy machine once timed them: every call of more than one row quicker
    through a float32 GEMM than through the int8 kernel that one row takes."""
    from helexa.engine.layers.autotune import BUCKETS, DENSE, WHOLE

    for _, m in _block_linears(llm):
        m.plans = [WHOLE, WHOLE] + [DENSE] * (BUCKETS[-1] - 1)


def _block_linears(llm: LLM) -> list:
    from helexa.engine.layers.linear import Linear

    model = llm.engine.loaded.model
    return [
        (name, m) for name, m in model.named_modules()
        if isinstance(m, Linear) and m.format == "blocks"
    ]  # fmt: skip


@pytest.mark.parametrize("plans", ["timed", "gemm_past_one_row"])
def test_the_bundled_model_answers_a_code_edit_the_same_and_accepts_most_drafts(plans):
    """SmolLM2 on its CPU GGUF kernels, as a node serves it by default, rewriting the
    benchmark's 60-line function: the same greedy answer with prompt lookup on and off (each
    check row computes what its one-row decode step would: the same kernels, a span split
    that depends on the row alone), and most drafts accepted. Both engines run the same
    plans: this machine's timings (measured once, by the first), or plans that send every
    call of more rows through a float32 GEMM (as CI's busy machine once timed them: the
    answers parted at the 35th token while check rows took the plans of their row count).
    Two engines timing the machine each for itself may choose differently (a prompt's
    floats then differ before any draft is checked)."""
    from helexa.bench.speculative import code_edit_prompt

    msgs = [{"role": "user", "content": code_edit_prompt()}]
    params = SamplingParams(temperature=0, max_tokens=160)
    args = dict(max_num_seqs=1, kv_cache_memory_mb=64)
    try:
        off = LLM(None, **args, autotune=plans == "timed")
    except FileNotFoundError:
        pytest.skip("the bundled SmolLM2 is not installed")
    with off:
        if plans != "timed":
            _gemm_past_one_row(off)
        (want,) = off.chat(msgs, params)
        measured = {name: (m.plans, m.exact_rows) for name, m in _block_linears(off)}
    with LLM(None, **args, autotune=False, speculative_method="ngram") as spec:
        for name, m in _block_linears(spec):
            m.plans, m.exact_rows = measured[name]
        (got,) = spec.chat(msgs, params)
        sched = spec.engine.scheduler
    assert got.token_ids == want.token_ids
    assert len(got.token_ids) == 160
    assert sched.num_accepted_tokens > sched.num_draft_tokens // 2 > 0


@needs_shared
def test_two_tensor_parallel_ranks_check_drafts_as_one_does(models):
    prompts = [_repetitive(512, s) for s in range(3)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    cpu = dict(EXACT, device="cpu", num_kv_blocks=64)
    with LLM(str(models["qwen3"]), **cpu) as plain:
        expected = [o.token_ids for o in plain.generate(prompts, params)]
    with LLM(str(models["qwen3"]), tensor_parallel=2, **cpu, **SPEC) as two:
        assert [o.token_ids for o in two.generate(prompts, params)] == expected
        assert two.engine.scheduler.num_draft_tokens > 0


@needs_shared
def test_sampled_tokens_have_the_targets_distribution(models):
    """500 seeded runs of 3 tokens (temperature 1, top-k 3: 27 outcomes) with drafts checked
    by the accept/reject rule, against the exact probabilities the model gives each path."""
    import torch
    from transformers import AutoModelForCausalLM

    # the prompt, its greedy continuation, the prompt again: after it, the model often says
    # what it said the first time, which is what prompt lookup drafts (and sometimes not)
    base = _repetitive(512, 4)
    with LLM(str(models["qwen3"]), **EXACT) as plain:
        greedy = plain.generate([base], SamplingParams(temperature=0, max_tokens=3))[0]
    prompt = [*base, *greedy.token_ids, *base]
    runs = 500
    params = [
        SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=3, ignore_eos=True)
        for s in range(runs)
    ]
    with LLM(str(models["qwen3"]), **EXACT, **SPEC, max_num_seqs=128) as spec:
        outs = spec.generate([prompt] * runs, params)
        sched = spec.engine.scheduler
        assert sched.num_draft_tokens > sched.num_accepted_tokens > 0  # both rules ran
        again = spec.generate([prompt] * 8, params[:8])
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:8]]  # seeds repeat
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1

    hf = AutoModelForCausalLM.from_pretrained(str(models["qwen3"]), dtype=torch.float32).eval()

    def top3(prefix: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + prefix])).logits[0, -1]
        vals, ids = logits.topk(3)
        return dict(zip(ids.tolist(), vals.softmax(-1).tolist(), strict=True))

    assert_three_token_distribution(counts, top3, runs)


@needs_shared
def test_check_rows_are_decode_rows_and_a_graph_replays_them_as_planned(models):
    """A draft is checked as decode rows, one a token, each a token longer (the decode
    kernels, so greedy output does not change); the CUDA graph's host rows for such a step
    are the eager plan's, so a captured check step replays what the eager one runs."""
    from helexa.engine.cuda_graph import DecodeGraphs

    seen = []
    with LLM(str(models["llama"]), **EXACT, **SPEC) as spec:
        runner = spec.engine.runner
        real_plan = runner.plan

        def plan(batch):
            step = real_plan(batch)
            if any(s.draft for s in batch.seqs):
                seen.append(step)
                if DecodeGraphs.fits(SimpleNamespace(max_batch=512), batch):  # decode only
                    (ids, pos, slots, lens, _), _ = DecodeGraphs.host_rows(runner, batch)
                    assert (ids, pos, slots) == (step.ids, step.positions, step.slots)
                    assert lens == step.decode_lens
                    assert step.decode_rows == list(range(len(ids))) and not step.prefills
            return step

        runner.plan = plan
        prompts = [_repetitive(512, s) for s in range(3)]
        spec.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert seen and all(not step.prefills for step in seen[-3:])


def _oracle(monkeypatch, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """Drafts from the answers known in advance, each second one wrong halfway: every draft
    is checked on rows a decode step would also compute, most tokens are kept, and some
    rejections fall mid-draft (the random tiny models seldom repeat what prompt lookup finds)."""
    calls = [0]

    def propose(self, tokens, k):
        for prompt, out in zip(prompts, outputs, strict=True):
            if tokens[: len(prompt)] == prompt:
                done = len(tokens) - len(prompt)
                draft = list(out[done : done + k])
                calls[0] += 1
                if calls[0] % 2 and len(draft) > 1:
                    draft[len(draft) // 2] = (draft[len(draft) // 2] + 1) % 512
                return draft
        return []

    monkeypatch.setattr(NgramIndex, "propose", propose)


@needs_shared
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_greedy_tokens_stay_the_same_when_most_drafts_are_right(models, family, monkeypatch):
    """Drafts that are mostly right (see _oracle): many check rows past the first are kept,
    so each row's own context length and position matter, and the tokens stay the same."""
    prompts = [_repetitive(512, s) for s in range(4)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(str(models[family]), **EXACT) as plain:
        expected = [o.token_ids for o in plain.generate(prompts, params)]
    _oracle(monkeypatch, prompts, expected)
    with LLM(str(models[family]), **EXACT, **SPEC) as spec:
        assert [o.token_ids for o in spec.generate(prompts, params)] == expected
        sched = spec.engine.scheduler
        assert sched.num_draft_tokens > sched.num_accepted_tokens > sched.num_draft_tokens // 2


@needs_triton
@needs_shared
def test_the_triton_path_checks_drafts_as_its_decode_steps_would(models, monkeypatch):
    """The Triton backend (the GPU's; the interpreter here): a check step's rows each get a
    context length and block table of their own, and greedy tokens do not change."""
    prompts = [_repetitive(512, s) for s in range(3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    triton = dict(kernels="triton", kv_cache_memory_mb=8, dtype="float32")
    with LLM(str(models["llama"]), **triton) as plain:
        expected = [o.token_ids for o in plain.generate(prompts, params)]
    _oracle(monkeypatch, prompts, expected)
    with LLM(str(models["llama"]), **triton, **SPEC) as spec:
        assert [o.token_ids for o in spec.generate(prompts, params)] == expected
        sched = spec.engine.scheduler
        assert sched.num_draft_tokens > sched.num_accepted_tokens > sched.num_draft_tokens // 2
