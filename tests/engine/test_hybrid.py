"""Qwen3-MoE and Qwen3.5 (hybrid Gated DeltaNet) families: parity with transformers, and the
recurrent state each sequence holds (allocation, preemption, abort, prefix snapshots)."""

from __future__ import annotations

import pytest
import torch

from helexa.engine import LLM, SamplingParams
from helexa.engine.layers.linear import Linear
from tests.engine.test_parity import (
    EXACT,
    LOGITS_ATOL,
    _prompts,
    _record_logits,
    assert_matches_transformers,
)
from tests.engine.tiny import make_tiny_new_family
from tests.shared_fixtures import needs_shared

pytestmark = needs_shared

KINDS = ("qwen3_moe", "qwen3_5", "qwen3_5_text", "qwen3_5_moe")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_greedy_tokens_match_transformers_for_a_mixed_batch(kind, tmp_path):
    model_dir, hf = make_tiny_new_family(kind, tmp_path)
    # Small chunks: long prompts prefill in pieces (the recurrent state carried from chunk to
    # chunk) while short ones already decode in the same steps.
    llm = LLM(str(model_dir), **EXACT)
    assert_matches_transformers(llm, hf, _prompts(512), kind)


def test_the_vision_tower_loads_with_the_decoder_and_text_only_layouts_take_no_images(tmp_path):
    model_dir, _ = make_tiny_new_family("qwen3_5", tmp_path)
    llm = LLM(str(model_dir), kv_cache_memory_mb=8)
    model = llm.engine.runner.model
    assert model.visual is not None and llm.engine.loaded.vision is not None
    assert len(model.recurrent_layers) == 2 and len(model.attention_layers) == 2
    text_dir, _ = make_tiny_new_family("qwen3_5_text", tmp_path)
    text = LLM(str(text_dir), kv_cache_memory_mb=8)
    assert text.engine.loaded.vision is None
    with pytest.raises(ValueError, match="takes no images"):
        text.engine.make_sequence([1, 2], SamplingParams(), images=[object()])


def test_float_experts_are_stacked_and_run_through_the_fused_moe_kernel(tmp_path, monkeypatch):
    import helexa.engine.layers.moe as moe

    model_dir, _ = make_tiny_new_family("qwen3_moe", tmp_path)
    llm = LLM(str(model_dir), kv_cache_memory_mb=8)
    experts = llm.engine.runner.model.layers[0].mlp.experts
    assert tuple(experts.w13.shape) == (6, 64, 64) and tuple(experts.w2.shape) == (6, 64, 32)
    calls = []
    real = moe.kernels.fused_moe

    def recording(x, w13, w2, weights, ids):
        calls.append(tuple(ids.shape))
        return real(x, w13, w2, weights, ids)

    monkeypatch.setattr(moe.kernels, "fused_moe", recording)
    llm.generate([list(range(3, 43))], SamplingParams(temperature=0, max_tokens=1))
    # the two sparse layers, each token's top-2; the last one's MLP takes the sampled row alone
    assert calls == [(40, 2), (1, 2)]


def test_quantized_experts_stay_quantized_and_run_on_their_own_tokens_only(tmp_path):
    model_dir, _ = make_tiny_new_family("qwen3_moe", tmp_path)
    # the CPU's packed int4 (an accelerator stacks the experts' blocks for its fused kernel)
    llm = LLM(
        str(model_dir), device="cpu", kv_cache_memory_mb=8, quant="int4", cpu_dense_copy=False
    )
    model = llm.engine.runner.model
    rows = []
    for layer in (model.layers[0], model.layers[2]):
        experts = layer.mlp.experts
        formats = {m.format for m in experts.modules() if isinstance(m, Linear)}
        assert experts.w13 is None and formats == {"int4"}
        for expert in experts:
            real = expert.forward
            expert.forward = lambda x, real=real: rows.append(x.shape[0]) or real(x)
    out = llm.generate([list(range(3, 43))], SamplingParams(temperature=0, max_tokens=1))[0]
    assert len(out.token_ids) == 1
    # top-2 of 40 tokens in the first sparse layer, of the sampled one in the last (its MLP
    # takes the sampled row alone): each expert saw only its own rows, never all 40
    assert sum(rows) == 40 * 2 + 1 * 2 and max(rows) < 40, rows


# ---- recurrent state and prefix snapshots ---------------------------------------------------


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    # SmolLM2's tokenizer: its special tokens (<|im_start|> = 1, <|im_end|> = 2) sit below
    # the tiny vocabulary, so token-id prompts can carry them.
    model_dir, _ = make_tiny_new_family(
        "qwen3_5", tmp_path_factory.mktemp("hybrid"), tokenizer="SmolLM2-135M-Instruct"
    )
    return str(model_dir)


IM_START = 1


def _engine(model_dir: str, **kw) -> LLM:
    kw.setdefault("kv_cache_memory_mb", 8)
    return LLM(model_dir, dtype="float32", block_size=16, max_prefill_chunk=24, **kw)


