from __future__ import annotations

from specserve.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama (and Mistral-style) checkpoints: the shared decoder without q/k norms."""
