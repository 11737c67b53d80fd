"""Penalties and sampling: the naive penalties against the engine's per-row loop as it was
before the kernels (bit for bit), and the Triton kernels against their naive twins, the
sampled tokens equal given the same noise. (The naive sample is the engine's old filter and
race on tensors; tests/engine/test_sampler.py holds the whole sampler to its old self.)

The sampler's gathered candidates are sorted by tl.sort, which the interpreter runs slowly,
so on the CPU these tests gather at most 64 (on a GPU, the default).
"""

from __future__ import annotations

import pytest
import torch

from helexa.kernels import filtered_sample
from helexa.kernels.filtered_sample import naive_filter, naive_sample
from helexa.kernels.sampling import naive_apply_penalties, triton_apply_penalties

from . import DEVICE, needs_triton

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def triton_sample(*args, **kwargs) -> torch.Tensor:
    """filtered_sample.triton_sample, gathering at most 64 candidates on the CPU unless told."""
    if DEVICE == "cpu":
        kwargs.setdefault("max_candidates", 64)
    return filtered_sample.triton_sample(*args, **kwargs)


# -- penalties -------------------------------------------------------------------------------

# per row: repetition, frequency, presence; row 0 has none, row 5 lists ids past the vocab
PENALTIES = [(1.0, 0.0, 0.0), (1.3, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, -0.7),
             (0.8, -1.2, 1.5), (1.2, 0.3, 0.2)]  # fmt: skip


def engine_penalties(logits, outputs, prompts, params) -> None:
    """The sampler's _apply_penalties before kernels.apply_penalties, rows given as lists."""
    vocab = logits.shape[-1]
    for i, (rep, freq, pres) in enumerate(params):
        row = logits[i]
        out = torch.tensor(outputs[i], dtype=torch.long)
        out = out[out < vocab]
        if rep != 1.0:
            seen = torch.tensor(prompts[i] + outputs[i], dtype=torch.long)
            seen = seen[seen < vocab].unique()
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / rep, vals * rep)
        if (freq or pres) and out.numel():
            counts = torch.zeros(vocab, dtype=logits.dtype)
            counts.scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
            row -= freq * counts + pres * (counts > 0)


def penalty_inputs(vocab: int, seed: int = 0):
    """logits [6, vocab] (no exact zeros), per-row output tokens (repeats) and prompt
    tokens, and the flat pairs and parameter tensors the kernels take."""
    gen = torch.Generator().manual_seed(seed)
    n = len(PENALTIES)
    logits = torch.randn(n, vocab, generator=gen) * 3
    outputs = [
        torch.randint(0, 40, (int(o),), generator=gen).tolist() for o in (5, 30, 17, 1, 64, 9)
    ]
    prompts = [
        torch.randint(0, vocab, (p,), generator=gen).tolist() for p in (7, 50, 0, 33, 80, 20)
    ]
    outputs[5] += [vocab, vocab + 3]
    prompts[5] += [vocab + 1]
    rows = [i for i, o in enumerate(outputs) for _ in o]
    rows += [i for i, p in enumerate(prompts) for _ in p]
    tokens = [t for o in outputs for t in o] + [t for p in prompts for t in p]
    num_output = sum(len(o) for o in outputs)
    rep, freq, pres = (torch.tensor(col) for col in zip(*PENALTIES, strict=True))
    pairs = (torch.tensor(rows, dtype=torch.int32), torch.tensor(tokens, dtype=torch.int32))
    return logits, outputs, prompts, pairs, num_output, (rep, freq, pres)


def test_naive_penalties_are_the_engines_loop_bit_for_bit():
    logits, outputs, prompts, (rows, tokens), num_output, params = penalty_inputs(1000)
    want = logits.clone()
    engine_penalties(want, outputs, prompts, PENALTIES)
    naive_apply_penalties(logits, rows, tokens, num_output, *params)
    assert torch.equal(logits, want)


@needs_triton
@pytest.mark.parametrize("vocab", [1000, 4099])  # one tile; several and a ragged last one
def test_triton_penalties_match_naive(vocab):
    logits, _, _, (rows, tokens), num_output, params = penalty_inputs(vocab, seed=1)
    want = logits.clone()
    naive_apply_penalties(want, rows, tokens, num_output, *params)
    got = logits.to(DEVICE)
    triton_apply_penalties(got, rows.to(DEVICE), tokens.to(DEVICE), num_output,
                           *(p.to(DEVICE) for p in params))  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=0)
    assert torch.equal(got[0].cpu(), logits[0])  # the row without penalties is untouched


@needs_triton
def test_triton_penalties_with_no_pairs_change_nothing():
    logits = torch.randn(3, 100, device=DEVICE)
    before = logits.clone()
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    ones = torch.full((3,), 1.5, device=DEVICE)
    triton_apply_penalties(logits, empty, empty, 0, ones, ones, ones)
    assert torch.equal(logits, before)


# -- sampling --------------------------------------------------------------------------------

