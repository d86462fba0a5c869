"""DeepSeek-V4's bundled DSpark drafter against a reference block forward
written from its description (``spec_helpers.V4Reference``, on the
checkpoint's own tensors): one block on its own, and the proposer's cached
rounds over its sliding-window draft pool."""

from __future__ import annotations

import pytest
import torch

from spec_helpers import V4Reference, v4_checkpoints
from specserve.config import EngineConfig
from specserve.core import Req
from specserve.runner.model_runner import ModelRunner
from specserve.sampling.params import SamplingParams
from specserve.speculative.dspark import DSparkProposer

BLOCK = 4


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return v4_checkpoints(str(tmp_path_factory.mktemp("v4-dspark-model")), BLOCK)


@pytest.fixture(scope="module")
def reference(paths) -> V4Reference:
    return V4Reference(paths["drafter"], paths["target"])


def proposer_for(paths: dict[str, str]) -> DSparkProposer:
    cfg = EngineConfig.from_kwargs(
        paths["target"], device="cpu", dtype="float32", max_total_tokens=512, page_size=4,
        speculative_algorithm="DSPARK", speculative_draft_model_path=paths["drafter"],
        # Confidences computed (and compared) but cutting nothing.
        speculative_dspark_confidence_threshold=1e-9,
    )  # fmt: skip
    return DSparkProposer.from_config(cfg, ModelRunner(cfg))


def test_drafter_forward_matches_a_reference(paths, reference) -> None:
    model = proposer_for(paths).model
    g = torch.Generator().manual_seed(0)
    width = reference.num_stages * reference.cfg["hidden_size"]
    for p_len in (3, 11):  # a context shorter and longer than the window (8)
        features = torch.randn(p_len, width, generator=g)
        anchor, prev = 17, torch.tensor([17, 40, 41, 42])
        want_base, want_corr, want_conf = reference.block_forward(features, anchor, prev)
        with torch.no_grad():
            keys = model.context_kv(features, torch.arange(p_len))
            lo = max(0, p_len - model.window)
            ctx = [k[lo:, 0][None] for k, _ in keys]
            attend = model.window_attend(ctx, torch.zeros(1, p_len - lo))
            hidden = model.block_hidden(
                torch.tensor([anchor]), torch.tensor([p_len]), attend, BLOCK
            )
            base = model.base_logits(hidden)[0]
            bias = [
                model.markov_head.step(prev[k : k + 1], hidden[:, k], None) for k in range(BLOCK)
            ]
            corrected = base + torch.cat([b[0] for b in bias])
            conf = model._confidence(hidden, [b[2] for b in bias])[0]
        assert torch.allclose(base, want_base, atol=1e-4)
        assert torch.allclose(corrected, want_corr, atol=1e-4)
        assert torch.allclose(conf, want_conf, atol=1e-5)


def test_cached_rounds_equal_a_from_scratch_reference(paths, reference) -> None:
    """Rounds of ragged commits through the proposer (context K/V cached in
    the draft pool, read through the window, pages behind it freed and handed
    out again) against the reference run from scratch on the whole context:
    a greedy request's drafts are its argmaxes, a sampled one's distributions
    are its softmaxes, and both requests' confidences match."""
    prop = proposer_for(paths)
    pool, window = prop.block_pool, prop.model.window
    temperature = 0.8
    reqs = [
        Req("greedy", [5] * 7, SamplingParams(temperature=0.0)),
        Req("sampled", [6] * 3, SamplingParams(temperature=temperature, seed=11)),
    ]
    width = reference.num_stages * reference.cfg["hidden_size"]
    g = torch.Generator().manual_seed(1)
    feats = {r.rid: torch.randn(60, width, generator=g) for r in reqs}
    for r in reqs:
        prop.on_target_features(r, 0, feats[r.rid][: r.prompt_len])
        r.output_ids = [40 + len(r.rid)]
    seen: dict[int, set[tuple[str, int]]] = {}  # page -> (request, page index) that held it
    # Committed positions per round: the contexts pass the window (8) within two
    # rounds and end 5 and 6 windows long.
    for rnd, n in enumerate([3, 1, 5, 2, 6, 4, 8, 5]):
        for r in reqs:
            if not r.sampling.greedy:
                r.generator = torch.Generator().manual_seed(100 + rnd)
        got = prop.propose(reqs, [BLOCK, BLOCK])
        for i, r in enumerate(reqs):
            p, anchor, tokens = r.seq_len - 1, r.output_ids[-1], got.tokens[i]
            assert len(tokens) == BLOCK
            prev = torch.tensor([anchor] + tokens[:-1])
            _, logits, conf = reference.block_forward(feats[r.rid][:p], anchor, prev)
            if r.sampling.greedy:
                assert tokens == logits.argmax(-1).tolist(), (rnd, r.rid)
                assert got.q[i] is None
            else:
                want = torch.softmax(logits / temperature, dim=-1)
                torch.testing.assert_close(got.q[i], want, atol=1e-5, rtol=1e-4)
                assert all(float(got.q[i][k, t]) > 0 for k, t in enumerate(tokens))
            torch.testing.assert_close(torch.tensor(got.confidence[i]), conf, atol=1e-5, rtol=0)
            # Only the window keeps pages (it may straddle one more).
            held = [(k, page) for k, page in enumerate(r.draft_state.pages) if page >= 0]
            assert len(held) <= pool.pages_for(window) + 1, (rnd, r.draft_state.pages)
            for k, page in held:
                seen.setdefault(page, set()).add((r.rid, k))
        for r in reqs:  # the anchor and n - 1 drafts are committed; their features arrive
            start = r.seq_len - 1
            prop.on_target_features(r, start, feats[r.rid][start : start + n])
            r.output_ids += torch.randint(4, 500, (n,), generator=g).tolist()
    assert any(len(owners) > 1 for owners in seen.values())  # freed pages were handed out again
    for r in reqs:
        prop.release(r)
    assert pool.free_pages() == pool.total_pages()


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"model_type": "deepseek_v41"}, "DeepSeek-V4.1 .* is not supported"),
        ({"dspark_markov_head_type": "gated"}, "vanilla Markov head only"),
        ({"sample_from_anchor": False}, "sample_from_anchor false is not supported"),
        ({"n_mtp_layers": 7}, "n_mtp_layers 7 must equal the number of dspark_target_layer_ids"),
        ({"dspark_n_routed_experts": 128}, "dspark_n_routed_experts 128: a drafter with other MoE"),
    ],
)
def test_what_other_v4_releases_need_is_named(paths, changes, says) -> None:
    """The published releases' keys this drafter does not implement stop
    the load with the key and the release; those it does pass."""
    import json
    import os

    from specserve.config import ModelConfig
    from specserve.speculative.dspark_v4_model import DSparkV4Config

    with open(os.path.join(paths["drafter"], "config.json")) as f:
        cfg = json.load(f)
    target = ModelConfig.from_path(paths["target"])
    same = {
        "n_mtp_layers": len(cfg["dspark_target_layer_ids"]),
        "dspark_markov_head_type": "vanilla",
    }
    assert (
        DSparkV4Config.from_dict({**cfg, **same}, target, "c.json").num_stages
        == same["n_mtp_layers"]
    )
    with pytest.raises(ValueError, match=says):
        DSparkV4Config.from_dict({**cfg, **changes}, target, "c.json")
