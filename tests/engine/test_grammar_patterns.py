"""What the grammar engine enforces for a string is what Python's `re` and the format
validators accept: the formats the engine writes as patterns (calendar dates, times,
hostnames, IPv4, UUIDs), user patterns (matched anywhere in the string, as JSON Schema says),
and a pattern or format together with length bounds (intersected, never one dropped).

Strings that match are drawn from each pattern by hypothesis; strings that do not are those
draws with one character deleted, doubled or replaced, kept when `re` refuses them. Each is
fed token by token to a matcher built by the engine's `GrammarCompiler` over a vocabulary of
the 256 bytes, so any text can be spelled."""

from __future__ import annotations

import json
import random
import re

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers

from helexa.engine.grammar import GrammarCompiler, GrammarError, OutputGrammar, check, json_safe
from helexa.engine.tokenizer import Tokenizer
from helexa.protocol.structured import FORMAT_PATTERNS

USER_PATTERNS = [
    r"^[0-9]{2}(\.[0-9]+)?$",
    r"^a(?:x[0-9]+)?Z$",  # xgrammar 0.2.8 took "a1Z"
    r"^(\+[0-9]{1,3})?[0-9]{6,10}$",
    r"^[A-Z]{2}-[0-9]{3}(-[a-z]+)?$",
    r"^v[0-9]+(\.[0-9]+){0,2}(-(alpha|beta)[0-9]*)?$",
    r"^(yes|no)?$",
    r"^[)?]+(x)?$",
]
PATTERNS = {f"format {k}": v for k, v in FORMAT_PATTERNS.items()} | {p: p for p in USER_PATTERNS}
MUTATION_CHARS = "0123456789aZx.-:T+/"


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    """A byte-level vocabulary: one token per byte, and an end token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))} | {"</s>": 256}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["</s>"])
    tok = Tokenizer(backend, eos_token="</s>")
    tok.eos_token_ids = {256}
    return GrammarCompiler(tok, 257)


def _accepts(compiler: GrammarCompiler, grammar: OutputGrammar, text: str) -> bool:
    """Whether the grammar takes `text` as the whole answer."""
    m = compiler.matcher(grammar)
    ids = compiler.tokenizer.tokenize_str(text)
    return all(m.accept(i) for i in ids) and m.is_complete


def _string(schema: dict) -> OutputGrammar:
    return OutputGrammar.json_schema({"type": "string", **schema})


def _mutations(text: str, rng: random.Random) -> list[str]:
    out = []
    for _ in range(6):
        i = rng.randrange(len(text)) if text else 0
        c = rng.choice(MUTATION_CHARS)
        out += [text[:i] + text[i + 1 :], text[:i] + c + text[i:], text[:i] + c + text[i + 1 :]]
    return out


@pytest.mark.parametrize("name", list(PATTERNS))
def test_the_grammar_matches_what_python_matches(compiler, name):
    pattern = PATTERNS[name]
    grammar = _string({"pattern": pattern})
    compiled = re.compile(pattern)
    rng = random.Random(name)

    @settings(
        max_examples=40, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given(st.from_regex(compiled, fullmatch=True))
    def check_draws(text: str) -> None:
        assert _accepts(compiler, grammar, json.dumps(text)), f"{pattern} refused {text!r}"
        for other in _mutations(text, rng):
            if compiled.search(other) is None:
                assert not _accepts(compiler, grammar, json.dumps(other)), (
                    f"{pattern} took {other!r}"
                )

    check_draws()


def test_a_pattern_matches_anywhere_in_the_string(compiler):
    """JSON Schema's `pattern` is a search, not a full match."""
    grammar = _string({"pattern": "ab"})
    assert _accepts(compiler, grammar, '"xaby"') and _accepts(compiler, grammar, '"ab"')
    assert not _accepts(compiler, grammar, '"ba"')


@pytest.mark.parametrize(
    ("schema", "good", "bad"),
    [
        ({"pattern": "^[a-z]+$", "maxLength": 3}, ["abc", "a"], ["abcd", "", "ab1"]),
        ({"pattern": "^[a-z]+$", "minLength": 2}, ["ab", "abcdef"], ["a", "A"]),
        ({"format": "date", "pattern": "^2"}, ["2024-02-29"], ["1999-01-01", "2023-02-29"]),
        ({"format": "email", "maxLength": 5}, ["a@b.c"], ["abc@def.com"]),
        ({"maxLength": 3}, ["a\tb", "é日"], ["abcd"]),
    ],
)
def test_bounds_beside_a_pattern_or_format_hold_too(compiler, schema, good, bad):
    grammar = _string(schema)
    for text in good:
        assert _accepts(compiler, grammar, json.dumps(text, ensure_ascii=False)), text
    for text in bad:
        assert not _accepts(compiler, grammar, json.dumps(text, ensure_ascii=False)), text


def test_a_raw_control_character_never_gets_into_a_string(compiler):
    grammar = _string({"maxLength": 4})
    assert not _accepts(compiler, grammar, '"a\tb"')  # a raw tab: not JSON
    assert _accepts(compiler, grammar, '"a\\tb"')


def test_formats_become_their_patterns():
    schema = json_safe(
        {
            "type": "object",
            "properties": {
                "d": {"type": "string", "format": "date", "maxLength": 10},
                "e": {"type": "string", "format": "ipv6"},
                "p": {"type": "string", "format": "date", "pattern": "^2"},
            },
        }
    )
    d, e, p = (schema["properties"][k] for k in "dep")
    assert d == {"type": "string", "pattern": FORMAT_PATTERNS["date"], "maxLength": 10}
    assert e == {"type": "string", "format": "ipv6"}  # the grammar engine's own
    assert p == {"type": "string", "pattern": "^2", "allOf": [{"pattern": FORMAT_PATTERNS["date"]}]}


def test_a_grammar_the_engine_cannot_build_is_a_grammar_error():
    with pytest.raises(GrammarError):
        check(_string({"pattern": "("}))
    with pytest.raises(GrammarError):
        check(OutputGrammar.lark("start: nowhere\n"))


@pytest.mark.parametrize("fmt", list(FORMAT_PATTERNS))
def test_every_string_a_format_pattern_admits_is_that_format(fmt):
    """The patterns only narrow: what they admit passes jsonschema's own format checker
    (its format extra: fqdn, rfc3339-validator, rfc3987)."""
    import jsonschema

    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    assert fmt in checker.checkers, f"no checker for {fmt}: install jsonschema[format]"

    @settings(
        max_examples=200, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given(st.from_regex(FORMAT_PATTERNS[fmt], fullmatch=True))
    def check_draws(text: str) -> None:
        assert checker.conforms(text, fmt), f"{fmt} pattern admits {text!r}"

    check_draws()


def test_every_format_the_protocol_accepts_the_engine_builds():
    from helexa.protocol.structured import SUPPORTED_FORMATS

    for fmt in SUPPORTED_FORMATS:
        check(_string({"format": fmt}))
