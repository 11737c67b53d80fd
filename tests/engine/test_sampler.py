"""The sampler: on CPU the same tokens, logprobs and generator draws as the sampler before
the sampling kernels (kept below, as it was); `sample` returns tokens on the device; on a GPU
it never waits for the device, and a seed gives the tokens it gives on CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helexa import kernels
from helexa.engine.layers.sampler import Sampler
from helexa.engine.sampling_params import SamplingParams
from helexa.engine.sequence import TokenLogprob
from tests.kernels import needs_triton

# -- the sampler before helexa.kernels.apply_penalties / sample, verbatim ---------------------


def _old_apply_penalties(logits, seqs) -> None:
    vocab = logits.shape[-1]
    for i, seq in enumerate(seqs):
        p = seq.params
        if not p.has_penalties:
            continue
        row = logits[i]
        out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
        out = out[out < vocab]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(seq.token_ids, dtype=torch.long, device=logits.device)
            seen = seen[seen < vocab].unique()
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if (p.frequency_penalty or p.presence_penalty) and out.numel():
            counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
            counts.scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _old_apply_logit_bias(logits, seqs) -> None:
    for i, seq in enumerate(seqs):
        bias = seq.params.logit_bias
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
            values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
            logits[i].index_add_(0, ids, values)


def _old_filter(logits, seqs):
    dev = logits.device
    temps = torch.tensor([s.params.temperature or 1.0 for s in seqs], device=dev)
    logits = logits / temps.unsqueeze(1)
    top_ks = [s.params.top_k for s in seqs]
    top_ps = [s.params.top_p for s in seqs]
    min_ps = [s.params.min_p for s in seqs]
    if any(top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=dev)
        ranks = torch.arange(vocab, device=dev).unsqueeze(0)
        drop = ranks >= ks.unsqueeze(1)
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        cum = probs.cumsum(-1) - probs
        drop |= cum > torch.tensor(top_ps, device=dev).unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    if any(min_ps):
        floor = torch.tensor(min_ps, device=dev).unsqueeze(1) * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def old_sampler(logits, seqs):
    logits = logits.float()
    want_logprobs = any(s.params.logprobs is not None for s in seqs)
    raw_logprobs = logits.log_softmax(-1) if want_logprobs else None
    if any(s.params.has_penalties or s.params.logit_bias for s in seqs):
        logits = logits.clone()
        _old_apply_penalties(logits, seqs)
        _old_apply_logit_bias(logits, seqs)
    greedy = [s.params.is_greedy for s in seqs]
    tokens = logits.argmax(-1)
    if not all(greedy):
        probs = _old_filter(logits, seqs)
        noise = torch.empty_like(probs)
        for i, seq in enumerate(seqs):
            if greedy[i]:
                continue
            g = seq.generator
            if g is None or noise.device.type == "cpu":
                noise[i].exponential_(generator=g)
            else:
                noise[i].copy_(torch.empty(noise.shape[1]).exponential_(generator=g))
        is_greedy = torch.tensor(greedy, device=noise.device)
        noise[is_greedy] = 1.0
        sampled = (probs / noise).argmax(-1)
        tokens = torch.where(is_greedy, tokens, sampled)
    token_list = tokens.tolist()
    if raw_logprobs is None:
        return token_list, None
    lps = []
    for i, seq in enumerate(seqs):
        n = seq.params.logprobs
        if n is None:
            lps.append(None)
            continue
        row = raw_logprobs[i]
        top = []
        if n:
            vals, idx = row.topk(n)
            top = list(zip(idx.tolist(), vals.tolist(), strict=True))
        lps.append(TokenLogprob(token_list[i], float(row[token_list[i]]), top))
    return token_list, lps


# -- batches -------------------------------------------------------------------------------

VOCAB = 1000
ROWS = [  # every parameter alone, combined, and rows that mix them
    dict(temperature=0),
    dict(temperature=0.8, seed=1),
    dict(top_k=1, seed=2),
    dict(top_k=20, seed=3),
    dict(top_p=0.7),
    dict(min_p=0.1, seed=4),
    dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, seed=5),
    dict(repetition_penalty=1.3, seed=6),
    dict(frequency_penalty=0.8, presence_penalty=-0.5, seed=7),
    dict(temperature=0, repetition_penalty=0.7, frequency_penalty=-1.0),
    dict(logit_bias={5: 30.0, 17: -100.0}, seed=8),
    dict(logprobs=3, top_k=5, seed=9),
    dict(logprobs=0, temperature=0, presence_penalty=1.5),
    dict(top_k=5000, top_p=1.0, seed=10),
    dict(temperature=1.2),
]


def make_seqs(rows: list[dict], seed: int = 0) -> list[SimpleNamespace]:
    """Sequences as the sampler reads them: params, generator, prompt + output token ids
    (repeats, and ids past the vocabulary, as a tokenizer's added tokens may be)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for kwargs in rows:
        params = SamplingParams(**kwargs)
        num_prompt, num_output = (int(torch.randint(lo, 40, (1,), generator=gen)) for lo in (1, 0))
        prompt = torch.randint(0, VOCAB + 5, (num_prompt,), generator=gen)
        output = torch.randint(0, 60, (num_output,), generator=gen)
        ids = prompt.tolist() + output.tolist()
        seqs.append(
            SimpleNamespace(
                params=params,
                generator=None
                if params.seed is None
                else torch.Generator().manual_seed(params.seed),
                token_ids=ids,
                num_prompt_tokens=prompt.numel(),
                output_token_ids=ids[prompt.numel() :],
                matcher=None,
            )
        )
    return seqs


def logits_for(num_rows: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_rows, VOCAB, generator=gen) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [ROWS, ROWS[:1] + ROWS[2:3], ROWS[7:11], ROWS[3:4]])
def test_same_tokens_logprobs_and_draws_as_the_sampler_before_the_kernels(rows, dtype):
    logits = logits_for(len(rows), dtype=dtype)
    results, generator_states = [], []
    for sample in (old_sampler, Sampler()):
        seqs = make_seqs(rows)
        torch.manual_seed(1234)  # the unseeded rows' noise
        results.append(sample(logits, seqs))
        states = [s.generator.get_state() for s in seqs if s.generator is not None]
        generator_states.append((states, torch.get_rng_state()))
    (old_tokens, old_lps), (tokens, lps) = results
    assert tokens == old_tokens
    assert lps == old_lps
    (old_states, old_global), (states, global_) = generator_states
    assert all(torch.equal(a, b) for a, b in zip(old_states, states, strict=True))
    assert torch.equal(old_global, global_)


