"""Row-wise logprobs: the Triton kernel (interpreted on CPU) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels.logprobs import (
    HAS_TRITON,
    RowLogprobs,
    row_logprobs,
    row_logprobs_ref,
    row_logprobs_triton,
    topk_lowest_id,
)

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
TOL = {"rtol": 1e-5, "atol": 1e-5}
NEG_INF = float("-inf")


def _hard_batch(
    v: int, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four rows: plain, sprinkled with -inf, a -9999 block, and only 5 finite entries.

    The last row's finite entries sit at its end, so whole leading chunks are
    -inf, and any top-k with k > 5 must include -inf entries.
    """
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, v, generator=g) * 3  # [4, V]
    logits[1, ::3] = NEG_INF
    logits[2, : v // 4] = -9999.0
    logits[3, :-5] = NEG_INF
    token_ids = torch.randint(0, v, (4,), generator=g)  # [4]
    token_ids[1] = 0  # a -inf entry
    token_ids[3] = 0  # a -inf entry
    gather_ids = torch.randint(0, v, (4, 5), generator=g)  # [4, M]
    gather_ids[0, 3:] = -1  # ragged padding
    gather_ids[1, 0] = 3  # a -inf entry
    gather_ids[2, 1:] = -1
    gather_ids[3, 2] = v - 2  # a finite entry of the sparse row
    temperatures = torch.tensor([1.0, 0.5, 1.7, 0.8])  # [4]
    return (
        logits.to(dtype).to(device),
        token_ids.to(device),
        temperatures.to(device),
        gather_ids.to(device),
    )


def _full_logprobs(logits: torch.Tensor, temperatures: torch.Tensor | None) -> torch.Tensor:
    x = logits.float()
    if temperatures is not None:
        x = x / temperatures.unsqueeze(1)
    return torch.log_softmax(x, dim=-1)  # [N, V]


def _assert_matches(
    out: RowLogprobs,
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperatures: torch.Tensor | None,
    top_k: int,
    gather_ids: torch.Tensor | None,
) -> None:
    """Compare a result with the reference, tolerating any order among tied top-k values."""
    n, v = logits.shape
    m = 0 if gather_ids is None else gather_ids.shape[1]
    ref = row_logprobs_ref(logits, token_ids, temperatures, top_k, gather_ids)
    assert out.token_logprobs.shape == (n,) and out.token_logprobs.dtype == torch.float32
    assert out.top_values.shape == (n, top_k) and out.top_values.dtype == torch.float32
    assert out.top_ids.shape == (n, top_k) and out.top_ids.dtype == torch.int64
    assert out.ids_logprobs.shape == (n, m) and out.ids_logprobs.dtype == torch.float32
    for t in (out.token_logprobs, out.top_values, out.top_ids, out.ids_logprobs):
        assert t.device == logits.device

    # assert_close treats equal infinities as close, so -inf positions must match.
    torch.testing.assert_close(out.token_logprobs, ref.token_logprobs, **TOL)
    if gather_ids is not None:
        assert torch.equal(out.ids_logprobs.isnan(), gather_ids == -1)
    torch.testing.assert_close(out.ids_logprobs, ref.ids_logprobs, equal_nan=True, **TOL)

    torch.testing.assert_close(out.top_values, ref.top_values, **TOL)
    if top_k == 0:
        return
    vals, ids = out.top_values, out.top_ids
    assert bool((vals[:, :-1] >= vals[:, 1:]).all()), "top values not sorted descending"
    assert bool(((ids >= 0) & (ids < v)).all())
    assert all(len(set(row.tolist())) == top_k for row in ids), "repeated top-k id"
    full = _full_logprobs(logits, temperatures)
    torch.testing.assert_close(full.gather(1, ids), vals, **TOL)
    # Ids must agree wherever the reference value is not tied with a neighbour,
    # including the first value left out of the top k.
    ext = torch.topk(full, min(top_k + 1, v), dim=-1).values  # [N, K or K+1]
    if ext.shape[1] == top_k:
        ext = torch.cat([ext, torch.full_like(ext[:, :1], float("nan"))], dim=1)
    prev_differs = torch.ones_like(vals, dtype=torch.bool)
    prev_differs[:, 1:] = ext[:, 1:top_k] != ext[:, : top_k - 1]
    distinct = prev_differs & (ext[:, 1:] != ext[:, :-1])
    assert torch.equal(ids[distinct], ref.top_ids[distinct])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("use_temps", [False, True], ids=["t=1", "mixed_t"])
@pytest.mark.parametrize("top_k", [0, 1, 20])
@pytest.mark.parametrize(
    ("v", "block_v"), [(203, 64), (100, 128)], ids=["tail_chunks", "single_chunk"]
)
def test_triton_matches_reference(
    v: int, block_v: int, top_k: int, use_temps: bool, dtype: torch.dtype
) -> None:
    logits, token_ids, temps, gather_ids = _hard_batch(v, dtype)
    temps = temps if use_temps else None
    out = row_logprobs_triton(logits, token_ids, temps, top_k, gather_ids, block_v=block_v)
    _assert_matches(out, logits, token_ids, temps, top_k, gather_ids)


@needs_triton
def test_triton_without_gather_ids() -> None:
    logits, token_ids, temps, _ = _hard_batch(150)
    out = row_logprobs_triton(logits, token_ids, temps, 3, None, block_v=64)
    assert out.ids_logprobs.shape == (4, 0)
    _assert_matches(out, logits, token_ids, temps, 3, None)


@needs_triton
def test_triton_strided_rows() -> None:
    v = 150
    big = torch.randn(6, v + 37, generator=torch.Generator().manual_seed(1))  # [6, V + 37]
    logits = big[::2, :v]  # [3, V]: row stride 2 * (V + 37)
    assert not logits.is_contiguous() and logits.stride(1) == 1
    token_ids = torch.tensor([0, 75, v - 1])
    temps = torch.tensor([0.7, 1.0, 2.5])
    gather_ids = torch.tensor([[1, 2, -1], [v - 1, -1, -1], [0, 10, 20]])
    out = row_logprobs_triton(logits, token_ids, temps, 5, gather_ids, block_v=64)
    _assert_matches(out, logits, token_ids, temps, 5, gather_ids)


@needs_triton
def test_triton_top_k_equals_vocab() -> None:
    # K_PAD (128) > K (70) > BLOCK_V (64): the first chunk cannot fill the list.
    logits, token_ids, temps, gather_ids = _hard_batch(70)
    logits, token_ids, temps, gather_ids = logits[1:2], token_ids[1:2], temps[1:2], gather_ids[1:2]
    out = row_logprobs_triton(logits, token_ids, temps, 70, gather_ids, block_v=64)
    _assert_matches(out, logits, token_ids, temps, 70, gather_ids)
    assert torch.equal(out.top_ids.sort(dim=1).values[0], torch.arange(70))


@needs_triton
def test_triton_ties_prefer_lower_index() -> None:
    logits = torch.zeros(1, 150)  # [1, V]
    logits[0, 90] = 1.0
    logits[0, 1] = -0.0  # must tie with +0.0
    out = row_logprobs_triton(logits, torch.tensor([0]), None, 5, None, block_v=64)
    assert out.top_ids[0].tolist() == [90, 0, 1, 2, 3]


@needs_triton
def test_reference_ties_prefer_lower_index() -> None:
    """The torch path breaks ties as the kernel does: lowest id first, and
    the lowest ids of a tie cut by k (``torch.topk`` alone shuffles them)."""
    logits = torch.zeros(3, 40)
    logits[1, [33, 7, 21]] = 2.0  # a three-way tie on top, then 37 zeros
    logits[2, 5] = -0.0  # ties with +0.0
    logits[2, 30:] = NEG_INF
    out = row_logprobs_ref(logits, torch.zeros(3, dtype=torch.int64), top_k=5)
    assert out.top_ids.tolist() == [[0, 1, 2, 3, 4], [7, 21, 33, 0, 1], [0, 1, 2, 3, 4]]
    want = torch.log_softmax(logits, dim=-1).gather(1, out.top_ids)
    torch.testing.assert_close(out.top_values, want)
    # Many ties, every k: what a stable descending sort keeps, in its order.
    g = torch.Generator().manual_seed(0)
    for k in range(1, 41):
        x = (torch.randn(4, 40, generator=g) * 2).round()
        values, ids = topk_lowest_id(x, k)
        sorted_values, order = torch.sort(x, descending=True, stable=True)
        assert torch.equal(ids, order[:, :k]) and torch.equal(values, sorted_values[:, :k])


def test_triton_default_block_via_dispatcher() -> None:
    # V spans three default-size chunks with a masked tail.
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 2500, generator=g) * 4  # [2, V]
    token_ids = torch.tensor([5, 2499])
    gather_ids = torch.tensor([[0, 1024, 2048, -1], [-1, -1, -1, -1]])
    temps = torch.tensor([1.3, 0.6])
    out = row_logprobs(logits, token_ids, temps, 4, gather_ids, backend="triton")
    _assert_matches(out, logits, token_ids, temps, 4, gather_ids)


