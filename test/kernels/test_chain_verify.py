"""Chain verification: Triton kernels (interpreted on CPU) against the torch references,
and the references against hand-made examples and sampling statistics."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels.chain_verify import (
    HAS_TRITON,
    greedy_argmax,
    greedy_verify,
    greedy_verify_ref,
    greedy_verify_triton,
    rejection_verify,
    rejection_verify_ref,
    rejection_verify_triton,
    row_argmax,
)

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
NAN = float("nan")
U_TOP = 0.999999  # largest uniform the tests use; float32 keeps it below 1


def _steep(v: int, lowest: bool) -> torch.Tensor:
    """Race noise under which the lowest (or the highest) token with positive
    weight wins, whatever the weights (of one order of magnitude)."""
    t = torch.arange(v, dtype=torch.float32)
    return torch.exp(t if lowest else -t)  # [V]


LOW, HIGH = True, False


def _layout(lengths: list[int], rows_per_chain: int) -> tuple[torch.Tensor, int]:
    """Row starts for chains laid out in reverse order with one unused row before each.

    ``rows_per_chain`` is added to each length (1 for target rows, 0 for draft rows).
    Returns (starts [B], rows needed).
    """
    starts = [0] * len(lengths)
    r = 0
    for b in reversed(range(len(lengths))):
        r += 1  # an unused row the kernels must not read
        starts[b] = r
        r += lengths[b] + rows_per_chain
    return torch.tensor(starts, dtype=torch.int64), r


def _pad_drafts(rows: list[list[int]], lmax: int, v: int) -> torch.Tensor:
    """[B, Lmax] drafts whose padding is junk (negative or out of vocab)."""
    out = torch.empty(len(rows), lmax, dtype=torch.int64)
    for b, row in enumerate(rows):
        out[b] = torch.tensor(row + [[-7, v + 3][i % 2] for i in range(lmax - len(row))])
    return out


def _assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, ...]) -> None:
    for g, w in zip(got, want):
        assert g.dtype == torch.int64 and g.shape == w.shape
        assert torch.equal(g.cpu(), w.cpu()), f"{g.tolist()} != {w.tolist()}"


# ------------------------------------------------------------------------------- greedy


def _lowest_argmax(row: list[float]) -> int:
    return row.index(max(row))


def _greedy_case(
    v: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int]]:
    """Chains with every accept length from 0 to L_b, including L_b = 0.

    With ``_layout``, chain 8 sits on rows 1-2, chain 7 on 4-8, chain 6 on 10,
    chain 5 on 12-14, and so on. Returns (logits, row_starts, drafts, lengths,
    the intended accept lengths, the expected next tokens).
    """
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 0, 4, 1, 4, 2, 0, 4, 1]
    miss = [0, 0, 4, 1, 2, 1, 0, 3, 0]  # index of the first wrong draft; L_b = all right
    lmax = max(lengths)
    row_starts, r = _layout(lengths, 1)
    logits = (torch.randn(r, v, generator=g) * 3).to(dtype)  # [R, V]
    logits[1] = logits[1, 0]  # correction row of chain 8, all tied: argmax 0
    logits[4] = logits[4, 5]  # accepted row of chain 7, all tied
    logits[5, [50, 10, 70]] = 40.0  # ties across chunks: argmax 10
    logits[6, :33] = float("-inf")
    logits[10, [70, 33]] = 50.0  # next-token row of draftless chain 6: argmax 33
    used = torch.zeros(r, dtype=torch.bool)
    for st, n in zip(row_starts.tolist(), lengths):
        used[st : st + n + 1] = True
    logits[~used] = NAN  # never read by the kernels
    rows = logits.float().tolist()
    drafts, want_next = [], []
    for b, (st, n, m) in enumerate(zip(row_starts.tolist(), lengths, miss)):
        row = [_lowest_argmax(rows[st + j]) for j in range(n)]
        if m < n:
            row[m] = (row[m] + 1 + b) % v
        drafts.append(row)
        want_next.append(_lowest_argmax(rows[st + m]))
    return (
        logits,
        row_starts,
        _pad_drafts(drafts, lmax, v),
        torch.tensor(lengths),
        miss,
        want_next,
    )


def test_greedy_reference_hand_example() -> None:
    logits = torch.tensor(
        [
            [0.0, 5.0, 1.0, 5.0, -1.0, 0.0],  # argmax 1 (the tie with 3 goes low)
            [2.0, 0.0, 0.0, 0.0, 0.0, 9.0],  # argmax 5
            [7.0, 7.0, 7.0, 7.0, 7.0, 7.0],  # argmax 0
            [0.0, 0.0, 0.0, 0.0, 3.0, 0.0],  # argmax 4
            [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],  # argmax 5
        ]
    )  # [R, V]
    row_starts = torch.tensor([0, 3, 1, 4])
    drafts = torch.tensor([[1, 5, 0], [4, -1, -1], [5, 1, 9], [2, 2, 2]])
    lengths = torch.tensor([3, 1, 2, 0])
    accept_len, next_token = greedy_verify_ref(logits, row_starts, drafts, lengths)
    # chain 0: rows 0..2 give 1, 5, 0, all match; bonus = argmax(row 3) = 4
    # chain 1: row 3 gives 4, a match; bonus = argmax(row 4) = 5
    # chain 2: row 1 gives 5, a match; row 2 gives 0 but the draft is 1: correction 0
    # chain 3: no drafts; next = argmax(row 4) = 5
    assert accept_len.tolist() == [3, 1, 1, 0]
    assert next_token.tolist() == [4, 5, 0, 5]


def test_greedy_reference_intended_accepts() -> None:
    logits, row_starts, drafts, lengths, miss, want_next = _greedy_case(77, torch.float32)
    assert want_next[8] == 0 and want_next[6] == 33  # the tied rows
    accept_len, next_token = greedy_verify_ref(logits, row_starts, drafts, lengths)
    assert accept_len.tolist() == miss
    assert next_token.tolist() == want_next


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_v", [32, 128], ids=["tail", "one_chunk"])
def test_greedy_triton_matches_reference(block_v: int, dtype: torch.dtype) -> None:
    logits, row_starts, drafts, lengths, miss, want_next = _greedy_case(77, dtype)
    got = greedy_verify_triton(logits, row_starts, drafts, lengths, block_v=block_v)
    _assert_same(got, greedy_verify_ref(logits, row_starts, drafts, lengths))
    assert got[0].tolist() == miss and got[1].tolist() == want_next


@needs_triton
def test_greedy_triton_strided_inputs() -> None:
    logits, row_starts, drafts, lengths, miss, want_next = _greedy_case(77, torch.float32, 1)
    wide = torch.full((logits.shape[0] * 2, 90), NAN)
    wide[::2, :77] = logits
    s_logits = wide[::2, :77]  # [R, V] with row stride 180
    dwide = torch.zeros(drafts.shape[0], drafts.shape[1] + 3, dtype=torch.int64)
    dwide[:, 1:-2] = drafts
    s_drafts = dwide[:, 1:-2]  # [B, Lmax] with row stride Lmax + 3
    pairs = torch.stack([row_starts, lengths], dim=1)  # [B, 2]: both columns strided
    got = greedy_verify_triton(s_logits, pairs[:, 0], s_drafts, pairs[:, 1], block_v=32)
    assert got[0].tolist() == miss and got[1].tolist() == want_next


# ---------------------------------------------------------------------------- rejection


def _normalise(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(dim=-1, keepdim=True)


def _rejection_case(v: int, with_q: bool, seed: int = 0) -> tuple[torch.Tensor | None, ...]:
    """Ragged chains with random drafts plus a forced all-accept and a first-reject chain.

    Returns (probs, row_starts, drafts, lengths, draft_probs, draft_starts, uniforms,
    noise); draft_probs and draft_starts are None when ``with_q`` is False.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 0, 4, 1, 4, 2, 0, 4, 1, 3, 4, 2]
    b, lmax = len(lengths), max(lengths)
    row_starts, r = _layout(lengths, 1)
    draft_starts, d = _layout(lengths, 0)
    probs = torch.softmax(torch.randn(r, v, generator=g) * 2, dim=-1)  # [R, V]
    # Filtered rows (as after top-k / top-p): some tokens get exactly zero mass.
    probs[::2] *= torch.rand(probs[::2].shape, generator=g) > 0.5
    probs = _normalise(probs)
    # Draft distributions leaning towards the target's tokens without equalling them.
    noise = torch.softmax(torch.randn(d, v, generator=g) * 2, dim=-1)  # [D, V]
    draft_probs = _normalise(noise + 0.5 * probs[:d])
    uniforms = torch.rand(b, lmax, generator=g)  # [B, Lmax]
    noise = torch.empty(b, v).exponential_(generator=g)  # [B, V]
    rows = []
    for c, (s, ds, n) in enumerate(zip(row_starts.tolist(), draft_starts.tolist(), lengths)):
        row = []
        for j in range(n):
            src = draft_probs[ds + j] if with_q else probs[s + j]
            x = int(torch.multinomial(src, 1, generator=g))
            if c == 4:  # every draft accepted: u = 0 passes whenever p > 0 and q > 0
                x = int(probs[s + j].argmax())
                uniforms[c, j] = 0.0
            if c == 10 and j == 0:  # first draft rejected: the lowest p / q, u near 1
                q = draft_probs[ds] if with_q else torch.ones(v)
                x = int((probs[s] / q).argmin())
                uniforms[c, j] = U_TOP
            row.append(x)
        rows.append(row)
    noise[2] = 1.0  # final-draw edges: the largest weight, lowest id on ties
    noise[3, ::5] = 0.0  # infinite scores where the weight is positive, none where it is 0
    q_args = (draft_probs, draft_starts) if with_q else (None, None)
    drafts = _pad_drafts(rows, lmax, v)
    return (probs, row_starts, drafts, torch.tensor(lengths), *q_args, uniforms, noise)


