"""The logits head: float32 logits accumulated in float32 for bf16 weights."""

from __future__ import annotations

import pytest
import torch

from specserve.layers.linear import LogitsHead


@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 64)], ids=["rows", "blocks"])
def test_bf16_weights_give_unrounded_float32_logits(shape) -> None:
    g = torch.Generator().manual_seed(0)
    head = LogitsHead(64, 1000).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1000, 64, generator=g) * 2)
    x = torch.randn(*shape, generator=g).to(torch.bfloat16)
    out = head(x)
    assert out.dtype == torch.float32 and out.shape == (*shape[:-1], 1000)
    exact = x.double() @ head.weight.double().t()
    assert (out.double() - exact).abs().max() < 1e-4
    # What a bf16 matmul then .float() gives is off by far more.
    rounded = torch.nn.functional.linear(x, head.weight).float()
    assert (rounded.double() - exact).abs().max() > 1e-2
    # Reloading the weight in place refreshes the float32 copy.
    with torch.no_grad():
        head.weight.mul_(2)
    torch.testing.assert_close(head(x), out * 2, atol=1e-4, rtol=0)


def test_post_load_lays_the_cpu_head_k_major_and_keeps_every_value() -> None:
    """Shape and values stay (a tied embedding reads the same rows); only the
    strides change, and the logits equal a plain float64 product."""
    g = torch.Generator().manual_seed(1)
    emb = torch.nn.Embedding(1000, 64)
    head = LogitsHead(64, 1000)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(1000, 64, generator=g))
    head.weight = emb.weight  # tied
    before = emb.weight.detach().clone()
    head.post_load()
    assert head.weight.shape == (1000, 64) and head.weight.stride() == (1, 1000)
    assert torch.equal(emb.weight, before)
    ids = torch.tensor([3, 999, 0])
    assert torch.equal(emb(ids), before[ids])
    x = torch.randn(7, 64, generator=g)
    exact = x.double() @ before.double().t()
    assert (head(x).double() - exact).abs().max() < 1e-4
    head.post_load()  # idempotent
    assert head.weight.stride() == (1, 1000)


@pytest.mark.gpu
def test_cuda_bf16_logits_are_float32_accumulated() -> None:
    g = torch.Generator().manual_seed(0)
    head = LogitsHead(256, 4096).to("cuda", torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_((torch.randn(4096, 256, generator=g) * 2).to("cuda"))
    x = torch.randn(7, 256, generator=g).to("cuda", torch.bfloat16)
    out = head(x)
    exact = x.double() @ head.weight.double().t()
    assert out.dtype == torch.float32 and (out.double() - exact).abs().max() < 1e-3