# per row: temperature, top_k, top_p, min_p: each filter alone, combined, and greedy rows
CONFIGS = [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (1.2, 50, 1.0, 0.0),
    (1.0, 0, 0.5, 0.0), (1.3, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.1), (0.8, 40, 0.8, 0.02),
    (0.5, 200, 0.95, 0.0), (1.0, 999, 1.0, 0.0), (1.0, 5000, 0.3, 0.0), (0.0, 0, 1.0, 0.0),
    (1.0, 1, 1.0, 0.0), (0.0, 20, 0.5, 0.1),
]  # fmt: skip


def row_params(configs, device=DEVICE):
    temperature, top_k, top_p, min_p = zip(*configs, strict=True)
    return (
        torch.tensor(temperature, device=device),
        torch.tensor(top_k, device=device),
        torch.tensor(top_p, device=device),
        torch.tensor(min_p, device=device),
    )


def sample_inputs(configs, vocab: int, seed: int = 0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(len(configs), vocab, generator=gen) * 3).to(device)
    noise = torch.empty(len(configs), vocab).exponential_(generator=gen).to(device)
    return logits, noise, row_params(configs, device)


def test_naive_greedy_rows_take_the_first_argmax_and_read_no_noise():
    logits = torch.randn(2, 50)
    logits[:, 7] = logits[:, 30] = 10.0
    noise = torch.full((2, 50), float("nan"))
    params = row_params([(0.0, 0, 1.0, 0.0), (0.9, 1, 0.5, 0.0)], "cpu")
    assert naive_sample(logits, noise, *params).tolist() == [7, 7]


@needs_triton
@pytest.mark.parametrize(("vocab", "block_v"), [(1000, None), (1037, 128)])
def test_triton_samples_the_naive_tokens(vocab, block_v):
    logits, noise, params = sample_inputs(CONFIGS, vocab)
    got = triton_sample(logits, noise, *params, block_v=block_v)
    assert got.dtype == torch.int64
    assert got.tolist() == naive_sample(logits, noise, *params).tolist()


@needs_triton
def test_triton_samples_the_naive_tokens_over_many_draws():
    sampled = [c for c in CONFIGS if c[0] > 0 and c[1] != 1]
    logits, _, _ = sample_inputs(sampled, 1000, seed=3)
    _, noise, params = sample_inputs(sampled * 4, 1000, seed=4)  # each row, 4 noise draws
    logits = logits.repeat(4, 1)
    got = triton_sample(logits, noise, *params)
    assert got.tolist() == naive_sample(logits, noise, *params).tolist()


def kept_by_definition(logits: torch.Tensor, temperature, top_k, top_p, min_p) -> set[int]:
    """The tokens a row's filters keep, in float64 from the definitions: the top_k most
    likely; of those, each whose renormalised mass strictly before it is <= top_p; of those,
    each whose probability is >= min_p times the largest."""
    x = logits.double() / (temperature or 1.0)
    order = x.argsort(descending=True)
    k = top_k if 0 < top_k < x.numel() else x.numel()
    probs = x[order[:k]].softmax(-1)
    n = int(((probs.cumsum(0) - probs) <= top_p).sum()) if top_p < 1 else k
    probs = probs[:n] / probs[:n].sum()
    return set(order[:n][probs >= min_p * probs[0]].tolist())


@needs_triton
def test_triton_keeps_exactly_the_defined_tokens_at_the_cut():
    # for the tokens ranked around each row's cut, noise that makes a token win if it is kept:
    # the kernel picks it exactly when the definition keeps it
    configs = [c for c in CONFIGS if c[0] > 0 and c[1] != 1]
    vocab = 1000
    logits, _, params = sample_inputs(configs, vocab, seed=5)
    rows, probes, expected = [], [], []
    for i, config in enumerate(configs):
        kept = kept_by_definition(logits[i].cpu(), *config)
        order = logits[i].cpu().argsort(descending=True).tolist()
        for rank in range(max(len(kept) - 2, 0), min(len(kept) + 2, vocab)):
            rows.append(i)
            probes.append(order[rank])
            expected.append(order[rank] in kept)
    idx = torch.tensor(rows, device=DEVICE)
    noise = torch.ones(len(rows), vocab, device=DEVICE)
    noise[torch.arange(len(rows)), probes] = 1e-30
    got = triton_sample(logits[idx], noise, *(t[idx] for t in params)).tolist()
    assert [g == p for g, p in zip(got, probes, strict=True)] == expected


def test_naive_keeps_the_defined_tokens_but_a_top_p_1_rows_rounded_tail():
    # the sort compares top_p with float32 cumulative sums, which round past 1 in the tail:
    # in a batch that sorts, a top_p=1 row loses those tokens (each < 1e-6 likely). The
    # engine's sampler always did; the Triton kernel keeps them.
    configs = [c for c in CONFIGS if c[0] > 0 and c[1] != 1]
    logits, _, params = sample_inputs(configs, 1000, seed=5, device="cpu")
    probs = naive_filter(logits, *params)
    for i, config in enumerate(configs):
        kept = set((probs[i] > 0).nonzero().flatten().tolist())
        defined = kept_by_definition(logits[i], *config)
        lost = sorted(defined - kept)
        assert kept <= defined
        assert not lost or config[2] == 1.0
        assert ((logits[i] / config[0]).softmax(-1)[lost] < 1e-6).all()