@needs_triton
@pytest.mark.parametrize("with_q", [True, False], ids=["q", "one_hot"])
@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_triton_matches_reference(with_q: bool, seed: int) -> None:
    args = _rejection_case(77, with_q, seed)
    want = rejection_verify_ref(*args)
    got = rejection_verify_triton(*args, block_v=32)
    _assert_same(got, want)
    accept_len, lengths = want[0], args[3]
    assert accept_len[4] == lengths[4], "the forced all-accept chain must reach the bonus"
    assert accept_len[10] == 0, "the forced rejection must stop the chain at draft 0"
    # Both outcomes occur among the random chains too.
    assert bool((accept_len < lengths).any())
    assert bool((accept_len[lengths > 0] > 0).any())


@needs_triton
def test_rejection_triton_single_chunk_and_strides() -> None:
    probs, row_starts, drafts, lengths, draft_probs, draft_starts, uniforms, noise = (
        _rejection_case(77, True, seed=2)
    )
    q_args = (draft_probs, draft_starts)
    want = rejection_verify_ref(probs, row_starts, drafts, lengths, *q_args, uniforms, noise)
    wide = torch.full((probs.shape[0], 100), NAN)
    wide[:, :77] = probs
    u_t = uniforms.T.contiguous()  # [Lmax, B]; .T gives strides (1, B)
    e_wide = torch.full((noise.shape[0], 90), NAN)
    e_wide[:, :77] = noise  # [B, V] with row stride 90
    got = rejection_verify_triton(
        wide[:, :77], row_starts, drafts, lengths, *q_args, u_t.T, e_wide[:, :77], block_v=128
    )
    _assert_same(got, want)


