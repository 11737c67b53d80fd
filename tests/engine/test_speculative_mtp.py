"""Speculative decoding with the checkpoint's multi-token-prediction head (issue 38, vLLM's
"mtp"), on tiny random Qwen3.5 and Qwen3.5-MoE models with a tiny random head written into
the checkpoint as HF lays it out (`mtp.*`). The head's forward over the paged cache is what
a plain-torch reference of vLLM's math computes; the engine's drafts are what that reference
drafts from the target's hidden states (transformers'); greedy output is token for token
the same with the head as without, in mixed batches, under preemption and after a cached
prefix; sampled output has the target's distribution and a seed repeats its tokens; a
checkpoint without the head is refused at load.

As in test_speculative_hybrid.py the prompts are made of four tokens that every request
biases far above the rest; here their lm_head rows are scaled up too, so that the head (which
reads no bias) mostly drafts among them, and its drafts are partly accepted, partly not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helexa.engine import LLM, SamplingParams
from helexa.engine.spec.mtp import naive_mtp, naive_propose
from helexa.engine.spec.mtp_drafter import _Row
from tests.engine.test_speculative import EXACT, assert_three_token_distribution
from tests.engine.test_speculative_hybrid import FEW, IM_START, _few, _greedy
from tests.engine.tiny import FIXTURE_MODELS, make_tiny_model, tiny_hf_model
from tests.shared_fixtures import needs_shared

pytestmark = [needs_shared, pytest.mark.usefixtures("check_every_draft")]

MTP = dict(speculative_method="mtp", num_speculative_tokens=3)


def _with_mtp_head(model_dir: Path, seed: int = 5) -> None:
    """Write a random MTP head into the checkpoint in the HF layout: its layer a noisy copy
    of the target's last full-attention layer (dense or MoE, as the target's), `fc` and the
    norms random (norms stored as offsets from one, as Qwen3.5 stores them)."""
    from safetensors.torch import load_file, save_file

    file = next(model_dir.glob("*.safetensors"))
    tensors = load_file(file)
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if ".layers.3." in n]:
        t = tensors[name]
        noise = torch.randn(t.shape, generator=g) * 0.05 * t.std()
        tensors["mtp.layers.0." + name.split(".layers.3.")[1]] = t + noise
    hidden = next(t for n, t in tensors.items() if n.endswith("embed_tokens.weight")).shape[1]
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.1
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=g) * 0.1
    save_file(tensors, file, metadata={"format": "pt"})


def _make(kind: str, root: Path, *, head: bool = True):
    """`kind` with tiny random weights, FEW's lm_head rows scaled up, the SmolLM2 tokenizer
    and (with `head`) an MTP head; returns (dir, transformers' model)."""
    hf = tiny_hf_model(kind)
    with torch.no_grad():
        hf.lm_head.weight[FEW] *= 30
    out = root / (kind if head else f"{kind}-no-head")
    hf.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(FIXTURE_MODELS / "SmolLM2-135M-Instruct" / f, out / f)
    if head:
        _with_mtp_head(out)
    return out, hf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_mtp")
    return {kind: _make(kind, root) for kind in ("qwen3_5", "qwen3_5_moe")}


def _reference(model_dir: Path) -> tuple[dict, dict, torch.Tensor, torch.Tensor]:
    """The checkpoint's head tensors (without `mtp.`), text config, embeddings and lm_head."""
    from safetensors.torch import load_file

    tensors = load_file(next(model_dir.glob("*.safetensors")))
    cfg = json.loads((model_dir / "config.json").read_text())
    head = {n.removeprefix("mtp."): t for n, t in tensors.items() if n.startswith("mtp.")}
    embed = next(t for n, t in tensors.items() if n.endswith("embed_tokens.weight"))
    return head, cfg.get("text_config", cfg), embed, tensors["lm_head.weight"]


def _target_hidden(hf, tokens: list[int]) -> torch.Tensor:
    """transformers' final hidden states (after the last norm) of `tokens`: [n, H]."""
    decoder = getattr(hf.model, "language_model", hf.model)
    with torch.no_grad():
        return decoder(input_ids=torch.tensor([tokens])).last_hidden_state[0]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_the_heads_forward_over_its_paged_cache_is_the_reference(models, family):
    """A 45-position sequence in two chunks (the second reads the first's KV from the
    head's cache through a block table) against the whole sequence in plain torch."""
    model_dir, _ = models[family]
    head, cfg, embed, _ = _reference(model_dir)
    g = torch.Generator().manual_seed(0)
    n, cut = 45, 29
    next_ids = torch.randint(3, 512, (n,), generator=g)
    hidden = torch.randn(n, embed.shape[1], generator=g)
    want = naive_mtp(head, cfg, embed, next_ids, hidden)
    with LLM(str(model_dir), **EXACT, **MTP, num_kv_blocks=8) as llm:
        drafter = llm.engine.runner.drafter
        blocks = [5, 2, 7]  # any blocks: the engine holds no sequence
        got = []
        for start, end in ((0, cut), (cut, n)):
            row = _Row([], start, end, blocks, n)
            ids = next_ids[start:end].tolist()
            got.append(drafter._forward([row], [end - start], ids, hidden[start:end]))
    got = torch.cat(got)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def _recorded(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Each draft the engine's head proposes, with the tokens it follows: filled as it runs."""
    drafter = llm.engine.runner.drafter
    propose, seen = drafter.propose, []

    def recording(batch):
        propose(batch)
        seen.extend((list(s.token_ids), list(s.draft)) for s in batch.seqs if s.draft)

    drafter.propose = recording
    return seen


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_the_drafts_are_what_the_reference_head_drafts_from_the_targets_hidden_states(
    models, family
):
    """Whatever the engine's head has cached across steps (prompt chunks, rejected drafts
    rolled back, drafts fed back), each draft is the reference's: at position i the
    embedding of token i+1 and transformers' hidden state at i, then its own out; a
    preempted sequence's head cache is computed again with its target's."""
    model_dir, hf = models[family]
    head, cfg, embed, lm_head = _reference(model_dir)
    prompts = [_few(s) for s in range(3)]
    seen = []
    # a pool of 8 blocks: the sequences preempt and recompute, the head's cache with them
    for extra in ({}, {"num_kv_blocks": 8}):
        with LLM(str(model_dir), **EXACT, **MTP, **extra) as llm:
            recorded = _recorded(llm)
            llm.generate(prompts, _greedy(24))
            seen += recorded
            assert llm.engine.scheduler.num_preemptions > 0 or not extra
    assert len(seen) >= 12 and max(len(d) for _, d in seen) > 1  # drafts fed back too
    for tokens, draft in seen:
        hidden = _target_hidden(hf, tokens)[:-1]
        want, logits = naive_propose(head, cfg, embed, lm_head, tokens, hidden, len(draft))
        for j, (a, b) in enumerate(zip(want, draft, strict=True)):
            # the same token, or a near tie the two computations may break either way
            assert a == b or float(logits[j][a] - logits[j][b]) < 1e-3, (tokens, want, draft)
            if a != b:
                break  # the reference drafts on from its own token


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_greedy_tokens_are_the_same_with_and_without_the_mtp_head(models, family):
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
        with LLM(model_dir, **EXACT, **MTP, **extra) as spec:
            got = spec.generate(prompts, params)
            sched = spec.engine.scheduler
            assert [o.token_ids for o in got] == [o.token_ids for o in expected], extra
            for a, b in zip(got[2].logprobs, expected[2].logprobs, strict=True):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            # drafts partly accepted, partly rejected (and rolled back)
            assert sched.num_draft_tokens > sched.num_accepted_tokens > 0, extra
            assert sched.rollback.num_rollbacks > 0
            if extra:
                assert sched.num_preemptions > 0


def test_a_second_turn_from_a_cached_prefix_answers_the_same_with_the_mtp_head(models):
    model_dir = str(models["qwen3_5"][0])
    first = [*_few(3, 40), IM_START, 40, 41]
    params = _greedy(24)
    with LLM(model_dir, **EXACT, enable_prefix_caching=False) as plain:
        reply = plain.generate([first], params)[0].token_ids
        second = [*first, *reply, 42, 43, IM_START, 40, 41]
        want = [plain.generate([p], params)[0].token_ids for p in (first, second)]
    with LLM(model_dir, **EXACT, **MTP) as spec:
        got = [spec.generate([p], params)[0] for p in (first, second)]
        assert got[1].num_cached_tokens == len(first) - 2  # up to the first <|im_start|>
        assert [o.token_ids for o in got] == want
        assert spec.engine.scheduler.num_accepted_tokens > 0


def test_sampled_tokens_have_the_targets_distribution_and_seeds_repeat(models):
    """500 seeded runs of 3 tokens among three (the three biased, top-k 3: 27 outcomes) whose
    drafts, the head's argmax, are checked by the accept/reject rule, against the exact
    probabilities transformers gives each path. The scaled lm_head rows make logits that
    span ±45 among the four: the three get +100, the fourth -100, and temperature 16 gives
    every path among the three some weight."""
    model_dir, hf = models["qwen3_5"]
    few, temperature = FEW[:3], 16.0
    prompt = [t for t in _few(7, 40) if t in few]
    runs = 500
    params = [
        SamplingParams(
            temperature=temperature,
            top_k=3,
            seed=s,
            max_tokens=3,
            ignore_eos=True,
            logit_bias={t: 100.0 if t in few else -100.0 for t in FEW},
        )
        for s in range(runs)
    ]
    with LLM(str(model_dir), **EXACT, **MTP, max_num_seqs=64) as spec:
        outs = spec.generate([prompt] * runs, params)
        sched = spec.engine.scheduler
        assert sched.num_draft_tokens > sched.num_accepted_tokens > 0  # both rules ran
        again = spec.generate([prompt] * 8, params[:8])
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:8]]  # seeds repeat
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1

    def probs(prefix: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt + prefix])).logits[0, -1]
        return dict(zip(few, (logits[few] / temperature).softmax(-1).tolist(), strict=True))

    assert_three_token_distribution(counts, probs, runs)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_two_tensor_parallel_ranks_check_the_mtp_heads_drafts_as_one_rank_does(models, family):
    """Under tensor parallel the head runs whole on rank 0, on whole copies of the target's
    embeddings and lm_head (the target's are split by vocabulary), from the target's hidden
    states, which rank 0 holds whole: the greedy tokens are one rank's without the head,
    and its drafts are those one rank's head drafts."""
    model_dir = str(models[family][0])
    prompts = [_few(s) for s in range(3)]
    params = _greedy(20)
    cpu = dict(EXACT, device="cpu", num_kv_blocks=64)
    with LLM(model_dir, **cpu) as plain:
        expected = [o.token_ids for o in plain.generate(prompts, params)]
    with LLM(model_dir, **cpu, **MTP) as one:
        one.generate(prompts, params)
        drafted = one.engine.scheduler.num_draft_tokens, one.engine.scheduler.num_accepted_tokens
    with LLM(model_dir, tensor_parallel=2, **cpu, **MTP) as two:
        assert [o.token_ids for o in two.generate(prompts, params)] == expected
        sched = two.engine.scheduler
        assert sched.num_draft_tokens > sched.num_accepted_tokens > 0
        assert (sched.num_draft_tokens, sched.num_accepted_tokens) == drafted
        vocab = two.engine.runner.drafter.model.vocab
        assert vocab.embed_tokens.weight.shape[0] == two.engine.loaded.config.vocab_size


def test_a_checkpoint_without_an_mtp_head_is_refused_at_load(tmp_path):
    bare, _ = _make("qwen3_5_text", tmp_path, head=False)
    with pytest.raises(ValueError, match=r"has no MTP weights \(mtp\.\*\)"):
        LLM(str(bare), **EXACT, **MTP, num_kv_blocks=16)
    llama = make_tiny_model("smollm2", tmp_path)[0]
    with pytest.raises(ValueError, match="'llama' has none"):
        LLM(str(llama), **EXACT, **MTP, num_kv_blocks=16)


def test_the_node_reports_the_mtp_head_and_its_memory(models):
    from helexa.engine.model_runner import model_memory_mb
    from helexa.engine.worker import model_facts

    model_dir = str(models["qwen3_5"][0])
    with LLM(model_dir, **EXACT, **MTP, num_kv_blocks=32) as spec:
        facts = model_facts(spec.engine)
        head_mb = model_memory_mb(spec.engine.runner.drafter.model)
        target_mb = model_memory_mb(spec.engine.runner.model)
    assert facts.speculative_method == "mtp"
    assert facts.memory_mb == target_mb + head_mb
