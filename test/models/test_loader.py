"""Checkpoint loading: config spellings, and clear errors when a checkpoint
does not match its config."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import specserve
from models_zoo import model_path, random_prompts
from specserve.config import ModelConfig
from specserve.models.loader import load_model

DEMO = os.path.join(os.path.dirname(specserve.__file__), "assets", "demo")


def copy_model(name: str, dst: str) -> str:
    shutil.copytree(model_path(name), dst)
    return dst


def edit_config(path: str, **changes) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def load(path: str):
    return load_model(path, ModelConfig.from_path(path), torch.float32, "cpu")


def test_missing_tensor_names_file_and_key(tmp_path) -> None:
    path = copy_model("qwen3", str(tmp_path / "m"))
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"model\.safetensors.*model\.layers\.1\.mlp\.up_proj\.weight"
    ):
        load(path)


def test_shape_mismatch_names_file_key_and_shapes(tmp_path) -> None:
    path = copy_model("llama-sharded", str(tmp_path / "m"))
    edit_config(path, intermediate_size=96)
    with pytest.raises(
        ValueError,
        match=r"model-0000\d-of-0000\d\.safetensors: tensor 'model\.layers\.\d\.mlp\.\w+_proj\.weight' has shape",
    ):
        load(path)


def test_extra_layers_in_checkpoint_are_reported(tmp_path) -> None:
    path = copy_model("qwen3", str(tmp_path / "m"))
    edit_config(path, num_hidden_layers=1, layer_types=["full_attention"])
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.1\."):
        load(path)


def test_missing_lm_head_without_tying_is_an_error(tmp_path) -> None:
    path = copy_model("llama-tied", str(tmp_path / "m"))
    edit_config(path, tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"missing tensor\(s\) 'lm_head\.weight'"):
        load(path)


def test_missing_config_and_unsupported_features(tmp_path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_path(str(tmp_path))
    path = copy_model("qwen3", str(tmp_path / "m"))
    edit_config(path, use_sliding_window=True)
    with pytest.raises(ValueError, match="sliding-window"):
        ModelConfig.from_path(path)
    edit_config(path, use_sliding_window=False, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load(path)


def test_dtype_spellings(tmp_path) -> None:
    path = copy_model("qwen3", str(tmp_path / "m"))
    assert ModelConfig.from_path(path).torch_dtype == "float32"  # transformers 5 writes "dtype"
    edit_config(path, dtype=None, torch_dtype="bfloat16")
    assert ModelConfig.from_path(path).torch_dtype == "bfloat16"


def test_transformers4_rope_layout_matches_hf(tmp_path) -> None:
    """``rope_theta`` + ``rope_scaling`` (llama3 type) instead of ``rope_parameters``."""
    from transformers import AutoModelForCausalLM

    path = copy_model("llama-sharded", str(tmp_path / "m"))
    edit_config(
        path,
        rope_parameters=None,
        rope_theta=5000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    cfg = ModelConfig.from_path(path)
    assert cfg.rope.rope_type == "llama3" and cfg.rope.theta == 5000.0
    ours = load(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = random_prompts(1, [40], seed=9)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    # Prefill through our model directly, with a throwaway KV pool.
    from specserve.cache.kv_pool import KVPool
    from specserve.layers.attention import AttentionMetadata, TorchAttentionBackend

    pool = KVPool(
        cfg.num_hidden_layers, 10, 4, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu"
    )
    backend = TorchAttentionBackend(pool)
    meta = AttentionMetadata(torch.arange(40), torch.arange(40), [40], [40], [list(range(10))], 4)
    backend.prepare(meta)
    with torch.no_grad():
        hidden, _ = ours(torch.tensor(prompt), meta, backend)
        got = ours.compute_logits(hidden)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_weights_are_materialized_in_the_target_dtype_only() -> None:
    """No float32 copy of a bf16 model's weights ever exists (peak load memory
    is the bf16 weights, not 1.5x or 2x of them)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from specserve.models.decoder import DecoderForCausalLM
    from specserve.models.loader import materialize

    class Allocations(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.dtypes: list[torch.dtype] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.device.type != "meta":
                self.dtypes.append(out.dtype)
            return out

    cfg = ModelConfig.from_path(model_path("qwen3"))
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg)
    with Allocations() as seen:
        model = materialize(model, torch.bfloat16, "cpu")
    assert seen.dtypes and set(seen.dtypes) == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_building_an_engine_imports_no_compiler() -> None:
    """Building a target and its DSpark drafter on meta and materializing
    them imports no ``torch._dynamo`` (meta's ``normal_`` did, through
    torch's reference ops: 2 s of every server's and rank's start-up)."""
    code = (
        "import sys\n"
        "from specserve import Engine\n"
        f"Engine(model_path={DEMO + '/target'!r}, device='cpu', speculative_algorithm='DSPARK',\n"
        f"       speculative_draft_model_path={DEMO + '/dspark'!r},\n"
        "       speculative_adaptive='off').shutdown()\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_embeddings_off_meta_are_initialised_as_torch_does() -> None:
    """Off the meta device an embedding's table is drawn as ``nn.Embedding``
    draws it (models built for training or tests rely on it)."""
    from specserve.layers.parallel import embedding_weight

    torch.manual_seed(5)
    ours = embedding_weight(33, 7)
    torch.manual_seed(5)
    want = torch.nn.Embedding(33, 7).weight.detach()
    assert torch.equal(ours, want)
    with torch.device("meta"):
        assert embedding_weight(33, 7).is_meta
