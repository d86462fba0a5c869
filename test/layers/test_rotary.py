"""RoPE frequencies against transformers' own rope initialisers."""

from __future__ import annotations

import pytest
import torch

from specserve.config import ModelConfig
from specserve.layers.rotary import RotaryEmbedding, rope_inv_freq

CASES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 512,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "beta_fast": 16,
    },
}


def hf_config(params: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        rope_parameters={"rope_theta": 50000.0, **params},
    )


@pytest.mark.parametrize("case", list(CASES))
def test_inv_freq_and_scale_match_transformers(case: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = hf_config(CASES[case])
    rope_type = CASES[case]["rope_type"]
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        ref_freq, ref_scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        ref_freq, ref_scale = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
    ours = ModelConfig.from_dict(hf_cfg.to_dict())
    freq, scale = rope_inv_freq(ours.rope, ours.head_dim, ours.max_position_embeddings)
    torch.testing.assert_close(freq, ref_freq.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-6)


def test_rotation_is_applied_at_the_given_positions() -> None:
    """Relative-position property: <R(p)q, R(p+d)k> depends only on d."""
    cfg = ModelConfig.from_dict(hf_config(CASES["default"]).to_dict())
    rope = RotaryEmbedding(cfg.rope, 64, 128)
    q = torch.randn(1, 1, 64)
    k = torch.randn(1, 1, 64)
    dots = []
    for p in (0, 17, 60):
        rq = rope(torch.tensor([p]), q)
        rk = rope(torch.tensor([p + 5]), k)
        dots.append(float((rq * rk).sum()))
    assert dots[0] == pytest.approx(dots[1], rel=1e-4) and dots[0] == pytest.approx(
        dots[2], rel=1e-4
    )


def test_unknown_rope_type_is_rejected() -> None:
    base = hf_config(CASES["default"]).to_dict()
    cfg = ModelConfig.from_dict(
        base | {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}
    )
    with pytest.raises(ValueError, match="longrope"):
        rope_inv_freq(cfg.rope, 64, 128)
