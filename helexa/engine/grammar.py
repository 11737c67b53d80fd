"""Structured output: what a request's answer must match, compiled for the model's vocabulary.

A request names an `OutputGrammar`: a JSON schema, any JSON object, or an xgrammar structural
tag (free text with constrained regions: a tool call's arguments after its start marker,
reasoning left free). The engine compiles it once per distinct grammar (`GrammarCompiler`,
cached: a second request with the same schema pays nothing), gives each sequence its own
matcher, and before each sampling step fills one bitmask row per constrained sequence: bit t
set when token t may come next. The sampler sets the other tokens' logits to -inf
(`helexa.kernels.apply_token_bitmask`), on the CPU or on the GPU.

xgrammar is the engine (docs/engine.md says why, with the figures of `helexa bench grammar`).
Its matchers work on token bytes: `tokenizer_info` hands it our tokenizer's vocabulary as
byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2), byte-fallback BPE (SentencePiece: `<0x0A>`,
`▁`) or raw strings, read from the tokenizer's own decoder.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from helexa.protocol.reasoning import ReasoningMarkers
from helexa.protocol.structured import FORMAT_PATTERNS
from helexa.protocol.tool_calls import ToolCallMarkers

if TYPE_CHECKING:
    import xgrammar

    from helexa.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

GrammarKind = Literal["json_schema", "json_object", "structural_tag"]
# Consecutive whitespace a JSON answer may hold: pretty-printing fits, a model stuck emitting
# blanks does not run to max_tokens.
MAX_JSON_WHITESPACE = 32
BITS = 32  # tokens per bitmask word (int32, as xgrammar lays it out)
# json_object: any object (xgrammar's built-in JSON grammar admits any value, arrays too;
# and a bare {"type": "object"} is read strictly, as no property allowed)
ANY_OBJECT: dict[str, Any] = {"type": "object", "additionalProperties": True}
ANY_OBJECT_TEXT = json.dumps(ANY_OBJECT)


class GrammarError(ValueError):
    """The grammar engine refused a grammar: the message says what it could not handle."""


@dataclass(frozen=True, slots=True)
class OutputGrammar:
    """What a sequence's output must match. `source` is JSON text: the schema
    (json_schema), "" (json_object: any JSON object), or the structural tag
    (structural_tag)."""

    kind: GrammarKind
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict | bool) -> OutputGrammar:
        return cls("json_schema", _canonical(json_safe(schema)))

    @classmethod
    def structural_tag(cls, tag: dict) -> OutputGrammar:
        return cls("structural_tag", _canonical(tag))


# xgrammar 0.2.8 writes a string with minLength/maxLength as `[^"\\\r\n]{min,max}`, which lets
# raw control characters (U+0000-U+001F other than CR, LF) into it: not JSON. As a pattern it
# is matched as a JSON string's text, control characters excluded (mlc-ai/xgrammar#800), and
# UTF-16 surrogates too: xgrammar takes their UTF-8 form (ED A0-BF xx) for a character, which
# decodes to three U+FFFD and breaks the bound.
_SAFE_CHAR = r'[^"\\\u0000-\u001f\ud800-\udfff]'
_CONTAINERS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def json_safe(schema: Any) -> Any:
    """`schema` as the engine enforces it exactly: each length-bounded string (no pattern,
    format, enum or const) as the equivalent pattern over characters a JSON string holds
    unescaped, so the grammar never lets a raw control character in; each format of
    `FORMAT_PATTERNS` as its pattern (calendar dates, hostname label lengths: xgrammar's own
    grammars are looser than validators). Length bounds beside a pattern or format are
    dropped: `check_schema` accepted them only where the pattern implies them. The strings
    it allows still satisfy the schema as given: this only narrows them."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _CONTAINERS:
        if isinstance(out.get(key), dict):
            out[key] = {k: json_safe(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [json_safe(v) for v in out[key]]
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = json_safe(out[key])
    if any(k in out for k in ("enum", "const")):
        return out
    fmt = out.get("format")
    if "pattern" not in out and isinstance(fmt, str) and fmt in FORMAT_PATTERNS:
        del out["format"]
        out["pattern"] = FORMAT_PATTERNS[fmt]
    if isinstance(out.get("pattern"), str):
        out["pattern"] = xgrammar_regex(out["pattern"])
    bounded = "minLength" in out or "maxLength" in out
    if bounded and any(k in out for k in ("pattern", "format")):
        out.pop("minLength", None)
        out.pop("maxLength", None)
    elif bounded:
        low = int(out.pop("minLength", 0))
        high = out.pop("maxLength", None)
        out["pattern"] = f"^{_SAFE_CHAR}{{{low},{'' if high is None else int(high)}}}$"
    return out


def xgrammar_regex(pattern: str) -> str:
    """`pattern` with each group's `?` written `{0,1}`: xgrammar 0.2.8 matches a JSON
    string's pattern wrongly when an optional group holds a repetition (`^a(?:x[0-9]+)?Z$`
    takes "a1Z": the group's first piece becomes skippable on its own); `{0,1}` is matched
    right. Escapes and character classes are left as they are."""
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":  # an escape: two characters as they are
            out.append(pattern[i : i + 2])
            i += 2
        elif c == "[":  # a class: to the first ] that is not its first member
            j = i + 1
            j += pattern[j : j + 1] == "^"
            j += pattern[j : j + 1] == "]"
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            out.append(pattern[i : j + 1])
            i = j + 1
        elif c == ")" and pattern[i + 1 : i + 2] == "?":
            out.append("){0,1}")
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _canonical(value: object) -> str:
    """One text per value, whatever its key order: the cache key."""
    return json.dumps(value, sort_keys=False, ensure_ascii=False, separators=(",", ":"))


def check(grammar: OutputGrammar) -> None:
    """Raise GrammarError when xgrammar cannot build `grammar` (no tokenizer needed: cheap).
    A bad regex `pattern`, a `$ref` to nowhere, a malformed structural tag."""
    import xgrammar as xgr

    try:
        if grammar.kind == "json_schema":
            xgr.Grammar.from_json_schema(grammar.source, max_whitespace_cnt=MAX_JSON_WHITESPACE)
        elif grammar.kind == "structural_tag":
            xgr.Grammar.from_structural_tag(grammar.source)
    except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses
        raise GrammarError(_message(e)) from None


def _message(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[-1] if text else type(error).__name__


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


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgrammar.TokenizerInfo:
    """The vocabulary as xgrammar reads it, `vocab_size` wide (the model's logits: ids the
    tokenizer lacks are never allowed). Special tokens other than the markers a grammar may
    name (`<tool_call>`, `<think>`: those whose text a template writes) are left empty, so no
    grammar ever lets one in as text; the stop tokens are allowed where an answer may end."""
    import xgrammar as xgr

    backend = tokenizer.backend
    special = tokenizer.special_ids()
    markers = _markers(tokenizer)
    words = []
    for i in range(min(vocab_size, backend.get_vocab_size(with_added_tokens=True))):
        token = backend.id_to_token(i)
        words.append("" if token is None or (i in special and token not in markers) else token)
    kind = {
        "byte_level": xgr.VocabType.BYTE_LEVEL,
        "byte_fallback": xgr.VocabType.BYTE_FALLBACK,
        "raw": xgr.VocabType.RAW,
    }[vocab_type(tokenizer)]
    stops = sorted(t for t in tokenizer.eos_token_ids if t < vocab_size)
    return xgr.TokenizerInfo(
        words,
        kind,
        vocab_size=vocab_size,
        stop_token_ids=stops,
        add_prefix_space=kind == xgr.VocabType.BYTE_FALLBACK,
    )


def _markers(tokenizer: Tokenizer) -> set[str]:
    """The reasoning and tool-call markers of this vocabulary: special tokens a structural
    tag names as text (the turn markers, `<|im_end|>`, never appear inside an answer)."""
    pairs = (ReasoningMarkers.from_vocab(tokenizer), ToolCallMarkers.from_vocab(tokenizer))
    return {t for pair in pairs if pair is not None for t in (pair.start, pair.end)}


# -- compiling, matching -------------------------------------------------------------------


class GrammarCompiler:
    """Compiles `OutputGrammar`s for one model's vocabulary; thread-safe. Each distinct
    grammar is compiled once: the last `cache_size` stay (xgrammar's own cache also keeps
    the compiled pieces, bounded by bytes)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        *,
        max_threads: int = 2,
        cache_size: int = 256,
    ) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size)
        self._compiler = xgr.GrammarCompiler(
            self.info, max_threads=max_threads, cache_limit_bytes=256 << 20
        )
        self._cache: OrderedDict[OutputGrammar, xgrammar.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def cached(self, grammar: OutputGrammar) -> bool:
        with self._lock:
            return grammar in self._cache

    def compile(self, grammar: OutputGrammar) -> xgrammar.CompiledGrammar:
        """The compiled grammar, from the cache when it was compiled before; raises
        GrammarError when xgrammar refuses it."""
        with self._lock:
            hit = self._cache.get(grammar)
            if hit is not None:
                self._cache.move_to_end(grammar)
                return hit
        try:
            if grammar.kind in ("json_object", "json_schema"):
                source = grammar.source if grammar.kind == "json_schema" else ANY_OBJECT_TEXT
                compiled = self._compiler.compile_json_schema(
                    source, max_whitespace_cnt=MAX_JSON_WHITESPACE
                )
            else:
                compiled = self._compiler.compile_structural_tag(grammar.source)
        except Exception as e:
            raise GrammarError(_message(e)) from None
        with self._lock:
            self._cache[grammar] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, grammar: OutputGrammar, stop_token_ids: set[int]) -> Matcher:
        """A fresh matcher for one sequence. `stop_token_ids`: the tokens that end it (none:
        it ends itself once the grammar is complete, as with ignore_eos)."""
        return Matcher(self.compile(grammar), sorted(stop_token_ids), self.vocab_size)


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(
        self, compiled: xgrammar.CompiledGrammar, stop_token_ids: list[int], vocab_size: int
    ) -> None:
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(
            compiled,
            override_stop_tokens=stop_token_ids,
            terminate_without_stop_token=not stop_token_ids,
        )
        self.vocab_size = vocab_size

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (state unchanged) when the grammar forbids it."""
        return self._m.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """Whether the grammar is complete and has taken its end (a stop token, or none)."""
        return self._m.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` [N, words] int32 (CPU) ← the tokens allowed next."""
        self._m.fill_next_token_bitmask(bitmask, row)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + BITS - 1) // BITS


def fill_bitmask(
    matchers: list[Matcher | None], vocab_size: int, *, pin: bool = False
) -> torch.Tensor:
    """The allowed-token bitmask [N, words] int32 of a batch, on the CPU (`pin`: in pinned
    memory, for a copy to the GPU that does not wait): constrained rows from their
    matchers, the others all ones."""
    shape = (len(matchers), bitmask_words(vocab_size))
    bitmask = torch.full(shape, -1, dtype=torch.int32, pin_memory=pin)
    for row, m in enumerate(matchers):
        if m is not None:
            m.fill(bitmask, row)
    return bitmask
