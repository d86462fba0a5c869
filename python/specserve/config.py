"""Frozen configuration passed down explicitly from the entry point.

argv is parsed only in ``server/args.py``; the offline ``Engine`` builds an
``EngineConfig`` from keyword arguments through ``EngineConfig.from_kwargs``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from specserve.models.deepseek_v4_config import DeepseekV4Config
    from specserve.models.gemma4_config import Gemma4Config

LOGPROBS_MODES = ("raw", "processed")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype, device: str) -> torch.dtype:
    """``auto`` is float32 on the CPU and bfloat16 on CUDA."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in _DTYPES:
        raise ValueError(
            f"dtype: unknown value {name!r}; expected auto or one of {sorted(_DTYPES)}"
        )
    return _DTYPES[name]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    # The remaining fields of the HF rope dict (factor, low_freq_factor, ...).
    params: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a decoder-only checkpoint, read from ``config.json``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # FP8 block-scaled weights (``quantization_config`` quant_method "fp8"):
    # the (rows, cols) block each ``weight_scale_inv`` entry scales; None: none.
    fp8_block: tuple[int, int] | None = None
    # DeepSeek-V4's own fields (attention kinds, compression, mHC, MoE); None
    # for the dense decoders.
    deepseek_v4: DeepseekV4Config | None = None
    # Gemma 4's own fields (sliding and global layers, their shapes, MoE).
    gemma4: Gemma4Config | None = None

    @classmethod
    def from_path(cls, model_path: str) -> ModelConfig:
        path = os.path.join(model_path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"model_path: no config.json in {model_path!r}")
        with open(path) as f:
            return cls.from_dict(json.load(f), source=path)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        from specserve.models.gemma4_config import is_gemma4, parse_gemma4, text_fields

        gemma4 = None
        if is_gemma4(cfg):
            cfg = text_fields(cfg)
            gemma4 = parse_gemma4(cfg, source)
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else cfg.get("model_type", "")

        def need(key: str) -> Any:
            if key not in cfg:
                raise ValueError(f"{source}: missing required field {key!r}")
            return cfg[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        head_dim = cfg.get("head_dim") or hidden // heads
        v4 = None
        if arch == "DeepseekV4ForCausalLM" or cfg.get("model_type") == "deepseek_v4":
            from specserve.models.deepseek_v4_config import parse_deepseek_v4

            for key in ("num_hidden_layers", "n_routed_experts", "num_experts_per_tok"):
                need(key)
            cfg = {**cfg, "intermediate_size": need("moe_intermediate_size")}
            v4 = parse_deepseek_v4(cfg, int(head_dim), source)
        elif gemma4 is None and (
            cfg.get("use_sliding_window")
            or any(t != "full_attention" for t in cfg.get("layer_types") or [])
        ):
            raise ValueError(f"{source}: sliding-window attention is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope=parse_rope(cfg) if v4 is None else v4.main_rope,
            # Gemma ties its head to the embedding unless told otherwise.
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma4 is not None)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch.startswith("Qwen3") or cfg.get("model_type") == "qwen3",
            hidden_act=str(cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"),
            # transformers 5 writes ``dtype``, earlier versions ``torch_dtype``.
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            fp8_block=parse_quantization(cfg, source),
            deepseek_v4=v4,
            gemma4=gemma4,
        )

    def kv_layers(self) -> list[tuple[int, int]]:
        """Each layer's (KV heads, head dim): one shape for most models,
        Gemma 4's global layers differ from its sliding ones."""
        if self.gemma4 is not None:
            return list(zip(self.gemma4.kv_heads, self.gemma4.head_dims))
        return [(self.num_key_value_heads, self.head_dim)] * self.num_hidden_layers


def parse_quantization(cfg: dict[str, Any], source: str) -> tuple[int, int] | None:
    """The FP8 weight block of a block-scaled checkpoint (DeepSeek's and
    Qwen's ``-FP8`` format: e4m3 weights, a float32 ``weight_scale_inv`` per
    block, dequantised at load); None without quantization. Other schemes
    stop start-up, named."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    block = q.get("weight_block_size")
    if method != "fp8" or q.get("fmt", "e4m3") != "e4m3" or not block or len(block) != 2:
        raise ValueError(
            f"{source}: quantization_config {json.dumps(q, sort_keys=True)} is not supported; "
            "supported: quant_method 'fp8' with fmt 'e4m3' and a weight_block_size [rows, cols]"
        )
    return int(block[0]), int(block[1])


def parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5: everything lives in ``rope_parameters``;
    # before: ``rope_theta`` at top level plus an optional ``rope_scaling`` dict.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    return RopeConfig(rope_type=rope_type, theta=float(theta), params=tuple(sorted(params.items())))


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    # Token capacity of the KV pool; None sizes it from ``mem_fraction_static``.
    max_total_tokens: int | None = None
    # When ``max_total_tokens`` is unset. CUDA: the share of the device's
    # whole memory that weights and KV take (SGLang's meaning; default 0.88).
    # CPU: the share of the available RAM the KV pool takes (default 0.5).
    mem_fraction_static: float | None = None

    def fraction(self, device_type: str) -> float:
        if self.mem_fraction_static is not None:
            return self.mem_fraction_static
        return 0.88 if device_type == "cuda" else 0.5

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(
                f"max_total_tokens must be >= page_size ({self.page_size}), got {self.max_total_tokens}"
            )
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64
    # Most prompt tokens prefilled in one step; a longer prompt is split.
    chunked_prefill_size: int = 2048

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}")


@dataclass(frozen=True)
class LimitsConfig:
    """What one request may ask for; past a limit it is refused (HTTP 400,
    ``ValueError`` offline) with a message naming the limit's flag."""

    max_n: int = 128  # choices per OpenAI request (OpenAI's own cap)
    # Sequences one request starts: its prompts times n. None: no limit (the
    # offline default: a batch job may pass any number of prompts); the
    # server's flag defaults to SERVER_MAX_SEQUENCES.
    max_sequences_per_request: int | None = None
    max_stop_strings: int = 32
    max_stop_length: int = 256  # characters of one stop string
    max_token_ids_logprob: int = 256  # ids of token_ids_logprob
    # Characters of a grammar's text (a JSON schema, regex or EBNF): several
    # times the largest schemas in common use, small enough to parse at once.
    max_grammar_length: int = 131072

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "max_sequences_per_request":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{f.name} must be an integer >= 1, got {value!r}")


SERVER_MAX_SEQUENCES = 512


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes (SGLang's flag names). One
    tensor-parallel group of ``tp_size`` ranks: rank 0 is the engine's own
    process (scheduler, sampling, server), ranks 1.. are worker processes
    that run only their shard of each forward (docs/parallelism.md)."""

    tp_size: int = 1
    # Engine replicas (each its own scheduler, KV pool and TP group), every
    # request routed to the least-loaded one (``DataParallelEngine``).
    dp_size: int = 1
    # DeepSeek-V4: its routed experts split whole over this many of the TP
    # ranks (1: each expert's intermediate features split instead). 1 or tp_size.
    ep_size: int = 1
    # Machines the ranks span (each runs tp_size / nnodes of them) and which
    # one this is: node 0 runs rank 0 and the server, the others only ranks.
    nnodes: int = 1
    node_rank: int = 0
    # Rendezvous of the ranks, host:port on node 0 (None: a free port on
    # 127.0.0.1; required with nnodes > 1).
    dist_init_addr: str | None = None
    # Seconds a collective of a forward may wait for another rank before the
    # engine stops on it (a hung or lost rank).
    dist_timeout: float = 300.0

    def __post_init__(self) -> None:
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be an integer >= 1, got {self.tp_size!r}")
        if isinstance(self.dp_size, bool) or not isinstance(self.dp_size, int) or self.dp_size < 1:
            raise ValueError(f"dp_size must be an integer >= 1, got {self.dp_size!r}")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(
                f"ep_size must be 1 or tp_size ({self.tp_size}): experts split over the "
                f"tensor-parallel ranks, got {self.ep_size!r}"
            )
        if not isinstance(self.nnodes, int) or self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(
                f"nnodes must be an integer >= 1 that divides tp_size ({self.tp_size}), "
                f"got {self.nnodes!r}"
            )
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank!r}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("dist_init_addr (host:port of node 0) is required with nnodes > 1")
        t = self.dist_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
            raise ValueError(f"dist_timeout must be a number of seconds > 0, got {t!r}")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The ranks this node runs (node 0's include rank 0, this process)."""
        per = self.ranks_per_node
        return range(self.node_rank * per, (self.node_rank + 1) * per)


SPEC_ALGORITHMS = ("DSPARK", "DFLASH", "NGRAM")


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str | None = None  # None: plain decoding
    draft_model_path: str | None = None
    # DSpark/DFlash block size (drafts per round); None: the checkpoint's.
    block_size: int | None = None
    # Verify chain length (anchor + drafts). DSpark/DFlash: must be block size + 1.
    num_draft_tokens: int | None = None
    # Static verify length: drafts up to the first confidence below this (0: all).
    confidence_threshold: float = 0.0
    # Verify lengths chosen each step by one cost model (speculative/planner.py),
    # down to plain steps; False: the fixed lengths of ``schedule``.
    adaptive: bool = True
    # With adaptive off: "static" (threshold or whole blocks) or "budget" (the
    # cost model refines each drafted round, never skipping the drafter).
    schedule: str = "static"
    sps_table_path: str | None = None  # the cost model's step-cost table (JSON)
    ngram_max_match: int = 4
    ngram_min_match: int = 1
    # DSpark/DFlash: the hot vocabulary drafts come from (SGLang's token map).
    token_map: str | None = None
    # DSpark/DFlash: prompt-lookup drafts where the history has an n-gram match
    # (ngram_min_match / ngram_max_match), the drafter network elsewhere.
    ngram_first: bool = False
    # DSpark/DFlash under tensor parallelism: the drafter split over the
    # group (tp_size) or on rank 0 alone (1); None: EngineConfig.draft_tp_size.
    draft_tp_size: int | None = None

    def __post_init__(self) -> None:
        alg = self.algorithm
        if alg is not None and alg.upper() not in SPEC_ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {SPEC_ALGORITHMS}, got {alg!r}")
        if alg is not None:
            object.__setattr__(self, "algorithm", alg.upper())
        if self.algorithm in ("DSPARK", "DFLASH") and not self.draft_model_path:
            raise ValueError(f"speculative_draft_model_path is required for {self.algorithm}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"speculative_dspark_block_size must be >= 1, got {self.block_size}")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 2:
            raise ValueError(
                f"speculative_num_draft_tokens must be >= 2, got {self.num_draft_tokens}"
            )
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise ValueError(
                f"speculative_dspark_confidence_threshold must be in [0, 1], got {self.confidence_threshold}"
            )
        if isinstance(self.adaptive, str):  # the flag's spelling
            if self.adaptive not in ("on", "off"):
                raise ValueError(f"speculative_adaptive must be on or off, got {self.adaptive!r}")
            object.__setattr__(self, "adaptive", self.adaptive == "on")
        if self.schedule not in ("static", "budget"):
            raise ValueError(
                f"speculative_dspark_schedule must be static or budget, got {self.schedule!r}"
            )
        if self.token_map and self.algorithm not in ("DSPARK", "DFLASH"):
            raise ValueError(
                "speculative_token_map: only DSPARK and DFLASH draft from a model's vocabulary, "
                f"got speculative_algorithm {self.algorithm}"
            )
        if self.ngram_first and self.algorithm not in ("DSPARK", "DFLASH"):
            raise ValueError(
                "speculative_ngram_first: looks up n-grams before a drafter network "
                f"(DSPARK or DFLASH), got speculative_algorithm {self.algorithm}"
            )
        if not 1 <= self.ngram_min_match <= self.ngram_max_match:
            raise ValueError(
                "speculative_ngram_min_match must be >= 1 and <= speculative_ngram_max_match, "
                f"got {self.ngram_min_match} and {self.ngram_max_match}"
            )

    @property
    def enabled(self) -> bool:
        return self.algorithm is not None


# EngineConfig fields that hold a nested config (flat arguments fill them).
SUB_CONFIGS = ("cache", "scheduler", "limits", "spec", "parallel")

# Flat engine-argument names (SGLang's) of the SpecConfig fields.
SPEC_ARG_NAMES = {
    "speculative_algorithm": "algorithm",
    "speculative_adaptive": "adaptive",
    "speculative_draft_model_path": "draft_model_path",
    "speculative_dspark_block_size": "block_size",
    "speculative_num_draft_tokens": "num_draft_tokens",
    "speculative_dspark_confidence_threshold": "confidence_threshold",
    "speculative_dspark_schedule": "schedule",
    "speculative_dspark_sps_table_path": "sps_table_path",
    "speculative_ngram_max_match": "ngram_max_match",
    "speculative_ngram_min_match": "ngram_min_match",
    "speculative_token_map": "token_map",
    "speculative_ngram_first": "ngram_first",
    "speculative_draft_tensor_parallel_size": "draft_tp_size",
}


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    tokenizer_path: str | None = None
    dtype: str = "auto"
    device: str = field(default_factory=default_device)
    context_length: int | None = None
    random_seed: int = 0
    logprobs_mode: str = "raw"
    max_top_logprobs: int = 20
    # "auto" picks Triton kernels for CUDA tensors and torch references elsewhere.
    kernel_backend: str = "auto"
    # "triton" (paged kernel) or "torch_native" (SDPA over gathered pages);
    # None: triton on CUDA, torch_native elsewhere.
    attention_backend: str | None = None
    grammar_backend: str = "xgrammar"  # or "none"
    # Seconds one new grammar may compile (in a worker process, killed past
    # it): typical schemas take milliseconds, one with 400 optional
    # properties ~4 s on an 8192-token vocabulary (more on larger ones); a
    # pathological one holds a core for at most this long.
    grammar_compile_timeout: float = 30.0
    # MiB one grammar's compile may allocate (its worker's address-space
    # limit; Linux); None: no limit.
    grammar_compile_max_memory: int | None = 4096
    # torch.compile the target layers' dense parts (off: on this project's CPUs
    # eager is faster, see docs/benchmarks.md).
    enable_torch_compile: bool = False
    # CUDA graphs for the target's DECODE and VERIFY steps and DSpark's block
    # forward (CUDA, Triton attention): captured for batches up to
    # cuda_graph_max_bs (None: 64, at most max_running_requests); larger or
    # mixed batches run eagerly.
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    # On CUDA the engine runs a few tiny requests at start-up, so that every
    # common kernel variant is compiled before the first user's request.
    skip_server_warmup: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            )
        if self.max_top_logprobs < 0:
            raise ValueError(f"max_top_logprobs must be >= 0, got {self.max_top_logprobs}")
        if self.kernel_backend not in ("auto", "triton", "torch"):
            raise ValueError(
                f"kernel_backend must be auto, triton or torch, got {self.kernel_backend!r}"
            )
        if self.attention_backend not in (None, "triton", "torch_native"):
            raise ValueError(
                f"attention_backend must be triton or torch_native, got {self.attention_backend!r}"
            )
        if self.grammar_backend not in ("xgrammar", "none"):
            raise ValueError(
                f"grammar_backend must be xgrammar or none, got {self.grammar_backend!r}"
            )
        t = self.grammar_compile_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
            raise ValueError(f"grammar_compile_timeout must be a number of seconds > 0, got {t!r}")
        mem = self.grammar_compile_max_memory
        if mem is not None and (isinstance(mem, bool) or not isinstance(mem, int) or mem < 1):
            raise ValueError(f"grammar_compile_max_memory must be an integer >= 1, got {mem!r}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {self.context_length}")
        draft_tp = self.spec.draft_tp_size
        if draft_tp is not None and draft_tp not in (1, self.parallel.tp_size):
            raise ValueError(
                "speculative_draft_tensor_parallel_size must be 1 (the drafter on rank 0) or "
                f"tp_size ({self.parallel.tp_size}), got {draft_tp}"
            )
        if self.enable_torch_compile and self.parallel.tp_size > 1:
            raise ValueError(
                "enable_torch_compile: not supported with tp_size > 1 yet (the compiled "
                "layers would hold the ranks' collectives)"
            )

    @property
    def draft_tp_size(self) -> int:
        """The ranks a DSpark / DFlash drafter is split over: the flag's, or
        by default the whole group on CUDA and rank 0 alone elsewhere. Over
        gloo on the CPU each collective costs about a millisecond, and a
        split drafter adds one per layer and per drafted slot: there one rank
        drafting with whole copies of the embedding and head is faster
        (docs/parallelism.md has the figures); over NCCL they cost
        microseconds and the split saves the copies and the compute."""
        if self.spec.draft_tp_size is not None:
            return self.spec.draft_tp_size
        return self.parallel.tp_size if torch.device(self.device).type == "cuda" else 1

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype, self.device)

    @classmethod
    def from_kwargs(cls, model_path: str, **kwargs: Any) -> EngineConfig:
        """Flat keyword arguments (SGLang names) into the nested frozen config."""
        sub: dict[type, dict[str, Any]] = {
            CacheConfig: {},
            SchedulerConfig: {},
            LimitsConfig: {},
            ParallelConfig: {},
        }
        spec: dict[str, Any] = {}
        top: dict[str, Any] = {}
        names = {f.name for f in dataclasses.fields(cls)}
        for key, value in kwargs.items():
            if key in SPEC_ARG_NAMES:
                spec[SPEC_ARG_NAMES[key]] = value
                continue
            for sub_cls in sub:
                if key in {f.name for f in dataclasses.fields(sub_cls)}:
                    sub[sub_cls][key] = value
                    break
            else:
                if key not in names or key in SUB_CONFIGS:
                    raise ValueError(f"unknown engine argument {key!r}")
                top[key] = value
        dspark = str(spec.get("algorithm") or "").upper() == "DSPARK"
        if dspark and not spec.get("draft_model_path") and bundles_drafter(model_path):
            spec["draft_model_path"] = model_path  # its own mtp.* drafter
        return cls(
            model_path=model_path,
            cache=CacheConfig(**sub[CacheConfig]),
            scheduler=SchedulerConfig(**sub[SchedulerConfig]),
            limits=LimitsConfig(**sub[LimitsConfig]),
            spec=SpecConfig(**spec),
            parallel=ParallelConfig(**sub[ParallelConfig]),
            **top,
        )


def bundles_drafter(model_path: str) -> bool:
    """Whether a checkpoint carries its own DSpark drafter (DeepSeek-V4's
    ``dspark_*`` config fields with ``mtp.*`` weights)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "dspark_target_layer_ids" in cfg


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the model path
    log_level: str = "info"
    # Seconds between status lines (running/queued, KV usage, throughput); 0: off.
    stats_interval: float = 10.0
    # Largest request body accepted (413 beyond it).
    max_request_body_bytes: int = 32 * 2**20

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.stats_interval < 0:
            raise ValueError(f"stats_interval must be >= 0, got {self.stats_interval}")
        if self.max_request_body_bytes < 1:
            raise ValueError(
                f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}"
            )
