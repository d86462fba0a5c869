from __future__ import annotations

from specserve.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3: the shared decoder with per-head q/k RMSNorm (``ModelConfig.qk_norm``)."""
