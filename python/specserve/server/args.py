"""The one place argv is parsed: engine flags (SGLang spellings) and subcommands."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from specserve.config import (
    LOG_LEVELS,
    LOGPROBS_MODES,
    SERVER_MAX_SEQUENCES,
    SPEC_ALGORITHMS,
    SPEC_ARG_NAMES,
    SUB_CONFIGS,
    CacheConfig,
    EngineConfig,
    LimitsConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    SpecConfig,
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model-path",
        default=None,
        help="local HF checkpoint directory (config.json + *.safetensors); "
        "default: the bundled demo model",
    )
    g.add_argument(
        "--tokenizer-path", default=None, help="tokenizer directory (default: the model path)"
    )
    g.add_argument(
        "--dtype",
        default="auto",
        help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16",
    )
    g.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    g.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="max prompt + output tokens (default: the model's)",
    )
    g.add_argument("--random-seed", type=int, default=0, help="seed of the shared sampling stream")
    g.add_argument(
        "--logprobs-mode",
        choices=LOGPROBS_MODES,
        default="raw",
        help="raw: the model's distribution; processed: the one sampled from",
    )
    g.add_argument(
        "--max-top-logprobs",
        type=int,
        default=20,
        help="largest top-logprobs count a request may ask for",
    )
    g.add_argument(
        "--kernel-backend",
        choices=("auto", "triton", "torch"),
        default="auto",
        help="auto: Triton kernels on CUDA tensors, torch references elsewhere",
    )
    g.add_argument(
        "--attention-backend",
        choices=("triton", "torch_native"),
        default=None,
        help="triton: paged-attention kernel (default on CUDA); "
        "torch_native: SDPA over gathered pages (default elsewhere)",
    )
    g.add_argument(
        "--enable-torch-compile",
        action="store_true",
        default=None,
        help="torch.compile the layers' dense parts (norms, projections, RoPE, MLP); "
        "attention stays the paged backend",
    )
    g.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        default=None,
        help="run every step eagerly instead of replaying captured decode/verify forwards (CUDA)",
    )
    g.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help="largest batch a CUDA graph is captured for (default 64, at most "
        "--max-running-requests); larger batches run eagerly",
    )
    g.add_argument(
        "--skip-server-warmup",
        action="store_true",
        default=None,
        help="do not compile the kernels with a few tiny requests at start-up (CUDA)",
    )
    g.add_argument(
        "--grammar-backend",
        choices=("xgrammar", "none"),
        default="xgrammar",
        help="backend for JSON-schema / regex / EBNF constrained output",
    )
    g.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=EngineConfig.grammar_compile_timeout,
        metavar="SECONDS",
        help="longest a new grammar may compile (in a worker process, killed past it); "
        "a request over it gets a 400",
    )
    g.add_argument(
        "--grammar-compile-max-memory",
        type=int,
        default=EngineConfig.grammar_compile_max_memory,
        metavar="MIB",
        help="most memory one grammar's compile may allocate (Linux); a request over it gets a 400",
    )
    c = parser.add_argument_group("KV cache")
    c.add_argument(
        "--page-size", type=int, default=CacheConfig.page_size, help="tokens per KV page"
    )
    c.add_argument("--max-total-tokens", type=int, default=None, help="KV cache capacity in tokens")
    c.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="when --max-total-tokens is unset: CUDA, the share of the device's memory for "
        "weights + KV (default 0.88); CPU, the share of available RAM for KV (default 0.5)",
    )
    s = parser.add_argument_group("scheduler")
    s.add_argument("--max-running-requests", type=int, default=SchedulerConfig.max_running_requests)
    s.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=SchedulerConfig.chunked_prefill_size,
        help="most prompt tokens prefilled per step",
    )
    par = parser.add_argument_group("parallelism (docs/parallelism.md)")
    par.add_argument(
        "--tp-size",
        type=int,
        default=ParallelConfig.tp_size,
        help="tensor-parallel ranks: the model split over this many processes (devices)",
    )
    par.add_argument(
        "--dp-size",
        type=int,
        default=ParallelConfig.dp_size,
        help="data-parallel engine replicas; each request goes to the least-loaded one",
    )
    par.add_argument(
        "--ep-size",
        type=int,
        default=ParallelConfig.ep_size,
        help="expert-parallel ranks (1 or --tp-size): DeepSeek-V4's routed experts split "
        "whole over them instead of each expert's intermediate features",
    )
    par.add_argument(
        "--nnodes", type=int, default=ParallelConfig.nnodes, help="machines the ranks span"
    )
    par.add_argument(
        "--node-rank",
        type=int,
        default=ParallelConfig.node_rank,
        help="this machine's index: 0 serves HTTP, the others run their ranks only",
    )
    par.add_argument(
        "--dist-init-addr",
        default=None,
        help="host:port where the ranks meet (default: a free port on 127.0.0.1)",
    )
    par.add_argument(
        "--dist-timeout",
        type=float,
        default=ParallelConfig.dist_timeout,
        help="seconds a forward waits for another rank before the server stops on it "
        f"({ParallelConfig.dist_timeout:g})",
    )
    lim = parser.add_argument_group("request limits (a request over one gets a 400)")
    for name, default, help in (
        ("max_n", LimitsConfig.max_n, "most choices (n) per OpenAI request"),
        (
            "max_sequences_per_request",
            SERVER_MAX_SEQUENCES,
            "most sequences per request: its prompts times n",
        ),
        ("max_stop_strings", LimitsConfig.max_stop_strings, "most stop strings per request"),
        ("max_stop_length", LimitsConfig.max_stop_length, "most characters of one stop string"),
        (
            "max_token_ids_logprob",
            LimitsConfig.max_token_ids_logprob,
            "most token ids in token_ids_logprob",
        ),
        (
            "max_grammar_length",
            LimitsConfig.max_grammar_length,
            "most characters of a JSON schema, regex or EBNF grammar",
        ),
    ):
        lim.add_argument(
            "--" + name.replace("_", "-"), type=int, default=default, help=f"{help} ({default})"
        )


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculative-algorithm",
        type=str.upper,
        choices=SPEC_ALGORITHMS,
        default=None,
        help="DSPARK (block drafter + Markov and confidence heads), DFLASH (the same drafter "
        "without those heads), NGRAM (prompt lookup, no network)",
    )
    g.add_argument(
        "--speculative-draft-model-path",
        default=None,
        help="DeepSpec-format DSpark/DFlash drafter directory",
    )
    g.add_argument(
        "--speculative-dspark-block-size",
        type=int,
        default=None,
        help="drafts per round (default: the drafter's block_size)",
    )
    g.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=None,
        help="verify chain length, anchor included (DSpark: block size + 1; n-gram: default 8)",
    )
    g.add_argument(
        "--speculative-adaptive",
        choices=("on", "off"),
        default="on",
        help="on: each step's verify lengths from one cost model (expected tokens per "
        "predicted second), down to plain steps with no drafter forward; off: fixed lengths",
    )
    g.add_argument(
        "--speculative-dspark-confidence-threshold",
        type=float,
        default=0.0,
        help="static mode: verify drafts up to the first confidence below this (0: all)",
    )
    g.add_argument(
        "--speculative-dspark-schedule",
        choices=("static", "budget"),
        default="static",
        help="with --speculative-adaptive off: static (threshold or whole blocks) or budget "
        "(the cost model trims each drafted round)",
    )
    g.add_argument(
        "--speculative-dspark-sps-table-path",
        default=None,
        help="the cost model's step-cost table (JSON): read if it exists, else profiled at "
        "start-up and written there",
    )
    g.add_argument(
        "--speculative-token-map",
        default=None,
        help="DSpark/DFlash: draft only these token ids (a .pt tensor or list, or a .json "
        "list; e.g. the most frequent outputs): cheaper drafting, exact output",
    )
    g.add_argument(
        "--speculative-ngram-first",
        action="store_true",
        help="DSpark/DFlash: take prompt-lookup drafts where the request's history has an "
        "n-gram match (see --speculative-ngram-min-match and --speculative-ngram-max-match), "
        "the drafter elsewhere; exact output either way",
    )
    g.add_argument(
        "--speculative-draft-tensor-parallel-size",
        type=int,
        default=None,
        help="DSpark/DFlash with --tp-size N: split the drafter over the N ranks (N) or run "
        "it on rank 0 alone with whole copies of the target's embedding and head (1); "
        "default N on CUDA, 1 on the CPU (where collectives cost more than a small drafter)",
    )
    g.add_argument(
        "--speculative-ngram-max-match",
        type=int,
        default=SpecConfig.ngram_max_match,
        help="longest suffix looked up in the request's history",
    )
    g.add_argument(
        "--speculative-ngram-min-match",
        type=int,
        default=SpecConfig.ngram_min_match,
        help="shortest suffix looked up",
    )


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=ServerConfig.host, help="address to bind")
    g.add_argument("--port", type=int, default=ServerConfig.port, help="port to bind")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use (default: the model path)",
    )
    g.add_argument("--log-level", choices=LOG_LEVELS, default=ServerConfig.log_level)
    g.add_argument(
        "--stats-interval",
        type=float,
        default=ServerConfig.stats_interval,
        help="seconds between status log lines while serving (0: off)",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=ServerConfig.max_request_body_bytes,
        help="largest request body accepted; larger ones get a 413",
    )


def server_config(args: argparse.Namespace) -> ServerConfig:
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    return ServerConfig(**{k: v for k, v in vars(args).items() if k in names})


def apply_demo_defaults(args: argparse.Namespace) -> None:
    """No ``--model-path``: the bundled demo target (served as ``specserve-demo``);
    DSPARK / DFLASH on it with no draft path: its bundled drafter, and its
    token map unless one is given."""
    from specserve.assets import DEMO_NAME, DEMO_ROOT, demo_path, demo_token_map

    if args.model_path is None:
        args.model_path = demo_path("target")
        if getattr(args, "served_model_name", "") is None:  # serve has the flag, generate not
            args.served_model_name = DEMO_NAME
    alg = getattr(args, "speculative_algorithm", None)
    if alg in ("DSPARK", "DFLASH") and args.speculative_draft_model_path is None:
        on_demo = os.path.realpath(args.model_path) == os.path.realpath(
            os.path.join(DEMO_ROOT, "target")
        )
        if on_demo:
            args.speculative_draft_model_path = demo_path(alg.lower())
            if getattr(args, "speculative_token_map", None) is None:
                args.speculative_token_map = demo_token_map()


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Engine keyword arguments from parsed flags (unset optional flags dropped)."""
    names = {
        f.name
        for cls in (EngineConfig, CacheConfig, SchedulerConfig, LimitsConfig, ParallelConfig)
        for f in dataclasses.fields(cls)
    } | set(SPEC_ARG_NAMES)
    names -= {"model_path", *SUB_CONFIGS}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve",
        description="A small LLM serving engine built around speculative decoding.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible and native HTTP APIs")
    add_engine_args(serve)
    add_spec_args(serve)
    add_server_args(serve)

    gen = sub.add_parser("generate", help="offline generation from the command line")
    add_engine_args(gen)
    add_spec_args(gen)
    gen.add_argument(
        "--prompt", action="append", required=True, help="a prompt (repeat for a batch)"
    )
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="print each output token's logprob and its top-K alternatives",
    )
    gen.add_argument("--json", action="store_true", help="print the raw result dicts as JSON")

    train = sub.add_parser(
        "train-dspark", help="train a DSpark (or DFlash) drafter for a local target"
    )
    train.add_argument("--target", required=True, help="target checkpoint directory")
    train.add_argument(
        "--data",
        nargs="+",
        required=True,
        help="text files, or .jsonl with input_ids or text per line",
    )
    train.add_argument(
        "--out", required=True, help="drafter output directory (resumed if it holds a run)"
    )
    train.add_argument("--block-size", type=int, default=7)
    train.add_argument("--num-layers", type=int, default=1)
    train.add_argument("--markov-rank", type=int, default=32, help="0 trains a DFlash drafter")
    train.add_argument("--markov-head-type", choices=("vanilla", "gated", "rnn"), default="vanilla")
    train.add_argument("--confidence-head", action=argparse.BooleanOptionalAction, default=True)
    train.add_argument("--target-layer-ids", type=int, nargs="+", default=None)
    train.add_argument("--steps", type=int, default=1000)
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--seq-len", type=int, default=256)
    train.add_argument("--anchors", type=int, default=16, help="blocks per sequence per step")
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--save-every", type=int, default=200)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        default="float32",
        help="dtype of the saved weights",
    )
    train.add_argument(
        "--device", default="auto", help="where to train: auto (cuda when available), cpu, cuda:N"
    )

    demo = sub.add_parser(
        "build-demo", help="build the demo target and drafters from the stdlib sources"
    )
    demo.add_argument(
        "--out", required=True, help="where the assets go (target/, dspark/, dflash/)"
    )
    demo.add_argument(
        "--work", required=True, help="intermediate files; finished stages are reused"
    )
    demo.add_argument("--pretrain-steps", type=int, default=None)
    demo.add_argument("--drafter-steps", type=int, default=None)
    demo.add_argument("--gen-prompts", type=int, default=None)
    demo.add_argument("--eval-prompts", type=int, default=None)
    demo.add_argument("--vocab-size", type=int, default=None)

    hot = sub.add_parser(
        "make-token-map",
        help="the most frequent tokens of some data, for --speculative-token-map",
    )
    hot.add_argument(
        "--model-path", required=True, help="the target (its tokenizer and vocabulary)"
    )
    hot.add_argument(
        "--data", nargs="+", required=True, help="text files, or .jsonl with input_ids or text"
    )
    hot.add_argument("--size", type=int, required=True, help="how many token ids to keep")
    hot.add_argument("--out", required=True, help="the token map to write (.pt)")

    draft = sub.add_parser(
        "make-tiny-dspark",
        help="write a random-weight DSpark drafter (DeepSpec format) for a target",
    )
    draft.add_argument("target", help="the target checkpoint the drafter is for")
    draft.add_argument("path", help="where to write the drafter")
    draft.add_argument("--markov-rank", type=int, default=8, help="0: a DFlash drafter")
    draft.add_argument("--markov-head-type", choices=("vanilla", "gated", "rnn"), default="vanilla")
    draft.add_argument("--block-size", type=int, default=7)
    draft.add_argument(
        "--bundle",
        action="store_true",
        help="DeepSeek-V4 targets: write a copy of the target with the drafter inside it",
    )
    draft.add_argument("--seed", type=int, default=0)

    check = sub.add_parser(
        "check-drafter",
        help="does a DSpark drafter fit a target: its format, settings, shapes, and a short "
        "run against plain decoding",
    )
    check.add_argument("target", help="the target checkpoint")
    check.add_argument("drafter", help="the drafter checkpoint (DeepSpec, TorchSpec, speculators)")
    check.add_argument(
        "--prompts-file", default=None, help="prompts, one per line (.jsonl: a 'text' per line)"
    )
    check.add_argument("--max-new-tokens", type=int, default=32)
    check.add_argument("--speculative-algorithm", choices=("DSPARK", "DFLASH"), default="DSPARK")
    check.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=None,
        help="the verify chain (the anchor and a block of drafts); a drafter that records "
        "no block (TorchSpec) drafts blocks of this less one, 7 by default",
    )
    check.add_argument("--device", default="cpu")
    check.add_argument("--dtype", default=None, help="default: the engine's for the device")
    check.add_argument(
        "--logprob-tol",
        type=float,
        default=None,
        help="largest logprob difference from plain decoding that passes "
        "(default 1e-4 in float32, 5e-2 otherwise)",
    )
    check.add_argument("--json", action="store_true", help="print the report as JSON")

    tiny = sub.add_parser(
        "make-tiny-model", help="write a tiny random-weight checkpoint with a real tokenizer"
    )
    tiny.add_argument("path")
    tiny.add_argument("--arch", choices=("qwen3", "llama", "deepseek_v4"), default="qwen3")
    tiny.add_argument("--tie-word-embeddings", action="store_true")
    tiny.add_argument(
        "--num-layers", type=int, default=None, help="default 2 (deepseek_v4: 5, every kind)"
    )
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--seed", type=int, default=0)
    return parser
