"""Tiny random-weight checkpoints with a real tokenizer, built offline.

No model can be downloaded on a fresh machine, so examples and tests build
their own: a byte-level BPE tokenizer trained on Python's own documentation
(``pydoc_data.topics``) and a Qwen3 or Llama checkpoint with random weights
from a fixed seed, written by transformers' ``save_pretrained`` so that the
checkpoint is exactly what an HF user would have on disk.
"""

from __future__ import annotations

import functools
import os
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def stdlib_corpus() -> list[str]:
    """Documentation text that ships with every CPython."""
    from pydoc_data import topics

    return list(topics.topics.values())


@functools.lru_cache(maxsize=4)
def _train_tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_corpus(), trainer=trainer)
    return tok.to_str()


def save_tokenizer(path: str, vocab_size: int = 512) -> Any:
    """Train (once per process) and save a ChatML byte-level BPE tokenizer."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_train_tokenizer_json(vocab_size)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|mask|>"],
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(path)
    return tok


def make_tiny_model(
    path: str,
    arch: str = "qwen3",
    *,
    tie_word_embeddings: bool = False,
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    tokenizer_vocab: int = 512,
    extra_vocab: int = 16,
    init_std: float = 0.08,
    max_shard_size: str | None = None,
    seed: int = 0,
    rope_theta: float = 10000.0,
) -> str:
    """Write tokenizer + random checkpoint to ``path``; returns ``path``.

    The model vocabulary is ``extra_vocab`` ids larger than the tokenizer's,
    as real checkpoints pad theirs. ``init_std`` is larger than HF's default so
    that logits of a random model are well separated (greedy ties are rare).
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    os.makedirs(path, exist_ok=True)
    tok = save_tokenizer(path, tokenizer_vocab)
    common: dict[str, Any] = dict(
        vocab_size=len(tok) + extra_vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        rope_theta=rope_theta,
    )
    if arch == "qwen3":
        config = Qwen3Config(**common)
    elif arch == "llama":
        config = LlamaConfig(**common)
    else:
        raise ValueError(f"arch must be 'qwen3' or 'llama', got {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Norm weights start at 1 in HF; perturb them so a loader that skips them fails tests.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path
