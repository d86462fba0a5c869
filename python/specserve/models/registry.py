from __future__ import annotations

from torch import nn

from specserve.models.deepseek_v4 import DeepseekV4ForCausalLM
from specserve.models.gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from specserve.models.llama import LlamaForCausalLM
from specserve.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,
    # gemma-4-12B: the same language model behind another multimodal front end.
    "Gemma4UnifiedForConditionalGeneration": Gemma4ForConditionalGeneration,
}


def resolve_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"architectures: {architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}"
        )
    return MODEL_REGISTRY[architecture]
