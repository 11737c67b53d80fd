"""Micro-benchmark of stop strings on the engine thread: per-step microseconds of one
sequence's `append_token` + `take_delta` over a 2,000-token output.

    python bench/stop_strings.py

Rows: no stop strings; 16 random stop strings of 30,000 chars; 16 of 30,000 chars that the
output keeps matching (each begins with the whole output, so every char advances every
stop and all the text is held back); and the search this replaced (`str.find` over the
tail plus a quadratic held-back scan) timed for one step at the output's final length.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helexa.engine.sampling_params import SamplingParams
from helexa.engine.sequence import Sequence
from helexa.engine.tokenizer import Tokenizer
from helexa.protocol.markers import held_back

NUM_TOKENS = 2000
NUM_STOPS = 16
STOP_CHARS = 30_000
ALPHABET = "abcdefghij "


class _WordTokenizer(Tokenizer):
    """Token id i decodes to WORDS[i]: detokenizing costs next to nothing."""

    def __init__(self, words: list[str]) -> None:
        self.words = words
        self.eos_token_ids = {0}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.words[i] for i in ids)


def run(tok: _WordTokenizer, ids: list[int], stops: list[str]) -> list[float]:
    """Seconds per step of one sequence that emits `ids`."""
    params = SamplingParams(stop=stops, ignore_eos=True)
    seq = Sequence([1], params, tok, max_tokens=len(ids))
    times = []
    for token in ids:
        t = time.perf_counter()
        seq.append_token(token)
        seq.take_delta()
        times.append(time.perf_counter() - t)
    assert seq.finish_reason == "length", seq.finish_reason
    return times


def naive_step(text: str, start: int, stops: list[str]) -> None:
    """The per-step search this replaced: find over the tail, then held back by prefixes."""
    for stop in stops:
        text.find(stop, max(0, start - len(stop) + 1))
    held_back(text, stops)  # still the plain prefix scan, kept for short protocol markers


def main() -> None:
    rng = random.Random(0)
    words = ["", *("".join(rng.choices(ALPHABET, k=rng.randint(1, 8))) for _ in range(500))]
    tok = _WordTokenizer(words)
    ids = [rng.randint(1, len(words) - 1) for _ in range(NUM_TOKENS)]
    text = tok.decode(ids)
    random_stops = ["".join(rng.choices(ALPHABET, k=STOP_CHARS)) for _ in range(NUM_STOPS)]
    tail = "".join(rng.choices(ALPHABET, k=STOP_CHARS - len(text) - 1))
    matching_stops = [text + tail + str(i) for i in range(NUM_STOPS)]

    print(f"{NUM_TOKENS} tokens ({len(text)} chars), {NUM_STOPS} stops x {STOP_CHARS} chars")
    print(f"{'case':<36} {'mean us/step':>12} {'p99':>8} {'max':>8}")
    for name, stops in (
        ("no stop strings", []),
        ("16 random stop strings", random_stops),
        ("16 stop strings the output matches", matching_stops),
    ):
        times = sorted(run(tok, ids, stops))
        mean = statistics.fmean(times) * 1e6
        p99 = times[int(len(times) * 0.99)] * 1e6
        print(f"{name:<36} {mean:>12.1f} {p99:>8.1f} {times[-1] * 1e6:>8.1f}")
    for name, stops in (("random", random_stops), ("matching", matching_stops)):
        t = time.perf_counter()
        naive_step(text, len(text) - len(words[ids[-1]]), stops)
        us = (time.perf_counter() - t) * 1e6
        print(f"{'before, ' + name + ', one last step':<36} {us:>12.1f}")


if __name__ == "__main__":
    main()
