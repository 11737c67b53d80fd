"""Which decoding rows speculate, and what a row keeps of its draft.

A row speculates when its next tokens depend on nothing but the logits of its rows: no
logprobs, no penalties (they count the tokens before each position), no grammar (its mask
moves with each token), past min_tokens (EOS is masked until then). Logit bias is the same
at every position, so it does not stop a row. Rows that do not speculate decode one token
as always, beside rows that do.

The target's step over [last token, d1..dk] gives k+1 rows of logits; row j is the
target's distribution after d1..dj.
- Greedy rows keep the drafts while they equal the target's choices, then the target's
  choice where they first differ (or after the last draft): 1 to k+1 tokens, each the one
  greedy decoding without speculation produces.
- Sampled rows check each draft by the standard rule (Leviathan et al., vLLM's rejection
  sampler) for a drafter that proposes one token with certainty (prompt lookup): d is kept
  with probability p(d) under the target's distribution as the sampler would draw from it
  (temperature, top-k, top-p, min-p, logit bias); where one is not, the row's token is
  drawn from p without d, renormalised, and the row stops there; when all are kept, one
  more is drawn from the last row. Each token then has exactly the target's distribution,
  and the draws come from the row's own generator: a seed gives the same tokens every run.
"""

from __future__ import annotations

import torch

from helexa.engine.sequence import Sequence
from helexa.kernels.filtered_sample import naive_filter


def speculates(seq: Sequence) -> bool:
    p = seq.params
    return (
        p.logprobs is None
        and not p.has_penalties
        and seq.matcher is None
        and seq.num_output_tokens >= p.min_tokens
        and p.debug_fault is None
    )


def accepted(draft: list[int], targets: list[int]) -> list[int]:
    """The tokens a row keeps: `draft`'s longest prefix equal to `targets`' (the target's
    choice at each row, len(draft) + 1 of them), then the target's next choice."""
    m = 0
    while m < len(draft) and draft[m] == targets[m]:
        m += 1
    return [*draft[:m], targets[m]]


def accepted_sampled(logits: torch.Tensor, draft: list[int], seq: Sequence) -> list[int]:
    """What a sampled row keeps: logits [len(draft) + 1, vocab], the target's at its last
    token and at each draft token (see the module's docstring)."""
    p = seq.params
    rows = logits.float().cpu()
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        rows[:, ids] += torch.tensor(list(p.logit_bias.values()), dtype=rows.dtype)
    n = rows.shape[0]
    probs = naive_filter(
        rows,
        torch.full((n,), p.temperature),
        torch.full((n,), min(p.top_k, rows.shape[1]), dtype=torch.long),
        torch.full((n,), p.top_p),
        torch.full((n,), p.min_p),
    )
    g = seq.generator
    out: list[int] = []
    for j, token in enumerate(draft):
        row = probs[j]
        if float(torch.rand((), generator=g)) < float(row[token]):
            out.append(token)
            continue
        residual = row.clone()
        residual[token] = 0.0
        out.append(int(torch.multinomial(residual, 1, generator=g)))
        return out
    out.append(int(torch.multinomial(probs[n - 1], 1, generator=g)))
    return out