@needs_triton
@pytest.mark.parametrize("chunk_v", [None, 64])  # the tied maxima in one chunk; in two
def test_triton_greedy_rows_take_the_first_argmax_and_read_no_noise(chunk_v):
    logits = torch.randn(2, 300, device=DEVICE)
    logits[:, 7] = logits[:, 250] = 10.0
    noise = torch.full((2, 300), float("nan"), device=DEVICE)
    params = row_params([(0.0, 0, 1.0, 0.0), (0.9, 1, 0.5, 0.0)])
    got = triton_sample(logits, noise, *params, block_v=64, chunk_v=chunk_v)
    assert got.tolist() == [7, 7]


# every kind twice (its own logits each time): greedy, temperature only, each filter
# alone, all combined. Each row is its own programs in the interpreter, whose time grows
# with the rows (64 rows took 110-170 s a case on a 2-core CI machine).
MIXED = CONFIGS * 2


@needs_triton
@pytest.mark.parametrize(
    ("num_rounds", "max_candidates"),
    [(0, 16), (1, 64), (3, 64)],  # cuts found by the one-program search; gathered; narrowed
)
def test_triton_samples_the_naive_tokens_with_rows_split_over_chunks(num_rounds, max_candidates):
    # 1037 = 4 chunks of 256 and a ragged 13; rows strided (a view of wider logits)
    logits, noise, params = sample_inputs(MIXED, 1037, seed=9)
    wide = torch.zeros(len(MIXED), 1100, device=DEVICE)
    wide[:, :1037] = logits
    got = triton_sample(wide[:, :1037], noise, *params, block_v=64, chunk_v=256,
                        num_rounds=num_rounds, max_candidates=max_candidates)  # fmt: skip
    assert got.tolist() == naive_sample(logits, noise, *params).tolist()


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # -FLT_MAX / temp
def test_triton_rows_with_masked_logits_sample_among_the_finite_ones():
    # 900 of 1000 logits -inf (banned); top-k asks for more than are left
    configs = [(1.0, 150, 1.0, 0.0), (0.9, 150, 0.9, 0.0), (1.0, 0, 0.8, 0.05), (1.0, 0, 1.0, 0.0)]
    logits, noise, params = sample_inputs(configs * 3, 1000, seed=7)
    gen = torch.Generator().manual_seed(8)
    banned = torch.rand(len(configs) * 3, 1000, generator=gen).argsort(dim=-1)[:, :900]
    logits.scatter_(1, banned.to(DEVICE), float("-inf"))
    got = triton_sample(logits, noise, *params, block_v=256)
    assert got.tolist() == naive_sample(logits, noise, *params).tolist()
    assert torch.isfinite(logits.gather(1, got[:, None])).all()


# -- at a real vocabulary -------------------------------------------------------------------


def llm_like_logits(num_rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """A background of small logits and, per row, 64 well-separated likely ones, so the cuts
    fall between tokens whose probabilities differ (no near-ties)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen) * 2
    top = torch.rand(num_rows, vocab, generator=gen).argsort(dim=-1)[:, :64]
    spikes = 22.0 - 0.25 * torch.arange(64.0) + 0.05 * torch.rand(num_rows, 64, generator=gen)
    return logits.scatter_(1, top, spikes)


@needs_triton
def test_triton_samples_the_naive_tokens_at_qwens_vocabulary():
    # a few rows, so the interpreter takes seconds: top-k and top-p, top-p, min-p, temperature
    configs = [(0.7, 20, 0.8, 0.0), (1.0, 0, 0.95, 0.0), (1.0, 0, 1.0, 0.05), (0.9, 0, 1.0, 0.0)]
    vocab = 151936
    logits = llm_like_logits(len(configs), vocab, seed=2).to(DEVICE)
    gen = torch.Generator().manual_seed(3)
    noise = torch.empty(len(configs), vocab).exponential_(generator=gen).to(DEVICE)
    params = row_params(configs)
    got = triton_sample(logits, noise, *params)
    assert got.tolist() == naive_sample(logits, noise, *params).tolist()


@pytest.mark.gpu
@needs_cuda
def test_gpu_sampling_at_qwens_vocabulary():
    vocab, configs = 151936, CONFIGS * 5  # 70 rows
    logits = llm_like_logits(len(configs), vocab).cuda()
    gen = torch.Generator().manual_seed(1)
    noise = torch.empty(len(configs), vocab).exponential_(generator=gen).cuda()
    params = row_params(configs, "cuda")
    got = triton_sample(logits, noise, *params)
    assert got.tolist() == naive_sample(logits, noise, *params).tolist()


@pytest.mark.gpu
@needs_cuda
def test_gpu_penalties_at_qwens_vocabulary():
    logits, _, _, (rows, tokens), num_output, params = penalty_inputs(151936)
    want = logits.cuda()
    naive_apply_penalties(want, rows.cuda(), tokens.cuda(), num_output, *(p.cuda() for p in params))
    got = logits.cuda()
    triton_apply_penalties(got, rows.cuda(), tokens.cuda(), num_output, *(p.cuda() for p in params))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