def _edge_probs(v: int) -> torch.Tensor:
    """A row with zeros at both ends: positive mass only on tokens 40..70."""
    row = torch.zeros(v)
    row[40:71] = torch.linspace(1.0, 2.0, 31)
    return row / row.sum()


@pytest.mark.parametrize(
    "backend", [pytest.param("triton", marks=needs_triton), "torch"], ids=["triton", "torch"]
)
def test_rejection_edges_with_q(backend: str) -> None:
    v = 77
    p = _edge_probs(v)
    probs = p.repeat(12, 1)  # [R, V]; chain b uses rows 2b, 2b + 1
    probs[1] = torch.softmax(torch.linspace(0, 3, v), dim=0)  # bonus row of chain 0
    q_off = p.clone()
    q_off[3] = 0.25  # q[3] > 0 = p[3]
    q_no45 = p.clone()
    q_no45[45] = 0.0  # q[45] = 0 < p[45]
    draft_probs = torch.stack([p, p, _normalise(q_off), p, _normalise(q_no45), p])  # [D, V]
    row_starts = torch.arange(0, 12, 2)
    draft_starts = torch.arange(6)
    lengths = torch.tensor([1, 1, 1, 1, 1, 0])
    drafts = torch.tensor([[55], [3], [3], [60], [45], [-1]])
    # Each chain's accept test, and which end its final draw favours.
    cases = [
        (0.0, LOW),  # q == p, p[x] > 0: accepted; bonus from row 1
        (0.0, LOW),  # q == p, p[x] = 0 = q[x]: rejected; residual all zero -> p
        (0.0, HIGH),  # q[x] > 0 = p[x]: rejected; residual = p / 5 on 40..70
        (U_TOP, HIGH),  # q == p: u * q < p for any u < 1, accepted
        (0.0, LOW),  # q[x] = 0: rejected though u = 0; residual only at 45
        (0.5, HIGH),  # no drafts: drawn from row 10
    ]
    uniforms = torch.tensor([[u] for u, _ in cases])  # [B, 1]
    noise = torch.stack([_steep(v, end) for _, end in cases])  # [B, V]
    accept_len, next_token = rejection_verify(
        probs, row_starts, drafts, lengths, draft_probs, draft_starts, uniforms, noise,
        backend=backend,
    )  # fmt: skip
    assert accept_len.tolist() == [1, 0, 0, 1, 0, 0]
    # LOW picks the first token with positive weight, HIGH the last one.
    assert next_token.tolist() == [0, 40, 70, 70, 45, 70]


