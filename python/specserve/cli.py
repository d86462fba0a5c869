"""``specserve`` command line entry point."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from specserve.server.args import build_parser, engine_kwargs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        from specserve.server.launch import serve

        return serve(args)
    try:
        if args.command == "make-tiny-model":
            return _make_tiny_model(args)
        if args.command == "make-tiny-dspark":
            return _make_tiny_dspark(args)
        if args.command == "train-dspark":
            return _train_dspark(args)
        if args.command == "build-demo":
            return _build_demo(args)
        if args.command == "make-token-map":
            return _make_token_map(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "check-drafter":
            return _check_drafter(args)
    except (ValueError, OSError) as e:  # bad input: one clear line, no traceback
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    return 1


def _make_tiny_model(args: Any) -> int:
    from specserve.tools.tiny_model import make_tiny_model

    path = make_tiny_model(
        args.path,
        args.arch,
        tie_word_embeddings=args.tie_word_embeddings,
        num_layers=args.num_layers or (5 if args.arch == "deepseek_v4" else 2),
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        seed=args.seed,
    )
    print(f"wrote a tiny {args.arch} checkpoint to {path}")
    return 0


def _build_demo(args: Any) -> int:
    from specserve.training.demo import DemoConfig, build_demo

    overrides = {
        k: v
        for k, v in vars(args).items()
        if k in ("pretrain_steps", "drafter_steps", "gen_prompts", "eval_prompts", "vocab_size")
        and v is not None
    }
    figures = build_demo(DemoConfig(out=args.out, work=args.work, **overrides))
    print(json.dumps(figures, indent=2))
    return 0


def _make_token_map(args: Any) -> int:
    import torch
    from transformers import AutoTokenizer

    from specserve.config import ModelConfig
    from specserve.training.data import hot_tokens, read_token_stream

    tok = AutoTokenizer.from_pretrained(args.model_path, local_files_only=True)
    vocab = ModelConfig.from_path(args.model_path).vocab_size
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    stream = read_token_stream(args.data, lambda t: tok.encode(t, add_special_tokens=False), eos)
    ids = hot_tokens(stream, args.size, vocab)
    torch.save(torch.tensor(ids), args.out)
    print(f"wrote the {len(ids)} most frequent of {len(stream)} tokens to {args.out}")
    return 0


def _train_dspark(args: Any) -> int:
    from specserve.training.train_dspark import DSparkTrainConfig, DSparkTrainer

    cfg = DSparkTrainConfig(
        target=args.target,
        data=tuple(args.data),
        out=args.out,
        block_size=args.block_size,
        num_layers=args.num_layers or (5 if args.arch == "deepseek_v4" else 2),
        markov_rank=args.markov_rank,
        markov_head_type=args.markov_head_type,
        confidence_head=args.confidence_head and args.markov_rank > 0,
        target_layer_ids=tuple(args.target_layer_ids) if args.target_layer_ids else None,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        anchors=args.anchors,
        lr=args.lr,
        save_every=args.save_every,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
    )
    trainer = DSparkTrainer(cfg)
    history = trainer.train()
    if history:
        last = history[-1]
        print(
            f"step {trainer.step}: loss {last.loss:.4f}, accept {last.accept:.3f}, tau {last.tau:.2f}"
        )
    print(f"drafter written to {cfg.out}")
    return 0


def _make_tiny_dspark(args: Any) -> int:
    from specserve.config import ModelConfig
    from specserve.tools.tiny_model import make_tiny_dspark, make_tiny_dspark_v4

    if args.bundle:
        if ModelConfig.from_path(args.target).deepseek_v4 is None:
            raise ValueError("--bundle: only DeepSeek-V4 targets carry their drafter inside")
        path = make_tiny_dspark_v4(
            args.path, args.target, block_size=args.block_size,
            markov_rank=args.markov_rank or 8, bundle=True, seed=args.seed,
        )  # fmt: skip
        print(f"wrote {args.target} with a random DSpark drafter inside it to {path}")
        return 0
    path = make_tiny_dspark(
        args.path,
        args.target,
        markov_rank=args.markov_rank,
        markov_head_type=args.markov_head_type,
        confidence_head=args.markov_rank > 0,
        block_size=args.block_size,
        seed=args.seed,
    )
    print(f"wrote a random DSpark drafter for {args.target} to {path}")
    return 0


def _generate(args: Any) -> int:
    from specserve import Engine
    from specserve.server.args import apply_demo_defaults

    apply_demo_defaults(args)
    sp = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
    }
    with Engine(model_path=args.model_path, **engine_kwargs(args)) as engine:
        k = args.logprobs
        results = engine.generate(
            list(args.prompt),
            sp,
            return_logprob=k is not None,
            top_logprobs_num=k or 0,
            return_text_in_logprobs=True,
        )
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for prompt, r in zip(args.prompt, results):
        meta = r["meta_info"]
        print(f"prompt: {prompt!r}")
        print(f"output: {r['text']!r}")
        print(f"        {meta['completion_tokens']} tokens, finish: {meta['finish_reason']}")
        if k is not None:
            tops = meta["output_top_logprobs"] or [[]] * meta["completion_tokens"]
            for (lp, _, text), top in zip(meta["output_token_logprobs"], tops):
                alts = ", ".join(f"{t!r} {v:.3f}" for v, _, t in top)
                print(f"    {text!r:>14} {lp:8.4f}   top: {alts}")
    return 0


def _check_drafter(args: Any) -> int:
    """Exit status 0 when the drafter fits, 1 on a mismatch."""
    from specserve.tools.check_drafter import check_drafter, read_prompts, render

    report = check_drafter(
        args.target,
        args.drafter,
        prompts=read_prompts(args.prompts_file) if args.prompts_file else None,
        max_new_tokens=args.max_new_tokens,
        algorithm=args.speculative_algorithm,
        num_draft_tokens=args.speculative_num_draft_tokens,
        device=args.device,
        dtype=args.dtype,
        logprob_tol=args.logprob_tol,
    )
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
