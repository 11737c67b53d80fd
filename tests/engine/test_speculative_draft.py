"""Speculative decoding with a draft model (issue 38, vLLM's "draft_model"): greedy output
is token for token the same with it as without, for llama, qwen3 and qwen3_moe targets, in
mixed batches where some rows do not speculate, under preemption and with a prefix cached;
a draft that is the target itself has every draft accepted (its cache holds what the
target's holds, prompt steps and cached prefixes included); sampled output has the
target's distribution and a seed repeats its tokens; a draft whose tokenizer is not the
target's is refused at load, and one whose table has fewer rows drafts on."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from helexa.engine import LLM, SamplingParams
from tests.engine.test_speculative import EXACT, _repetitive, assert_three_token_distribution
from tests.engine.tiny import make_tiny_model, make_tiny_new_family
from tests.shared_fixtures import needs_shared

pytestmark = [needs_shared, pytest.mark.usefixtures("check_every_draft")]

K = dict(speculative_method="draft_model", num_speculative_tokens=3)


def _perturbed(src: Path, dst: Path, scale: float = 0.05) -> Path:
    """A copy of the model at `src` with noise on its weights: a draft that agrees with it
    often, and not always."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(1)
    for f in dst.glob("*.safetensors"):
        tensors = {
            name: t + torch.randn(t.shape, generator=g) * scale * t.std() if t.dim() > 1 else t
            for name, t in load_file(f).items()
        }
        save_file(tensors, f, metadata={"format": "pt"})
    return dst


def _narrowed(src: Path, dst: Path, rows: int) -> Path:
    """A perturbed copy of the model at `src` with only its first `rows` vocabulary rows (a
    table padded less, as a family's small model often is)."""
    import json

    from safetensors.torch import load_file, save_file

    _perturbed(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = {
            name: t[:rows].contiguous() if name.endswith(("embed_tokens.weight", "lm_head.weight"))
            else t
            for name, t in load_file(f).items()
        }  # fmt: skip
        save_file(tensors, f, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "vocab_size": rows}))
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each family's target, and a perturbed copy of it to draft for it."""
    root = tmp_path_factory.mktemp("draft")
    targets = {
        "llama": make_tiny_model("smollm2", root)[0],
        "qwen3": make_tiny_model("qwen3", root)[0],
        "qwen3_moe": make_tiny_new_family("qwen3_moe", root)[0],
    }
    drafts = {f: _perturbed(p, root / f"{f}-draft") for f, p in targets.items()}
    return targets, drafts


def _prompts(n: int) -> list[list[int]]:
    """Prompts that repeat themselves and prompts that do not."""
    rng = random.Random(7)
    noise = [[rng.randrange(3, 512) for _ in range(rng.randrange(8, 60))] for _ in range(n)]
    return [_repetitive(512, s) if s % 2 else noise[s] for s in range(n)]


PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),  # max_tokens mid-draft
    SamplingParams(temperature=0, max_tokens=12, min_tokens=14, ignore_eos=True),  # none
    SamplingParams(temperature=0, logprobs=2, max_tokens=12, ignore_eos=True),  # no draft
    SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
]


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_greedy_tokens_are_the_same_with_a_draft_model_and_without(models, family):
    targets, drafts = models
    target = str(targets[family])
    prompts = _prompts(len(PARAMS))
    with LLM(target, **EXACT) as plain:
        expected = plain.generate(prompts, PARAMS)
    # the target drafting for itself, then a model that often disagrees with it; a pool of
    # 12 blocks makes the batch preempt and recompute as it grows
    for draft in (target, str(drafts[family])):
        for extra in ({}, {"num_kv_blocks": 12}):
            case = (draft, extra)
            with LLM(target, **EXACT, **K, speculative_model=draft, **extra) as spec:
                got = spec.generate(prompts, PARAMS)
                stats = spec.engine.stats()
                preemptions = spec.engine.scheduler.num_preemptions
            assert [o.token_ids for o in got] == [o.token_ids for o in expected], case
            assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
            for a, b in zip(got[3].logprobs, expected[3].logprobs, strict=True):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            drafted, accepted = stats.spec_draft_tokens, stats.spec_accepted_tokens
            if draft == target:  # the same model over the same cached positions: all kept
                assert accepted == drafted > 0, case
            else:
                assert 0 < accepted < drafted, case
            if extra:
                assert preemptions > 0


def test_a_prefix_cached_by_one_request_serves_the_draft_model_of_the_next(models):
    targets, _ = models
    target = str(targets["llama"])
    rng = random.Random(3)
    shared = [rng.randrange(3, 512) for _ in range(50)]  # three blocks of 16, and 2 tokens
    first, second = [*shared, 7, 8, 9], [*shared, 11, 12]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(target, **EXACT) as plain:
        expected = [plain.generate([p], params)[0].token_ids for p in (first, second)]
    with LLM(target, **EXACT, **K, speculative_model=target) as spec:
        got = [spec.generate([p], params)[0].token_ids for p in (first, second)]
        bm, stats = spec.engine.block_manager, spec.engine.stats()
    assert got == expected
    assert bm.num_prefix_hits >= 48  # the second prompt's three full blocks came cached
    # every draft of the second answer read the first one's prompt from the draft's cache
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0