@pytest.mark.parametrize(
    "backend", [pytest.param("triton", marks=needs_triton), "torch"], ids=["triton", "torch"]
)
def test_rejection_edges_one_hot(backend: str) -> None:
    probs = _edge_probs(77).repeat(6, 1)  # [R, V]
    row_starts = torch.tensor([0, 2, 4])
    lengths = torch.tensor([2, 1, 1])
    # chain 0: two drafts with p > 0 and u = 0, both accepted; bonus favouring HIGH
    # chain 1: p[x] = 0, rejected with u = 0; residual = p, drawn favouring LOW
    # chain 2: x = 40 rejected at u near 1 (p[40] < 1); residual = p without token 40
    drafts = torch.tensor([[50, 60], [0, 12345], [40, -1]])
    uniforms = torch.tensor([[0.0, 0.0], [0.0, 0.3], [U_TOP, 0.7]])
    noise = torch.stack([_steep(77, HIGH), _steep(77, LOW), _steep(77, LOW)])
    accept_len, next_token = rejection_verify(
        probs, row_starts, drafts, lengths, None, None, uniforms, noise, backend=backend
    )
    assert accept_len.tolist() == [2, 0, 0]
    assert next_token.tolist() == [70, 40, 41]


@pytest.mark.parametrize("with_q", [True, False], ids=["q", "one_hot"])
def test_rejection_reference_first_token_distribution(with_q: bool) -> None:
    """Whatever the drafts, the first committed token follows the target row."""
    n, v, lmax = 5000, 5, 2
    g = torch.Generator().manual_seed(7)
    probs = torch.tensor(
        [[0.45, 0.25, 0.15, 0.1, 0.05], [0.0, 0.3, 0.3, 0.2, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]]
    )  # [R, V]; every chain shares rows 0..2
    draft_probs = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.3], [0.6, 0.1, 0.1, 0.1, 0.1]])  # [D, V]
    row_starts = torch.zeros(n, dtype=torch.int64)
    lengths = torch.randint(1, lmax + 1, (n,), generator=g)
    if with_q:
        first = torch.multinomial(draft_probs[0], n, replacement=True, generator=g)
        second = torch.multinomial(draft_probs[1], n, replacement=True, generator=g)
        q_args = (draft_probs, torch.zeros(n, dtype=torch.int64))
    else:
        # A deterministic drafter: any choice made without looking at the uniforms.
        first = torch.randint(0, v, (n,), generator=g)
        second = torch.randint(0, v, (n,), generator=g)
        q_args = (None, None)
    drafts = torch.stack([first, second], dim=1)  # [B, Lmax]
    uniforms = torch.rand(n, lmax, generator=g)  # [B, Lmax]
    noise = torch.empty(n, v).exponential_(generator=g)  # [B, V]
    accept_len, next_token = rejection_verify_ref(
        probs, row_starts, drafts, lengths, *q_args, uniforms, noise
    )
    committed = torch.where(accept_len > 0, drafts[:, 0], next_token)  # [B]
    freq = torch.bincount(committed, minlength=v).float() / n
    tv = 0.5 * (freq - probs[0]).abs().sum()
    assert tv < 0.03, f"total variation {tv:.4f}: {freq.tolist()} vs {probs[0].tolist()}"
    # Acceptance is neither trivial nor total, so both paths were taken.
    assert 0.1 < (accept_len > 0).float().mean() < 0.9


