"""Structured output on random weights: whatever the model would say, the answer is JSON that
matches its schema, unless max_tokens cuts it (finish_reason "length").

A tiny random llama over SmolLM2's byte-level vocabulary samples at temperature 1:
unconstrained, gibberish. 200 schemas drawn by
hypothesis-jsonschema (tests/structured/schemas.py) and the hand-written ones of
`helexa bench grammar` (nested objects, enums, bounded arrays, anyOf, $ref, formats, a
pydantic model) run through the engine in batches, each answer validated by `jsonschema`.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from helexa.bench.schemas import HAND_SCHEMAS
from helexa.engine.engine_args import EngineArgs
from helexa.engine.grammar import OutputGrammar
from helexa.engine.llm_engine import LLMEngine
from helexa.engine.sampling_params import SamplingParams
from helexa.protocol.structured import check_schema
from tests.engine.tiny import make_tiny_model
from tests.shared_fixtures import need_shared
from tests.structured.schemas import load_drawn

# Every format is checked, by the validators of jsonschema's format extra (calendar dates,
# RFC 3339 times, hostnames as fqdn reads them, RFC 3987 URIs)
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
PROMPT = [1, 57, 300, 41, 99, 2]
BATCH = 32
QUOTE_BIAS = 5.0
MAX_TOKENS = 128


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    need_shared()
    model_dir, _ = make_tiny_model("smollm2", tmp_path_factory.mktemp("random"), vocab_size=49152)
    return LLMEngine(EngineArgs(model=str(model_dir)))


def _quotes(engine: LLMEngine) -> dict[int, float]:
    """A nudge towards the tokens holding a double quote: among 49,152 a random model rarely
    picks one, so its free strings would seldom end within max_tokens. The grammar still
    decides which of them may come."""
    tok = engine.tokenizer
    ids = (i for i in range(tok.vocab_size) if '"' in tok.decode([i], skip_special_tokens=True))
    return dict.fromkeys(ids, QUOTE_BIAS)


def _run(
    engine: LLMEngine, schemas: list[dict], seeds: int = 1, max_tokens: int = MAX_TOKENS
) -> tuple[int, int]:
    """Every schema `seeds` times at temperature 1; returns (answers complete, all). Each
    complete answer must validate; the others must have been cut by max_tokens."""
    jobs = [(s, seed) for s in schemas for seed in range(seeds)]
    bias = _quotes(engine)
    validators = {}
    complete = 0
    for start in range(0, len(jobs), BATCH):
        chunk = jobs[start : start + BATCH]
        params = [
            SamplingParams(
                temperature=1.0,
                max_tokens=max_tokens,
                seed=start + i,
                logit_bias=bias,
                grammar=OutputGrammar.json_schema(schema),
            )
            for i, (schema, _) in enumerate(chunk)
        ]
        outs = engine.generate([PROMPT] * len(chunk), params)
        for (schema, _), out in zip(chunk, outs, strict=True):
            if out.finish_reason == "length":
                assert len(out.token_ids) == max_tokens
                continue
            assert out.finish_reason == "stop", (schema, out.text)
            key = json.dumps(schema)
            if key not in validators:
                validators[key] = jsonschema.Draft202012Validator(schema, format_checker=FORMATS)
            try:
                validators[key].validate(json.loads(out.text))
            except (jsonschema.ValidationError, ValueError) as e:
                raise AssertionError(f"{key}\n{out.text!r}\n{e}") from None
            complete += 1
    return complete, len(jobs)


def test_the_drawn_schemas_are_all_accepted_as_enforceable():
    drawn = load_drawn()
    assert len(drawn) == 200
    for schema in drawn:
        check_schema(schema, "schema")


def test_200_drawn_schemas_answer_valid_json_on_random_weights(engine):
    complete, total = _run(engine, load_drawn())
    # unbounded strings are where a random model runs out of tokens; most answers end
    assert complete >= total // 2, f"only {complete} of {total} answers completed"


def test_the_hand_written_schemas_answer_valid_json_on_random_weights(engine):
    schemas = list(HAND_SCHEMAS.values())
    for schema in schemas:
        check_schema(schema, "schema")
    complete, total = _run(engine, schemas, seeds=2, max_tokens=384)  # larger answers
    assert complete >= total // 2, f"only {complete} of {total} answers completed"


def test_without_the_grammar_the_same_model_says_no_json(engine):
    """The control: unconstrained, these answers are not JSON at all."""
    params = [SamplingParams(temperature=1.0, max_tokens=64, seed=i) for i in range(8)]
    outs = engine.generate([PROMPT] * 8, params)
    parsed = 0
    for out in outs:
        try:
            json.loads(out.text)
            parsed += 1
        except ValueError:
            pass
    assert parsed == 0


def test_json_object_answers_are_objects(engine):
    params = [
        SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=i,
                       grammar=OutputGrammar("json_object"))
        for i in range(8)
    ]  # fmt: skip
    for out in engine.generate([PROMPT] * 8, params):
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.finish_reason == "length"
