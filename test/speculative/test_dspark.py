"""The DSpark proposer's per-request state: the pending features it keeps
for the drafter between rounds. (Its drafting is checked against plain
decoding in test_planner and test_spec_engine.)"""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from models_zoo import model_path
from specserve import Engine
from specserve.tools.tiny_model import make_tiny_dspark


def test_pending_rows_are_the_rows_handed_on_and_keep_few_others_alive(tmp_path) -> None:
    """Rows of shared step tensors (a request among others, a prefill chunk
    among decodes) and tensors of its own, in a random order: the pending
    features are the rows handed on, in order, and the other rows their
    tensors keep alive never pass the proposer's bound."""
    target = model_path("qwen3")
    eng = Engine(
        model_path=target,
        device="cpu",
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=make_tiny_dspark(str(tmp_path / "d"), target),
    )
    try:
        proposer = eng.proposer
        proposer.max_shared_rows = bound = 50
        width = proposer.model.feature_weight.shape[1]
        rng = random.Random(5)
        req, want, adds = SimpleNamespace(draft_state=None), [], 0
        while sum(w.shape[0] for w in want) < 6 * bound:
            rows = rng.choice([1, 1, 1, 3, 20])
            captured = torch.randn(rows + rng.choice([0, 0, 3, 15, 63]), width)  # [T, m * d]
            first = rng.randrange(captured.shape[0] - rows + 1)
            start = sum(w.shape[0] for w in want)
            proposer.on_target_features(req, start, captured, first, rows)
            want.append(captured[first : first + rows].clone())
            adds += 1
            st = req.draft_state
            assert sum(t.shape[0] - n for t, _, n in st.pending) <= bound
        assert torch.equal(torch.cat(st.pending_features()), torch.cat(want))
        assert st.pending_len == sum(w.shape[0] for w in want)
        assert len(st.pending) < adds  # (rows were copied out)
    finally:
        eng.shutdown()
