"""Sampling against independent references: filters, the draw itself, penalties."""

from __future__ import annotations

import pytest
import torch

from specserve.sampling.metadata import SamplingMetadata, filter_probs
from specserve.sampling.params import SamplingParams
from specserve.sampling.penalties import PenaltyState, RowControls, process_logits
from specserve.sampling.sampler import Sampler


def controls(
    sp: SamplingParams, penalty=None, num_out: int = 0, stop_ids=frozenset()
) -> RowControls:
    return RowControls(sp, penalty, num_out, stop_ids)


def filter_ref(p: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """One row, written the slow obvious way."""
    order = sorted(range(len(p)), key=lambda i: -float(p[i]))
    keep = set()
    mass = 0.0
    for rank, i in enumerate(order):
        if sp.top_k > 0 and rank >= sp.top_k:
            break
        if rank > 0 and mass >= sp.top_p:
            break
        keep.add(i)
        mass += float(p[i])
    top = float(p[order[0]])
    keep = {i for i in keep if i == order[0] or float(p[i]) >= sp.min_p * top}
    return torch.tensor([float(p[i]) if i in keep else 0.0 for i in range(len(p))])


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.5),
        SamplingParams(min_p=0.3),
        SamplingParams(top_k=5, top_p=0.8, min_p=0.05),
        SamplingParams(top_p=1e-6),
    ],
)
def test_filter_matches_reference(sp: SamplingParams) -> None:
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(4, 12, generator=g) * 2, dim=-1)
    got = filter_probs(probs.clone(), [sp] * 4)
    for i in range(4):
        torch.testing.assert_close(got[i], filter_ref(probs[i], sp))


def test_draws_follow_the_filtered_distribution() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    n = 20000
    sampler = Sampler(torch.device("cpu"), seed=0)
    for sp in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=3)):
        out = sampler.sample(logits.repeat(n, 1), SamplingMetadata([controls(sp)] * n, [None] * n))
        freq = torch.bincount(out, minlength=6).float() / n
        target = torch.softmax(logits / sp.temperature, dim=-1)
        if sp.top_k > 0:
            target = filter_ref(target, sp)
            target /= target.sum()
        assert 0.5 * (freq - target).abs().sum() < 0.02


def test_greedy_and_seeded_rows() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=g)
    sampler = Sampler(torch.device("cpu"), seed=0)
    seeded = SamplingParams(temperature=1.0, seed=7)

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(7)

    rows = [controls(SamplingParams(temperature=0)), controls(seeded), controls(SamplingParams())]
    a = sampler.sample(logits, SamplingMetadata(rows, [None, gen(), None]))
    b = sampler.sample(logits[1:2], SamplingMetadata([controls(seeded)], [gen()]))
    assert a[0] == int(logits[0].argmax())
    assert a[1] == b[0]


def test_repetition_penalty_matches_transformers() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 40, generator=g)
    prompt, output = [1, 5, 9], [5, 12, 30]
    state = PenaltyState.create(prompt, 40, torch.device("cpu"))
    state.add(output)
    sp = SamplingParams(repetition_penalty=1.3)
    got = process_logits(logits.clone(), [controls(sp, state)])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits.clone())
    torch.testing.assert_close(got, ref)