# ----------------------------------------------------------------------- dispatch, misc


@pytest.mark.parametrize(
    "backend", [pytest.param("triton", marks=needs_triton), "torch"], ids=["triton", "torch"]
)
def test_empty_and_draftless_batches(backend: str) -> None:
    g = torch.Generator().manual_seed(3)
    probs = _normalise(torch.rand(3, 40, generator=g) + 0.1)  # [R, V]
    e = torch.empty(0, dtype=torch.int64)
    for out in (
        greedy_verify(probs, e, e.view(0, 2), e, backend=backend),
        rejection_verify(
            probs,
            e,
            e.view(0, 2),
            e,
            None,
            None,
            torch.empty(0, 2),
            torch.empty(0, 40),
            backend=backend,
        ),  # fmt: skip
    ):
        assert out[0].shape == (0,) and out[1].shape == (0,)
    # Lmax = 0: every chain only draws its next token.
    row_starts = torch.tensor([2, 0])
    drafts = torch.empty(2, 0, dtype=torch.int64)
    lengths = torch.zeros(2, dtype=torch.int64)
    accept_len, next_token = greedy_verify(probs, row_starts, drafts, lengths, backend=backend)
    assert accept_len.tolist() == [0, 0]
    assert next_token.tolist() == probs[[2, 0]].argmax(dim=-1).tolist()
    uniforms = torch.empty(2, 0)
    noise = torch.stack([_steep(40, LOW), _steep(40, HIGH)])
    accept_len, next_token = rejection_verify(
        probs, row_starts, drafts, lengths, None, None, uniforms, noise, backend=backend
    )
    assert accept_len.tolist() == [0, 0]
    assert next_token.tolist() == [0, 39]


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_cpu_dispatch_uses_reference(backend: str) -> None:
    g_args = _greedy_case(77, torch.float32)[:4]
    _assert_same(greedy_verify(*g_args, backend=backend), greedy_verify_ref(*g_args))
    r_args = _rejection_case(77, True)
    _assert_same(rejection_verify(*r_args, backend=backend), rejection_verify_ref(*r_args))


