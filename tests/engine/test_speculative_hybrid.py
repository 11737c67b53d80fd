"""Speculative decoding on hybrid models (Qwen3.5: Gated DeltaNet layers beside attention):
a step that rejects drafts rolls the recurrent state back and recomputes what it kept
(spec/rollback.py). Greedy output is token for token what it is without speculation, in
mixed batches, under preemption and after a prefix snapshot; sampled output has the
target's distribution and a seed repeats its tokens; a row with no free state row to keep
its state in decodes without a draft.

The prompts are made of four tokens and every request biases those four far above the rest:
the model still chooses among them by its own logits (so a wrong state shows as a different
choice), and prompt lookup, which drafts from the same four, is right often enough that
drafts are partly accepted and partly rejected."""

from __future__ import annotations

import random

import pytest
import torch

from helexa.engine import LLM, SamplingParams
from tests.engine.test_speculative import EXACT, SPEC, assert_three_token_distribution
from tests.engine.tiny import make_tiny_new_family
from tests.shared_fixtures import needs_shared

pytestmark = [needs_shared, pytest.mark.usefixtures("check_every_draft")]

FEW = [40, 41, 42, 43]
BIAS = {t: 30.0 for t in FEW}
IM_START = 1  # SmolLM2's tokenizer: <|im_start|>, a special token (a snapshot boundary)


def _few(seed: int, n: int | None = None) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(FEW) for _ in range(n or rng.randrange(20, 50))]


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, logit_bias=BIAS, **kw
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_hybrid")
    return {
        kind: make_tiny_new_family(kind, root, tokenizer="SmolLM2-135M-Instruct")
        for kind in ("qwen3_5", "qwen3_5_moe")
    }


def _assert_rows_given_back(llm: LLM) -> None:
    sm = llm.engine.state_manager
    assert sm.num_free == sm.num_slots - sm.num_snapshots  # no lent row left behind


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_greedy_tokens_are_the_same_with_and_without_speculation(models, family):
    model_dir = str(models[family][0])
    prompts = [_few(s) for s in range(6)]
    params = [
        _greedy(32),
        _greedy(7),  # max_tokens mid-draft
        _greedy(12, logprobs=2),  # no draft: a row decoding one token beside the others
        _greedy(24, min_tokens=10),  # no draft before its 10th token
        _greedy(32),
        _greedy(20),
    ]
    with LLM(model_dir, **EXACT) as plain:
        expected = plain.generate(prompts, params)
    # a pool of 12 blocks: the batch preempts and recomputes as it grows
    for extra in ({}, {"num_kv_blocks": 12}):
        with LLM(model_dir, **EXACT, **SPEC, **extra) as spec:
            got = spec.generate(prompts, params)
            assert [o.token_ids for o in got] == [o.token_ids for o in expected], extra
            sched = spec.engine.scheduler
            rollback = sched.rollback
            # drafts partly accepted, partly rejected, and rolled back past what they kept
            assert sched.num_draft_tokens > sched.num_accepted_tokens > 0
            assert rollback.num_rollbacks > 0
            assert rollback.num_recomputed_tokens > rollback.num_rollbacks
            if extra:
                assert sched.num_preemptions > 0
            _assert_rows_given_back(spec)


def test_a_second_turn_resumes_from_its_snapshot_and_speculates_the_same(models):
    model_dir = str(models["qwen3_5"][0])
    first = [*_few(3, 40), IM_START, 40, 41]
    params = _greedy(24)
    with LLM(model_dir, **EXACT, enable_prefix_caching=False) as plain:
        reply = plain.generate([first], params)[0].token_ids
        second = [*first, *reply, 42, 43, IM_START, 40, 41]
        want = [plain.generate([p], params)[0].token_ids for p in (first, second)]
    with LLM(model_dir, **EXACT, **SPEC) as spec:
        got = [spec.generate([p], params)[0] for p in (first, second)]
        assert got[1].num_cached_tokens == len(first) - 2  # up to the first <|im_start|>
        assert [o.token_ids for o in got] == want
        assert spec.engine.scheduler.rollback.num_rollbacks > 0
        _assert_rows_given_back(spec)


