from __future__ import annotations

import torch
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