def test_the_node_reports_the_draft_models_method_and_memory(models):
    from helexa.engine.model_runner import model_memory_mb
    from helexa.engine.worker import model_facts

    targets, drafts = models
    target = str(targets["qwen3"])
    with LLM(target, **EXACT, num_kv_blocks=32) as plain:
        alone = model_facts(plain.engine).memory_mb
    with LLM(
        target, **EXACT, **K, speculative_model=str(drafts["qwen3"]), num_kv_blocks=32
    ) as spec:
        facts = model_facts(spec.engine)
        draft_mb = model_memory_mb(spec.engine.runner.drafter.model)
    assert facts.speculative_method == "draft_model"
    assert facts.memory_mb == alone + draft_mb


def test_sampled_tokens_have_the_targets_distribution_with_a_draft_model(models):
    """500 seeded runs of 3 tokens (temperature 1, top-k 3: 27 outcomes) whose drafts, the
    draft model's argmax, are checked by the accept/reject rule, against the exact
    probabilities the model gives each path."""
    from transformers import AutoModelForCausalLM

    targets, drafts = models
    target = str(targets["qwen3"])
    prompt = _repetitive(512, 4)
    runs = 500
    params = [
        SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=3, ignore_eos=True)
        for s in range(runs)
    ]
    spec = LLM(target, **EXACT, **K, speculative_model=str(drafts["qwen3"]), max_num_seqs=128)
    with spec:
        outs = spec.generate([prompt] * runs, params)
        sched = spec.engine.scheduler
        assert sched.num_draft_tokens > sched.num_accepted_tokens > 0  # both rules ran
        again = spec.generate([prompt] * 8, params[:8])
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:8]]  # seeds repeat
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1

    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def top3(prefix: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + prefix])).logits[0, -1]
        vals, ids = logits.topk(3)
        return dict(zip(ids.tolist(), vals.softmax(-1).tolist(), strict=True))

    assert_three_token_distribution(counts, top3, runs)


def test_a_draft_model_with_fewer_vocabulary_rows_drafts_and_keeps_the_greedy_tokens(
    models, tmp_path
):
    """The draft reads the target's ids past its rows as its last row and proposes only ids
    it has: drafts are kept where the target's choice lies within its rows, and greedy output
    is the target's own (eager steps and the draft's decode graphs read ids alike)."""
    targets, _ = models
    target = str(targets["llama"])
    narrow = str(_narrowed(targets["llama"], tmp_path / "narrow", 384))
    prompts = _prompts(len(PARAMS))
    with LLM(target, **EXACT) as plain:
        expected = [o.token_ids for o in plain.generate(prompts, PARAMS)]
    assert any(t >= 384 for ids in expected for t in ids)  # the draft meets ids it lacks
    with LLM(target, **EXACT, **K, speculative_model=narrow) as spec:
        assert [o.token_ids for o in spec.generate(prompts, PARAMS)] == expected
        stats = spec.engine.stats()
        assert spec.engine.runner.drafter.runner.id_limit == 384
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens


def test_a_draft_model_of_another_vocabulary_is_refused_at_load(models, tmp_path):
    targets, _ = models
    llama, moe = str(targets["llama"]), str(targets["qwen3_moe"])
    hybrid = make_tiny_new_family("qwen3_5_text", tmp_path)[0]  # the Qwen3 tokenizer
    cases = [
        (llama, moe, "its tokenizer has 151669 tokens, this model's 49152"),
        (moe, str(hybrid), "is a hybrid"),
    ]
    for target, draft, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(target, **EXACT, **K, speculative_model=draft, num_kv_blocks=16)
    with pytest.raises(ValueError, match="needs speculative_model"):
        LLM(llama, **EXACT, **K, num_kv_blocks=16)


def test_two_tensor_parallel_ranks_check_the_drafts_of_a_draft_model_on_rank_0(models):
    targets, drafts = models
    target = str(targets["qwen3"])
    prompts = _prompts(3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    cpu = dict(EXACT, device="cpu", num_kv_blocks=64)
    with LLM(target, **cpu) as plain:
        expected = [o.token_ids for o in plain.generate(prompts, params)]
    draft = str(drafts["qwen3"])
    with LLM(target, tensor_parallel=2, **cpu, **K, speculative_model=draft) as two:
        assert [o.token_ids for o in two.generate(prompts, params)] == expected
        sched = two.engine.scheduler
        assert sched.num_draft_tokens > sched.num_accepted_tokens > 0
