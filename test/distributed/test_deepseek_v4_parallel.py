"""DeepSeek-V4 over 2 gloo ranks against one: query heads and output groups
split, the K=V head, compressors and indexer replicated, experts split by
intermediate features (``ep_size`` 1) or whole (``ep_size`` 2, hash and
learned routing), embedding and head by vocabulary; greedy ids equal and
logprobs within 1e-5 for plain decoding, the bundled DSpark drafter and
NGRAM, on prompts long enough for every attention kind (window 8,
compression 4 and 16) and chunked prefill."""

from __future__ import annotations

import pytest

from models_zoo import random_prompts
from spec_helpers import record_drafts as _record_drafts
from spec_helpers import v4_checkpoints
from specserve import Engine

PROMPTS = random_prompts(3, [70, 9, 33], seed=5) + [[5, 6, 7, 8] * 10]


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return v4_checkpoints(str(tmp_path_factory.mktemp("v4-tp")), block=4)


def _run(eng: Engine) -> list[dict]:
    return eng.generate(
        input_ids=PROMPTS,
        sampling_params={"temperature": 0, "max_new_tokens": 14, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
    )


def _assert_same(want: list[dict], got: list[dict]) -> None:
    for a, b in zip(want, got):
        assert a["output_ids"] == b["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            for x, y in zip(a["meta_info"][key], b["meta_info"][key]):
                assert (x[0] is None and y[0] is None) or x[0] == pytest.approx(y[0], abs=1e-5)
        for ra, rb in zip(
            a["meta_info"]["output_top_logprobs"], b["meta_info"]["output_top_logprobs"]
        ):
            assert [e[1] for e in ra] == [e[1] for e in rb]


SPECS = {
    "plain": lambda v: ("target", {}),
    "dspark-bundle": lambda v: ("bundle", {"speculative_algorithm": "DSPARK"}),
    # The drafter on rank 0 alone (the CPU's default), with whole copies.
    "dspark-bundle-rank0": lambda v: ("bundle", {"speculative_algorithm": "DSPARK"}),
    "ngram": lambda v: ("target", {"speculative_algorithm": "NGRAM"}),
}


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("spec", list(SPECS))
def test_v4_tp2_equals_tp1(v4, spec, ep) -> None:
    if spec in ("ngram", "dspark-bundle-rank0") and ep == 1:
        pytest.skip("one run covers it: the proposer never touches the shards")
    which, kw = SPECS[spec](v4)
    kw = dict(device="cpu", max_total_tokens=4096, chunked_prefill_size=16, **kw)
    with Engine(model_path=v4[which], **kw) as one:
        want_drafts = _record_drafts(one)
        want = _run(one)
    split = {"speculative_draft_tensor_parallel_size": 2} if spec == "dspark-bundle" else {}
    with Engine(model_path=v4[which], tp_size=2, ep_size=ep, **kw, **split) as two:
        got_drafts = _record_drafts(two)
        got = _run(two)
        assert two.free_pages() == two.total_pages()
        experts = two.runner.model.layers[-1].ffn.experts
        assert experts.w13.shape[0] == (2 if ep == 2 else 4)  # of 4
        if spec == "dspark-bundle":  # the drafter is split like the target
            drafter = two.proposer.model
            assert drafter.head is two.runner.model.head
            assert drafter.stages[0].attn.heads == two.runner.model.layers[0].attn.heads
            assert drafter.stages[0].ffn.experts.w13.shape[0] == (2 if ep == 2 else 4)
        if spec == "dspark-bundle-rank0":  # whole: its head and experts
            assert two.proposer.model.head.weight.shape[0] == two.runner.vocab_size
            assert two.proposer.model.stages[0].ffn.experts.w13.shape[0] == 4
    _assert_same(want, got)
    if spec != "plain":
        assert got[0]["meta_info"]["spec_verify_ct"] > 0
        # Every round's drafts are one device's (its windowed context was
        # stored by the target's forwards on both ranks).
        assert got_drafts == want_drafts


def test_fp8_v4_shards(v4, tmp_path) -> None:
    """An FP8 block-scaled V4 split over 2 ranks: each rank's slices are the
    dequantised checkpoint's (the block scales follow the slice), and it
    serves as one rank does."""
    import torch

    from models_zoo import fp8_v4_copy
    from specserve.config import ModelConfig
    from specserve.distributed import RankGroup
    from specserve.models.loader import load_model

    fp8 = str(tmp_path / "fp8")
    full = fp8_v4_copy(v4["target"], fp8, str(tmp_path / "dequantised"))
    cfg = ModelConfig.from_path(fp8)
    model = load_model(fp8, cfg, torch.float32, "cpu", 64, RankGroup(1, 2))
    attn, experts = model.layers[1].attn, model.layers[1].ffn.experts
    wq_b = full["model.layers.1.attn.wq_b.weight"]
    assert torch.equal(attn.wq_b.weight, wq_b[wq_b.shape[0] // 2 :])
    w2 = full["model.layers.1.ffn.experts.3.w2.weight"]  # [d, I]: columns split
    assert torch.equal(experts.w2[3], w2[:, w2.shape[1] // 2 :])
    kw = dict(device="cpu", max_total_tokens=4096, chunked_prefill_size=16)
    with Engine(model_path=fp8, **kw) as one:
        want = _run(one)
    with Engine(model_path=fp8, tp_size=2, **kw) as two:
        got = _run(two)
    _assert_same(want, got)
