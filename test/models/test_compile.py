"""``enable_torch_compile``: the layers' dense parts compiled give what eager
gives (ids and logprobs) on the CPU: prefill chunks, decode rows and (n-gram)
verify chains."""

from __future__ import annotations

import pytest

from models_zoo import model_path, random_prompts
from specserve.models.decoder import before_attention


def test_compiled_layers_equal_eager() -> None:
    from specserve import Engine

    prompts = random_prompts(3, [7, 12, 5], seed=61)
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    results = {}
    for compiled in (False, True):
        eng = Engine(
            model_path=model_path("qwen3"),
            device="cpu",
            max_total_tokens=256,
            enable_torch_compile=compiled,
            speculative_algorithm="NGRAM",
        )
        try:
            assert (eng.runner.model._before is before_attention) != compiled
            results[compiled] = eng.generate(
                input_ids=prompts, sampling_params=sp, return_logprob=True, logprob_start_len=0
            )
        finally:
            eng.shutdown()
    for a, b in zip(results[False], results[True]):
        assert a["output_ids"] == b["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            la = [x[0] for x in a["meta_info"][key] if x[0] is not None]
            lb = [x[0] for x in b["meta_info"][key] if x[0] is not None]
            assert la == pytest.approx(lb, abs=1e-4)
