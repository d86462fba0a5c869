"""KV-cache bytes per token: DeepSeek-V4 against a Qwen3 of the same hidden size.

Measured: one request grown to ``--context`` tokens on each model through the
engine (a prompt, then 64 decode steps); the pages it holds in every cache
group when it gets there, times what a page of that group costs, over
``--context`` is the figure (what a long-lived request costs to keep, not
the transient pages of its prompt's prefill chunk). Then the same accounting for the published sizes (DeepSeek-V4-Flash's
config against a Qwen3 with hidden size 4096), from the pool layout alone.

    python benchmark/bench_kv_bytes.py                  # tiny random models, 4k context
    python benchmark/bench_kv_bytes.py --context 2048 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--output-json", default=None)
    return p.parse_args()


def measured(path: str, args: argparse.Namespace) -> float:
    """KV bytes one request holds once it has grown to the context, per token."""
    from specserve import Engine

    eng = Engine(
        model_path=path, dtype=args.dtype, page_size=args.page_size, max_running_requests=1,
        context_length=args.context,
    )  # fmt: skip
    core, runner = eng.core, eng.runner
    pools = core.pools
    held = 0
    schedule = core.scheduler.schedule

    def watch():
        nonlocal held
        batch = schedule()
        if batch is not None:
            held = sum(
                (p.total_pages() - p.free_pages()) * b for p, b in zip(pools, runner.page_bytes)
            )
        return batch

    core.scheduler.schedule = watch
    new = 64
    prompt = [4 + i % 400 for i in range(args.context - new)]
    eng.generate(input_ids=[prompt], sampling_params={"max_new_tokens": new, "ignore_eos": True})
    eng.shutdown()
    return held / args.context


def analytic(cfg: dict, args: argparse.Namespace) -> float:
    """The same accounting from a config alone: a request of ``--context``
    tokens, group 0 bounded by the retained window when there is one."""
    from specserve.cache.block_pool import cache_groups
    from specserve.cache.kv_pool import KVPool
    from specserve.config import ModelConfig
    from specserve.layers.compressed_attention import bytes_per_page

    mc = ModelConfig.from_dict(cfg)
    dtype, ps, n = getattr(torch, args.dtype), args.page_size, args.context
    if mc.deepseek_v4 is None:
        page = KVPool.bytes_per_page(
            mc.num_hidden_layers, ps, mc.num_key_value_heads, mc.head_dim, dtype
        )
        return -(-n // ps) * page / n
    groups, pages = cache_groups(mc), bytes_per_page(mc, ps, dtype)
    held = (-(-(groups[0].retain + 1) // ps) + 1) * pages[0]
    held += sum(-(-(n // g.rate) // ps) * b for g, b in zip(groups[1:], pages[1:]))
    return held / n


V4_FLASH = {  # DeepSeek-V4-Flash's architecture fields (transformers' defaults)
    "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 129280, "hidden_size": 4096,
    "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "n_routed_experts": 256, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
    "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "max_position_embeddings": 1048576,
}  # fmt: skip
QWEN3_4096 = {  # a Qwen3 of the same hidden size (Qwen3-8B's attention)
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
}  # fmt: skip


def main() -> int:
    args = parse_args()
    from specserve.tools.tiny_model import make_tiny_model

    root = tempfile.mkdtemp(prefix="bench-kv-")
    v4 = make_tiny_model(os.path.join(root, "v4"), "deepseek_v4", num_layers=5)
    with open(os.path.join(v4, "config.json")) as f:
        v4_cfg = json.load(f)
    qwen = make_tiny_model(
        os.path.join(root, "qwen3"), "qwen3", num_layers=5, hidden_size=v4_cfg["hidden_size"]
    )
    rows = {
        "tiny (hidden 64, 5 layers), measured": (measured(v4, args), measured(qwen, args)),
        "published sizes (hidden 4096), accounting": (
            analytic(V4_FLASH, args),
            analytic(QWEN3_4096, args),
        ),
    }
    print(f"KV bytes per token at {args.context} tokens, {args.dtype}, page {args.page_size}")
    print(f"{'':44s} {'DeepSeek-V4':>12s} {'Qwen3':>12s} {'Qwen3/V4':>9s}")
    for name, (a, b) in rows.items():
        print(f"{name:44s} {a:12.0f} {b:12.0f} {b / a:8.1f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({k: {"v4": a, "qwen3": b} for k, (a, b) in rows.items()}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
