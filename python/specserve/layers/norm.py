from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Normalises the last dim of ``x``; ``weight`` broadcasts against ``x``
    (None: no weight)."""
    if weight is None:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), eps=eps) * weight
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and scaled in the input dtype, as HF does."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)
