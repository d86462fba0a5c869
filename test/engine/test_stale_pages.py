"""What a page held before cannot reach a request that now reads it: with
every K/V slot of every pool (the target's, DeepSeek-V4's windows and
compressed entries, the DSpark drafter's) set to NaN, as a request whose
model went NaN leaves its freed pages, a batch of requests generates exactly
what it generates over clean pools. The batched attention reads whole pages
(the tail of a request's last page, and padding pages, belong to others),
and a masked NaN still poisons attention unless it is never read as one."""

from __future__ import annotations

import pytest
import torch

from models_zoo import model_path, random_prompts
from specserve import Engine
from specserve.tools.tiny_model import make_tiny_dspark, make_tiny_dspark_v4, make_tiny_model

# Different lengths, so the batch's page tables are ragged (padded) and its
# tails fall at different offsets.
PROMPTS = random_prompts(3, [5, 11, 18], seed=9)
SAMPLING = {"temperature": 0, "max_new_tokens": 9, "ignore_eos": True}


def tensors(obj) -> list[torch.Tensor]:
    """Every tensor an object holds, through lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in tensors(x)]
    if hasattr(obj, "__dict__"):
        return [t for x in vars(obj).values() for t in tensors(x)]
    return []


def poison_pools(eng: Engine) -> int:
    """NaN into every floating slot of every KV pool; how many tensors."""
    pools = [eng.runner.kv_pool]
    drafter_pool = getattr(eng.proposer, "kv_pool", None)
    if drafter_pool is not None:
        pools.append(drafter_pool)
    filled = [t for pool in pools for t in tensors(pool) if t.is_floating_point()]
    for t in filled:
        t.fill_(float("nan"))
    return len(filled)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("stale")
    qwen = model_path("qwen3")
    v4 = make_tiny_model(str(root / "v4"), arch="deepseek_v4", num_layers=5)
    return {
        "qwen3": qwen,
        "dspark": make_tiny_dspark(str(root / "dspark"), qwen, block_size=4, seed=2),
        "v4": v4,
        "v4-bundle": make_tiny_dspark_v4(
            str(root / "v4-bundle"), v4, block_size=4, seed=1, bundle=True
        ),
    }


CASES = {
    "qwen3": ("qwen3", {}),
    "qwen3-dspark": ("qwen3", {"speculative_algorithm": "DSPARK", "draft": "dspark"}),
    "v4": ("v4", {}),
    "v4-dspark": ("v4-bundle", {"speculative_algorithm": "DSPARK"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_nan_left_in_every_pool_reaches_no_request(paths, case) -> None:
    target, kw = CASES[case]
    kw = dict(kw)
    if "draft" in kw:
        kw["speculative_draft_model_path"] = paths[kw.pop("draft")]
    eng = Engine(
        model_path=paths[target],
        device="cpu",
        dtype="float32",
        page_size=4,
        max_total_tokens=1024,
        attention_backend="torch_native",
        **kw,
    )
    try:
        clean = eng.generate(input_ids=PROMPTS, sampling_params=SAMPLING, return_logprob=True)
        assert poison_pools(eng) >= 2
        stale = eng.generate(input_ids=PROMPTS, sampling_params=SAMPLING, return_logprob=True)
        assert len(stale) == len(clean) == len(PROMPTS)
        for got, want in zip(stale, clean):
            assert got["meta_info"]["finish_reason"]["type"] == "length", got["meta_info"]
            assert got["output_ids"] == want["output_ids"]
            assert (
                got["meta_info"]["output_token_logprobs"]
                == want["meta_info"]["output_token_logprobs"]
            )
        assert eng.free_pages() == eng.total_pages()
    finally:
        eng.shutdown()
