"""The engine's tokenizer: a `tokenizers.Tokenizer` plus the metadata generation needs.

Both loaders build one of these: `load_hf_tokenizer(dir)` for HF-layout directories and
`helexa.engine.loader.gguf` from GGUF metadata. Nothing here imports `transformers`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import tokenizers


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

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for `text`; special-token strings in it map to their ids.

        `add_special_tokens=True` prepends bos when the model wants one (raw prompts);
        rendered chat templates already carry their own bos, so they pass False.
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None:
            if not ids or ids[0] != bos:
                ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
