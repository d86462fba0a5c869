"""Gemma 4's DSpark drafter (DeepSpec's ``Gemma4DSparkModel``, and the
speculators export of the same weights, both slot layouts) on a Gemma 4
target: its blocks against a reference written here from transformers'
Gemma 4 pieces, cached rounds against from-scratch blocks on both
attention backends, and DSPARK serving exactly what plain decoding serves."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from models_zoo import random_prompts
from spec_helpers import (
    SMALL_SCHEMA,
    assert_rounds_match_scratch,
    assert_same_rounds,
    draft_rounds,
    features,
    proposer_for,
)
from specserve import Engine
from specserve.kernels.dispatch import HAS_TRITON
from specserve.speculative.drafter_formats import read_drafter
from specserve.tools.drafter_layouts import write_deepspec, write_speculators
from specserve.tools.tiny_model import make_tiny_dspark, make_tiny_model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4-dspark")
    target = make_tiny_model(str(root / "target"), arch="gemma4", num_layers=4, seed=3)
    drafter = make_tiny_dspark(
        str(root / "deepspec"), target, markov_head_type="gated", num_layers=2,
        target_layer_ids=(0, 1, 2), seed=4,
    )  # fmt: skip
    return {
        "target": target,
        "deepspec": drafter,
        "speculators": write_speculators(drafter, str(root / "sp"), verifier="google/gemma-4"),
        "speculators-anchor-false": write_speculators(
            drafter, str(root / "sp2"), sample_from_anchor=False
        ),
        # bf16 weights, as the releases ship them.
        "deepspec-bf16": write_deepspec(drafter, str(root / "ds-bf16"), dtype=torch.bfloat16),
        "speculators-bf16": write_speculators(drafter, str(root / "sp-bf16"), dtype=torch.bfloat16),
    }


def test_the_config_is_gemma4s_global_layer(gemma) -> None:
    cfg = read_drafter(gemma["deepspec"]).config
    # The tiny target's global layers: 1 KV head of 32, keys as values.
    assert cfg.gemma4 and cfg.keys_are_values and (cfg.num_key_value_heads, cfg.head_dim) == (1, 32)
    assert cfg.logit_softcap == 30.0 and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.rope.rope_type == "proportional"
    sp = read_drafter(gemma["speculators"]).config
    assert sp == dataclasses.replace(cfg, num_target_layers=None)  # (not recorded there)


@torch.no_grad()
def reference_block(path: str, feats: torch.Tensor, anchor: int, block: int) -> torch.Tensor:
    """The final-normed block ``[block, d]`` over context features ``[p, m * d]``,
    written from the drafter's description with transformers' Gemma 4 RMSNorm,
    rotary embedding and rotation: the fused context joins every layer's
    keys and values; the block ``[anchor, mask...]`` at positions p.. sees
    the context and itself, unmasked, at scale 1."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import (
        Gemma4RMSNorm,
        Gemma4TextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    w = load_file(os.path.join(path, "model.safetensors"))
    d, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
    heads, hd, kv = (
        cfg["num_attention_heads"],
        cfg["global_head_dim"],
        cfg["num_global_key_value_heads"],
    )

    def norm(x, weight=None):
        n = Gemma4RMSNorm(x.shape[-1], eps, with_scale=weight is not None)
        if weight is not None:
            n.weight.copy_(weight)
        return n(x)

    def lin(x, name):
        return x @ w[name].T

    p = feats.shape[0]
    ctx = norm(lin(feats, "fc.weight"), w["hidden_norm.weight"])  # [p, d]
    ids = torch.tensor([anchor] + [cfg["mask_token_id"]] * (block - 1))
    x = w["embed_tokens.weight"][ids] * math.sqrt(d)  # [G, d]
    rope_cfg = Gemma4TextConfig(
        hidden_size=d, num_attention_heads=heads, head_dim=16, global_head_dim=hd,
        num_hidden_layers=1, layer_types=["full_attention"], rope_parameters=cfg["rope_parameters"],
        attention_k_eq_v=True, num_global_key_value_heads=kv,
    )  # fmt: skip
    positions = torch.arange(p + block)[None]
    cos, sin = Gemma4TextRotaryEmbedding(rope_cfg)(x, positions, "full_attention")
    for i in range(cfg["num_hidden_layers"]):
        pre = f"layers.{i}."
        h = norm(x, w[pre + "input_layernorm.weight"])
        q = lin(h, pre + "self_attn.q_proj.weight").view(1, block, heads, hd)
        q = apply_rotary_pos_emb(
            norm(q, w[pre + "self_attn.q_norm.weight"]), cos[:, p:], sin[:, p:], 2
        )
        k = lin(torch.cat([ctx, h]), pre + "self_attn.k_proj.weight").view(1, p + block, kv, hd)
        v = norm(k)  # keys as values, normed without a weight
        k = apply_rotary_pos_emb(norm(k, w[pre + "self_attn.k_norm.weight"]), cos, sin, 2)
        k, v = (t.transpose(1, 2).repeat_interleave(heads // kv, dim=1) for t in (k, v))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, scale=1.0)  # [1, H, G, hd]
        o = lin(o.transpose(1, 2).reshape(block, heads * hd), pre + "self_attn.o_proj.weight")
        x = x + norm(o, w[pre + "post_attention_layernorm.weight"])
        m = norm(x, w[pre + "pre_feedforward_layernorm.weight"])
        gate = F.gelu(lin(m, pre + "mlp.gate_proj.weight"), approximate="tanh")
        m = lin(gate * lin(m, pre + "mlp.up_proj.weight"), pre + "mlp.down_proj.weight")
        x = (x + norm(m, w[pre + "post_feedforward_layernorm.weight"])) * w[pre + "layer_scalar"]
    return norm(x, w["norm.weight"])


def test_blocks_equal_the_reference(gemma) -> None:
    prop, runner = proposer_for(gemma["deepspec"], target=gemma["target"])
    model = prop.model
    feats = features(11, model.fc.in_features, 7)
    for anchor, block in [(40, 4), (41, 3)]:
        got = model.naive_block(feats, anchor, block)
        want = reference_block(gemma["deepspec"], feats, anchor, block)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # The logits are the target's (shared head), soft-capped as the target's are.
    assert model.vocab_head is runner.model.lm_head and model.vocab_head.softcap == 30.0


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_cached_rounds_equal_a_from_scratch_forward(gemma, backend) -> None:
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    prop, _ = proposer_for(
        gemma["deepspec"], target=gemma["target"], attention_backend=backend,
        speculative_dspark_confidence_threshold=1e-9,
    )  # fmt: skip
    assert_rounds_match_scratch(prop, prop.model)


def test_the_speculators_export_drafts_the_same(gemma) -> None:
    for base, export in [("deepspec", "speculators"), ("deepspec-bf16", "speculators-bf16")]:
        want = draft_rounds(gemma[base], target=gemma["target"])
        assert_same_rounds(want, draft_rounds(gemma[export], target=gemma["target"]))
    prop, _ = proposer_for(
        gemma["speculators-anchor-false"], target=gemma["target"],
        speculative_dspark_confidence_threshold=1e-9,
    )  # fmt: skip
    assert (prop.max_drafts, prop.block_len) == (3, 4)
    model = proposer_for(gemma["deepspec"], target=gemma["target"])[0].model
    assert_rounds_match_scratch(prop, model, lead=1)


def _serve(eng: Engine, prompts: list[list[int]]) -> dict[str, list[dict]]:
    common = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    return {
        "greedy": eng.generate(input_ids=prompts, sampling_params=greedy, **common),
        "sampled": eng.generate(
            input_ids=prompts,
            sampling_params=[
                {"temperature": 0.9, "seed": 20 + i, "max_new_tokens": 24, "ignore_eos": True}
                for i in range(len(prompts))
            ],
            **common,
        ),
        "grammar": eng.generate(
            input_ids=prompts[:1],
            sampling_params={"temperature": 0, "max_new_tokens": 40, "json_schema": SMALL_SCHEMA},
        ),
    }


def _close(want: list, got: list) -> None:
    for x, y in zip(want, got, strict=True):
        assert (x[0] is None and y[0] is None) or abs(x[0] - y[0]) < 1e-5


@pytest.mark.parametrize("drafter", ["deepspec", "speculators-anchor-false"])
def test_dspark_serves_what_plain_decoding_serves(gemma, drafter) -> None:
    """Past the target's window of 8: greedy ids and logprobs as plain's;
    seeded samples whose logprobs are the plain target's of the same
    sequence; a JSON grammar's output as plain's."""
    pytest.importorskip("xgrammar")
    prompts = [p * 3 for p in random_prompts(3, [4, 6, 9], seed=13)]
    kw = dict(model_path=gemma["target"], device="cpu", max_total_tokens=2048, page_size=4)
    with Engine(
        **kw, speculative_algorithm="DSPARK", speculative_draft_model_path=gemma[drafter]
    ) as eng:
        spec = _serve(eng, prompts)
    with Engine(**kw) as eng:
        plain = _serve(eng, prompts)
        sampled = [p + o["output_ids"] for p, o in zip(prompts, spec["sampled"])]
        scored = eng.generate(
            input_ids=sampled,
            sampling_params={"max_new_tokens": 1},
            return_logprob=True,
            logprob_start_len=0,
        )
    for mode in ("greedy", "grammar"):
        assert [o["output_ids"] for o in spec[mode]] == [o["output_ids"] for o in plain[mode]]
    for a, b in zip(plain["greedy"], spec["greedy"]):
        assert b["meta_info"]["spec_verify_ct"] > 0
        for key in ("input_token_logprobs", "output_token_logprobs"):
            _close(a["meta_info"][key], b["meta_info"][key])
    for p, s, whole in zip(prompts, spec["sampled"], scored):
        assert s["meta_info"]["spec_verify_ct"] > 0
        _close(
            whole["meta_info"]["input_token_logprobs"][len(p) :],
            s["meta_info"]["output_token_logprobs"],
        )