def _row_id_batch(
    v: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hard batch scattered over a [7, V] block whose other rows are NaN.

    ``row_ids`` is unsorted and repeats rows; any read of an unlisted row (or a
    wrong one) would show up as NaN or a mismatch.
    """
    logits, token_ids, temps, gather_ids = _hard_batch(v, dtype)
    block = torch.full((7, v), float("nan"), dtype=dtype)  # [R, V]
    block[[5, 0, 2, 6]] = logits  # hard row k sits at block row place[k]
    pick = torch.tensor([3, 1, 1, 0, 2, 3])  # hard row of each output row
    place = torch.tensor([5, 0, 2, 6])
    row_ids = place[pick]  # [N] = [6, 0, 0, 5, 2, 6]
    return block, row_ids, token_ids[pick], temps[pick], gather_ids[pick]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("top_k", [0, 7])
def test_triton_row_ids_matches_reference(top_k: int, dtype: torch.dtype) -> None:
    block, row_ids, token_ids, temps, gather_ids = _row_id_batch(203, dtype)
    out = row_logprobs_triton(
        block, token_ids, temps, top_k, gather_ids, block_v=64, row_ids=row_ids
    )
    _assert_matches(out, block[row_ids], token_ids, temps, top_k, gather_ids)
    ref = row_logprobs_ref(block, token_ids, temps, top_k, gather_ids, row_ids)
    torch.testing.assert_close(out.token_logprobs, ref.token_logprobs, **TOL)
    torch.testing.assert_close(out.ids_logprobs, ref.ids_logprobs, equal_nan=True, **TOL)
    assert not out.top_values.isnan().any()


@needs_triton
def test_triton_row_ids_strided_block() -> None:
    v = 150
    big = torch.randn(10, v + 37, generator=torch.Generator().manual_seed(4))  # [10, V + 37]
    block = big[::2, :v]  # [5, V]: row stride 2 * (V + 37)
    row_ids = torch.tensor([4, 1, 4])
    token_ids = torch.tensor([3, v - 1, 0])
    temps = torch.tensor([0.9, 1.4, 0.3])
    gather_ids = torch.tensor([[1, -1], [v - 1, 7], [-1, -1]])
    out = row_logprobs_triton(block, token_ids, temps, 5, gather_ids, block_v=64, row_ids=row_ids)
    _assert_matches(out, block[row_ids], token_ids, temps, 5, gather_ids)


@pytest.mark.parametrize(
    "backend", [pytest.param("triton", marks=needs_triton), "torch"], ids=["triton", "torch"]
)
def test_row_ids_empty_selection(backend: str) -> None:
    block = torch.randn(3, 40)  # [R, V] with R = 3, N = 0
    row_ids = torch.empty(0, dtype=torch.int64)
    token_ids = torch.empty(0, dtype=torch.int64)
    gather_ids = torch.empty(0, 2, dtype=torch.int64)
    out = row_logprobs(
        block, token_ids, torch.empty(0), 4, gather_ids, backend=backend, row_ids=row_ids
    )
    assert out.token_logprobs.shape == (0,)
    assert out.top_values.shape == (0, 4) and out.top_ids.shape == (0, 4)
    assert out.ids_logprobs.shape == (0, 2)
    out = row_logprobs(block, token_ids, None, 0, None, backend=backend, row_ids=row_ids)
    assert out.ids_logprobs.shape == (0, 0)


def test_reference_row_ids_equals_indexed_rows() -> None:
    block, row_ids, token_ids, temps, gather_ids = _row_id_batch(120)
    got = row_logprobs_ref(block, token_ids, temps, 6, gather_ids, row_ids)
    want = row_logprobs_ref(block[row_ids], token_ids, temps, 6, gather_ids)
    for a, b in zip(
        (got.token_logprobs, got.top_values, got.top_ids, got.ids_logprobs),
        (want.token_logprobs, want.top_values, want.top_ids, want.ids_logprobs),
    ):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    # Without gather_ids the empty default must follow N, not R.
    got = row_logprobs_ref(block, token_ids, temps, 2, None, row_ids)
    assert got.ids_logprobs.shape == (6, 0)


@needs_triton
def test_triton_rejects_bad_row_ids() -> None:
    block = torch.randn(4, 64)
    token_ids = torch.tensor([0, 1])
    with pytest.raises(AssertionError, match="row_ids must be int64"):
        row_logprobs_triton(block, token_ids, row_ids=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(AssertionError, match="1-D"):
        row_logprobs_triton(block, token_ids, row_ids=torch.tensor([[0, 3]]))
    with pytest.raises(AssertionError, match="token_ids must be"):
        row_logprobs_triton(block, token_ids, row_ids=torch.tensor([0, 3, 1]))


@pytest.mark.parametrize(
    "backend", [pytest.param("triton", marks=needs_triton), "torch"], ids=["triton", "torch"]
)
def test_empty_batch(backend: str) -> None:
    logits = torch.empty(0, 50, dtype=torch.bfloat16)  # [0, V]
    token_ids = torch.empty(0, dtype=torch.int64)
    gather_ids = torch.empty(0, 3, dtype=torch.int64)
    out = row_logprobs(logits, token_ids, torch.empty(0), 7, gather_ids, backend=backend)
    assert out.token_logprobs.shape == (0,)
    assert out.top_values.shape == (0, 7) and out.top_ids.shape == (0, 7)
    assert out.ids_logprobs.shape == (0, 3)
    out = row_logprobs(logits, token_ids, None, 0, None, backend=backend)
    assert out.top_values.shape == (0, 0) and out.ids_logprobs.shape == (0, 0)


@needs_triton
def test_triton_rejects_bad_inputs() -> None:
    logits = torch.randn(2, 64)
    token_ids = torch.tensor([0, 1])
    with pytest.raises(AssertionError, match="contiguous"):
        row_logprobs_triton(torch.randn(2, 128)[:, ::2], token_ids)
    with pytest.raises(AssertionError, match="int64"):
        row_logprobs_triton(logits, token_ids.int())
    with pytest.raises(AssertionError, match="top_k"):
        row_logprobs_triton(logits, token_ids, top_k=65)
    with pytest.raises(AssertionError, match="temperatures"):
        row_logprobs_triton(logits, token_ids, torch.ones(3))


def test_reference_matches_float64() -> None:
    logits, token_ids, temps, gather_ids = _hard_batch(203)
    ref = row_logprobs_ref(logits, token_ids, temps, 20, gather_ids)
    full = torch.log_softmax(logits.double() / temps.double().unsqueeze(1), dim=-1)  # [N, V]
    torch.testing.assert_close(
        ref.token_logprobs, full.gather(1, token_ids[:, None])[:, 0].float(), **TOL
    )
    torch.testing.assert_close(ref.top_values, full.topk(20, dim=-1).values.float(), **TOL)
    torch.testing.assert_close(ref.top_values, full.gather(1, ref.top_ids).float(), **TOL)
    want = full.gather(1, gather_ids.clamp(min=0)).float()
    want[gather_ids == -1] = float("nan")
    torch.testing.assert_close(ref.ids_logprobs, want, equal_nan=True, **TOL)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_cpu_dispatch_uses_reference(backend: str) -> None:
    logits, token_ids, temps, gather_ids = _hard_batch(120)
    out = row_logprobs(logits, token_ids, temps, 4, gather_ids, backend=backend)
    ref = row_logprobs_ref(logits, token_ids, temps, 4, gather_ids)
    for got, want in zip(
        (out.token_logprobs, out.top_values, out.top_ids, out.ids_logprobs),
        (ref.token_logprobs, ref.top_values, ref.top_ids, ref.ids_logprobs),
    ):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_unknown_backend_raises() -> None:
    logits, token_ids, _, _ = _hard_batch(16)
    with pytest.raises(ValueError, match="cutlass"):
        row_logprobs(logits, token_ids, backend="cutlass")


@pytest.mark.gpu
@needs_triton
def test_triton_cuda_large_vocab() -> None:
    n, v = 256, 151936
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(n, v, generator=g) * 4).to(torch.bfloat16)  # [N, V]
    logits[::7, ::5] = NEG_INF
    logits[1::7, : v // 3] = -9999.0
    token_ids = torch.randint(0, v, (n,), generator=g)
    temps = torch.rand(n, generator=g) * 1.5 + 0.2  # [N]
    gather_ids = torch.randint(0, v, (n, 8), generator=g)  # [N, M]
    gather_ids[::3, 5:] = -1
    logits, token_ids, temps, gather_ids = (
        t.cuda() for t in (logits, token_ids, temps, gather_ids)
    )
    out = row_logprobs(logits, token_ids, temps, 20, gather_ids, backend="auto")
    _assert_matches(out, logits, token_ids, temps, 20, gather_ids)


@pytest.mark.gpu
@needs_triton
def test_triton_cuda_row_ids() -> None:
    r, n, v = 300, 128, 151936
    g = torch.Generator().manual_seed(5)
    block = (torch.randn(r, v, generator=g) * 4).to(torch.bfloat16)  # [R, V]
    row_ids = torch.randint(0, r, (n,), generator=g)  # [N], unsorted with repeats
    token_ids = torch.randint(0, v, (n,), generator=g)
    temps = torch.rand(n, generator=g) * 1.5 + 0.2  # [N]
    gather_ids = torch.randint(0, v, (n, 4), generator=g)  # [N, M]
    block, row_ids, token_ids, temps, gather_ids = (
        t.cuda() for t in (block, row_ids, token_ids, temps, gather_ids)
    )
    out = row_logprobs(
        logits=block,
        token_ids=token_ids,
        temperatures=temps,
        top_k=8,
        gather_ids=gather_ids,
        backend="auto",
        row_ids=row_ids,
    )
    _assert_matches(out, block[row_ids], token_ids, temps, 8, gather_ids)


@needs_triton
@pytest.mark.filterwarnings("ignore:divide by zero")  # the interpreter's log(0) of an empty row
def test_nan_logits_count_as_impossible_tokens_on_both_paths() -> None:
    """The NaN contract: a NaN logit is -inf (never in the top-k, logprob -inf),
    and a row with no possible token reports -inf everywhere, never NaN."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 70, generator=g) * 3
    logits[0, [3, 17, 50]] = float("nan")
    logits[1, :] = float("nan")
    logits[2, :] = NEG_INF
    logits[3, ::2] = float("nan")
    token_ids = torch.tensor([3, 5, 6, 8])  # row 3: an even (NaN) id
    gather = torch.tensor([[17, 0, -1], [1, 2, 3], [4, -1, -1], [0, 1, 2]])
    for temps in (None, torch.full((4,), 0.7)):
        ref = row_logprobs_ref(logits, token_ids, temps, 5, gather)
        tri = row_logprobs_triton(logits, token_ids, temps, 5, gather, block_v=32)
        for out in (ref, tri):
            assert not out.token_logprobs.isnan().any() and not out.top_values.isnan().any()
            assert torch.equal(out.ids_logprobs.isnan(), gather == -1)
            assert out.token_logprobs[0] == NEG_INF and out.token_logprobs[3] == NEG_INF
            assert (out.token_logprobs[1:3] == NEG_INF).all()
            assert not (out.top_ids[0].unsqueeze(1) == torch.tensor([3, 17, 50])).any()
            assert (out.top_ids[3] % 2 == 1).all()  # the NaN (even) ids never rank
        torch.testing.assert_close(tri.token_logprobs, ref.token_logprobs, **TOL)
        torch.testing.assert_close(tri.top_values, ref.top_values, **TOL)
        torch.testing.assert_close(tri.ids_logprobs, ref.ids_logprobs, equal_nan=True, **TOL)


@needs_triton
@pytest.mark.parametrize("programs", [1, 10**6], ids=["one-program-per-row", "vocab-slices"])
@pytest.mark.parametrize("top_k", [0, 3, 20])
def test_both_launch_shapes_match_the_reference(monkeypatch, programs: int, top_k: int) -> None:
    """One program per row, or each row split into vocab slices merged by the
    combine kernel (logsumexp of the parts, top k of their top keys)."""
    from specserve.kernels import logprobs as lp

    monkeypatch.setattr(lp, "TARGET_PROGRAMS", programs)
    logits, token_ids, temps, gather_ids = _hard_batch(333)
    parts, _ = lp._vocab_split(4, 333, 32)
    assert (parts == 1) == (programs == 1)
    out = row_logprobs_triton(logits, token_ids, temps, top_k, gather_ids, block_v=32)
    _assert_matches(out, logits, token_ids, temps, top_k, gather_ids)
