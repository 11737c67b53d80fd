"""The engine's tokenizer: a `tokenizers.Tokenizer` plus the metadata generation needs.

Both loaders build one of these: `load_hf_tokenizer(dir)` for HF-layout directories and
`helexa.engine.loader.gguf` from GGUF metadata. Nothing here imports `transformers`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE


@dataclass(slots=True)
class Tokenizer:
    """Encode/decode plus special tokens and the chat template of one model."""

    backend: tokenizers.Tokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    # Prepend bos when encoding a raw prompt (Llama: true; Qwen/SmolLM2: false).
    add_bos_token: bool = False
    # A template string, or {name: template} when the model ships several named ones.
    chat_template: str | dict[str, str] | None = None
    # Ids that end generation: the tokenizer's eos plus generation_config eos ids.
    eos_token_ids: set[int] = field(default_factory=set)
    # Extra chat-template variables from tokenizer_config (e.g. additional special tokens).
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token) if self.eos_token else None

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def is_special(self, token: str) -> bool:
        """Whether `token` is a special token (one `skip_special_tokens` drops in decoding)."""
        token_id = self.token_to_id(token)
        added = (
            self.backend.get_added_tokens_decoder().get(token_id) if token_id is not None else None
        )
        return bool(added is not None and added.special)

    def special_ids(self) -> set[int]:
        """Ids of the special tokens (`<|im_start|>`, `<|im_end|>`, bos, eos...)."""
        decoder = self.backend.get_added_tokens_decoder()
        return {i for i, tok in decoder.items() if tok.special}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for `text`; special-token strings in it map to their ids.

        `add_special_tokens=True` prepends bos when the model wants one (raw prompts);
        rendered chat templates already carry their own bos, so they pass False.
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


# Qwen2's pre-tokenizer split, as transformers' Qwen2Tokenizer builds it (digits one by one).
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_CLASSES = {"Qwen2Tokenizer", "Qwen2TokenizerFast"}
_NAMED_SPECIALS = ("bos_token", "eos_token", "pad_token", "unk_token")
# Named special tokens HF also hands to templates; kept in `Tokenizer.extra` when set.
_OTHER_SPECIALS = ("sep_token", "cls_token", "mask_token")


def load_hf_tokenizer(model_dir: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of an HF-layout directory: tokenizer.json, or vocab.json + merges.txt."""
    root = Path(model_dir)
    config = _read_json(root / "tokenizer_config.json")
    special_map = _read_json(root / "special_tokens_map.json")
    specials = {
        name: _special_token(name, config, special_map)
        for name in _NAMED_SPECIALS + _OTHER_SPECIALS
    }
    listed = _lookup("additional_special_tokens", config, special_map) or []
    additional = [t for t in map(_token_content, listed) if t is not None]

    if (root / "tokenizer.json").is_file():
        backend = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
    elif (root / "vocab.json").is_file() and (root / "merges.txt").is_file():
        named = [t for t in specials.values() if t is not None]
        backend = _byte_level_bpe(root, config, special_tokens=[*named, *additional])
    else:
        raise FileNotFoundError(f"no tokenizer.json or vocab.json + merges.txt in {str(root)!r}")

    extra: dict[str, Any] = {name: specials[name] for name in _OTHER_SPECIALS if specials[name]}
    if additional:
        extra["additional_special_tokens"] = additional
    tok = Tokenizer(
        backend=backend,
        bos_token=specials["bos_token"],
        eos_token=specials["eos_token"],
        pad_token=specials["pad_token"],
        unk_token=specials["unk_token"],
        chat_template=read_chat_template(root, config),
        extra=extra,
    )
    bos_id = tok.bos_token_id
    # Either signal means the model was trained with bos in front; `encode` adds it itself
    # (the backend is always called without its post-processor), so it is never doubled.
    tok.add_bos_token = bos_id is not None and (
        bool(config.get("add_bos_token", False)) or _post_processor_prepends(backend, bos_id)
    )
    tok.eos_token_ids = _eos_token_ids(root, tok)
    return tok


