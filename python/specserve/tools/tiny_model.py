"""Tiny random-weight checkpoints with a real tokenizer, built offline.

No model can be downloaded on a fresh machine, so examples and tests build
their own: a byte-level BPE tokenizer trained on Python's own documentation
(``pydoc_data.topics``) and a Qwen3, Llama, DeepSeek-V4 or Gemma 4 checkpoint with
random weights from a fixed seed, written by transformers' ``save_pretrained``
so that the checkpoint is exactly what an HF user would have on disk.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
ARCHS = ("qwen3", "llama", "deepseek_v4", "gemma4", "gemma4_moe", "gemma4_multimodal")
V4_ATTENTION = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")

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


def train_bpe(texts: Iterable[str], vocab_size: int) -> str:
    """A byte-level BPE tokenizer (as JSON) with the ChatML and mask specials."""
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
    tok.train_from_iterator(texts, trainer=trainer)
    return tok.to_str()


@functools.lru_cache(maxsize=4)
def _docs_tokenizer_json(vocab_size: int) -> str:
    return train_bpe(stdlib_corpus(), vocab_size)


def save_tokenizer(
    path: str, vocab_size: int = 512, tokenizer_json: str | None = None, eos: str = "<|im_end|>"
) -> Any:
    """Save a ChatML byte-level BPE tokenizer (by default one trained, once
    per process, on Python's documentation)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    specials = [t for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>") if t != eos]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json or _docs_tokenizer_json(vocab_size)),
        eos_token=eos,
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in specials if t != "<|endoftext|>"],
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
    elif arch == "deepseek_v4":
        config = _deepseek_v4_config(common)
    elif arch.startswith("gemma4"):
        config = _gemma4_config(common, arch)
    else:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    torch.manual_seed(seed)
    if arch == "gemma4_multimodal":
        from transformers import Gemma4ForConditionalGeneration

        model = Gemma4ForConditionalGeneration(config).float()
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Norm weights and scales start at 1 in HF; perturb them so a loader that
    # skips them fails tests.
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith(("layer_scalar", "router.scale", "expert_scale")):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("sinks"):  # attention sinks start at 0
                p.copy_(torch.randn_like(p))
        if arch == "deepseek_v4":
            _random_hash_routes(model, config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def _deepseek_v4_config(common: dict[str, Any]) -> Any:
    """A tiny DeepSeek-V4: MQA with sinks and a grouped output projection,
    the three attention kinds in turn (window 8, compression rates 4 and 16),
    hash-routed MoE in the first layers and top-k MoE after, mHC with 2 streams."""
    from transformers import DeepseekV4Config

    n = common["num_hidden_layers"]
    d = common["hidden_size"]
    return DeepseekV4Config(
        vocab_size=common["vocab_size"],
        hidden_size=d,
        num_hidden_layers=n,
        num_attention_heads=common["num_attention_heads"],
        num_key_value_heads=1,
        head_dim=2 * common["head_dim"],
        q_lora_rank=d // 2,
        partial_rotary_factor=0.25,
        o_groups=2,
        o_lora_rank=d // 4,
        layer_types=[V4_ATTENTION[i % 3] for i in range(n)],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        sliding_window=8,
        index_n_heads=2,
        index_head_dim=common["head_dim"],
        index_topk=2,
        mlp_layer_types=["hash_moe" if i < min(2, n - 1) else "moe" for i in range(n)],
        moe_intermediate_size=common["intermediate_size"] // 4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        hc_mult=2,
        hc_sinkhorn_iters=3,
        num_nextn_predict_layers=0,
        max_position_embeddings=common["max_position_embeddings"],
        rms_norm_eps=common["rms_norm_eps"],
        initializer_range=common["initializer_range"],
        tie_word_embeddings=False,
        bos_token_id=common["bos_token_id"],
        eos_token_id=common["eos_token_id"],
        pad_token_id=common["pad_token_id"],
    )


def _gemma4_config(common: dict[str, Any], arch: str) -> Any:
    """A tiny Gemma 4: sliding (window 8) and global layers in turn, the
    global ones with twice the head size and, but in the MoE variant, one
    KV head whose keys serve as values; soft-capped logits. ``gemma4_moe``
    adds routed experts beside every MLP; ``gemma4_multimodal`` wraps the
    text model with a tiny vision tower, as the -it releases ship."""
    from transformers import Gemma4Config, Gemma4TextConfig

    n = common["num_hidden_layers"]
    moe = arch == "gemma4_moe"
    text = Gemma4TextConfig(
        **{k: v for k, v in common.items() if k != "rope_theta"},
        hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        sliding_window=8,
        global_head_dim=2 * common["head_dim"],
        num_global_key_value_heads=1,
        attention_k_eq_v=not moe,
        final_logit_softcapping=30.0,
        hidden_size_per_layer_input=0,
        enable_moe_block=moe,
        num_experts=4 if moe else None,
        top_k_experts=2 if moe else None,
        moe_intermediate_size=common["intermediate_size"] // 2 if moe else None,
    )
    if arch != "gemma4_multimodal":
        return text
    from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig

    vision = Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    return Gemma4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None,
        tie_word_embeddings=common["tie_word_embeddings"],
    )  # fmt: skip


def _random_hash_routes(model: Any, config: Any) -> None:
    """``tid2eid`` starts all zero (every token to expert 0, twice): give each
    token its own ``num_experts_per_tok`` distinct experts."""
    import torch

    k, experts = config.num_experts_per_tok, config.n_routed_experts
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            routes = torch.stack([torch.randperm(experts)[:k] for _ in range(buf.shape[0])])
            buf.copy_(routes.to(buf.dtype))