def test_sampled_tokens_have_the_targets_distribution_and_seeds_repeat(models):
    """500 seeded runs of 3 tokens among three (temperature 1, the three biased, top-k 3:
    27 outcomes), drafts checked by the accept/reject rule and rejected ones rolled back,
    against the exact probabilities transformers gives each path."""
    model_dir, hf = models["qwen3_5"]
    few = FEW[:3]
    prompt = _few(7, 40)
    prompt = [t for t in prompt if t in few]
    runs = 500
    params = [
        SamplingParams(
            temperature=1.0,
            top_k=3,
            seed=s,
            max_tokens=3,
            ignore_eos=True,
            logit_bias={t: 30.0 for t in few},
        )
        for s in range(runs)
    ]
    with LLM(str(model_dir), **EXACT, **SPEC, max_num_seqs=64) as spec:
        outs = spec.generate([prompt] * runs, params)
        sched = spec.engine.scheduler
        assert sched.num_draft_tokens > sched.num_accepted_tokens > 0  # both rules ran
        assert sched.rollback.num_rollbacks > 0
        again = spec.generate([prompt] * 8, params[:8])
        _assert_rows_given_back(spec)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:8]]  # seeds repeat
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1

    def probs(prefix: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt + prefix])).logits[0, -1]
        return dict(zip(few, logits[few].softmax(-1).tolist(), strict=True))

    assert_three_token_distribution(counts, probs, runs)


def test_a_row_that_finds_no_free_state_row_decodes_without_a_draft(models):
    """Two sequences and no snapshots: two state rows in all. A alone has one spare and
    speculates; the step that admits B (B takes that row) checks no draft of A's, and
    neither drafts while both run. A's answer is what it is without speculation."""
    model_dir = str(models["qwen3_5"][0])
    a_prompt, b_prompt = _few(11, 30), _few(12, 30)
    params = _greedy(40)
    with LLM(model_dir, **EXACT) as plain:
        want = plain.generate([a_prompt], params)[0].token_ids
    with LLM(model_dir, **EXACT, **SPEC, max_num_seqs=2, max_prefix_snapshots=0) as spec:
        engine, sched = spec.engine, spec.engine.scheduler
        a = engine.add_request(a_prompt, params)
        while sched.num_drafts == 0:  # A's first draft
            engine.step()
        engine.add_request(b_prompt, params)
        drafts, before = sched.num_drafts, a.num_output_tokens
        engine.step()  # A drafted with a row free; B's admission took it
        assert sched.num_drafts == drafts and a.num_output_tokens == before + 1
        while engine.has_unfinished():
            engine.step()
            if not a.is_finished:
                assert sched.num_drafts == drafts  # no row to spare while both run
        assert a.output_token_ids == want
        _assert_rows_given_back(spec)


def test_two_tensor_parallel_ranks_roll_back_as_one_does(models):
    """The lent rows' copies travel in the step's plan and the rows a rollback swaps are rank
    0's books alone: the other ranks take each step's rows from its plan."""
    model_dir = str(models["qwen3_5"][0])
    prompts = [_few(s) for s in range(3)]
    params = _greedy(20)
    cpu = dict(EXACT, device="cpu", num_kv_blocks=64)
    with LLM(model_dir, **cpu) as plain:
        expected = [o.token_ids for o in plain.generate(prompts, params)]
    with LLM(model_dir, tensor_parallel=2, **cpu, **SPEC) as two:
        assert [o.token_ids for o in two.generate(prompts, params)] == expected
        assert two.engine.scheduler.rollback.num_rollbacks > 0


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_a_draft_model_drafts_for_a_hybrid_target_and_its_rollbacks(models, family, tmp_path):
    """A non-hybrid draft model (a tiny llama on the same tokenizer) drafting for a hybrid
    target: its drafts (proposed with the request's logit bias, as the target samples) are
    partly kept, the target's state rolls back past the rest, a rolled-back row's several
    own tokens reach the draft model too, and greedy tokens are those without speculation,
    also under preemption."""
    from tests.engine.tiny import make_tiny_model

    draft = str(make_tiny_model("smollm2", tmp_path)[0])  # SmolLM2's tokenizer, 512 rows
    model_dir = str(models[family][0])
    prompts = [_few(s) for s in range(4)]
    params = [_greedy(24), _greedy(9), _greedy(16, logprobs=1), _greedy(24)]
    with LLM(model_dir, **EXACT) as plain:
        expected = [o.token_ids for o in plain.generate(prompts, params)]
    for extra in ({}, {"num_kv_blocks": 12}):
        with LLM(
            model_dir, **EXACT, speculative_method="draft_model", speculative_model=draft,
            num_speculative_tokens=3, **extra,
        ) as spec:  # fmt: skip
            assert [o.token_ids for o in spec.generate(prompts, params)] == expected, extra
            sched = spec.engine.scheduler
            assert sched.num_draft_tokens > sched.num_accepted_tokens > 0
            assert sched.rollback.num_rollbacks > 0
            _assert_rows_given_back(spec)
