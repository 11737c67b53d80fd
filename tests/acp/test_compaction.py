"""History compaction: older tool results, then older assistant prose, elided to markers
until the conversation fits its window; user turns, the system prompt and the last four
messages verbatim; every tool call keeps its result in place."""

from __future__ import annotations

from helexa.acp.compaction import KEEP_TAIL, budget, compact, tokens
from helexa.acp.wire import Message, ToolCall

SYSTEM = Message("system", "You are a coding agent.")


def _history(rounds: int, result_chars: int = 8000) -> list[Message]:
    out = [Message("user", "Read every file and summarise.")]
    for i in range(rounds):
        call = ToolCall(f"c{i}", "read_file", f'{{"path": "f{i}.py"}}')
        out.append(Message("assistant", f"Reading f{i}.py. " * 20, [call]))
        out.append(Message("tool", "x" * result_chars, tool_call_id=f"c{i}"))
    out.append(Message("user", "Now fix the bug."))
    return out


def test_nothing_changes_without_a_window_or_when_it_fits():
    history = _history(3)
    assert compact(SYSTEM, history, None, None) == [SYSTEM, *history]
    assert compact(SYSTEM, history, 200_000, 8192) == [SYSTEM, *history]


def test_old_tool_results_go_first_and_the_conversation_fits():
    history = _history(10)
    out = compact(SYSTEM, history, 16_384, 4096)
    assert sum(tokens(m) for m in out) <= budget(16_384, 4096)
    assert len(out) == len(history) + 1  # nothing dropped
    assert out[0] == SYSTEM
    assert [m.content for m in out if m.role == "user"] == [
        m.content for m in history if m.role == "user"
    ]
    assert out[-KEEP_TAIL:] == history[-KEEP_TAIL:]  # the tail verbatim
    elided = [m for m in out if m.role == "tool" and m.content.startswith("[tool result elided")]
    assert elided and all("8000 characters" in m.content for m in elided)
    # every call still has its result, in place
    for i, m in enumerate(out):
        for call in m.tool_calls:
            assert out[i + 1].role == "tool" and out[i + 1].tool_call_id == call.id
    # only as much as needed: the newest results outside the tail are kept if they fit
    assert out[-KEEP_TAIL - 1].content == "x" * 8000 or out[-KEEP_TAIL - 1].role != "tool"


def test_assistant_prose_goes_once_the_results_are_not_enough():
    history = _history(45, result_chars=100)
    out = compact(SYSTEM, history, 8192, 4096)
    assert any(m.content.startswith("[earlier answer elided") for m in out if m.role == "assistant")
    assert all(m.tool_calls for m in out if m.role == "assistant")  # the calls themselves stay


def test_images_are_counted():
    with_image = Message("user", "look", images=[("image/png", "AAAA")])
    assert tokens(with_image) >= 512


def test_when_the_tail_alone_is_too_long_its_tool_results_are_cut_to_fit():
    history = [
        Message("user", "Read big.txt."),
        Message("assistant", "", [ToolCall("c0", "read_file", '{"path": "big.txt"}')]),
        Message("tool", "word " * 4000, tool_call_id="c0"),  # the round's own result, last
    ]
    out = compact(SYSTEM, history, 4096, 1024, fixed_tokens=500)
    assert sum(tokens(m) for m in out) <= budget(4096, 1024) - 500
    assert out[3].content.startswith("word word") and "were cut to fit" in out[3].content
    assert out[:3] == [SYSTEM, *history[:2]]
