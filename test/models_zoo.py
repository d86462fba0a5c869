"""Tiny checkpoints for tests, built once per session, and HF oracles for them."""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile

import torch

from specserve.tools.tiny_model import make_tiny_model

# name -> make_tiny_model arguments. Together they cover Qwen3 and Llama, tied
# and untied embeddings, single-file and sharded checkpoints.
ZOO = {
    "qwen3": dict(arch="qwen3"),
    "qwen3-tied-sharded": dict(
        arch="qwen3", tie_word_embeddings=True, max_shard_size="60KB", seed=1
    ),
    "llama-sharded": dict(arch="llama", max_shard_size="60KB", seed=2),
    "llama-tied": dict(arch="llama", tie_word_embeddings=True, seed=3),
}

_ROOT = tempfile.mkdtemp(prefix="specserve-zoo-")


@functools.cache
def model_path(name: str) -> str:
    return make_tiny_model(os.path.join(_ROOT, name), **ZOO[name])


@functools.cache
def hf_model(name: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path(name), dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(name: str, ids: list[int]) -> torch.Tensor:
    """Logits ``[len(ids), V]`` of the HF model over one sequence."""
    return hf_model(name)(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(name: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model(name)
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


def greedy_with_logprobs(eng, ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """An engine's greedy continuation of ``ids`` and the logprob of every
    token after the first (the prompt's, then the output's)."""
    out = eng.generate(
        input_ids=[ids],
        sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens},
        return_logprob=True,
        logprob_start_len=0,
    )[0]
    meta = out["meta_info"]
    entries = meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]
    return out["output_ids"], [x[0] for x in entries]


@torch.no_grad()
def hf_sequence_logprobs(model, ids: list[int]) -> tuple[list[float], torch.Tensor]:
    """A transformers model's logprob of every token of ``ids`` after the first,
    and the log-softmax rows ``[len(ids), V]``."""
    logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))], logp


def greedy_runs(eng, prompts: list[list[int]], new: int) -> list[tuple[list[int], list[float]]]:
    """An engine's greedy ids for each prompt (``new`` tokens, past any stop)
    and the logprob of every token after the first (the prompt's, then the
    output's)."""
    outs = eng.generate(
        input_ids=prompts,
        sampling_params={"temperature": 0, "max_new_tokens": new, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=0,
    )
    got = []
    for out in outs:
        meta = out["meta_info"]
        entries = meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]
        got.append((out["output_ids"], [x[0] for x in entries]))
    return got


def check_greedy(
    reference, prompt: list[int], ids: list[int], logprobs: list[float], tol: float
) -> None:
    """``greedy_runs``' logprobs are a transformers ``reference``'s of the
    same sequence (one forward), and its ids the reference's argmax after
    every prefix wherever that is not a near-tie."""
    seq = prompt + ids
    want, logp = hf_sequence_logprobs(reference, seq)
    assert max(abs(a - b) for a, b in zip(logprobs, want)) < tol
    rows = logp[len(prompt) - 1 : -1]
    top2 = rows.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1] > 1e-4).tolist()
    assert all(a == b for a, b, c in zip(ids, rows.argmax(-1).tolist(), clear) if c)


def random_prompts(n: int, lengths: list[int], vocab: int = 500, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(4, vocab, (lengths[i % len(lengths)],), generator=g).tolist()
        for i in range(n)
    ]


# FP8 block scaling (DeepSeek's and Qwen's ``-FP8`` format), written out here.
BLOCK = (16, 16)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block amax scaling written out here: fp8 weight and float32 scale_inv."""
    n, k = w.shape
    bn, bk = BLOCK
    rows, cols = -(-n // bn), -(-k // bk)
    scale = torch.empty(rows, cols)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            s = max(float(blk.abs().max()), 1e-12) / FP8_MAX
            scale[i, j] = s
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape)
    bn, bk = BLOCK
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


# DeepSeek-V4's projections that its releases store in FP8.
FP8_KEYS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "w1", "w2", "w3")


def fp8_v4_copy(v4_path: str, fp8: str, plain: str) -> dict[str, torch.Tensor]:
    """Writes ``v4_path`` with its ``FP8_KEYS`` weights FP8 block-scaled
    (``fp8``; both spellings of the scales, transformers' and DeepSeek's)
    and the same weights dequantised (``plain``); returns the latter."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    state = load_file(os.path.join(v4_path, "model.safetensors"))
    for d in (fp8, plain):
        shutil.copytree(v4_path, d, ignore=shutil.ignore_patterns("*.safetensors"))
    quantised, dequantised = {}, {}
    for i, (key, w) in enumerate(state.items()):
        if key.rsplit(".", 2)[-2] in FP8_KEYS:
            q, s = quantize(w.float())
            scale_key = key + "_scale_inv" if i % 2 else key.removesuffix(".weight") + ".scale"
            quantised[key], quantised[scale_key] = q, s
            dequantised[key] = dequantize(q, s)
        else:
            quantised[key] = dequantised[key] = w
    assert {k.rsplit(".", 1)[-1] for k in quantised} >= {"scale", "weight_scale_inv"}
    save_file(quantised, os.path.join(fp8, "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantised, os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(fp8, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(BLOCK)}
    with open(os.path.join(fp8, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dequantised


@contextlib.contextmanager
def earlier_entry_wins():
    """transformers' indexer with our tie rule: a perturbation far below any
    real score gap that orders exact ties by entry index."""
    import transformers.models.deepseek_v4.modeling_deepseek_v4 as hf_v4

    scorer = hf_v4.DeepseekV4IndexerScorer
    original = scorer.forward

    def forward(self, q, keys, hidden):
        scores = original(self, q, keys, hidden)
        return scores - torch.arange(scores.shape[-1], dtype=scores.dtype) * 1e-30

    scorer.forward = forward
    try:
        yield
    finally:
        scorer.forward = original
