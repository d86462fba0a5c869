"""Manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams
per token instead of one.

Before a block the streams collapse into its input (weights ``pre``); after
it the block's output is spread back (``post``) and added to the streams
mixed by ``comb``, a matrix made doubly stochastic by Sinkhorn iterations so
the residual path never amplifies. All three weights come from the streams
themselves through one small projection, in float32.
"""

from __future__ import annotations

import torch
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """One mixing site (before attention or before the MLP). Parameters are
    ``fn [(2 + N) * N, N * d]``, ``base [(2 + N) * N]``, ``scale [3]``."""

    def __init__(self, hc_mult: int, hidden: int, sinkhorn_iters: int, eps: float, norm_eps: float):
        super().__init__()
        n = hc_mult
        self.n, self.iters, self.eps, self.norm_eps = n, sinkhorn_iters, eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [T, N, d]`` -> the block input ``[T, d]``, ``post [T, N]``
        and ``comb [T, N, N]`` (float32)."""
        t, n = streams.shape[0], self.n
        mixes = (
            unweighted_rms_norm(streams.reshape(t, -1).float(), self.norm_eps) @ self.fn.float().T
        )
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s = self.scale.float()
        pre = torch.sigmoid(pre_w * s[0] + pre_b) + self.eps  # [T, N]
        post = 2 * torch.sigmoid(post_w * s[1] + post_b)  # [T, N]
        comb = torch.softmax(comb_w.view(t, n, n) * s[2] + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return collapsed, post, comb


def expand(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The streams after a block: ``post``-spread output plus ``comb``-mixed
    streams (stream k takes ``sum_j comb[j, k] * streams[j]``)."""
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)  # [T, N, d]
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """The final collapse of the streams into one hidden state per token."""

    def __init__(self, hc_mult: int, hidden: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden))
        self.base = nn.Parameter(torch.empty(hc_mult))
        self.scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)  # [T, N * d]
        pre = torch.sigmoid(flat @ self.fn.float().T * self.scale.float() + self.base.float())
        return ((pre + self.eps).unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
