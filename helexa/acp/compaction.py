"""A long session's history fitted into its endpoint's context window before each round:
older tool results and assistant prose are elided to one-line markers, oldest first, until
the conversation fits; the user's turns and the last `KEEP_TAIL` messages stay verbatim,
and every tool call keeps its result's place (a result elided, never dropped), so wires
that pair calls and results strictly still accept it. Images count `IMAGE_TOKENS` each.
The saved transcript is never changed: only what is sent."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace

from helexa.acp.wire import Message

CHARS_PER_TOKEN = 4  # an estimate that leans high for code and prose in most tokenizers
IMAGE_TOKENS = 512
PER_MESSAGE_TOKENS = 8  # role markers and separators a chat template adds
SAFETY_TOKENS = 512
KEEP_TAIL = 4
DEFAULT_ANSWER_TOKENS = 4096  # room left for the answer when the endpoint sets no max_tokens


def tokens(m: Message) -> int:
    text = len(m.content) + sum(len(c.name) + len(c.arguments) for c in m.tool_calls)
    return -(-text // CHARS_PER_TOKEN) + IMAGE_TOKENS * len(m.images) + PER_MESSAGE_TOKENS


def budget(context_window: int, max_tokens: int | None) -> int:
    """Prompt tokens a round may send: the window less the answer's room and a margin."""
    return max(0, context_window - (max_tokens or DEFAULT_ANSWER_TOKENS) - SAFETY_TOKENS)


def compact(
    system: Message,
    history: Sequence[Message],
    context_window: int | None,
    max_tokens: int | None,
    fixed_tokens: int = 0,
) -> list[Message]:
    """`[system, *history]`, with older tool results and assistant prose elided until it
    fits `budget(context_window, max_tokens)` less `fixed_tokens` (the tools' schemas, sent
    with every round); unchanged without a context window. Should the last messages alone
    not fit, their tool results are cut to what fits, with a note telling the model to read
    the rest in smaller pieces."""
    out = [system, *history]
    if context_window is None:
        return out
    limit = budget(context_window, max_tokens) - fixed_tokens
    total = sum(tokens(m) for m in out)
    tail_from = max(1, len(out) - KEEP_TAIL)
    # tool results first (the bulk of an agent's history), then assistant prose; oldest
    # first; then, as a last resort, the tail's tool results
    for role in ("tool", "assistant"):
        for i in range(1, tail_from):
            if total <= limit:
                return out
            m = out[i]
            if m.role != role or (m.role == "assistant" and not m.content):
                continue
            marker = _marker(m)
            if len(marker) >= len(m.content):
                continue
            elided = replace(m, content=marker, images=[])
            total -= tokens(m) - tokens(elided)
            out[i] = elided
    for i in range(tail_from, len(out)):  # the tail's own tool results: cut to what fits
        if total <= limit:
            break
        m = out[i]
        if m.role != "tool":
            continue
        note = -(-len(_cut_note(len(m.content))) // CHARS_PER_TOKEN)
        room = max(0, limit - (total - tokens(m)) - PER_MESSAGE_TOKENS - note - 1) * CHARS_PER_TOKEN
        if room >= len(m.content):
            continue
        cut = replace(m, content=m.content[:room] + _cut_note(len(m.content) - room))
        total -= tokens(m) - tokens(cut)
        out[i] = cut
    return out


def _cut_note(chars: int) -> str:
    return (
        f"\n[… the last {chars} characters were cut to fit the context window: read the rest "
        "in smaller pieces (read_file with line and limit)]"
    )


def tools_tokens(schemas: object) -> int:
    """What the tools' definitions take of every prompt."""
    return -(-len(json.dumps(schemas)) // CHARS_PER_TOKEN)


def _marker(m: Message) -> str:
    if m.role == "tool":
        return f"[tool result elided to fit the context window: {len(m.content)} characters]"
    return f"[earlier answer elided to fit the context window: {len(m.content)} characters]"
