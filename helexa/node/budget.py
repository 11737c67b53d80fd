"""The gateway's budget reservation, enforced exactly where the tokens are counted.

The gateway reserves a request's upper bound from an estimate of its prompt; only the node
knows the real prompt length. With `x-helexa-budget: tokens=R; cost=C; in=A; out=B` (USD,
and USD per 1M tokens) the node lowers the request's max_tokens so that prompt + output
stays within R tokens and C dollars, or refuses it when not one output token fits — so a
key's spend can never pass its cap, whatever the estimate said.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from helexa.errors import insufficient_quota
from helexa.protocol.openai import ChatCompletionRequest, CompletionRequest


@dataclass(slots=True, frozen=True)
class SpendBudget:
    tokens: int | None = None
    cost: float | None = None
    in_price: float = 0.0  # USD per 1M prompt tokens
    out_price: float = 0.0  # USD per 1M output tokens

    @classmethod
    def parse(cls, value: str) -> SpendBudget:
        fields: dict[str, str] = {}
        for part in value.split(";"):
            name, sep, raw = part.strip().partition("=")
            if not sep or name not in ("tokens", "cost", "in", "out"):
                raise ValueError(f"expected tokens=N; cost=USD; in=P; out=P, got {value!r}")
            fields[name] = raw.strip()
        try:
            budget = cls(
                tokens=int(fields["tokens"]) if "tokens" in fields else None,
                cost=float(fields["cost"]) if "cost" in fields else None,
                in_price=float(fields.get("in", 0)),
                out_price=float(fields.get("out", 0)),
            )
        except ValueError:
            raise ValueError(f"expected numbers, got {value!r}") from None
        numbers = (budget.cost or 0.0, budget.in_price, budget.out_price)
        if not all(math.isfinite(x) and x >= 0 for x in numbers):
            raise ValueError(f"expected finite non-negative numbers, got {value!r}")
        return budget

    def max_output(self, prompt_tokens: int) -> int | None:
        """Output tokens the budget leaves after the prompt (None: no limit from it)."""
        room: int | None = None
        if self.tokens is not None:
            room = self.tokens - prompt_tokens
        if self.cost is not None:
            left = self.cost - prompt_tokens * self.in_price / 1e6
            if left < 0:
                return 0
            if self.out_price > 0:
                by_cost = math.floor(left / (self.out_price / 1e6))
                room = by_cost if room is None else min(room, by_cost)
        return room

    def apply(self, req: ChatCompletionRequest | CompletionRequest, prompt_tokens: int) -> None:
        """Lower the request's output limit to what the budget covers (split over `n`)."""
        room = self.max_output(prompt_tokens)
        if room is None:
            return
        per_choice = room // req.n
        if per_choice < 1:
            raise insufficient_quota(
                f"the key's remaining budget does not cover this request: the prompt has "
                f"{prompt_tokens} tokens"
            )
        limit = req.output_limit
        capped = per_choice if limit is None else min(limit, per_choice)
        req.max_tokens = capped
        if isinstance(req, ChatCompletionRequest):
            req.max_completion_tokens = capped
