"""A vocabulary slice's part of each row's logprobs: the torch reference
against the plain definitions (logsumexp, a stable sort), and the Triton
kernel's partial mode (interpreted on the CPU) against the reference."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels.logprob_partials import (
    EMPTY_KEY,
    key_values,
    row_partials,
    row_partials_ref,
    row_partials_triton,
)
from specserve.kernels.logprobs import HAS_TRITON

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
INF = float("inf")
OFFSET = 1000  # the slice's first global id


def _rows(v: int = 300) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, v, generator=g) * 2
    x[0, [3, 200, 250]] = 5.0  # a tie at the top, across block boundaries
    x[1] = 0.0  # everything tied
    x[1, [4, 9]] = -0.0  # ties +0.0
    x[2, ::2] = -INF
    x[3] = -INF  # nothing possible in this slice
    x[4, [7, 70]] = float("nan")
    x[5, 11] = INF
    x[6, :] = float("nan")
    return x


TEMPS = torch.tensor([0.5, 1.0, 2.0, 1.0, 0.7, 1.0, 1.3])


@pytest.mark.parametrize("temps", [None, TEMPS], ids=["t1", "temps"])
@pytest.mark.parametrize("k", [0, 1, 5, 300, 301])
def test_reference_is_the_definition(temps, k) -> None:
    x = _rows()
    part = row_partials_ref(x, temps, k, OFFSET)
    scaled = x.masked_fill(x.isnan(), -INF)
    if temps is not None:
        scaled = scaled / temps.unsqueeze(1)
    assert torch.equal(part.maxes, scaled.amax(dim=1))
    fin = part.maxes.isfinite()
    lse = part.maxes[fin] + part.sums[fin].log()
    torch.testing.assert_close(lse, torch.logsumexp(scaled[fin], dim=1))
    assert torch.equal(part.sums[3], torch.tensor(0.0))  # an all -inf slice adds nothing
    values, ids = key_values(part.top_keys[:, : min(k, 300)])
    order = scaled.sort(dim=1, descending=True, stable=True)  # ties: lowest id first
    assert torch.equal(ids, order.indices[:, : min(k, 300)] + OFFSET)
    assert torch.equal(values, order.values[:, : min(k, 300)])
    assert (part.top_keys[:, 300:] == EMPTY_KEY).all()  # k past the slice: no candidate


# (dtype, temperatures, k, block_v): 64 splits each row into 5 slices, 512 does not.
TRITON_CASES = [
    (torch.float32, None, 0, 64),
    (torch.float32, TEMPS, 5, 64),
    (torch.float32, None, 301, 512),
    (torch.float32, TEMPS, 301, 64),
    (torch.bfloat16, TEMPS, 1, 64),
    (torch.bfloat16, None, 5, 512),
]


@needs_triton
@pytest.mark.parametrize(("dtype", "temps", "k", "block_v"), TRITON_CASES)
def test_triton_equals_reference(dtype, temps, k, block_v) -> None:
    x = _rows().to(dtype)
    want = row_partials_ref(x, temps, k, OFFSET)
    got = row_partials_triton(x, temps, k, OFFSET, block_v=block_v)
    assert torch.equal(got.maxes, want.maxes)
    assert torch.equal(got.top_keys, want.top_keys)  # values and ids, bit for bit
    fin = want.maxes.isfinite()  # (a +inf or empty slice's sum is never read)
    torch.testing.assert_close(got.sums[fin], want.sums[fin], rtol=1e-5, atol=0)


@needs_triton
def test_triton_on_a_strided_slice_and_no_rows() -> None:
    """A rank's real columns are a slice of its padded shard (row stride >
    width); a step may score no rows."""
    x = _rows(320)
    want = row_partials_ref(x[:, :300], None, 4, OFFSET)
    got = row_partials(x[:, :300], None, 4, OFFSET, backend="triton")
    assert torch.equal(got.maxes, want.maxes) and torch.equal(got.top_keys, want.top_keys)
    empty = row_partials(x[:0], None, 3, OFFSET, backend="triton")
    assert empty.maxes.shape == (0,) and empty.top_keys.shape == (0, 3)