def test_unknown_backend_raises() -> None:
    g_args = _greedy_case(77, torch.float32)[:4]
    with pytest.raises(ValueError, match="cutlass"):
        greedy_verify(*g_args, backend="cutlass")
    with pytest.raises(ValueError, match="tilelang"):
        rejection_verify(*_rejection_case(77, False), backend="tilelang")


@needs_triton
def test_triton_rejects_bad_inputs() -> None:
    logits, row_starts, drafts, lengths, _, _ = _greedy_case(77, torch.float32)
    with pytest.raises(AssertionError, match="row_starts must be int64"):
        greedy_verify_triton(logits, row_starts.int(), drafts, lengths)
    with pytest.raises(AssertionError, match="lengths must be"):
        greedy_verify_triton(logits, row_starts, drafts, lengths[:-1])
    with pytest.raises(AssertionError, match="contiguous"):
        greedy_verify_triton(logits.T.contiguous().T, row_starts, drafts, lengths)
    with pytest.raises(AssertionError, match="logits dtype"):
        greedy_verify_triton(logits.double(), row_starts, drafts, lengths)
    probs, row_starts, drafts, lengths, draft_probs, draft_starts, uniforms, noise = (
        _rejection_case(40, True)
    )
    base = (row_starts, drafts, lengths)
    ue = (uniforms, noise)
    with pytest.raises(AssertionError, match="probs dtype"):
        rejection_verify_triton(probs.half(), *base, draft_probs, draft_starts, *ue)
    with pytest.raises(AssertionError, match="draft_probs must be float32"):
        rejection_verify_triton(probs, *base, draft_probs.double(), draft_starts, *ue)
    with pytest.raises(AssertionError, match="draft_probs must be \\[D"):
        rejection_verify_triton(probs, *base, draft_probs[:, :-1], draft_starts, *ue)
    with pytest.raises(AssertionError, match="draft_starts is required"):
        rejection_verify_triton(probs, *base, draft_probs, None, *ue)
    with pytest.raises(AssertionError, match="uniforms must be"):
        rejection_verify_triton(probs, *base, draft_probs, draft_starts, uniforms[:, :-1], noise)
    with pytest.raises(AssertionError, match="noise must be \\["):
        rejection_verify_triton(probs, *base, draft_probs, draft_starts, uniforms, noise[:, :-1])
    with pytest.raises(AssertionError, match="noise must be float32"):
        rejection_verify_triton(probs, *base, draft_probs, draft_starts, uniforms, noise.double())


# -------------------------------------------------------------------------------- GPU


def _check_draw(weights: torch.Tensor, noise: torch.Tensor, tok: int) -> None:
    """``tok`` wins the race of ``weights`` against ``noise``, up to rounding."""
    w, e = weights.double(), noise.double()
    score = torch.where(w > 0, w / e, -1.0)
    assert w[tok] > 0
    assert float(score[tok]) >= float(score.max()) * (1 - 1e-6)


