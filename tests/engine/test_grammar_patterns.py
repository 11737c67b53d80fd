"""The patterns the engine hands xgrammar match what Python's `re` matches: the formats it
enforces as patterns (calendar dates, times, hostnames, IPv4, UUIDs) and user patterns with
optional groups, which xgrammar 0.2.8 matched wrongly until `xgrammar_regex` rewrote them.
Strings that match are drawn from each pattern by hypothesis; strings that do not are those
draws with one character deleted, doubled or replaced, kept when `re` refuses them."""

from __future__ import annotations

import json
import random
import re

import pytest
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from xgrammar.testing import _is_grammar_accept_string

from helexa.engine.grammar import OutputGrammar, json_safe, xgrammar_regex
from helexa.protocol.structured import FORMAT_PATTERNS

USER_PATTERNS = [
    r"^[0-9]{2}(\.[0-9]+)?$",
    r"^a(?:x[0-9]+)?Z$",
    r"^(\+[0-9]{1,3})?[0-9]{6,10}$",
    r"^[A-Z]{2}-[0-9]{3}(-[a-z]+)?$",
    r"^v[0-9]+(\.[0-9]+){0,2}(-(alpha|beta)[0-9]*)?$",
    r"^(yes|no)?$",
    r"^[)?]+(x)?$",
]
PATTERNS = {**{f"format {k}": v for k, v in FORMAT_PATTERNS.items()}, **dict.fromkeys(USER_PATTERNS)}
PATTERNS = {k: v if v is not None else k for k, v in PATTERNS.items()}
MUTATION_CHARS = "0123456789aZx.-:T+/"


def _grammar(pattern: str) -> xgr.Grammar:
    schema = json_safe({"type": "string", "pattern": pattern})
    return xgr.Grammar.from_json_schema(json.dumps(schema))


def _accepts(grammar: xgr.Grammar, text: str) -> bool:
    return _is_grammar_accept_string(grammar, json.dumps(text))


def _mutations(text: str, rng: random.Random) -> list[str]:
    out = []
    for _ in range(6):
        i = rng.randrange(len(text)) if text else 0
        c = rng.choice(MUTATION_CHARS)
        out += [text[:i] + text[i + 1 :], text[:i] + c + text[i:], text[:i] + c + text[i + 1 :]]
    return out


@pytest.mark.parametrize("name", list(PATTERNS))
def test_xgrammar_matches_what_python_matches(name):
    pattern = PATTERNS[name]
    grammar = _grammar(pattern)
    compiled = re.compile(pattern)
    rng = random.Random(name)

    @settings(
        max_examples=40, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given(st.from_regex(compiled, fullmatch=True))
    def check(text: str) -> None:
        assert _accepts(grammar, text), f"{pattern} refused {text!r}"
        for other in _mutations(text, rng):
            if compiled.fullmatch(other) is None:
                assert not _accepts(grammar, other), f"{pattern} took {other!r}"

    check()


def test_the_optional_group_bug_is_what_the_rewrite_avoids():
    """The premise, so the rewrite can go when xgrammar is fixed: given as written, an
    optional group holding a repetition lets its first piece be skipped."""
    raw = xgr.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": USER_PATTERNS[1]}))
    fixed = _grammar(USER_PATTERNS[1])
    if not _accepts(raw, "a1Z"):
        pytest.skip("this xgrammar matches optional groups right: xgrammar_regex may go")
    assert not _accepts(fixed, "a1Z") and _accepts(fixed, "ax1Z") and _accepts(fixed, "aZ")


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        (r"^a(?:x[0-9]+)?Z$", r"^a(?:x[0-9]+){0,1}Z$"),
        (r"^a\)?b$", r"^a\)?b$"),  # an escaped parenthesis
        (r"^[)]?(a)?$", r"^[)]?(a){0,1}$"),  # one inside a class
        (r"^[]a)]?(b)??$", r"^[]a)]?(b){0,1}?$"),  # a class opening with ]
        (r"^[^]x)?]+(c)?$", r"^[^]x)?]+(c){0,1}$"),
        (r"(?:a(?:b)?)?", r"(?:a(?:b){0,1}){0,1}"),
    ],
)
def test_only_a_groups_question_mark_is_rewritten(pattern, expected):
    assert xgrammar_regex(pattern) == expected
    assert re.compile(expected).pattern == expected  # still a regex Python reads


def test_formats_become_their_patterns_and_length_bounds_beside_them_go():
    schema = json_safe(
        {
            "type": "object",
            "properties": {
                "d": {"type": "string", "format": "date", "maxLength": 10},
                "e": {"type": "string", "format": "email"},
                "s": {"type": "string", "maxLength": 3},
            },
        }
    )
    d, e, s = (schema["properties"][k] for k in "des")
    assert d == {"type": "string", "pattern": xgrammar_regex(FORMAT_PATTERNS["date"])}
    assert e == {"type": "string", "format": "email"}  # xgrammar's own grammar
    assert s["pattern"].endswith("{0,3}$") and "maxLength" not in s
    # the grammar's cache key is the rewritten schema
    assert OutputGrammar.json_schema({"type": "string", "format": "date"}).source == json.dumps(
        {"type": "string", "pattern": xgrammar_regex(FORMAT_PATTERNS["date"])},
        separators=(",", ":"),
    )
