"""Speculative decoding: a drafter proposes the next few tokens of a decoding sequence, one
step of the target model checks them all, and the sequence keeps the longest prefix the
target agrees with plus the target's own next token. Greedy output is token for token what
it is without speculation.

- `ngram`: prompt lookup, the continuation of the longest recent n-gram match in the
  prompt and output so far (agents' edits re-emit runs of code already in the prompt).
- `mtp`, `mtp_drafter`: the checkpoint's multi-token-prediction head (Qwen3.5/3.6), drafting
  from the target's hidden states a step behind it.
- `verify`: which rows speculate, and what a row keeps of its draft.
"""