@pytest.mark.gpu
@needs_triton
def test_triton_cuda_large_vocab() -> None:
    b, lmax, v = 64, 6, 151936
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(0, lmax + 1, (b,), generator=g)
    row_starts, r = _layout(lengths.tolist(), 1)
    draft_starts, d = _layout(lengths.tolist(), 0)
    logits = (torch.randn(r, v, generator=g) * 4).to(torch.bfloat16)  # [R, V]
    target = logits.float().argmax(dim=-1)  # [R]
    drafts = torch.randint(0, v, (b, lmax), generator=g)
    for c in range(b):
        m = int(torch.randint(0, int(lengths[c]) + 1, (1,), generator=g))
        s = int(row_starts[c])
        drafts[c, :m] = target[s : s + m]
    args = (logits, row_starts, drafts, lengths)
    want = greedy_verify_ref(*args)
    got = greedy_verify(*(t.cuda() for t in args), backend="auto")
    _assert_same(got, want)

    probs = torch.softmax(logits.float() * 0.7, dim=-1)  # [R, V]
    spread = torch.softmax(torch.randn(d, v, generator=g) * 4, dim=-1)  # [D, V]
    draft_probs = _normalise(spread + probs[:d])
    for c in range(b):
        for j in range(int(lengths[c])):
            q = draft_probs[int(draft_starts[c]) + j]
            drafts[c, j] = int(torch.multinomial(q, 1, generator=g))
    uniforms = torch.rand(b, lmax, generator=g)  # [B, Lmax]
    noise = torch.empty(b, v).exponential_(generator=g)  # [B, V]
    for q_args in ((draft_probs, draft_starts), (None, None)):
        args = (probs, row_starts, drafts, lengths, *q_args, uniforms, noise)
        want = rejection_verify_ref(*args)
        got = rejection_verify(*(t.cuda() if t is not None else None for t in args))
        accept_len, next_token = (t.cpu() for t in got)
        assert torch.equal(accept_len, want[0])
        # Should the GPU round a score otherwise, a near-tie may go the other
        # way; the token must still win the race up to rounding.
        for c in range(b):
            if next_token[c] == want[1][c]:
                continue
            a, s = int(accept_len[c]), int(row_starts[c])
            w = probs[s + a]
            if a < lengths[c]:
                if q_args[0] is not None:
                    q_row = q_args[0][int(draft_starts[c]) + a]
                else:
                    q_row = torch.zeros(v)
                    q_row[int(drafts[c, a])] = 1.0
                res = (w - q_row).clamp(min=0.0)
                w = res if bool((res > 0).any()) else w
            _check_draw(w, noise[c], int(next_token[c]))


@needs_triton
def test_nan_logits_are_never_the_greedy_token_on_both_paths() -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 40, generator=g)
    logits[0, logits[0].argmax()] = NAN  # the would-be argmax is NaN
    logits[3, :20] = NAN
    best = logits.nan_to_num(nan=float("-inf")).argmax(dim=-1)
    row_starts = torch.tensor([0, 3])
    lengths = torch.tensor([2, 2])
    drafts = torch.stack([best[0:2], best[3:5]])
    for fn in (greedy_verify_ref, lambda *a: greedy_verify_triton(*a, block_v=16)):
        accept, nxt = fn(logits, row_starts, drafts, lengths)
        assert accept.tolist() == [2, 2] and nxt.tolist() == [int(best[2]), int(best[5])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_row_argmax_is_torch_argmax(dtype) -> None:
    """The CPU fast path (NumPy) returns torch's index: the first maximum,
    NaN as the maximum, on strided rows and on tensors that require grad."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (6, 3, 40), generator=g).to(dtype)  # many ties
    x[1, 0, 7] = float("nan")
    x[2, 1, 3] = x[2, 1, 30] = float("nan")
    x[3, 2] = float("-inf")
    for rows in (x, x[:, 1], x.transpose(0, 1)):  # contiguous, strided, transposed
        torch.testing.assert_close(row_argmax(rows), rows.argmax(dim=-1), rtol=0, atol=0)
    w = torch.randn(4, 9, generator=g, requires_grad=True)
    assert torch.equal(row_argmax(w), w.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_argmax_counts_nan_as_minus_infinity(dtype) -> None:
    """The greedy token (plain sampling and verify): torch's argmax with NaN
    as -inf; rows with and without NaN side by side, an all-NaN row, +inf,
    ties, and a strided view."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 4, (7, 2, 30), generator=g).to(dtype)  # many ties
    x[0, 0, x[0, 0].argmax()] = NAN  # the would-be argmax
    x[1, 1] = NAN
    x[2, 0, 11] = float("inf")
    x[3, 1, :5] = NAN
    for rows in (x[:, 0], x[:, 1], x.reshape(14, 30)):
        want = rows.float().nan_to_num(nan=float("-inf")).argmax(dim=-1)
        assert torch.equal(greedy_argmax(rows), want)
    clean = x[4:, 0]  # no NaN: the plain argmax
    assert torch.equal(greedy_argmax(clean), clean.float().argmax(dim=-1))