def make_tiny_dspark(
    path: str,
    target_path: str,
    *,
    markov_rank: int = 8,
    markov_head_type: str = "vanilla",
    confidence_head: bool = True,
    num_layers: int = 1,
    block_size: int = 4,
    target_layer_ids: tuple[int, ...] | None = None,
    init_std: float = 0.08,
    seed: int = 0,
) -> str:
    """A DeepSpec-format DSpark drafter with random weights for ``target_path``
    (``markov_rank=0`` and no confidence head: a DFlash drafter). A
    DeepSeek-V4 target gets its own drafter format (``make_tiny_dspark_v4``)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from specserve.config import ModelConfig
    from specserve.speculative.dspark_config import ARCHITECTURE, GEMMA4_ARCHITECTURE, DSparkConfig
    from specserve.speculative.dspark_model import DSparkDraftModel

    target = ModelConfig.from_path(target_path)
    if target.deepseek_v4 is not None:
        return make_tiny_dspark_v4(
            path, target_path, block_size=block_size, markov_rank=markov_rank or 8,
            target_layer_ids=target_layer_ids, init_std=init_std, seed=seed,
        )  # fmt: skip
    n = target.num_hidden_layers
    ids = list(target_layer_ids if target_layer_ids is not None else range(max(0, n - 1)))
    heads = target.num_attention_heads
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": target.hidden_size,
        "intermediate_size": 2 * target.hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "rms_norm_eps": target.rms_norm_eps,
        "vocab_size": target.vocab_size,
        "max_position_embeddings": target.max_position_embeddings,
        "rope_theta": target.rope.theta,
        "dtype": "float32",
        "block_size": block_size,
        "mask_token_id": 3,  # the tiny tokenizer's <|mask|>
        "target_layer_ids": ids,
        "num_target_layers": n,
        "num_anchors": 64,
        "markov_rank": markov_rank,
        "markov_head_type": markov_head_type,
        "enable_confidence_head": confidence_head,
        "confidence_head_with_markov": confidence_head and markov_rank > 0,
    }
    g4 = target.gemma4
    if g4 is not None:  # DeepSpec's Gemma4DSparkModel: draft layers shaped as global ones
        full = g4.full_rope
        cfg.update(
            architectures=[GEMMA4_ARCHITECTURE],
            model_type="gemma4_text",
            global_head_dim=g4.head_dims[-1],
            num_global_key_value_heads=g4.kv_heads[-1],
            attention_k_eq_v=g4.k_eq_v,
            hidden_activation=target.hidden_act,
            final_logit_softcapping=g4.final_logit_softcapping,
            hidden_size_per_layer_input=0,
            rope_parameters={
                "full_attention": {
                    "rope_type": full.rope_type,
                    "rope_theta": full.theta,
                    **dict(full.params),
                }
            },
        )
        cfg.pop("rope_theta")
    torch.manual_seed(seed)
    model = DSparkDraftModel(DSparkConfig.from_dict(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("layer_scalar"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, init_std)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    # DeepSpec checkpoints carry copies of the target's embedding and lm_head.
    tgt = {}
    for f in sorted(os.listdir(target_path)):
        if f.endswith(".safetensors"):
            tgt.update(load_file(os.path.join(target_path, f)))
    embed = tgt.get(
        "model.embed_tokens.weight", tgt.get("model.language_model.embed_tokens.weight")
    )
    state["embed_tokens.weight"] = embed.clone()
    state["lm_head.weight"] = tgt.get("lm_head.weight", embed).clone()
    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def make_tiny_dspark_v4(
    path: str,
    target_path: str,
    *,
    block_size: int = 4,
    markov_rank: int = 8,
    target_layer_ids: tuple[int, ...] | None = None,
    bundle: bool = False,
    init_std: float = 0.08,
    seed: int = 0,
) -> str:
    """A DeepSeek-V4 DSpark drafter with random weights for ``target_path``
    in the published layout: ``dspark_*`` config fields and ``mtp.{stage}.*``
    weights in DeepSeek's names. ``bundle``: ``path`` is a copy of the target
    with the drafter inside it; otherwise a drafter-only directory."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    from specserve.config import ModelConfig
    from specserve.speculative.dspark_v4_model import DSparkV4Config, DSparkV4DraftModel

    with open(os.path.join(target_path, "config.json")) as f:
        cfg = json.load(f)
    n = int(cfg["num_hidden_layers"])
    ids = list(target_layer_ids if target_layer_ids is not None else range(max(0, n - 2), n))
    cfg.update(
        dspark_block_size=block_size,
        dspark_target_layer_ids=ids,
        dspark_markov_rank=markov_rank,
        dspark_noise_token_id=3,  # the tiny tokenizer's <|mask|>
        enable_confidence_head=True,
    )
    target = ModelConfig.from_dict(cfg)
    dcfg = DSparkV4Config.from_dict(cfg, target, "config.json")
    torch.manual_seed(seed)
    model = DSparkV4DraftModel(target, dcfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            # Sinks, mixing biases and routing corrections off zero, so that
            # every one of them changes the drafts.
            if name.endswith("norm.weight") or leaf == "scale":
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif leaf in ("attn_sink", "base", "bias"):
                p.normal_(0, 0.5)
            else:
                p.normal_(0, init_std)
    state = {k: v.detach().clone().contiguous() for k, v in model.checkpoint_state().items()}
    assert all(model.checkpoint_key(k) in model.checkpoint_targets() for k in state)
    if bundle:
        shutil.copytree(target_path, path, dirs_exist_ok=True)
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                data = json.load(f)
            data["weight_map"].update(dict.fromkeys(state, "model-dspark.safetensors"))
            with open(index, "w") as f:
                json.dump(data, f, indent=2)
    os.makedirs(path, exist_ok=True)
    name = "model-dspark.safetensors" if bundle else "model.safetensors"
    save_file(state, os.path.join(path, name), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return path
