"""What every kernel file shares: the optional triton import and the choice
between a Triton kernel and its torch reference."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the package must still import on machines without triton
    triton = None
    tl = None
    HAS_TRITON = False

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("auto", "triton", "torch")


def use_triton(backend: str, t: torch.Tensor, kernel: str) -> bool:
    """ "auto" picks Triton for CUDA tensors when triton is installed, the torch
    reference elsewhere; "triton" and "torch" force one side."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown {kernel} backend {backend!r}; expected one of {BACKENDS}")
    return backend == "triton" or (backend == "auto" and t.is_cuda and HAS_TRITON)


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``,
    the CPU test path), whose ``tl.dot`` misreads bf16/fp16 operands."""
    return os.environ.get("TRITON_INTERPRET") == "1"