def _turn(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(20, 512, (n,), generator=g).tolist()


def _chat(lengths: list[int]) -> list[list[int]]:
    """Prompts of a growing conversation: each turn's prompt is the previous one, a reply,
    and an assistant header `<|im_start|> x y`, so its last special token sits 3 from the end."""
    prompts, tokens = [], []
    for i, n in enumerate(lengths):
        tokens = [*tokens, *_turn(n, i), IM_START, 30, 31]
        prompts.append(tokens)
    return prompts


@pytest.mark.parametrize("first", [37, 47])  # turn 1's boundary mid-block (38) or on one (48)
def test_the_next_turn_resumes_from_the_snapshot_and_matches_a_run_without_cache(hybrid_dir, first):
    prompts = _chat([first, 29, 50])
    cached, plain = _engine(hybrid_dir), _engine(hybrid_dir, enable_prefix_caching=False)
    seen_c, seen_p = _record_logits(cached), _record_logits(plain)
    for i, prompt in enumerate(prompts):
        a = cached.generate([prompt], GREEDY)[0]
        b = plain.generate([prompt], GREEDY)[0]
        boundary = len(prompt) - 2  # just after <|im_start|>
        want_cached = 0 if i == 0 else len(prompts[i - 1]) - 2
        assert a.num_cached_tokens == want_cached, (i, a.num_cached_tokens)
        assert b.num_cached_tokens == 0
        assert a.token_ids == b.token_ids, i
        diff = (torch.stack(seen_c[a.request_id]) - torch.stack(seen_p[b.request_id])).abs()
        assert diff.max().item() <= LOGITS_ATOL, (i, diff.max().item())
        assert cached.engine.state_manager.has(prompt[:boundary])
    # each turn's snapshot extends the previous one, which is dropped
    assert cached.engine.state_manager.num_snapshots == 1


def test_a_block_aligned_boundary_needs_no_partial_block(hybrid_dir):
    prompt = [*_turn(31, 5), IM_START, 30, 31]  # boundary 32 = two whole blocks
    llm = _engine(hybrid_dir)
    llm.generate([prompt], GREEDY)
    snap = next(iter(llm.engine.state_manager._snapshots.values()))
    assert snap.length == 32 and snap.tail_block is None
    again = llm.generate([[*prompt, 40, 41]], GREEDY)[0]
    assert again.num_cached_tokens == 32


def test_a_prompt_without_a_special_token_takes_no_snapshot_and_caches_nothing(hybrid_dir):
    llm = _engine(hybrid_dir)
    prompt = _turn(40, 9)
    llm.generate([prompt], GREEDY)
    out = llm.generate([[*prompt, 40, 41]], GREEDY)[0]
    assert llm.engine.state_manager.num_snapshots == 0
    assert out.num_cached_tokens == 0  # KV blocks alone cannot resume a recurrent state


def test_snapshots_are_bounded_and_dropped_least_recently_used(hybrid_dir):
    llm = _engine(hybrid_dir, max_prefix_snapshots=2)
    sm = llm.engine.state_manager
    chats = [[*_turn(20, s), IM_START, 30, 31] for s in (1, 2, 3)]
    for prompt in chats:
        llm.generate([prompt], GREEDY)
    assert sm.num_snapshots == 2
    assert not sm.has(chats[0][:-2]) and sm.has(chats[2][:-2])
    out = llm.generate([[*chats[0], 5]], GREEDY)[0]
    assert out.num_cached_tokens == 0


def test_state_rows_come_back_after_finish_abort_and_a_failed_step(hybrid_dir):
    llm = _engine(hybrid_dir, max_num_seqs=4, max_prefix_snapshots=2)
    engine = llm.engine
    sm = engine.state_manager
    free_at_start = len(sm._free)
    assert free_at_start == 6
    llm.generate([_turn(30, 1), _turn(10, 2)], GREEDY)
    assert len(sm._free) == free_at_start
    # abort mid-prefill
    seq = engine.add_request(_turn(60, 3), GREEDY)
    engine.step()
    assert seq.state_slot >= 0 and len(sm._free) == free_at_start - 1
    engine.abort(seq.request_id)
    assert seq.state_slot == -1 and len(sm._free) == free_at_start
    # a step that raises fills no snapshot and keeps no reservation
    runner = engine.runner
    real = runner.model.forward

    def broken(*a, **kw):
        raise RuntimeError("device fault")

    runner.model.forward = broken
    seq = engine.add_request([*_turn(10, 4), IM_START, 30], GREEDY)
    with pytest.raises(RuntimeError, match="device fault"):
        engine.step()
    runner.model.forward = real
    engine.abort(seq.request_id)
    assert len(sm._free) == free_at_start and sm.num_snapshots == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preempted_hybrid_sequences_recompute_their_state(hybrid_dir):
    prompts = [_turn(40, s) for s in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = _engine(hybrid_dir).generate(prompts, params)
    # 12 blocks of 16 tokens cannot hold four 64-token sequences at once
    tight = _engine(hybrid_dir, num_kv_blocks=12)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert len(tight.engine.state_manager._free) == tight.engine.state_manager.num_slots


def test_a_batch_of_turns_sharing_a_snapshot_all_resume_from_it(hybrid_dir):
    base = [*_turn(37, 11), IM_START, 30, 31]
    llm, plain = _engine(hybrid_dir), _engine(hybrid_dir, enable_prefix_caching=False)
    llm.generate([base], GREEDY)
    nexts = [[*base, *_turn(n, 20 + n), IM_START, 30] for n in (3, 17, 40)]
    outs = llm.generate(nexts, GREEDY)
    refs = plain.generate(nexts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [len(base) - 2] * 3
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]


def test_large_states_lower_the_number_of_concurrent_sequences_instead_of_failing(hybrid_dir):
    # a state row of this model is ~16 KiB; half of 1 MiB holds 32 rows, not 64 + 8
    llm = _engine(hybrid_dir, kv_cache_memory_mb=1)
    engine = llm.engine
    rows = engine.state_manager.num_slots
    assert rows <= 32 and engine.scheduler.config.max_num_seqs < rows
    assert engine.state_manager.max_snapshots == rows - engine.scheduler.config.max_num_seqs
    outs = llm.generate([_turn(8, s) for s in range(40)], GREEDY)  # more than fit at once
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
