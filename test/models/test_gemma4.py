"""Gemma 4 on the paged engine against transformers' Gemma 4 on the same
checkpoint: the dense model (k = v on its global layers), the MoE model
and the multimodal checkpoint's language model. Every tiny model has
sliding layers with a window of 8 and global layers with twice the head
size, so the prompts and outputs here cross the window many times."""

from __future__ import annotations

import json
import os

import pytest
import torch

from models_zoo import check_greedy, greedy_runs, random_prompts
from specserve import Engine
from specserve.config import ModelConfig
from specserve.models.gemma4 import Gemma4ForCausalLM
from specserve.models.loader import load_model
from specserve.tools.tiny_model import make_tiny_model

TOL = 1e-4
PAGE = 4
VARIANTS = ("gemma4", "gemma4_moe", "gemma4_multimodal")


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gemma4")
    return {
        arch: make_tiny_model(str(root / arch), arch=arch, num_layers=4, seed=i)
        for i, arch in enumerate(VARIANTS)
    }


@pytest.fixture(scope="module")
def references(paths) -> dict:
    from transformers import AutoModelForCausalLM, Gemma4ForConditionalGeneration

    out = {}
    for arch, path in paths.items():
        cls = (
            Gemma4ForConditionalGeneration if arch == "gemma4_multimodal" else AutoModelForCausalLM
        )
        out[arch] = cls.from_pretrained(path, dtype=torch.float32).eval()
    return out


def engine(path: str, **kw) -> Engine:
    args = dict(dtype="float32", page_size=PAGE, max_running_requests=4, chunked_prefill_size=16)
    return Engine(model_path=path, **{**args, **kw})


@pytest.mark.parametrize("arch", VARIANTS)
def test_ragged_batch_in_chunks_past_the_window(paths, references, arch) -> None:
    """Prompts of 1 to 37 tokens prefilled in 16-token chunks beside each
    other's decodes, then 40 tokens each: five windows past the first."""
    prompts = random_prompts(4, [1, 9, 23, 37], seed=3)
    for prompt, (ids, lps) in zip(prompts, greedy_runs(engine(paths[arch]), prompts, 40)):
        assert len(ids) == 40
        check_greedy(references[arch], prompt, ids, lps, TOL)


def test_preemption_and_recompute(paths, references) -> None:
    prompts = random_prompts(4, [20, 31], seed=7)
    eng = engine(paths["gemma4"], max_total_tokens=120)
    results = greedy_runs(eng, prompts, 40)
    assert eng.core.scheduler.num_preemptions > 0
    for prompt, (ids, lps) in zip(prompts, results):
        check_greedy(references["gemma4"], prompt, ids, lps, TOL)


def test_ngram_speculation_equals_plain(paths) -> None:
    """Verify chains over sliding layers, drafts rejected and their K/V
    overwritten: NGRAM's output is plain output, ids and logprobs."""
    prompts = [p * 4 for p in random_prompts(3, [5, 7, 9], seed=11)]
    plain = greedy_runs(engine(paths["gemma4_moe"]), prompts, 30)
    spec_eng = engine(
        paths["gemma4_moe"], speculative_algorithm="NGRAM", speculative_num_draft_tokens=4
    )
    spec = greedy_runs(spec_eng, prompts, 30)
    assert spec_eng.core.spec.stats.rounds > 0
    for (a_ids, a_lps), (b_ids, b_lps) in zip(plain, spec):
        assert a_ids == b_ids
        assert max(abs(x - y) for x, y in zip(a_lps, b_lps)) < 1e-5


def edit_config(path: str, edit) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    edit(cfg.get("text_config", cfg))
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def test_published_config_spelling_reads_the_same(paths, tmp_path) -> None:
    """The releases spell the global layers' shape ``global_head_dim`` /
    ``num_global_key_value_heads``; transformers writes ``per_layer_config``."""
    import shutil

    path = shutil.copytree(paths["gemma4"], str(tmp_path / "published"))
    written = ModelConfig.from_path(path)

    def published(cfg: dict) -> None:
        cfg.pop("per_layer_config")
        cfg.update(global_head_dim=2 * cfg["head_dim"], num_global_key_value_heads=1)

    edit_config(path, published)
    assert ModelConfig.from_path(path) == written
    g4 = written.gemma4
    assert g4 is not None and g4.head_dims == (16, 32, 16, 32) and g4.kv_heads == (2, 1, 2, 1)
    model = load_model(path, ModelConfig.from_path(path), torch.float32, "cpu")
    assert isinstance(model, Gemma4ForCausalLM)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size_per_layer_input", 256, "per-layer input embeddings"),
        ("num_kv_shared_layers", 2, "reuse another layer's KV"),
        ("use_bidirectional_attention", "all", "use_bidirectional_attention"),
    ],
)
def test_what_the_small_releases_add_is_a_named_error(paths, tmp_path, field, value, message):
    import shutil

    path = shutil.copytree(paths["gemma4_multimodal"], str(tmp_path / field))
    edit_config(path, lambda cfg: cfg.update({field: value}))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_path(path)
