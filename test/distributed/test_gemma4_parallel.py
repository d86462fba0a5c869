"""Gemma 4 over 2 gloo ranks against one: each layer's heads split by its
own shape (the sliding layers' 2 KV heads one per rank, the global
layers' one KV head on both), the MLP by intermediate features, experts
whole (``ep_size`` 2), embedding and head by vocabulary; greedy ids equal
and logprobs within 1e-5, past the window and in chunks."""

from __future__ import annotations

import pytest

from models_zoo import random_prompts
from specserve import Engine
from specserve.tools.tiny_model import make_tiny_model

PROMPTS = random_prompts(3, [30, 9, 21], seed=5)


def _run(eng: Engine) -> list[dict]:
    return eng.generate(
        input_ids=PROMPTS,
        sampling_params={"temperature": 0, "max_new_tokens": 14, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=0,
    )


@pytest.mark.parametrize(("arch", "ep"), [("gemma4", 1), ("gemma4_moe", 2)])
def test_gemma4_tp2_equals_tp1(tmp_path, arch, ep) -> None:
    path = make_tiny_model(str(tmp_path / arch), arch=arch, num_layers=4)
    kw = dict(device="cpu", max_total_tokens=1024, chunked_prefill_size=16)
    with Engine(model_path=path, **kw) as one:
        want = _run(one)
    with Engine(model_path=path, tp_size=2, ep_size=ep, **kw) as two:
        got = _run(two)
        attn = [layer.self_attn for layer in two.runner.model.model.layers]
        assert [(a.num_heads, a.num_kv_heads) for a in attn] == [(2, 1)] * 4
    for a, b in zip(want, got):
        assert a["output_ids"] == b["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            for x, y in zip(a["meta_info"][key], b["meta_info"][key]):
                assert (x[0] is None and y[0] is None) or x[0] == pytest.approx(y[0], abs=1e-5)


def test_experts_split_only_whole(tmp_path) -> None:
    path = make_tiny_model(str(tmp_path / "moe"), arch="gemma4_moe", num_layers=2)
    with pytest.raises(ValueError, match="ep-size"):
        Engine(model_path=path, device="cpu", tp_size=2, max_total_tokens=256)
