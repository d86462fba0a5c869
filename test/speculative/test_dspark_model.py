"""The DSpark drafter: cached incremental drafting against a from-scratch
forward, the Markov heads against their equations, checkpoint loading."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from models_zoo import model_path
from spec_helpers import assert_rounds_match_scratch, features, proposer_for
from specserve.config import EngineConfig
from specserve.core import Req
from specserve.kernels.dispatch import HAS_TRITON
from specserve.runner.model_runner import ModelRunner
from specserve.sampling.params import SamplingParams
from specserve.speculative.dspark import DSparkProposer
from specserve.tools.tiny_model import make_tiny_dspark

KINDS = ("vanilla", "gated", "rnn")


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    target = model_path("qwen3")
    paths = {
        k: make_tiny_dspark(str(root / k), target, markov_head_type=k, num_layers=2, seed=i)
        for i, k in enumerate(KINDS)
    }
    paths["dflash"] = make_tiny_dspark(
        str(root / "dflash"), target, markov_rank=0, confidence_head=False
    )
    return paths


@pytest.mark.parametrize(
    ("kind", "backend"),
    [*((k, "torch_native") for k in KINDS), ("rnn", "triton")],
)
def test_cached_rounds_equal_a_from_scratch_forward(drafters, kind, backend) -> None:
    """The block read from the draft pool by the paged attention backends
    (``backend``; Triton under the interpreter) against a dense forward."""
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    # A tiny threshold: confidences are computed (and compared) but cut nothing.
    prop, _ = proposer_for(
        drafters[kind], speculative_dspark_confidence_threshold=1e-9, attention_backend=backend
    )
    assert type(prop.attn_backend).__name__.lower().startswith(backend[:5])
    assert_rounds_match_scratch(prop, prop.model)


def test_blocks_fit_beside_a_full_target_pool(drafters) -> None:
    """The worst legal case: every target page taken by running requests whose
    anchor is the last position they hold (no room reserved for drafts near
    their token limit). Each block still gets draft slots past its context."""
    prop, runner = proposer_for(drafters["vanilla"], max_running_requests=32)
    ps, block = runner.page_size, prop.max_drafts
    n = runner.num_pages // 32 * ps  # positions each request holds on the target
    width = prop.model.fc.in_features
    sp = SamplingParams(temperature=0.0)
    reqs = [Req(f"r{i}", [5] * (n - 1), sp) for i in range(32)]
    for i, r in enumerate(reqs):
        prop.on_target_features(r, 0, features(n - 1, width, i))
        r.output_ids = [40]  # the anchor sits at position n - 1
    assert sum(prop.block_pool.pages_for(r.seq_len) for r in reqs) == runner.num_pages
    got = prop.propose(reqs, [block] * 32)
    assert [len(t) for t in got.tokens] == [block] * 32
    for r in reqs:
        prop.release(r)
    assert prop.block_pool.free_pages() == prop.block_pool.total_pages()


def test_markov_heads_follow_their_equations(drafters) -> None:
    """The draft loop against the equations of dspark.md written out here."""
    for kind in KINDS:
        prop, _ = proposer_for(drafters[kind])
        m, mh = prop.model, prop.model.markov_head
        g = torch.Generator().manual_seed(3)
        hidden = torch.randn(1, prop.max_drafts, m.config.hidden_size, generator=g)
        anchor = torch.tensor([9])
        tokens, _, conf = m.draft(hidden, anchor, torch.tensor([0.0]))
        prev, s = 9, torch.zeros(mh.rank)
        for k in range(prop.max_drafts):
            h = hidden[0, k]
            e = mh.markov_w1.weight[prev]
            if kind == "vanilla":
                bias = mh.markov_w2.weight @ e
            elif kind == "gated":
                gate = torch.sigmoid(mh.gate_proj.weight @ torch.cat([h, e]) + mh.gate_proj.bias)
                bias = mh.markov_w2.weight @ (gate * e)
            else:
                z = mh.joint_proj.weight @ torch.cat([s, e, h]) + mh.joint_proj.bias
                gg, cc, oo = z.chunk(3)
                s = torch.sigmoid(gg) * s + (1 - torch.sigmoid(gg)) * torch.tanh(cc)
                bias = mh.markov_w2.weight @ torch.tanh(oo)
            logits = m.lm_head.weight @ h + bias
            expect_conf = torch.sigmoid(
                m.confidence_head.proj.weight @ torch.cat([h, e]) + m.confidence_head.proj.bias
            )
            assert int(tokens[0, k]) == int(logits.argmax())
            assert float(conf[0, k]) == pytest.approx(float(expect_conf), abs=1e-5)
            prev = int(logits.argmax())


def test_a_token_map_drafts_from_its_tokens_alone(drafters, tmp_path) -> None:
    """Greedy drafts are the argmax of the full-vocabulary logits (the
    equations above) over the map's tokens; sampled drafts come from a
    distribution that is zero off them."""
    hot = torch.arange(7, 528, 5)
    torch.save(hot.flip(0).tolist(), tmp_path / "map.pt")  # any order; read back ascending
    prop, _ = proposer_for(drafters["vanilla"], speculative_token_map=str(tmp_path / "map.pt"))
    m, mh = prop.model, prop.model.markov_head
    assert torch.equal(m.hot_ids, hot)
    hidden = torch.randn(
        3, prop.max_drafts, m.config.hidden_size, generator=torch.Generator().manual_seed(4)
    )
    anchors = torch.tensor([9, 12, 40])
    tokens, _, _ = m.draft(hidden, anchors, torch.zeros(3))
    off = torch.ones(m.config.vocab_size, dtype=torch.bool)
    off[hot] = False
    for i in range(3):
        prev = int(anchors[i])
        for k in range(prop.max_drafts):
            logits = (
                m.lm_head.weight @ hidden[i, k] + mh.markov_w2.weight @ mh.markov_w1.weight[prev]
            )
            prev = int(logits.masked_fill(off, float("-inf")).argmax())
            assert int(tokens[i, k]) == prev
    temps = [1.0, 0.0, 0.7]
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    tokens, q, _ = m.draft(hidden, anchors, torch.tensor(temps), gens)
    assert q is not None and q.shape == (3, prop.max_drafts, m.config.vocab_size)
    assert bool(torch.isin(tokens, hot).all())
    for i in range(3):  # q: the softmax over the map's tokens that each draft was drawn from
        prev = int(anchors[i])
        for k in range(prop.max_drafts):
            logits = (
                m.lm_head.weight @ hidden[i, k] + mh.markov_w2.weight @ mh.markov_w1.weight[prev]
            )
            expect = torch.zeros(m.config.vocab_size)
            if temps[i] == 0:
                expect[int(tokens[i, k])] = 1.0
            else:
                expect[hot] = torch.softmax(logits[hot] / temps[i], dim=-1)
            torch.testing.assert_close(q[i, k], expect, atol=1e-5, rtol=0)
            prev = int(tokens[i, k])


def test_token_map_errors(drafters, tmp_path) -> None:
    (tmp_path / "floats.json").write_text("[1.5, 2.0]")
    (tmp_path / "empty.json").write_text("[]")
    (tmp_path / "big.json").write_text("[1, 100000]")
    (tmp_path / "junk.pt").write_text("not a tensor")
    cases = [
        ("missing.pt", "cannot read"),
        ("junk.pt", "cannot read"),
        ("floats.json", "non-empty 1-D list of token ids"),
        ("empty.json", "non-empty 1-D list of token ids"),
        ("big.json", "must be in \\[0, 528\\)"),
    ]
    for name, match in cases:
        with pytest.raises(ValueError, match="speculative_token_map: .*" + match):
            proposer_for(drafters["vanilla"], speculative_token_map=str(tmp_path / name))
    with pytest.raises(ValueError, match="speculative_token_map: only DSPARK and DFLASH"):
        EngineConfig.from_kwargs(
            model_path("qwen3"), speculative_algorithm="NGRAM", speculative_token_map="m.pt"
        )


def test_dflash_ignores_the_markov_and_confidence_heads(drafters) -> None:
    for path in (drafters["dflash"], drafters["vanilla"]):
        cfg = EngineConfig.from_kwargs(
            model_path("qwen3"),
            device="cpu",
            max_total_tokens=256,
            speculative_algorithm="DFLASH",
            speculative_draft_model_path=path,
        )
        prop = DSparkProposer.from_config(cfg, ModelRunner(cfg))
        hidden = torch.randn(2, prop.max_drafts, prop.model.config.hidden_size)
        tokens, _, conf = prop.model.draft(hidden, torch.tensor([1, 2]), torch.zeros(2))
        assert conf is None
        assert torch.equal(tokens, F.linear(hidden, prop.model.lm_head.weight).argmax(-1))


def test_checkpoint_round_trip_and_shared_embedding(drafters) -> None:
    from safetensors.torch import load_file

    prop, runner = proposer_for(drafters["gated"])
    saved = load_file(os.path.join(drafters["gated"], "model.safetensors"))
    state = prop.model.state_dict()
    for key, value in saved.items():
        assert torch.equal(state[key], value), key
    assert prop.model.embed_tokens is runner.model.model.embed_tokens
    assert prop.model.lm_head is runner.model.lm_head


def edited(src: str, dst: str, **changes) -> str:
    import shutil

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def test_startup_errors(drafters, tmp_path) -> None:
    from specserve import Engine

    path = drafters["vanilla"]
    cases = [
        (
            dict(speculative_num_draft_tokens=4, speculative_dspark_block_size=4),
            "speculative_num_draft_tokens \\(4\\) must be speculative_dspark_block_size \\+ 1 = 5",
        ),
        (dict(speculative_num_draft_tokens=10), "exceeds the drafter's block size"),
        (dict(speculative_dspark_block_size=9), "exceeds the drafter's block size"),
        (
            dict(
                speculative_draft_model_path=edited(path, str(tmp_path / "a"), num_target_layers=5)
            ),
            "5-layer target",
        ),
        (
            dict(
                speculative_draft_model_path=edited(path, str(tmp_path / "b"), target_layer_ids=[2])
            ),
            "target_layer_ids",
        ),
        (
            dict(
                speculative_draft_model_path=edited(path, str(tmp_path / "c"), architectures=["X"])
            ),
            "Qwen3DSparkModel",
        ),
        (dict(speculative_draft_model_path=None), "speculative_draft_model_path is required"),
    ]
    for extra, message in cases:
        kwargs = dict(
            speculative_algorithm="DSPARK",
            speculative_draft_model_path=path,
            device="cpu",
            max_total_tokens=256,
        )
        kwargs.update(extra)
        with pytest.raises(ValueError, match=message):
            Engine(model_path=model_path("qwen3"), **kwargs)


@pytest.mark.parametrize("kind", ["vanilla", "rnn"])
def test_training_forward_equals_the_inference_path(drafters, kind) -> None:
    """Many anchors of whole sequences at once (training) give each block what a
    from-scratch inference forward gives, and the teacher-forced logits equal
    the draft loop's when the drafts are fed back as the previous tokens."""
    prop, _ = proposer_for(drafters[kind], speculative_dspark_confidence_threshold=1e-9)
    m = prop.model
    g = torch.Generator().manual_seed(9)
    b, t, block = 2, 12, prop.max_drafts
    feats = torch.randn(b, t, m.fc.in_features, generator=g)
    ids = torch.randint(4, 500, (b, t), generator=g)
    anchors = torch.tensor([[0, 5, 11], [3, 4, 9]])
    with torch.no_grad():
        hidden = m.train_hidden(feats, ids, anchors, block)
        for i in range(b):
            for j in range(anchors.shape[1]):
                pos = int(anchors[i, j])
                ref = m.naive_block(feats[i, :pos], int(ids[i, pos]), block)
                torch.testing.assert_close(hidden[i, j], ref, atol=1e-5, rtol=0)
        tokens, probs, conf = m.draft(hidden[0], ids[0, anchors[0]], torch.zeros(3))
        prev = torch.cat([ids[0, anchors[0]][:, None], tokens[:, :-1]], dim=1)
        logits, tconf = m.train_logits(hidden[0], prev)
        assert torch.equal(logits.argmax(-1), tokens)
        torch.testing.assert_close(tconf, conf, atol=1e-6, rtol=0)


def test_the_chain_length_flag_sets_the_block(drafters) -> None:
    prop, _ = proposer_for(drafters["vanilla"], speculative_num_draft_tokens=3)
    assert prop.max_drafts == 2  # the anchor plus two drafts
    prop, _ = proposer_for(drafters["vanilla"])
    assert prop.max_drafts == prop.model.config.block_size
