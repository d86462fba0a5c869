"""FP8 block-scaled checkpoints (DeepSeek's and Qwen's ``-FP8`` format) are
dequantised at load; other formats stop start-up with the tensor named."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models_zoo import (
    BLOCK,
    dequantize,
    greedy_with_logprobs,
    hf_sequence_logprobs,
    model_path,
    quantize,
    random_prompts,
)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """The tiny Qwen3 with every projection FP8 block-scaled (odd shapes and
    partial blocks included), and its dequantised weights."""
    src = model_path("qwen3")
    dst = str(tmp_path_factory.mktemp("fp8") / "qwen3-fp8")
    shutil.copytree(src, dst)
    state = {}
    for f in [f for f in os.listdir(dst) if f.endswith(".safetensors")]:
        state.update(load_file(os.path.join(dst, f)))
        os.remove(os.path.join(dst, f))
    out, dequantized = {}, {}
    for key, w in state.items():
        if key.endswith("_proj.weight") and w.dim() == 2:
            q, s = quantize(w.float())
            out[key], out[key + "_scale_inv"] = q, s
            dequantized[key] = dequantize(q, s)
        else:
            out[key] = w
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }  # fmt: skip
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst, state, dequantized


def test_fp8_weights_load_dequantized_and_serve_like_their_source(fp8_checkpoint) -> None:
    from transformers import AutoModelForCausalLM

    from specserve import Engine

    path, source, dequantized = fp8_checkpoint
    eng = Engine(model_path=path, device="cpu", max_total_tokens=256, dtype="float32")
    try:
        params = dict(eng.runner.model.named_parameters())
        q = params["model.layers.0.self_attn.qkv_proj.weight"]
        want = torch.cat([dequantized[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(q, want)
        src = torch.cat([source[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
        # Within e4m3 rounding of the source: 3 mantissa bits, so 1/16 of each value.
        assert ((q - src).abs() <= src.abs() / 16 + 1e-6).all() and not torch.equal(q, src)
        # Served logits equal transformers' on the same dequantised weights.
        ref = AutoModelForCausalLM.from_pretrained(model_path("qwen3"), dtype=torch.float32).eval()
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if name in dequantized:
                    p.copy_(dequantized[name])
        prompt = random_prompts(1, [11], seed=4)[0]
        output, got = greedy_with_logprobs(eng, prompt, 4)
        want_lp, _ = hf_sequence_logprobs(ref, prompt + output)
        assert got == pytest.approx(want_lp, abs=1e-4)
    finally:
        eng.shutdown()


def test_unsupported_formats_are_named(fp8_checkpoint, tmp_path) -> None:
    from specserve import Engine

    path, _, _ = fp8_checkpoint
    # An FP8 tensor without its scale.
    bad = str(tmp_path / "no-scale")
    shutil.copytree(path, bad)
    state = load_file(os.path.join(bad, "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(state, os.path.join(bad, "model.safetensors"))
    with pytest.raises(
        ValueError, match="'model.layers.1.mlp.down_proj.weight' is torch.float8_e4m3fn"
    ):
        Engine(model_path=bad, device="cpu", max_total_tokens=256)
    # Packed integer weights (as FP4 experts ship).
    state = load_file(os.path.join(path, "model.safetensors"))
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].view(
        torch.uint8
    )
    save_file(state, os.path.join(bad, "model.safetensors"))
    with pytest.raises(ValueError, match="'model.layers.0.mlp.up_proj.weight' is torch.uint8"):
        Engine(model_path=bad, device="cpu", max_total_tokens=256)
    # Another quantization scheme.
    with open(os.path.join(bad, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="quantization_config .* is not supported"):
        Engine(model_path=bad, device="cpu", max_total_tokens=256)
