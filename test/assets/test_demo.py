"""The bundled demo model: it loads through the real loader, and DSpark on it
is lossless and actually accepts drafts."""

from __future__ import annotations

import json
import os

import pytest

from models_zoo import greedy_with_logprobs, hf_sequence_logprobs
from specserve import Engine
from specserve.assets import DEMO_ROOT, demo_path

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(DEMO_ROOT, "target", "config.json")),
    reason="demo assets not built",
)

PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n",
    "    for i, item in enumerate(items):\n        if item is None:\n",
]


def test_assets_are_small_and_described() -> None:
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(DEMO_ROOT) for f in fs)
    assert total <= 30 * 2**20
    with open(os.path.join(DEMO_ROOT, "manifest.json")) as f:
        manifest = json.load(f)
    assert {"tokenizer", "target", "dspark", "dflash", "evaluate"} <= set(manifest["stages"])


def test_demo_target_matches_transformers() -> None:
    """The float16 checkpoint through our loader and model gives transformers' logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    eng = Engine(
        model_path=demo_path("target"), device="cpu", dtype="float32", max_total_tokens=1024
    )
    try:
        ids = eng.tokenizer.encode(PROMPTS[1], add_special_tokens=False)
        output, got = greedy_with_logprobs(eng, ids, 8)
    finally:
        eng.shutdown()
    ref = AutoModelForCausalLM.from_pretrained(demo_path("target"), dtype=torch.float32).eval()
    want, logp = hf_sequence_logprobs(ref, ids + output)
    assert got == pytest.approx(want, abs=2e-3)
    assert output == logp[len(ids) - 1 :].argmax(-1).tolist()[: len(output)]


@pytest.mark.parametrize("alg", ["DSPARK", "DFLASH"])
def test_demo_speculation_is_lossless_and_accepts(alg) -> None:
    sp = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    plain = Engine(model_path=demo_path("target"), device="cpu", max_total_tokens=2048)
    try:
        want = plain.generate(PROMPTS, sp)
    finally:
        plain.shutdown()
    spec = Engine(
        model_path=demo_path("target"), device="cpu", max_total_tokens=2048,
        speculative_algorithm=alg, speculative_draft_model_path=demo_path(alg.lower()),
    )  # fmt: skip
    try:
        got = spec.generate(PROMPTS, sp)
        assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
        # A trained drafter: measured 4.27 (DSPARK) and 3.20 (DFLASH) tokens a round.
        low, high = {"DSPARK": (3.8, 4.7), "DFLASH": (2.85, 3.55)}[alg]
        assert low <= spec.stats()["spec_accept_length"] <= high
    finally:
        spec.shutdown()
