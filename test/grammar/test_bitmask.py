"""Chain masks and the committed-run advance, on hand-made chains, against a
fresh matcher stepped one token at a time (the oracle)."""

from __future__ import annotations

import pytest
import torch

from models_zoo import model_path
from specserve.grammar.base import GrammarSpec
from specserve.grammar.bitmask import (
    advance_committed,
    allocate_bitmask,
    apply_bitmask,
    apply_bitmask_ref,
    fill_chain_masks,
    is_allowed,
    unpack_bitmask,
)
from specserve.tokenizer.tokenizer import Tokenizer

pytest.importorskip("xgrammar")
from specserve.grammar.xgrammar_backend import XGrammarBackend  # noqa: E402

V = 528
EOS = 2


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(model_path("qwen3"))


@pytest.fixture(scope="module")
def backend(tok: Tokenizer):
    b = XGrammarBackend(tok.hf, V, [EOS])
    yield b
    b.close()


@pytest.fixture(scope="module")
def answer(backend):
    """A finite grammar: 'yes', 'no' or 'maybe' followed by '!'."""
    return backend.compile(GrammarSpec("regex", "(yes|no|maybe)!"))


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def oracle_rows(backend, compiled, prefix: list[int], n: int) -> list[torch.Tensor]:
    """Mask rows after prefix[:0], prefix[:1], ... prefix[:n-1], from fresh matchers."""
    rows = []
    for j in range(n):
        m = backend.matcher(compiled)
        for t in prefix[:j]:
            assert m.accept(t)
        bm = allocate_bitmask(1, V)
        m.fill_mask(bm, 0)
        rows.append(bm[0].clone())
    return rows


def test_legal_chain_fills_every_row_and_rolls_back(tok, backend, answer) -> None:
    chain = ids(tok, "maybe!")
    m = backend.matcher(answer)
    bm = allocate_bitmask(len(chain) + 3, V)
    fill_chain_masks(m, chain, bm, start_row=2)
    expect = oracle_rows(backend, answer, chain, len(chain) + 1)
    for j, row in enumerate(expect):
        assert torch.equal(bm[2 + j], row)
    assert torch.equal(bm[0], allocate_bitmask(1, V)[0])  # rows outside the chain untouched
    # Rolled back: the matcher still accepts the chain from the start.
    assert advance_committed(m, chain).num_accepted == len(chain)


def test_chain_stops_at_the_first_illegal_draft(tok, backend, answer) -> None:
    good = ids(tok, "ye")
    bad = ids(tok, "x")
    chain = good + bad + ids(tok, "s!")
    m = backend.matcher(answer)
    bm = allocate_bitmask(len(chain) + 1, V)
    fill_chain_masks(m, chain, bm, 0)
    expect = oracle_rows(backend, answer, chain, len(good) + 1)
    for j, row in enumerate(expect):
        assert torch.equal(bm[j], row)
    assert not is_allowed(bm, len(good), bad[0])
    # Rows past the illegal draft are unreachable and left all-allowed.
    assert all(
        torch.equal(bm[j], allocate_bitmask(1, V)[0]) for j in range(len(good) + 1, len(chain) + 1)
    )
    assert advance_committed(m, ids(tok, "yes!") + [EOS]).terminated


def test_chain_that_terminates_midway(tok, backend, answer) -> None:
    chain = ids(tok, "no!") + [EOS] + ids(tok, "yes")
    m = backend.matcher(answer)
    bm = allocate_bitmask(len(chain) + 1, V)
    fill_chain_masks(m, chain, bm, 0)
    n = len(ids(tok, "no!")) + 1
    # After the grammar is complete only the stop token is allowed, and the
    # walk stopped at the draft that completed it: later rows stay all-allowed.
    last = unpack_bitmask(bm[n - 1 : n], V)[0]
    assert last.nonzero().flatten().tolist() == [EOS]
    assert all(torch.equal(bm[j], allocate_bitmask(1, V)[0]) for j in range(n, len(chain) + 1))
    assert not m.is_terminated()  # rolled back


def test_advance_committed_cuts_at_termination_and_reports_rejection(tok, backend, answer) -> None:
    m = backend.matcher(answer)
    run = ids(tok, "yes!") + [EOS] + ids(tok, "more")
    adv = advance_committed(m, run)
    assert adv.num_accepted == len(ids(tok, "yes!")) + 1 and adv.terminated and not adv.rejected
    m2 = backend.matcher(answer)
    adv = advance_committed(m2, ids(tok, "no") + ids(tok, "pe"))
    assert adv.rejected and adv.num_accepted == len(ids(tok, "no"))


def test_padding_ids_past_the_tokenizer_are_never_allowed(tok, backend) -> None:
    compiled = backend.compile(GrammarSpec("regex", ".*"))
    m = backend.matcher(compiled)
    bm = allocate_bitmask(1, V)
    m.fill_mask(bm, 0)
    allowed = unpack_bitmask(bm, V)[0]
    assert allowed[: len(tok)].any() and not allowed[len(tok) :].any()


def test_apply_bitmask_matches_reference() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, V, generator=g)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (2, -(-V // 32)), generator=g, dtype=torch.int64
    ).to(torch.int32)
    a, b = logits.clone(), logits.clone()
    apply_bitmask(a, bitmask, [1, 3])
    apply_bitmask_ref(b, bitmask, [1, 3])
    assert torch.equal(a, b)
    assert torch.equal(a[[0, 2, 4]], logits[[0, 2, 4]])
    allowed = unpack_bitmask(bitmask, V)
    assert torch.equal(torch.isinf(a[[1, 3]]), ~allowed)
    for t in (0, 31, 32, 100, V - 1):
        assert is_allowed(bitmask, 0, t) == bool(allowed[0, t])


def test_compile_errors_name_the_field_and_the_cache_reuses(backend) -> None:
    for spec, field in (
        (GrammarSpec("regex", "a("), "regex"),
        (GrammarSpec("json_schema", "{not json"), "json_schema"),
        (GrammarSpec("ebnf", "root ::= "), "ebnf"),
    ):
        with pytest.raises(ValueError, match=rf"^{field}: the grammar does not compile: \S"):
            backend.compile(spec)
    spec = GrammarSpec("regex", "[0-9]+")
    assert backend.compile(spec) is backend.compile(GrammarSpec("regex", "[0-9]+"))
