"""The shared acceptance rule against exact distributions on a tiny vocabulary."""

from __future__ import annotations

import itertools

import pytest
import torch

from specserve.sampling.metadata import target_probs
from specserve.sampling.params import SamplingParams
from specserve.speculative.verify import Chain, verify_chains


def run(logits, drafts, q, params, generator, shared=False) -> tuple[list[int], int]:
    """One chain: the committed tokens (accepted drafts + one more) and how
    many drafts were accepted; ``shared``: its uniforms come from the shared
    generator (an unseeded request) instead of its own."""
    chain = Chain(logits, drafts, q, params, None if shared else generator)
    out = verify_chains([chain], shared=generator if shared else None)
    accept, nxt = int(out.accept_len[0]), int(out.next_token[0])
    return drafts[:accept] + [nxt], accept


V = 6


def test_greedy_accepts_while_drafts_equal_the_argmax() -> None:
    logits = torch.eye(V)[[2, 4, 1, 5]] * 5  # argmax per row: 2, 4, 1, 5
    g = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0)
    for drafts, expect, accepted in (
        ([2, 4, 1], [2, 4, 1, 5], 3),  # all accepted, bonus from the last row
        ([2, 4, 0], [2, 4, 1], 2),
        ([3, 4, 1], [2], 0),
    ):
        assert run(logits, drafts, None, greedy, g) == (expect, accepted)
    assert run(logits[:1], [], None, greedy, g) == ([2], 0)


def sampled_runs(p_rows, q_rows, draft_probs, n, generator, params, shared=False, batch=2000):
    """``n`` independent rounds of two drafts drawn from ``draft_probs``, in
    batches of chains (each chain's uniforms its own, as one request's):
    the committed tokens ``[n, 3]`` (-1 past a round's end) and the
    accepted counts ``[n]``."""
    tokens, accepted = [], []
    for start in range(0, n, batch):
        m = min(batch, n - start)
        drafts = torch.stack(
            [
                torch.multinomial(draft_probs[j], m, replacement=True, generator=generator)
                for j in range(2)
            ],
            dim=1,
        ).tolist()  # [m, 2]
        own = None if shared else generator
        chains = [Chain(p_rows, d, q_rows, params, own) for d in drafts]
        out = verify_chains(chains, shared=generator if shared else None)
        acc = out.accept_len.tolist()
        for d, a, nxt in zip(drafts, acc, out.next_token.tolist()):
            tokens.append(d[:a] + [nxt] + [-1] * (2 - a))
            accepted.append(a)
    return torch.tensor(tokens), torch.tensor(accepted)


def chain_distribution(p_rows, q_rows, draft_probs, n, seed, params, shared=False):
    """Empirical distribution of the first committed token."""
    g = torch.Generator().manual_seed(seed)
    tokens, _ = sampled_runs(p_rows, q_rows, draft_probs, n, g, params, shared)
    return torch.bincount(tokens[:, 0], minlength=V).float() / n


@pytest.mark.parametrize("shared", [False, True], ids=["seeded", "shared-generator"])
@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_reproduces_the_target_distribution(one_hot, shared) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g) * 1.5
    params = SamplingParams(temperature=0.8)
    p = torch.softmax(logits / 0.8, dim=-1)
    draft = torch.softmax(torch.randn(2, V, generator=g) * 2, dim=-1)  # a poor drafter
    n = 20000
    if one_hot:
        # Deterministic drafts: always propose token 3 then 1 (q is one-hot).
        draft = torch.zeros(2, V)
        draft[0, 3] = draft[1, 1] = 1.0
    first = chain_distribution(logits, None if one_hot else draft, draft, n, 7, params, shared)
    assert 0.5 * (first - p[0]).abs().sum() < 0.02


def test_second_token_follows_the_target_after_an_accepted_draft() -> None:
    """P(x1, x2) over pairs equals p0(x1) * p1(x2) wherever x1 was accepted as a draft
    (the verify rows do not depend on x1 here, so p1 is the same row for all x1)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, V, generator=g)
    params = SamplingParams(temperature=1.0)
    p = torch.softmax(logits, dim=-1)
    draft = torch.softmax(torch.randn(2, V, generator=g), dim=-1)
    n = 40000
    gen = torch.Generator().manual_seed(3)
    tokens, accepted = sampled_runs(logits, draft, draft, n, gen, params)
    seconds = torch.bincount(tokens[accepted >= 1, 1], minlength=V).float()
    seconds /= seconds.sum()
    assert 0.5 * (seconds - p[1]).abs().sum() < 0.03


def test_top_k_and_top_p_are_respected() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0]] * 2)
    params = SamplingParams(temperature=1.0, top_k=2)
    g = torch.Generator().manual_seed(4)
    seen = set()
    for _ in range(300):
        tokens, _ = run(logits, [5], None, params, g)  # a draft outside the top 2
        seen.add(tokens[0])
    assert seen <= {0, 1}
    probs = target_probs(logits, [SamplingParams(top_p=0.5)] * 2)
    assert torch.count_nonzero(probs[0]) == 1 and float(probs[0].sum()) == pytest.approx(1.0)


def test_every_accept_length_is_reachable_greedily() -> None:
    target = [1, 2, 3, 4]
    logits = torch.eye(V)[target + [0]] * 3
    g = torch.Generator().manual_seed(0)
    for cut, bad in itertools.product(range(5), [5]):
        drafts = target[:cut] + [bad] * (4 - cut)
        tokens, accepted = run(logits, drafts, None, SamplingParams(temperature=0), g)
        assert accepted == cut and tokens == target[:cut] + [logits[cut].argmax().item()]
