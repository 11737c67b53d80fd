"""Which decoding rows speculate, and what a row keeps of its draft.

A row speculates when its next tokens depend on nothing but the logits of its rows: greedy,
no logprobs, no penalties (they count the tokens before each position), no grammar (its
mask moves with each token), past min_tokens (EOS is masked until then). Logit bias is the
same at every position, so it does not stop a row. Rows that do not speculate decode one
token as always, beside rows that do.

The target's step over [last token, d1..dk] gives k+1 rows of logits; row j is the target's
choice after d1..dj. The row keeps the drafts while they equal those choices, then the
target's choice where they first differ (or after the last draft): 1 to k+1 tokens, each
the one greedy decoding without speculation would have produced.
"""

from __future__ import annotations

from helexa.engine.sequence import Sequence


def speculates(seq: Sequence) -> bool:
    p = seq.params
    return (
        p.is_greedy
        and p.logprobs is None
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
