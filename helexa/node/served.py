"""One loaded model as the node serves it: its worker process (the engine runs there), its
admission, what its vocabulary and template teach (reasoning and tool-call markers), its
limits and its `/models` entry."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helexa.config import ImageLimits
from helexa.engine.llm_engine import EngineStats
from helexa.engine.tokenizer import Tokenizer
from helexa.engine.vision.inputs import VisionProfile
from helexa.engine.worker_client import WorkerClient
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
    llm: WorkerClient
    admission: Admission
    status: str = "loaded"  # loaded | poisoned (a device fault) | recovering (reloading)
    loaded_at: float = field(default_factory=time.time)
    load_seconds: float = 0.0
    # [node.images]: what images a request may carry, and the pixels they are resized to
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    # a GGUF served with its base repository's tokenizer: that repository's id
    tokenizer_label: str | None = None
    memory_mb: int = field(init=False)  # fixed once loaded: weights and KV pool
    # marker pairs found in the vocabulary (never guessed from the model's name)
    reasoning_markers: ReasoningMarkers | None = field(init=False)
    tool_call_markers: ToolCallMarkers | None = field(init=False)
    markers_are_special: bool = field(init=False)
    # the template teaches Qwen XML calls (`<function=name>`) rather than Hermes JSON
    teaches_xml_calls: bool = field(init=False)

    def __post_init__(self) -> None:
        self.memory_mb = self.llm.facts.memory_mb
        tok = self.llm.tokenizer
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
    def tokenizer(self) -> Tokenizer:
        return self.llm.tokenizer

    @property
    def vocab_size(self) -> int:
        """The bound on token ids: the embedding table, or the tokenizer when smaller."""
        tok = self.llm.tokenizer.vocab_size
        return min(tok, self.llm.facts.vocab_size or tok)

    @property
    def stats(self) -> EngineStats:
        """The engine's latest figures, as its worker sent them with its last step."""
        return self.llm.stats

    @property
    def max_model_len(self) -> int:
        return self.llm.facts.max_model_len

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
    def vision(self) -> VisionProfile | None:
        """How this model takes images, with the node's pixel bounds (clamped under the
        tower's cap); None for a text-only model."""
        profile = self.llm.facts.vision
        if profile is None:
            return None
        return profile.bounded(self.image_limits.min_pixels, self.image_limits.max_pixels)

    @property
    def capabilities(self) -> list[str]:
        return ["text", "image"] if self.llm.facts.vision is not None else ["text"]

    def describe(self) -> dict[str, Any]:
        """One `/models` entry."""
        facts = self.llm.facts
        return {
            "id": self.id,
            "status": self.status,
            "devices": [_cuda_index(d) for d in facts.devices if d.startswith("cuda")],
            "device": facts.device,
            "tensor_parallel": len(facts.pids),
            "workers": self.llm.describe_workers(),
            "dtype": facts.dtype,
            # "checkpoint", "gguf", "tokenizer.json beside the file", or the base repository's
            "tokenizer": self.tokenizer_label or facts.tokenizer,
            # a pre-quantized checkpoint's (fp8, awq, gptq), else the one asked, else a GGUF's
            "quant": facts.checkpoint_quant
            or self.options.quant
            or _gguf_quant_of(facts.source_format, facts.path),
            "format": facts.source_format,
            "linear_weights": facts.linear_weights,  # as held: "int4×14 float×1"
            "capabilities": self.capabilities,
            "tool_call": self.tool_call_markers is not None,
            "reasoning": self.reasoning_markers is not None,
            "limit": self.limit,
            "memory_mb": self.memory_mb,
            "in_flight": self.admission.num_running,
            "queue_depth": self.admission.queue_depth,
            "loaded_at": int(self.loaded_at),
            "load_seconds": round(self.load_seconds, 2),
            # the CPU plans: fresh | cached | provisional (this run's only) | off
            "autotune": facts.autotune.as_dict() if facts.autotune else {"state": "off"},
            "speculative": self.speculative,
        }

    @property
    def speculative(self) -> dict[str, Any] | None:
        """Speculative decoding's method and how it has fared: the share of drafted tokens
        accepted, and the tokens a speculating row gains a step (1 + accepted per draft)."""
        method = self.llm.facts.speculative_method
        if method is None:
            return None
        s = self.stats
        return {
            "method": method,
            "model": self.llm.facts.speculative_model,  # the draft model's, else None
            "drafts": s.spec_drafts,
            "acceptance_rate": round(s.spec_accepted_tokens / s.spec_draft_tokens, 4)
            if s.spec_draft_tokens
            else None,
            "tokens_per_step": round(1 + s.spec_accepted_tokens / s.spec_drafts, 3)
            if s.spec_drafts
            else None,
            "rollbacks": s.spec_rollbacks,  # hybrid models (Gated DeltaNet state)
        }


def _cuda_index(device: str) -> int:
    _, _, index = device.partition(":")
    return int(index or 0)


def _gguf_quant_of(source_format: str, path: str) -> str | None:
    if source_format != "gguf":
        return None
    stem = Path(path).stem.upper().replace("-", ".")
    return next((q for q in GGUF_QUANTS if q in stem.split(".")), "gguf")
