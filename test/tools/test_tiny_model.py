"""``make-tiny-model --arch deepseek_v4``: a checkpoint transformers reads back,
with every attention kind and both MoE kinds, and hash routes that route."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch


def test_tiny_deepseek_v4_mixes_every_kind_and_reloads(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    path = str(tmp_path / "v4")
    done = subprocess.run(
        [sys.executable, "-m", "specserve.cli", "make-tiny-model", "--arch", "deepseek_v4", path],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["DeepseekV4ForCausalLM"]
    assert set(cfg["layer_types"]) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert set(cfg["mlp_layer_types"]) == {"hash_moe", "moe"} and cfg["num_hidden_layers"] == 5
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    routes = dict(model.named_buffers())["model.layers.0.mlp.gate.tid2eid"]
    k = cfg["num_experts_per_tok"]
    assert routes.shape == (cfg["vocab_size"], k)
    assert all(len(set(r)) == k for r in routes.tolist())  # distinct experts per token
    assert len(routes.unique()) == cfg["n_routed_experts"]
    ids = torch.randint(4, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 40, cfg["vocab_size"]) and torch.isfinite(logits).all()
    assert logits[0].std(dim=-1).min() > 0.1  # random weights that separate tokens
