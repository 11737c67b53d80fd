"""Model families by HF `model_type`."""

from __future__ import annotations

from helexa.engine.models.llama import LlamaForCausalLM
from helexa.engine.models.qwen2 import Qwen2ForCausalLM
from helexa.engine.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}
SCRIPTED_MODEL_TYPE = "helexa_scripted"
SUPPORTED_MODEL_TYPES = sorted([*MODEL_REGISTRY, SCRIPTED_MODEL_TYPE])


class UnsupportedModelError(ValueError):
    """The checkpoint's model_type is not one helexa can run."""


def check_model_type(model_type: str | None) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
        )
