"""Pretrains a small Qwen3-architecture target from scratch (for the demo model)."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch

from specserve.training.data import chunk


@dataclass(frozen=True)
class PretrainConfig:
    out: str
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 1000
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.1
    seed: int = 0
    max_position_embeddings: int = 4096
    dtype: str = "float16"  # of the saved weights


def pretrain(cfg: PretrainConfig, stream: list[int], tokenizer, progress: bool = True) -> dict:
    """Trains on ``stream`` (token ids), saves model + tokenizer to ``cfg.out``."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(cfg.seed)
    data = chunk(stream, cfg.seq_len + 1)  # inputs and their shifted labels
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=eos[0],
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95)
    )
    g = torch.Generator().manual_seed(cfg.seed)
    bar = tqdm(total=cfg.steps, disable=not progress, desc="pretrain", dynamic_ncols=True)
    losses = []
    start = time.time()
    model.train()
    for step in range(cfg.steps):
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup)
        if step >= cfg.warmup:
            progress_frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
            lr = cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress_frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        rows = torch.randint(0, data.shape[0], (cfg.batch_size,), generator=g)
        batch = data[rows]
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr:.1e}")
        bar.update(1)
    bar.close()
    model.eval()
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
        cfg.dtype
    ]
    os.makedirs(cfg.out, exist_ok=True)
    model.to(dtype).save_pretrained(cfg.out)
    tokenizer.save_pretrained(cfg.out)
    summary = {
        "config": asdict(cfg),
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "minutes": (time.time() - start) / 60,
    }
    with open(os.path.join(cfg.out, "pretrain.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