def read_chat_template(
    model_dir: str | os.PathLike[str], tokenizer_config: dict[str, Any] | None = None
) -> str | dict[str, str] | None:
    """The model's chat template(s), in HF precedence.

    `chat_template.jinja` (plus `additional_chat_templates/*.jinja` as named ones) →
    `chat_template.json` → tokenizer_config.json `chat_template`; None when there is none.
    """
    root = Path(model_dir)
    templates: dict[str, str] = {}
    if (root / "chat_template.jinja").is_file():
        templates["default"] = (root / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return _normalize_templates(templates)
    if tokenizer_config is None:
        tokenizer_config = _read_json(root / "tokenizer_config.json")
    for source in (_read_json(root / "chat_template.json"), tokenizer_config):
        if source.get("chat_template") is not None:
            return _normalize_templates(source["chat_template"])
    return None


def _normalize_templates(value: Any) -> str | dict[str, str]:
    """A template string, or {name: template}; a lone "default" collapses to its string."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        value = {entry["name"]: entry["template"] for entry in value}
    if not isinstance(value, dict) or not all(isinstance(t, str) for t in value.values()):
        raise ValueError(f"chat_template must be a string or named templates, got {value!r:.200}")
    if list(value) == ["default"]:
        return value["default"]
    return dict(value)


def _byte_level_bpe(
    root: Path, config: dict[str, Any], special_tokens: list[str]
) -> tokenizers.Tokenizer:
    """A byte-level BPE from vocab.json + merges.txt, as transformers builds the fast one."""
    vocab: dict[str, int] = json.loads((root / "vocab.json").read_text(encoding="utf-8"))
    merges = [
        tuple(line.split(" "))
        for line in (root / "merges.txt").read_text(encoding="utf-8").split("\n")
        if line and not line.startswith("#version")
    ]
    added = sorted((int(i), spec) for i, spec in config.get("added_tokens_decoder", {}).items())
    # Added tokens go into the model vocab at their ids, so gaps in the id range keep their ids.
    for token_id, spec in added:
        vocab.setdefault(spec["content"], token_id)
    backend = tokenizers.Tokenizer(
        BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="")
    )
    add_prefix_space = bool(config.get("add_prefix_space") or False)
    if config.get("tokenizer_class") in _QWEN2_CLASSES:
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(
                    Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False
                ),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
            ]
        )
    else:  # GPT-2 style
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    backend.decoder = decoders.ByteLevel()

    for token_id, spec in added:
        token = AddedToken(
            spec["content"],
            single_word=spec.get("single_word", False),
            lstrip=spec.get("lstrip", False),
            rstrip=spec.get("rstrip", False),
            normalized=spec.get("normalized", not spec.get("special", False)),
            special=spec.get("special", False),
        )
        if token.special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
        if backend.token_to_id(token.content) != token_id:
            raise ValueError(
                f"added token {token.content!r} should have id {token_id}, "
                f"got {backend.token_to_id(token.content)} (vocab.json disagrees)"
            )
    # Named and additional special tokens always match whole, as transformers registers them.
    known = {spec["content"] for _, spec in added}
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in special_tokens if t not in known]
    )
    return backend


def _post_processor_prepends(backend: tokenizers.Tokenizer, token_id: int) -> bool:
    """True when the backend's post-processor puts `token_id` in front (Llama 3's template)."""
    if backend.post_processor is None:
        return False
    with_specials = backend.encode("a", add_special_tokens=True).ids
    without = backend.encode("a", add_special_tokens=False).ids
    return with_specials[:1] == [token_id] and without[:1] != [token_id]


def _eos_token_ids(root: Path, tok: Tokenizer) -> set[int]:
    """The eos token's id plus generation_config.json's and config.json's `eos_token_id`."""
    ids: set[int] = set()
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    config = _read_json(root / "config.json")
    for source in (_read_json(root / "generation_config.json"), config, config.get("text_config")):
        value = (source or {}).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def _lookup(name: str, config: dict[str, Any], special_map: dict[str, Any]) -> Any:
    """tokenizer_config.json wins (an explicit null included), then special_tokens_map.json."""
    return config[name] if name in config else special_map.get(name)


def _special_token(name: str, config: dict[str, Any], special_map: dict[str, Any]) -> str | None:
    return _token_content(_lookup(name, config, special_map))


def _token_content(value: Any) -> str | None:
    """A special token given as a string or as an AddedToken dict ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} should hold a JSON object, got {type(data).__name__}")
    return data
