"""Stop strings matched incrementally agree with the plain definitions, piece by piece."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from helexa.engine.detokenizer import StopMatcher
from helexa.engine.sampling_params import SamplingParams
from helexa.engine.sequence import Sequence
from helexa.engine.tokenizer import Tokenizer
from helexa.protocol.markers import held_back

# A small alphabet, so stop strings overlap themselves and the text often.
TEXT = st.text(alphabet="abé ", max_size=6)
STOPS = st.lists(st.text(alphabet="abé ", min_size=1, max_size=5), min_size=1, max_size=4)


def naive_find_stop(text: str, start: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends after `start`; the first listed on a tie."""
    best = None
    for stop in stops:
        idx = text.find(stop, max(0, start - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def naive_held_back(text: str, stops: list[str]) -> int:
    """The longest end of `text` that is a proper prefix of a stop string."""
    return max(
        (
            n
            for stop in stops
            for n in range(len(stop))
            if n <= len(text) and stop[:n] == text[len(text) - n :]
        ),
        default=0,
    )


@settings(max_examples=400, deadline=None)
@given(stops=STOPS, pieces=st.lists(TEXT, max_size=12))
def test_the_matcher_finds_what_a_search_of_the_whole_text_finds(stops, pieces):
    matcher = StopMatcher(stops)
    text = ""
    for piece in pieces:  # fed on past matches too, as while min_tokens holds stops off
        start = len(text)
        text += piece
        hit = matcher.feed(piece)
        found = None if hit is None else (start + hit[0], hit[1])
        assert found == naive_find_stop(text, start, stops), (text, start)
        assert matcher.num_held == naive_held_back(text, stops) == held_back(text, stops)


PIECES = ("", "a", "b", "ab", "é", " ", "ba", "aab")


class _PieceTokenizer(Tokenizer):
    """Token id i decodes to PIECES[i]; id 0 is eos."""

    def __init__(self) -> None:
        self.eos_token_ids = {0}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(PIECES[i] for i in ids)


def _reference(ids: list[int], stops: list[str], min_tokens: int) -> tuple[str, str | None, str]:
    """(text, stop_reason, the deltas joined) by the plain definitions."""
    text, sent = "", ""
    for n, token in enumerate(ids, 1):
        start = len(text)
        text += PIECES[token]
        hit = naive_find_stop(text, start, stops)
        if hit is not None and n > min_tokens:
            text = text[: hit[0]]
            return text, hit[1], sent + text[len(sent) :]
        sent = text[: len(text) - naive_held_back(text, stops)]
    return text, None, text


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(1, len(PIECES) - 1), min_size=1, max_size=16),
    stops=STOPS,
    min_tokens=st.integers(0, 3),
)
def test_a_sequence_stops_truncates_and_holds_back_as_the_plain_definitions_say(
    ids, stops, min_tokens
):
    params = SamplingParams(stop=stops, min_tokens=min_tokens, ignore_eos=True)
    seq = Sequence([1], params, _PieceTokenizer(), max_tokens=len(ids))
    deltas = []
    for token in ids:
        seq.append_token(token)
        deltas.append(seq.take_delta().text)
        if seq.is_finished:
            break
    text, stop_reason, streamed = _reference(ids, stops, min_tokens)
    assert seq.output_text == text == seq.to_output().text
    assert seq.stop_reason == stop_reason
    assert seq.finish_reason == ("stop" if stop_reason is not None else "length")
    assert "".join(deltas) == streamed == text


def test_long_stop_strings_hold_back_only_the_text_that_begins_them():
    stops = [("x" * 29_999 + str(i)) for i in range(16)]
    matcher = StopMatcher(stops)
    for _ in range(2000):
        assert matcher.feed("ab cd") is None
    matcher.feed("xxx")
    assert matcher.num_held == 3
    assert matcher.feed("y") is None and matcher.num_held == 0
