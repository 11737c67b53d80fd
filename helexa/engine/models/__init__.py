"""Model families by HF `model_type`.

A family is a class the loader uses through one interface: `build(hf_config, tokenizer,
max_position=)` makes the model from config.json (GGUF metadata in the same keys), then
`load_weights(weights, dtype=, quant=, dense_copies=)` places the checkpoint's tensors and
`post_load()` fuses what it can. `source_format` is None when weights come from the
checkpoint, else what `/models` calls a family that reads none (the test architecture).
"""

from __future__ import annotations

from helexa.engine.models.llama import LlamaForCausalLM
from helexa.engine.models.qwen2 import Qwen2ForCausalLM
from helexa.engine.models.qwen3 import Qwen3ForCausalLM
from helexa.engine.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from helexa.engine.models.qwen3_moe import Qwen3MoeForCausalLM
from helexa.engine.models.scripted import ScriptedForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM] | type[ScriptedForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen3_5": Qwen3_5ForCausalLM,  # Qwen3.5/3.6 as shipped: text_config + a vision tower
    "qwen3_5_text": Qwen3_5ForCausalLM,
    "qwen3_5_moe": Qwen3_5MoeForCausalLM,
    "qwen3_5_moe_text": Qwen3_5MoeForCausalLM,
    "helexa_scripted": ScriptedForCausalLM,  # a fixed script, for protocol tests
}
SUPPORTED_MODEL_TYPES = sorted(MODEL_REGISTRY)


class UnsupportedModelError(ValueError):
    """The checkpoint's model_type is not one helexa can run."""


def check_model_type(model_type: str | None) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
        )
