"""Turn the last-position logits of a batch into tokens, each row with its own params."""

from __future__ import annotations

import torch

from helexa.engine.sequence import Sequence, TokenLogprob


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
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


def _apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """OpenAI's logit_bias: each listed token's logit moved by its bias (ids checked
    against the vocabulary when the request was admitted)."""
    for i, seq in enumerate(seqs):
        bias = seq.params.logit_bias
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
            values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
            logits[i].index_add_(0, ids, values)


def _filter(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, vectorized; returns probabilities."""
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
        cum = probs.cumsum(-1) - probs  # mass strictly before each token
        drop |= cum > torch.tensor(top_ps, device=dev).unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    if any(min_ps):
        floor = torch.tensor(min_ps, device=dev).unsqueeze(1) * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


class Sampler:
    """Greedy rows take the argmax; the rest sample by the exponential-race trick, each
    seeded row from its own generator so the same seed gives the same tokens whatever
    else is in the batch."""

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[TokenLogprob | None] | None]:
        # logits: [num_seqs, vocab]
        if any(s.params.debug_fault == "sampler" for s in seqs):
            raise RuntimeError("fault injected by HELEXA_DEBUG_FAULT=sampler")
        logits = logits.float()
        want_logprobs = any(s.params.logprobs is not None for s in seqs)
        raw_logprobs = logits.log_softmax(-1) if want_logprobs else None
        if any(s.params.has_penalties or s.params.logit_bias for s in seqs):
            logits = logits.clone()
            _apply_penalties(logits, seqs)
            _apply_logit_bias(logits, seqs)
        greedy = [s.params.is_greedy for s in seqs]
        tokens = logits.argmax(-1)
        if not all(greedy):
            probs = _filter(logits, seqs)
            noise = torch.empty_like(probs)
            for i, seq in enumerate(seqs):
                if greedy[i]:
                    continue
                g = seq.generator  # a CPU generator: its draws are the same on every device
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
