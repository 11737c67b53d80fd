"""Turn the last-position logits of a batch into tokens, each row with its own params.

The math is two kernels, `helexa.kernels.apply_penalties` and `helexa.kernels.sample`
(Triton on CUDA; on CPU their naive twins, which sort); this module builds their per-row
inputs on the host. On CUDA, `Sampler.sample` never waits for the device: lists go to it
through pinned memory with non_blocking copies, unseeded rows draw their Exp(1) noise on the
device, and seeded rows draw theirs from their own CPU generator (so a seed gives the same
tokens on every device), pinned and copied likewise.
"""

from __future__ import annotations

import torch

from helexa import kernels
from helexa.engine.grammar import fill_bitmask
from helexa.engine.layers import native
from helexa.engine.sampling_params import SamplingParams
from helexa.engine.sequence import Sequence, TokenLogprob


def _to(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`; to CUDA from pinned memory, without a sync."""
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Each penalised row's output tokens, then (for a repetition penalty) its prompt's, as
    flat (row, token) pairs: one host array, one copy, one kernel."""
    rows: list[int] = []
    tokens: list[int] = []
    prompt_rows: list[int] = []
    prompt_tokens: list[int] = []
    n = len(seqs)
    rep, freq, pres = [1.0] * n, [0.0] * n, [0.0] * n
    for i, seq in enumerate(seqs):
        p = seq.params
        if not p.has_penalties:
            continue
        ids, num_prompt = seq.token_ids, seq.num_prompt_tokens
        tokens += ids[num_prompt:]
        rows += [i] * (len(ids) - num_prompt)
        if p.repetition_penalty != 1.0:  # over the prompt too (the output is in `tokens`)
            prompt_tokens += ids[:num_prompt]
            prompt_rows += [i] * num_prompt
        rep[i], freq[i], pres[i] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
    dev = logits.device
    pairs = _to([rows + prompt_rows, tokens + prompt_tokens], torch.int32, dev)
    rep_t, freq_t, pres_t = _to([rep, freq, pres], torch.float32, dev)
    kernels.apply_penalties(logits, pairs[0], pairs[1], len(tokens), rep_t, freq_t, pres_t)


def _apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """OpenAI's logit_bias: each listed token's logit moved by its bias (ids checked
    against the vocabulary when the request was admitted)."""
    vocab = logits.shape[-1]
    pos: list[int] = []
    values: list[float] = []
    for i, seq in enumerate(seqs):
        bias = seq.params.logit_bias
        if bias:
            pos += [i * vocab + t for t in bias]
            values += bias.values()
    if pos:  # one add per (row, token): the same sums in any order
        dev = logits.device
        logits.view(-1).index_add_(0, _to(pos, torch.long, dev), _to(values, logits.dtype, dev))


def _apply_grammars(logits: torch.Tensor, matchers: list) -> None:
    """Structured output: the tokens each constrained row's grammar forbids next set to -inf.
    The matchers fill the bitmask on the host (on CUDA while the device still runs the
    forward: nothing before this waited for it), one copy takes it to the device."""
    bitmask = fill_bitmask(matchers, logits.shape[-1], pin=logits.is_cuda)
    if logits.is_cuda:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    kernels.apply_token_bitmask(logits, bitmask)


def _noise(logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool]) -> torch.Tensor:
    """Exp(1) draws [N, V] for the sampled rows (greedy rows' are not read): a seeded row's
    from its generator, on the CPU; the others' from torch's generator of the logits' device."""
    noise = torch.empty_like(logits)
    if not logits.is_cuda:
        for i, seq in enumerate(seqs):
            if not greedy[i]:
                noise[i].exponential_(generator=seq.generator)
        return noise
    seeded = [i for i, s in enumerate(seqs) if not greedy[i] and s.generator is not None]
    if len(seeded) < greedy.count(False):
        noise.exponential_()
    if seeded:
        host = torch.empty(len(seeded), logits.shape[1], pin_memory=True)
        for j, i in enumerate(seeded):
            host[j].exponential_(generator=seqs[i].generator)
        drawn = host.to(logits.device, non_blocking=True)
        if len(seeded) == len(seqs):
            return drawn
        noise.index_copy_(0, _to(seeded, torch.long, logits.device), drawn)
    return noise


def _row_params(params: list[SamplingParams], vocab: int, device: torch.device):
    """temperature, top_k, top_p, min_p [N] (top_k as an int tensor, at most the vocab)."""
    temperature = [p.temperature for p in params]
    top_k = [min(p.top_k, vocab) for p in params]  # k >= vocab keeps all, as k = vocab does
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if device.type != "cuda":
        return (
            torch.tensor(temperature),
            torch.tensor(top_k),
            torch.tensor(top_p),
            torch.tensor(min_p),
        )
    t = _to([temperature, top_k, top_p, min_p], torch.float32, device)  # one copy
    return t[0], t[1].to(torch.int32), t[2], t[3]


class Sampler:
    """Greedy rows take the argmax; the rest sample by the exponential-race trick, each
    seeded row from its own generator so the same seed gives the same tokens whatever
    else is in the batch."""

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[TokenLogprob | None] | None]:
        """logits [N, vocab] -> (one token per row, per-row logprobs when any row asks)."""
        logits = logits.float()
        want_logprobs = any(s.params.logprobs is not None for s in seqs)
        raw_logprobs = logits.log_softmax(-1) if want_logprobs else None
        token_list = self.sample(logits, seqs).tolist()
        if raw_logprobs is None:
            return token_list, None
        lps: list[TokenLogprob | None] = []
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

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits [N, vocab] (not modified) -> tokens [N] int64 on the logits' device. On CUDA
        nothing here waits for the device."""
        if any(s.params.debug_fault == "sampler" for s in seqs):
            raise RuntimeError("fault injected by HELEXA_DEBUG_FAULT=sampler")
        params = [s.params for s in seqs]
        given = logits
        logits = logits.float()
        matchers = [s.matcher for s in seqs]
        constrained = any(m is not None for m in matchers)
        if constrained or any(p.has_penalties or p.logit_bias for p in params):
            if logits is given:  # .float() made no copy: make one to modify
                logits = logits.clone(memory_format=torch.contiguous_format)
            logits = logits.contiguous()
            if any(p.has_penalties for p in params):
                _apply_penalties(logits, seqs)
            _apply_logit_bias(logits, seqs)
            if constrained:  # last: a biased or penalised -inf stays -inf
                _apply_grammars(logits, matchers)
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            return argmax(logits)
        noise = _noise(logits, seqs, greedy)
        temperature, top_k, top_p, min_p = _row_params(params, logits.shape[1], logits.device)
        return kernels.sample(logits, noise, temperature, top_k, top_p, min_p)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1); on the CPU the native pass, ~6x quicker over a 49k vocabulary."""
    if native.usable(logits) and logits.dim() == 2:
        return native.argmax_finite(logits)[0]
    return logits.argmax(-1)


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.isfinite().all(-1); on the CPU the native pass."""
    if native.usable(logits) and logits.dim() == 2:
        return native.argmax_finite(logits)[1]
    return logits.isfinite().all(-1)