def test_frequency_presence_bias_and_min_tokens() -> None:
    logits = torch.zeros(1, 10)
    state = PenaltyState.create([3], 10, torch.device("cpu"))
    state.add([4, 4, 5])
    sp = SamplingParams(
        frequency_penalty=0.5, presence_penalty=0.25, logit_bias={7: 2.0}, min_new_tokens=5
    )
    got = process_logits(logits.clone(), [controls(sp, state, num_out=3, stop_ids=frozenset({9}))])
    expect = torch.zeros(10)
    expect[4] = -(2 * 0.5 + 0.25)  # output tokens only: the prompt's 3 is not penalised
    expect[5] = -(0.5 + 0.25)
    expect[7] = 2.0
    expect[9] = float("-inf")  # a stop id before min_new_tokens
    torch.testing.assert_close(got[0], expect)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"max_new_tokens": 1.5}, "max_new_tokens"),
        ({"min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"seed": "x"}, "seed"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(kwargs)


def test_params_normalisation() -> None:
    sp = SamplingParams.from_dict({"stop": "x", "logit_bias": {"3": 1}, "top_k": 0})
    assert sp.stop == ("x",) and sp.logit_bias == {3: 1.0} and not sp.needs_filter
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy


def test_mixed_rows_are_processed_as_each_alone() -> None:
    """One call over rows of different requests (and verify rows that count
    the drafts before them) against each row's rules written out here."""
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(5)
    vocab = 30
    logits = torch.randn(5, vocab, generator=g) * 3
    prompt, output = [1, 2], [4, 4, 7]
    state = PenaltyState.create(prompt, vocab, torch.device("cpu"))
    state.add(output)
    rep = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    plain = SamplingParams(logit_bias={3: -1.0, 40: 5.0}, min_new_tokens=4)
    rows = [
        RowControls(rep, state, 3, frozenset()),  # the chain's first row
        RowControls(rep, state, 4, frozenset(), (9,)),  # after draft 9
        RowControls(rep, state, 5, frozenset(), (9, 4)),  # after drafts 9, 4
        RowControls(plain, None, 2, frozenset({0, 5})),  # bias; stops held
        RowControls(SamplingParams(), None, 0, frozenset({0})),  # untouched
    ]
    got = process_logits(logits.clone(), rows)
    for i, extra in enumerate([(), (9,), (9, 4)]):
        history = prompt + output + list(extra)
        want = RepetitionPenaltyLogitsProcessor(1.5)(
            torch.tensor([history]), logits[i : i + 1].clone()
        )[0]
        for t in set(output + list(extra)):
            n = (output + list(extra)).count(t)
            want[t] -= 0.3 * n + 0.2
        torch.testing.assert_close(got[i], want)
    want = logits[3].clone()
    want[3] -= 1.0  # id 40 is past the vocabulary: ignored
    want[[0, 5]] = float("-inf")
    torch.testing.assert_close(got[3], want)
    torch.testing.assert_close(got[4], logits[4])


def test_every_row_of_a_request_gets_its_bias_and_held_stops() -> None:
    """Bias and stop suppression are applied per request, not per entry: each
    row of a verify chain (and of another request sharing the parameters)
    still gets all of it, stops held only while under min_new_tokens."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 12, generator=g)
    sp = SamplingParams(logit_bias={2: 1.5, 6: -2.0, 99: 3.0}, min_new_tokens=5)
    stops = frozenset({0, 6})
    rows = [
        RowControls(sp, None, 3, stops),  # a chain: held, held, free
        RowControls(sp, None, 4, stops, (8,)),
        RowControls(sp, None, 5, stops, (8, 1)),
        RowControls(SamplingParams(logit_bias={2: -4.0}), None, 0, frozenset()),
        RowControls(sp, None, 3, frozenset({0, 6})),  # another request, the same parameters
    ]
    got = process_logits(logits.clone(), rows)
    want = logits.clone()
    want[[0, 1, 2, 4], 2] += 1.5  # id 99 is past the vocabulary: ignored
    want[[0, 1, 2, 4], 6] -= 2.0
    want[3, 2] -= 4.0
    want[[0, 1, 4], 0] = want[[0, 1, 4], 6] = float("-inf")
    torch.testing.assert_close(got, want)


def test_nan_logits_are_impossible_tokens_when_sampling_too() -> None:
    """The NaN contract of greedy verify and the logprob kernel holds for plain
    sampling: a NaN logit is never drawn, greedily or not."""
    logits = torch.tensor([[0.0, float("nan"), 1.0, -1.0]] * 4)
    sampler = Sampler(torch.device("cpu"), seed=0)
    greedy = sampler.sample(
        logits[:1], SamplingMetadata([controls(SamplingParams(temperature=0))], [None])
    )
    assert greedy.tolist() == [2]
    rows = [controls(SamplingParams(temperature=1.0))] * 4000
    drawn = sampler.sample(logits[:1].repeat(4000, 1), SamplingMetadata(rows, [None] * 4000))
    assert 1 not in drawn.tolist() and {0, 2, 3} <= set(drawn.tolist())
