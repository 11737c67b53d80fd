"""Structured output: what a request's answer must match, compiled for the model's vocabulary.

A request names an `OutputGrammar`: a JSON schema, any JSON object, or a Lark grammar (free
text with constrained regions: a tool call's arguments after its start marker, reasoning left
free; `helexa.node.structured` writes them). The engine builds a matcher for it once per
distinct grammar (`GrammarCompiler`, cached: a second request with the same schema copies
the first's), gives each sequence its own copy, and before each sampling step fills one
bitmask row per constrained sequence: bit t set when token t may come next. The sampler sets
the other tokens' logits to -inf (`helexa.kernels.apply_token_bitmask`), on the CPU or on
the GPU.

llguidance is the engine (docs/engine.md says why, with the figures of `helexa bench
grammar`): it reads the vocabulary from the tokenizer's own tokenizer.json (byte-level BPE,
byte-fallback BPE), builds its lexer lazily, so a new schema costs milliseconds, and
intersects what xgrammar drops (a pattern with length bounds). Added tokens (`<tool_call>`,
`<think>`, the turn markers) are tokens to it, never text: a JSON answer can never hold one,
and a Lark grammar names the markers it allows by id.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from helexa.protocol.structured import FORMAT_PATTERNS

if TYPE_CHECKING:
    import llguidance

    from helexa.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

GrammarKind = Literal["json_schema", "json_object", "lark"]
# Consecutive whitespace a JSON answer may hold between tokens: pretty-printing fits, a model
# stuck emitting blanks does not run to max_tokens.
MAX_JSON_WHITESPACE = 32
WHITESPACE_PATTERN = rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}"
BITS = 32  # tokens per bitmask word (int32, as llguidance lays it out)
# json_object: any JSON object
ANY_OBJECT: dict[str, Any] = {"type": "object", "additionalProperties": True}


class GrammarError(ValueError):
    """The grammar engine refused a grammar: the message says what it could not handle."""


@dataclass(frozen=True, slots=True)
class OutputGrammar:
    """What a sequence's output must match. `source` is the schema as JSON text
    (json_schema), "" (json_object: any JSON object), or a Lark grammar (lark)."""

    kind: GrammarKind
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict | bool, *, lenient: bool = False) -> OutputGrammar:
        """`lenient`: keywords llguidance does not know are ignored rather than refused (a
        tool that is not strict: its schema was never checked)."""
        return cls("json_schema", json.dumps(json_options(schema, lenient=lenient)))

    @classmethod
    def lark(cls, text: str) -> OutputGrammar:
        return cls("lark", text)


def json_options(schema: dict | bool, *, lenient: bool = False) -> dict[str, Any]:
    """`schema` as llguidance is to read it: formats as the engine's exact patterns
    (`json_safe`) and the compile options in its `x-guidance` key: whitespace bounded,
    `oneOf` read as `anyOf` (a schema's branches rarely overlap), `lenient` as asked."""
    if schema is False:
        raise GrammarError("the schema `false` admits no value at all")
    body = json_safe(schema) if isinstance(schema, dict) else {}
    options = {"whitespace_pattern": WHITESPACE_PATTERN, "coerce_one_of": True}
    if lenient:
        options["lenient"] = True
    return {**body, "x-guidance": options}


_CONTAINERS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def json_safe(schema: Any, *, close: bool = True) -> Any:
    """`schema` as the engine enforces it: closed (an object with `properties` takes no
    others unless it says so; an array with `prefixItems`, no more items), and each format
    of `FORMAT_PATTERNS` written as its pattern (llguidance's own formats are looser than
    the validators clients check answers with), in an `allOf` beside a pattern the string
    has of its own, which llguidance intersects with it. What it allows still satisfies the
    schema as given: this only narrows it."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _CONTAINERS:
        if isinstance(out.get(key), dict):
            out[key] = {k: json_safe(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):  # allOf's parts are merged: none closes alone
            out[key] = [json_safe(v, close=key != "allOf") for v in out[key]]
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = json_safe(out[key])
    if close and "allOf" not in out:
        # closed, as OpenAI's strict mode and xgrammar read a schema: listed properties and
        # no others, the prefix's items and no more (llguidance would let a model add keys)
        open_keys = ("additionalProperties", "unevaluatedProperties", "patternProperties")
        if isinstance(out.get("properties"), dict) and not any(k in out for k in open_keys):
            out["additionalProperties"] = False
        if isinstance(out.get("prefixItems"), list) and "items" not in out:
            out["items"] = False
    fmt = out.get("format")
    if isinstance(fmt, str) and fmt in FORMAT_PATTERNS:
        del out["format"]
        if "pattern" in out:  # both hold: llguidance intersects an allOf's patterns
            out["allOf"] = [*out.get("allOf", []), {"pattern": FORMAT_PATTERNS[fmt]}]
        else:
            out["pattern"] = FORMAT_PATTERNS[fmt]
    return out


def llg_grammar(grammar: OutputGrammar) -> str:
    """The grammar as llguidance takes it."""
    from llguidance import LLMatcher

    if grammar.kind == "json_object":
        return LLMatcher.grammar_from_json_schema(json_options(ANY_OBJECT))
    if grammar.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(grammar.source)
    return LLMatcher.grammar_from_lark(grammar.source)


def check(grammar: OutputGrammar) -> None:
    """Raise GrammarError when llguidance cannot build `grammar` (no tokenizer needed: a
    millisecond or two). A bad regex `pattern`, a `$ref` to nowhere, a malformed Lark."""
    from llguidance import LLMatcher

    try:
        error = LLMatcher.validate_grammar(llg_grammar(grammar))
    except ValueError as e:  # not JSON at all
        raise GrammarError(str(e)) from None
    if error:
        raise GrammarError(_message(error))


def _message(error: str) -> str:
    """llguidance's error, without the grammar text it quotes after the first line."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return lines[0] if lines else "invalid grammar"


# -- the vocabulary ----------------------------------------------------------------------


def vocab_type(tokenizer: Tokenizer) -> str:
    """ "byte_level", "byte_fallback" or "raw": how token strings map to bytes, from the
    tokenizer's decoder (ByteLevel; ByteFallback in a Sequence; anything else)."""
    decoder = json.loads(tokenizer.backend.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or ()}
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds:
        return "byte_fallback"
    return "raw"


def llg_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The vocabulary as llguidance reads it, ending on the tokenizer's stop tokens: as wide
    as the model's logits (`vocab_size`: ids the tokenizer lacks are never allowed), or the
    tokenizer's own when that is wider (ids past the logits are never sampled)."""
    import llguidance

    width = max(vocab_size, tokenizer.vocab_size)
    stops = sorted(t for t in tokenizer.eos_token_ids if t < vocab_size)
    return llguidance.LLTokenizer(
        tokenizer.backend.to_str(), n_vocab=width, eos_token=stops or None
    )


# -- compiling, matching -------------------------------------------------------------------


class GrammarCompiler:
    """Builds `OutputGrammar`s for one model's vocabulary; thread-safe. Each distinct grammar
    is built once: the last `cache_size` stay, as matchers at their start that each new
    sequence copies."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *, cache_size: int = 256) -> None:
        self.tokenizer = llg_tokenizer(tokenizer, vocab_size)
        self.vocab_size = self.tokenizer.vocab_size  # the bitmask's width
        self._cache: OrderedDict[OutputGrammar, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def cached(self, grammar: OutputGrammar) -> bool:
        with self._lock:
            return grammar in self._cache

    def compile(self, grammar: OutputGrammar) -> llguidance.LLMatcher:
        """A matcher at the start of `grammar` (never advanced: copy it), from the cache when
        built before; raises GrammarError when llguidance refuses the grammar."""
        from llguidance import LLMatcher

        with self._lock:
            hit = self._cache.get(grammar)
            if hit is not None:
                self._cache.move_to_end(grammar)
                return hit
        try:
            text = llg_grammar(grammar)
        except ValueError as e:
            raise GrammarError(str(e)) from None
        built = LLMatcher(self.tokenizer, text, log_level=0)  # drops the GIL while it builds
        if built.is_error():
            raise GrammarError(_message(built.get_error()))
        with self._lock:
            self._cache[grammar] = built
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return built

    def matcher(self, grammar: OutputGrammar) -> Matcher:
        """A fresh matcher for one sequence."""
        start = Matcher(self.compile(grammar), self.vocab_size)
        with self._lock:
            return start.copy()


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size

    def copy(self) -> Matcher:
        """An independent matcher at the same place."""
        return Matcher(self._m.deep_copy(), self.vocab_size)

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self._m.reset()

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False when the grammar forbids it (the matcher is then
        in error and forbids everything)."""
        return self._m.consume_token(token_id)

    @property
    def is_complete(self) -> bool:
        """Whether the output so far is a whole answer (it may still go on)."""
        return self._m.is_accepting()

    @property
    def is_terminated(self) -> bool:
        """Whether the grammar is complete and nothing may follow (not even a stop token is
        needed: the answer is over)."""
        return self._m.is_stopped()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` [N, words] int32 (CPU) ← the tokens allowed next."""
        _check_bitmask(bitmask)
        words = bitmask[row]
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)


def _check_bitmask(bitmask: torch.Tensor) -> None:
    """llguidance writes through a raw pointer (llguidance.torch does the same, but importing
    it pulls in torch._dynamo: seconds): the tensor must be what it expects."""
    ok = bitmask.dtype == torch.int32 and bitmask.is_contiguous() and bitmask.dim() == 2
    if not ok or bitmask.device.type != "cpu":
        raise ValueError("the bitmask must be a contiguous [N, words] int32 tensor on the CPU")


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + BITS - 1) // BITS


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def _parallel() -> llguidance.LLExecutor:
    """llguidance's thread pool for a batch's masks (one per process, like torch's)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor(max(1, min(8, os.cpu_count() or 1)))
        return _executor


def fill_bitmask(
    matchers: list[Matcher | None], vocab_size: int, *, pin: bool = False
) -> torch.Tensor:
    """The allowed-token bitmask [N, words] int32 of a batch, on the CPU (`pin`: in pinned
    memory, for a copy to the GPU that does not wait): constrained rows from their
    matchers, filled in parallel when there are several, the others all ones. At least
    `vocab_size` wide (the logits); wider when the grammar's vocabulary is."""
    width = max([vocab_size, *(m.vocab_size for m in matchers if m is not None)])
    shape = (len(matchers), bitmask_words(width))
    bitmask = torch.full(shape, -1, dtype=torch.int32, pin_memory=pin)
    fill_rows(matchers, bitmask)
    return bitmask


def fill_rows(matchers: list[Matcher | None], bitmask: torch.Tensor) -> None:
    """Each constrained row of `bitmask` from its matcher (in parallel when there are
    several); the others are left as they are."""
    rows = [(m, row) for row, m in enumerate(matchers) if m is not None]
    if len(rows) == 1:
        rows[0][0].fill(bitmask, rows[0][1])
    elif rows:
        _check_bitmask(bitmask)
        pairs = [(m._m, row) for m, row in rows]
        n, words = bitmask.shape
        _parallel().unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, n)
