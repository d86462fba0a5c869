"""The pieces of DeepSeek-V4's compressed attention against loops written here."""

from __future__ import annotations

import torch

from specserve.layers.compressed_attention import Visible, compress_windows, select_entries


def test_indexer_ties_go_to_the_earlier_entry_and_never_past_the_visible() -> None:
    n, top_k = 6, 3
    keys = torch.zeros(n, 4)  # every score 0: all tied
    # Two queries of one request, seeing all 6 entries and the first 2.
    visible = Visible(
        torch.arange(n)[None, :], torch.zeros(2, dtype=torch.long), torch.tensor([6, 2]), None
    )
    q, w = torch.randn(2, 2, 4), torch.ones(2, 2)
    got, ok = select_entries(q, w, keys, visible, top_k)
    assert got[0].tolist() == [0, 1, 2] and ok[0].all()
    assert set(got[1][ok[1]].tolist()) == {0, 1} and ok[1].sum() == 2


def test_indexer_picks_the_top_scores() -> None:
    g = torch.Generator().manual_seed(0)
    keys, q, w = (
        torch.randn(10, 8, generator=g),
        torch.randn(3, 4, 8, generator=g),
        torch.rand(3, 4),
    )
    visible = Visible(
        torch.arange(10)[None, :], torch.zeros(3, dtype=torch.long), torch.full((3,), 10), None
    )
    got, _ = select_entries(q, w, keys, visible, 4)
    chunked, _ = select_entries(q, w, keys, visible, 4, budget=1)  # one query per gather
    assert torch.equal(chunked, got)
    for t in range(3):
        scores = [
            sum(float(w[t, h]) * max(0.0, float(q[t, h] @ keys[e])) for h in range(4))
            for e in range(10)
        ]
        want = sorted(range(10), key=lambda e: -scores[e])[:4]
        assert sorted(got[t].tolist()) == sorted(want)


def test_compression_is_a_per_channel_softmax_over_the_window() -> None:
    g = torch.Generator().manual_seed(1)
    m, d = 4, 3
    kv, gate = torch.randn(2, 2 * m, 2 * d, generator=g), torch.randn(2, 2 * m, 2 * d, generator=g)
    ape = torch.randn(m, 2 * d, generator=g)
    valid = torch.ones(2, 2 * m, dtype=torch.bool)
    valid[0, :m] = False  # the first window has no previous one
    got = compress_windows(kv, gate, valid, ape, overlap=True)
    for e in range(2):
        for c in range(d):
            # Slots 0..m-1: the previous positions' first channels; m..2m-1: own, second.
            vals, logits = [], []
            for j in range(2 * m):
                if not valid[e, j]:
                    continue
                ch = c if j < m else d + c
                vals.append(float(kv[e, j, ch]))
                logits.append(float(gate[e, j, ch] + ape[j % m, ch]))
            p = torch.tensor(logits).softmax(0)
            assert abs(float((p * torch.tensor(vals)).sum()) - float(got[e, c])) < 1e-5
    hca = compress_windows(kv[:, :m, :d], gate[:, :m, :d], valid[:, m:], ape[:, :d], overlap=False)
    p = (gate[:, :m, :d] + ape[:, :d]).softmax(dim=1)
    assert torch.allclose(hca, (p * kv[:, :m, :d]).sum(1), atol=1e-6)
