from __future__ import annotations

from specserve.models.decoder import DecoderForCausalLM
from specserve.models.llama import LlamaForCausalLM
from specserve.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
}


def resolve_model_class(architecture: str) -> type[DecoderForCausalLM]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"architectures: {architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}"
        )
    return MODEL_REGISTRY[architecture]
