"""Reasoning split from content, wherever the stream's chunk boundaries fall."""

from __future__ import annotations

import pytest

from helexa.engine.tokenizer import load_hf_tokenizer
from helexa.protocol.reasoning import (
    ReasoningMarkers,
    ReasoningSplitter,
    split_reasoning,
)
from tests.engine.tiny import FIXTURE_MODELS
from tests.shared_fixtures import needs_shared

THINK = ReasoningMarkers("<think>", "</think>")
ANSWER = "<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is 4."


def _stream(text: str, cuts: list[int], **kw) -> tuple[str, str]:
    splitter = ReasoningSplitter(THINK, **kw)
    reasoning, content = "", ""
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        r, c = splitter.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = splitter.flush()
    return reasoning + r, content + c


def test_a_whole_answer_splits_into_reasoning_and_content():
    assert split_reasoning(ANSWER, THINK) == (
        "\nThe user asks 2+2. That is 4.\n",
        "The answer is 4.",
    )


@pytest.mark.parametrize("cut", range(1, len(ANSWER)))
def test_every_two_way_split_of_the_stream_gives_the_same_result(cut):
    assert _stream(ANSWER, [cut]) == split_reasoning(ANSWER, THINK)


def test_one_character_at_a_time_never_leaks_a_marker_into_content():
    splitter = ReasoningSplitter(THINK)
    content = ""
    for ch in ANSWER:
        _, c = splitter.feed(ch)
        content += c
        assert "<" not in content and "think" not in content
    assert content + splitter.flush()[1] == "The answer is 4."


def test_a_prompt_that_opened_think_starts_in_reasoning():
    prompt = "<|im_start|>assistant\n<think>\n"
    assert THINK.opened_by(prompt)
    assert not THINK.opened_by(prompt + "</think>\n\n")
    reasoning, content = split_reasoning("Hmm, 4.\n</think>\n\n4", THINK, in_reasoning=True)
    assert (reasoning, content) == ("Hmm, 4.\n", "4")


def test_text_that_only_looks_like_a_marker_start_is_content_in_the_end():
    assert _stream("a <b> c <thin", [3, 6]) == ("", "a <b> c <thin")


def test_an_unclosed_block_stays_reasoning():
    assert split_reasoning("<think>still thinking", THINK) == ("still thinking", "")


def test_several_blocks_and_bracket_markers():
    brackets = ReasoningMarkers("[THINK]", "[/THINK]")
    text = "[THINK]a[/THINK]b[THINK]c[/THINK]d"
    assert split_reasoning(text, brackets) == ("ac", "bd")


@needs_shared
def test_markers_come_from_the_vocabulary_not_the_model_name():
    qwen3 = load_hf_tokenizer(FIXTURE_MODELS / "Qwen3-0.6B")
    assert ReasoningMarkers.from_vocab(qwen3) == THINK
    smol = load_hf_tokenizer(FIXTURE_MODELS / "SmolLM2-135M-Instruct")
    assert ReasoningMarkers.from_vocab(smol) is None
