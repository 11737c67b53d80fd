"""An answer split into reasoning, content and tool calls as it streams."""

from __future__ import annotations

import json

import pytest

from helexa.protocol.assistant_output import AssistantOutput
from helexa.protocol.reasoning import ReasoningMarkers
from helexa.protocol.tool_calls import ToolCallMarkers

THINK = ReasoningMarkers("<think>", "</think>")
CALLS = ToolCallMarkers("<tool_call>", "</tool_call>")
ANSWER = (
    "<think>\nI should search. <tool_call>not a call</tool_call>\n</think>\n\n"
    'Searching.<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'
)


def _feed_all(out: AssistantOutput, text: str, step: int = 1) -> tuple[str, str, list]:
    reasoning = content = ""
    calls = []
    for at in range(0, len(text), step):
        p = out.feed(text[at : at + step], num_tokens=1)
        reasoning, content, calls = reasoning + p.reasoning, content + p.content, calls + p.calls
    p = out.finish()
    return reasoning + p.reasoning, content + p.content, calls + p.calls


@pytest.mark.parametrize("step", [1, 3, 7, len(ANSWER)])
def test_reasoning_content_and_calls_come_apart(step):
    out = AssistantOutput(THINK, CALLS, {})
    reasoning, content, calls = _feed_all(out, ANSWER, step)
    assert reasoning == "\nI should search. <tool_call>not a call</tool_call>\n"
    assert content == "Searching."
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [
        (0, "search", {"q": "x"})
    ]
    assert calls[0].id.startswith("call_")
    assert (out.reasoning, out.content) == (reasoning, content)


def test_reasoning_tokens_are_counted_while_reasoning():
    out = AssistantOutput(THINK, None, {})
    for piece in ["<think>", "a", "b", "</think>", "c", "d", "e"]:
        out.feed(piece, num_tokens=1)
    assert out.num_reasoning_tokens == 4  # <think>, a, b, </think>


def test_a_prompt_that_opened_reasoning_starts_in_reasoning():
    out = AssistantOutput(THINK, None, {}, in_reasoning=True)
    reasoning, content, _ = _feed_all(out, "hmm\n</think>\n\nHi")
    assert (reasoning, content) == ("hmm\n", "Hi")


def test_include_thinking_puts_reasoning_back_inside_its_markers():
    out = AssistantOutput(THINK, None, {}, in_reasoning=True, include_thinking=True)
    reasoning, content, _ = _feed_all(out, "hmm</think>Hi", step=2)
    assert reasoning == ""
    assert content == "<think>hmm</think>Hi"


def test_held_content_is_released_with_the_call_and_kept_without_one():
    out = AssistantOutput(None, CALLS, {}, hold_content=True)
    p = out.feed("First ")
    assert p.content == ""
    _, content, calls = _feed_all(out, '<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert content == "First " and len(calls) == 1

    refused = AssistantOutput(None, CALLS, {}, hold_content=True)
    _, content, calls = _feed_all(refused, "I will not call anything.")
    assert (content, calls) == ("", [])
    assert refused.held_text == "I will not call anything."


def test_without_markers_everything_is_content():
    out = AssistantOutput(None, None, {})
    assert _feed_all(out, "<think>x</think>") == ("", "<think>x</think>", [])
