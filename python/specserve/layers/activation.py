from __future__ import annotations

import torch
import torch.nn.functional as F

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def get_activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"hidden_act: unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[name]


def gated_act(gate_up: torch.Tensor, act) -> torch.Tensor:
    """``act(gate) * up`` for a fused ``[..., 2 * I]`` gate/up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up
