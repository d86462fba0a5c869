"""Tensor parallelism over NCCL (2 CUDA devices) against one device: greedy
ids equal, logprobs within bf16-free float32 rounding. Skipped, saying why,
on a machine with fewer than 2 devices (benchmark/gpu_check.sh's ``gpu``
stage runs it)."""

from __future__ import annotations

import pytest
import torch

from models_zoo import model_path, random_prompts
from specserve import Engine

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for TP=2")
def test_nccl_tp2_equals_one_device() -> None:
    prompts = random_prompts(4, [5, 30, 12, 64], seed=2)
    kw = dict(device="cuda", dtype="float32", max_total_tokens=4096, grammar_backend="none")
    args = dict(
        input_ids=prompts,
        sampling_params={"temperature": 0, "max_new_tokens": 16, "ignore_eos": True},
        return_logprob=True,
        top_logprobs_num=3,
    )
    with Engine(model_path=model_path("qwen3"), **kw) as one:
        want = one.generate(**args)
    with Engine(model_path=model_path("qwen3"), tp_size=2, **kw) as two:
        got = two.generate(**args)
    for a, b in zip(want, got):
        assert a["output_ids"] == b["output_ids"]
        la = [e[0] for e in a["meta_info"]["output_token_logprobs"]]
        lb = [e[0] for e in b["meta_info"]["output_token_logprobs"]]
        assert la == pytest.approx(lb, abs=1e-4)
