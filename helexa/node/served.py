"""One loaded model as the node serves it: its engine, its admission, what its vocabulary
and template teach (reasoning and tool-call markers), its limits and its `/models` entry."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from helexa.engine import AsyncLLM, LLMEngine
from helexa.kernels import QuantWeight
from helexa.node.admission import Admission
from helexa.node.loading import GGUF_QUANTS, LoadOptions
from helexa.protocol.reasoning import ReasoningMarkers
from helexa.protocol.tool_calls import ToolCallMarkers
from helexa.protocol.wire import DEFAULT_MAX_OUTPUT_TOKENS

MiB = 1 << 20


@dataclass(slots=True)
class ServedModel:
    """One loaded model and its traffic."""

    id: str
    options: LoadOptions
    llm: AsyncLLM
    admission: Admission
    status: str = "loaded"  # loaded | recovering (after a device fault)
    loaded_at: float = field(default_factory=time.time)
    load_seconds: float = 0.0
    memory_mb: int = field(init=False)  # fixed once loaded: weights and KV pool
    # marker pairs found in the vocabulary (never guessed from the model's name)
    reasoning_markers: ReasoningMarkers | None = field(init=False)
    tool_call_markers: ToolCallMarkers | None = field(init=False)
    markers_are_special: bool = field(init=False)
    # the template teaches Qwen XML calls (`<function=name>`) rather than Hermes JSON
    teaches_xml_calls: bool = field(init=False)

    def __post_init__(self) -> None:
        self.memory_mb = model_memory_mb(self.llm.engine.runner.model)
        tok = self.llm.engine.tokenizer
        self.reasoning_markers = ReasoningMarkers.from_vocab(tok)
        self.tool_call_markers = ToolCallMarkers.from_vocab(tok)
        markers = [m for m in (self.reasoning_markers, self.tool_call_markers) if m is not None]
        # Special marker tokens ([THINK] in Mistral vocabularies) would vanish in decoding,
        # and the reasoning with them would pass for content: chat answers keep them.
        self.markers_are_special = any(tok.is_special(t) for m in markers for t in (m.start, m.end))
        template = tok.chat_template
        sources = template.values() if isinstance(template, dict) else [template or ""]
        self.teaches_xml_calls = any("<function=" in t for t in sources)

    @property
    def engine(self) -> LLMEngine:
        return self.llm.engine

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def limit(self) -> dict[str, int]:
        """context = the engine's ceiling (positions, KV pool, config); output = what a
        request may generate by default; input = the rest, rounded down to 1024 when
        large enough to round."""
        context = self.max_model_len
        output = min(DEFAULT_MAX_OUTPUT_TOKENS, max(1, context // 4))
        room = context - output
        return {
            "context": context,
            "input": room - room % 1024 if room >= 2048 else room,
            "output": output,
        }

    @property
    def capabilities(self) -> list[str]:
        return ["text"]

    def describe(self) -> dict[str, Any]:
        """One `/models` entry."""
        engine = self.engine
        device = engine.runner.device
        return {
            "id": self.id,
            "status": self.status,
            "devices": [device.index or 0] if device.type == "cuda" else [],
            "device": str(device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "quant": self.options.quant or _gguf_quant_of(engine),
            "format": engine.loaded.source_format,
            "capabilities": self.capabilities,
            "tool_call": self.tool_call_markers is not None,
            "reasoning": self.reasoning_markers is not None,
            "limit": self.limit,
            "memory_mb": self.memory_mb,
            "in_flight": self.admission.num_running,
            "queue_depth": self.admission.queue_depth,
            "loaded_at": int(self.loaded_at),
            "load_seconds": round(self.load_seconds, 2),
        }


def model_memory_mb(model: torch.nn.Module) -> int:
    """Weights (packed, dense copies, quantized on a GPU), KV pool and buffers: every tensor
    the model's modules hold, as parameters or as plain attributes, each storage counted once."""
    storages: dict[int, int] = {}
    for module in model.modules():
        attrs = [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for v in vars(module).values():
            if isinstance(v, QuantWeight):
                attrs.extend(v.tensors)
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False), *attrs):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) // MiB


def _gguf_quant_of(engine: LLMEngine) -> str | None:
    if engine.loaded.source_format != "gguf":
        return None
    stem = engine.loaded.path.stem.upper().replace("-", ".")
    return next((q for q in GGUF_QUANTS if q in stem.split(".")), "gguf")
