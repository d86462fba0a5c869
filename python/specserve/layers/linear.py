from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MergedLinear(nn.Linear):
    """Several projections of the same input in one matmul (q/k/v, gate/up).

    The checkpoint stores each projection separately; ``load_shard`` copies one
    of them into its row range of the fused weight.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]

    def shard_view(self, param_name: str, shard: int) -> torch.Tensor:
        param = self.weight if param_name == "weight" else self.bias
        return param.data.narrow(0, self.offsets[shard], self.out_sizes[shard])


class FusedLinears:
    """Linears that share an input, run as one matmul over their weights side
    by side. ``fuse_()`` (once the weights are loaded; serving) moves the
    weights into one tensor and re-points each linear to its rows, so nothing
    is copied twice; until then (training) the concatenation is made per
    call, through which gradients reach each linear."""

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def fuse_(self) -> None:
        """Serving: one weight (K-major on the CPU, see ``k_major_``)."""
        self.weight, self.bias = self._joined()
        k_major_(self.weight)
        offset = 0
        for lin in self.linears:
            rows = slice(offset, offset + lin.weight.shape[0])
            lin.weight.data = self.weight[rows]
            if self.bias is not None:
                lin.bias.data = self.bias[rows]
            offset = rows.stop

    def _joined(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = torch.cat([lin.weight for lin in self.linears])
        has_bias = self.linears[0].bias is not None
        return w, torch.cat([lin.bias for lin in self.linears]) if has_bias else None

    def __call__(self, x: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., sum(out)]`` (or the output ``rows`` only)."""
        w, b = (self.weight, self.bias) if self.weight is not None else self._joined()
        return F.linear(x, w[rows], None if b is None else b[rows])


def k_major_(weight: torch.Tensor) -> None:
    """Re-lays a CPU linear weight ``[out, in]`` in place so that ``in`` is the
    outer dimension (the shape and values stay; the strides become
    ``(1, out)``). For wide outputs (a vocabulary) MKL's matmul runs about 2x
    faster on that layout at a few rows, the sizes of decode, verify chains
    and draft blocks. A no-op on other devices and on weights laid out so."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.stride(0) == 1:
        return
    weight.data = weight.data.t().contiguous().t()


class LogitsHead(nn.Linear):
    """``lm_head``: float32 logits accumulated in float32, whatever the weight's
    dtype. A bf16 matmul rounds its output to bf16 (about ±0.06 at typical
    logit magnitudes), which no later ``.float()`` can undo; logprobs and the
    sampler's distribution need the unrounded values.

    CUDA: one GEMM with bf16/fp16 inputs and a float32 output. CPU (which has
    no such GEMM): a float32 weight, the weight itself or a copy made once,
    laid out K-major (``k_major_``) by ``post_load``.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self._fp32: torch.Tensor | None = None
        self._fp32_of: tuple[int, int] | None = None  # (data_ptr, version) it copies

    def post_load(self) -> None:
        """After the weights are in (outside inference mode: the weight may be
        trained through)."""
        k_major_(self.weight)

    def cpu_weight(self) -> torch.Tensor:
        """The float32 weight the CPU path multiplies by: the weight itself, or
        its float32 copy (made once, K-major, refreshed when the weight changes)."""
        w = self.weight
        if w.dtype == torch.float32:
            return w
        key = (w.data_ptr(), w._version)
        if self._fp32_of != key:
            self._fp32, self._fp32_of = w.detach().t().float().contiguous().t(), key
        assert self._fp32 is not None
        return self._fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., V] float32
        w = self.weight
        if w.dtype == torch.float32:
            return F.linear(x.float(), w)
        flat = x.reshape(-1, x.shape[-1])
        if w.is_cuda:
            out = torch.mm(flat, w.t(), out_dtype=torch.float32)
        else:
            out = F.linear(flat.float(), self.cpu_weight())
        return out.view(*x.shape[:-1], w.shape[0])