def test_sample_returns_int64_tokens_and_leaves_the_logits_alone():
    logits = logits_for(len(ROWS))
    before = logits.clone()
    tokens = Sampler().sample(logits, make_seqs(ROWS))
    assert tokens.dtype == torch.int64 and tokens.shape == (len(ROWS),)
    assert torch.equal(logits, before)  # penalties and biases applied to a copy
    assert tokens[10] == 5  # the +30 bias


def test_a_seeded_row_gets_the_same_token_whatever_its_batch():
    alone = Sampler().sample(logits_for(len(ROWS))[6:7], make_seqs(ROWS[6:7]))
    batched = Sampler().sample(logits_for(len(ROWS)), make_seqs(ROWS))
    assert batched[6] == alone[0]


@needs_triton
def test_the_triton_kernels_through_the_sampler_give_the_naive_tokens():
    # CPU tensors through the Triton kernels (Triton's interpreter): the sampler's inputs as
    # the kernels take them (row pairs, per-row parameters, top_k's dtype)
    rows = [r for r in ROWS if "logprobs" not in r]
    logits = logits_for(len(rows), seed=2)
    torch.manual_seed(5)  # the unseeded rows' noise
    want = Sampler().sample(logits, make_seqs(rows))
    kernels.set_backend("triton")
    try:
        torch.manual_seed(5)
        got = Sampler().sample(logits, make_seqs(rows))
    finally:
        kernels.set_backend("auto")
    assert got.tolist() == want.tolist()


# -- on a GPU ------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_gpu_sample_never_waits_for_the_device():
    rows = [r for r in ROWS if "logprobs" not in r] * 4
    logits = logits_for(len(rows)).cuda()
    sampler = Sampler()
    sampler.sample(logits, make_seqs(rows))  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sampler.sample(logits, make_seqs(rows))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.is_cuda and tokens.shape == (len(rows),)


@pytest.mark.gpu
@needs_cuda
def test_gpu_seeded_and_greedy_rows_give_the_cpu_tokens():
    # the same noise (drawn on the CPU from each row's generator) and the same kept sets
    rows = [r for r in ROWS if r.get("seed") is not None or r.get("temperature") == 0]
    logits = logits_for(len(rows), seed=3)
    on_cpu = Sampler().sample(logits, make_seqs(rows))
    on_gpu = Sampler().sample(logits.cuda(), make_seqs(rows))
    assert on_gpu.tolist() == on_cpu.tolist()
