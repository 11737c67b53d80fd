"""When drafting pays: each step, which of the drafted tokens to check, from what this
machine's decode steps cost and what each row's drafts have been worth.

A check row costs what one more decode row costs. Where a step is bound by reading the
weights (one sequence on a GPU, or on a CPU with few rows), four more rows cost next to
nothing and every accepted draft is a token for free. Where it is bound by arithmetic (a
CPU decoding sixteen sequences), rows cost nearly their share, and checking drafts that are
mostly rejected lowers the throughput: SmolLM2 at batch 16 on a 2-core EPYC decoded 0.70x
with every row drafting. No threshold says where one regime ends: it differs by CPU, by
model and by context length. So the policy measures.

- `StepCosts`: the wall time of decode steps (no prompt tokens) by row count, each an
  exponentially weighted mean of its recent steps, forgotten after `STALE_STEPS` (contexts
  grow, and a busy neighbour passes); between two measured row counts, interpolated.
- Each row's acceptance: the chance that a drafted token is kept once those before it
  were, a running mean over its recent drafts (a code edit's rows keep most, a chat's
  few), from a prior of one half.
- `DraftPolicy.choose`: a draft's j-th token is kept with probability a^j (a row's
  acceptance a, each token kept only if those before it were). Taking tokens by that value,
  highest first, the step checks the D tokens that maximise (B + expected kept) / t(B + D),
  B being the step's own rows: against B / t(B) without drafts. Where t(B + D) is not
  known (never measured, or stale), it is measured: the step checks every draft, or, where
  t(B) is the one unknown, none.

Greedy output does not depend on the policy: every check row computes what its decode step
would (model_runner.checks_as_decode), so which drafts are checked only changes the speed.
A sampled row's tokens do (a checked draft takes the row's random draws another way), so a
row with a seed is never cut (scheduler._worth_checking): its seed repeats its tokens.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field

STALE_STEPS = 512  # a row count's time not measured for this many steps is measured again
WEIGHT = 0.25  # an EWMA's weight on its newest step
PRIOR_ACCEPTANCE = 0.5  # a row's acceptance before it has drafted
ACCEPTANCE_WEIGHT = 0.3  # a row's running acceptance: its newest draft's share
RECOVERY = 0.05  # an unchecked draft's pull of its row's acceptance back to the prior


@dataclass(slots=True)
class StepCosts:
    """Decode steps' seconds by row count (see the module's docstring)."""

    times: dict[int, tuple[float, int]] = field(default_factory=dict)  # rows: (s, step seen)
    step: int = 0

    def observe(self, rows: int, seconds: float) -> None:
        self.step += 1
        old = self.times.get(rows)
        fresh = old is not None and self.step - old[1] <= STALE_STEPS
        mean = old[0] + WEIGHT * (seconds - old[0]) if fresh else seconds
        self.times[rows] = (mean, self.step)

    def estimate(self, rows: int) -> float | None:
        """Seconds a decode step of `rows` rows takes: measured, or interpolated between
        the nearest fresh row counts below and above it; None beyond them."""
        return self.curve()(rows)

    def curve(self) -> Callable[[int], float | None]:
        """`estimate` over the fresh measurements as they stand, gathered once: a step's
        choice asks it at every row count it weighs."""
        live = sorted(
            (r, t) for r, (t, seen) in self.times.items() if self.step - seen <= STALE_STEPS
        )
        counts = [r for r, _ in live]
        times = [t for _, t in live]

        def at(rows: int) -> float | None:
            i = bisect_left(counts, rows)
            if i < len(counts) and counts[i] == rows:
                return times[i]
            if i == 0 or i == len(counts):
                return None
            below, above = counts[i - 1], counts[i]
            share = (rows - below) / (above - below)
            return times[i - 1] + share * (times[i] - times[i - 1])

        return at


class DraftPolicy:
    """Which drafted tokens a step checks (see the module's docstring)."""

    def __init__(self) -> None:
        self.costs = StepCosts()

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step (no prompt tokens) of `rows` rows, drafts included, took `seconds`."""
        self.costs.observe(rows, seconds)

    @staticmethod
    def acceptance(state: float | None, drafted: int, kept: int) -> float:
        """A row's running acceptance after a draft of `drafted` tokens kept `kept`: the
        chance that a token is kept once those before it were. A draft checks its tokens
        until one is rejected, so it tried kept + 1 of them (all of them when none was) and
        kept `kept` (the share kept of all drafted, 0.77 on a code edit at k = 4, says 0.9
        a token)."""
        before = PRIOR_ACCEPTANCE if state is None else state
        tried = kept + (kept < drafted)
        return before + ACCEPTANCE_WEIGHT * (kept / tried - before)

    @staticmethod
    def unchecked(state: float | None) -> float | None:
        """A row's acceptance after a step that drafted for it but checked none: a step
        nearer the prior, so that a row whose text turns to copying (a chat that starts
        quoting code) is tried again rather than never."""
        return None if state is None else state + RECOVERY * (PRIOR_ACCEPTANCE - state)

    def choose(self, base_rows: int, drafts: list[tuple[float | None, int]]) -> list[int]:
        """How many of its drafted tokens each row checks: `drafts` holds each drafting
        row's (acceptance or None, draft length); `base_rows` is the step's rows without
        drafts. Each row keeps a prefix of its draft (its first tokens are its likeliest)."""
        values = sorted(
            (
                (a**j, i)
                for i, (acc, k) in enumerate(drafts)
                for a in (PRIOR_ACCEPTANCE if acc is None else acc,)
                for j in range(1, k + 1)
            ),
            reverse=True,
        )
        total = len(values)
        if not total:
            return [0] * len(drafts)
        estimate = self.costs.curve()
        if estimate(base_rows + total) is None:
            take = total  # measure the step with every draft checked
        elif (plain := estimate(base_rows)) is None:
            take = 0  # measure the step without
        else:
            best, take, gain = base_rows / plain, 0, 0.0
            for d, (value, _) in enumerate(values, start=1):
                gain += value
                t = estimate(base_rows + d)
                if t is not None and (base_rows + gain) / t > best:
                    best, take = (base_rows + gain) / t, d
        keep = [0] * len(drafts)
        for _, i in values[:take]:
            keep[i] += 1
        return keep
