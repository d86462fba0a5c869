"""Trains a DSpark (or, with ``markov_rank=0``, DFlash) drafter for a local target.

The objective follows DeepSpec's: for blocks at random anchors of each
training sequence, every slot k is weighted ``exp(-k / 4)`` and scored with
``0.1 * CE + 0.9 * TV`` of its Markov-corrected draft distribution against
the target's next-token distribution at that position (``TV`` the L1
distance of the two); the Markov head is teacher-forced with the sequence's
own tokens; the confidence head learns, by binary cross-entropy, the soft
target ``1 - TV / 2`` (the probability that a draft sampled from the drafter
is accepted). The target and its embedding / ``lm_head`` stay frozen.
Training data is best produced by the target itself (its own continuations),
so that drafts are judged on text the target would write.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from specserve.config import ModelConfig
from specserve.speculative.dspark_config import ARCHITECTURE, DSparkConfig
from specserve.speculative.dspark_model import DSparkDraftModel
from specserve.speculative.dspark_v4_model import DSparkV4Config, DSparkV4DraftModel
from specserve.training.data import chunk, read_token_stream

STATE_FILE = "train_state.pt"


@dataclass(frozen=True)
class DSparkTrainConfig:
    target: str
    data: tuple[str, ...]
    out: str
    block_size: int = 7
    num_layers: int = 1
    markov_rank: int = 32  # 0: DFlash
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    target_layer_ids: tuple[int, ...] | None = None  # default: 3 spread over the target
    intermediate_size: int | None = None  # default: the target's
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    anchors: int = 16  # blocks per sequence per step
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.01
    confidence_weight: float = 0.1
    save_every: int = 200
    save_embeddings: bool = True  # DeepSpec checkpoints carry copies of the target's
    seed: int = 0
    dtype: str = "float32"  # of the saved weights
    device: str = "auto"  # auto: cuda when available, else cpu


def default_layer_ids(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """``count`` target layers spread from the first to the second-to-last
    (any layer may be chosen, the last one included: features are each
    layer's output before the final norm)."""
    top = max(num_layers - 2, 0)
    if top == 0:
        return (0,)
    picks = {round(i * top / (count - 1)) for i in range(count)} if count > 1 else {top}
    return tuple(sorted(picks))


def draft_config(cfg: DSparkTrainConfig, target: dict, mask_token_id: int) -> dict:
    """The drafter's ``config.json`` (DeepSpec's fields) for a target config."""
    n = int(target["num_hidden_layers"])
    ids = list(cfg.target_layer_ids or default_layer_ids(n))
    heads = int(target["num_attention_heads"])
    rope = target.get("rope_parameters") or {
        "rope_type": "default",
        "rope_theta": target.get("rope_theta", 10000.0),
    }
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": int(target["hidden_size"]),
        "intermediate_size": int(cfg.intermediate_size or target["intermediate_size"]),
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(target.get("num_key_value_heads") or heads),
        "head_dim": int(target.get("head_dim") or int(target["hidden_size"]) // heads),
        "rms_norm_eps": float(target.get("rms_norm_eps", 1e-6)),
        "vocab_size": int(target["vocab_size"]),
        "max_position_embeddings": int(target.get("max_position_embeddings", 4096)),
        "rope_parameters": rope,
        "dtype": cfg.dtype,
        "block_size": cfg.block_size,
        "mask_token_id": mask_token_id,
        "target_layer_ids": ids,
        "num_target_layers": n,
        "num_anchors": cfg.anchors,
        "markov_rank": cfg.markov_rank,
        "markov_head_type": cfg.markov_head_type,
        "enable_confidence_head": cfg.confidence_head,
        "confidence_head_with_markov": cfg.confidence_head and cfg.markov_rank > 0,
    }


@dataclass
class StepMetrics:
    loss: float
    tv: float
    accept: float  # mean over slots of 1 - TV/2: expected acceptance of a sampled draft
    tau: float  # greedy accepted length estimate (bonus included) under teacher forcing
    extra: dict = field(default_factory=dict)


class DSparkTrainer:
    def __init__(self, cfg: DSparkTrainConfig) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
        )
        torch.manual_seed(cfg.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.target, local_files_only=True)
        self.target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.float32).eval()
        self.target.requires_grad_(False)
        self.target.to(self.device)
        with open(os.path.join(cfg.target, "config.json")) as f:
            tcfg = json.load(f)
        mask_id = _mask_token_id(self.tokenizer)
        self.v4 = tcfg.get("model_type") == "deepseek_v4"
        if self.v4:
            self.draft_json = v4_draft_config(cfg, tcfg, mask_id)
            target = ModelConfig.from_dict(self.draft_json)
            dcfg = DSparkV4Config.from_dict(self.draft_json, target, "config.json")
            self.model = DSparkV4DraftModel(target, dcfg)
            _init_v4_weights(self.model, cfg.seed)
            self.model.embed = self.target.get_input_embeddings()
            self.model.head = self.target.get_output_embeddings()
            _earlier_entry_wins(self.target)
        else:
            self.draft_json = draft_config(cfg, tcfg, mask_id)
            dcfg = DSparkConfig.from_dict(self.draft_json)
            self.model = DSparkDraftModel(dcfg)
            _init_weights(self.model, cfg.seed)
            # The drafter embeds and reads out through the target's own (frozen) tensors.
            self.model.embed_tokens = self.target.get_input_embeddings()
            self.model.lm_head = self.target.get_output_embeddings()
        self.model.to(self.device)
        self.layer_ids = dcfg.target_layer_ids
        self._hook_layer_outputs(self.layer_ids)
        eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        stream = read_token_stream(
            cfg.data, lambda t: self.tokenizer.encode(t, add_special_tokens=False), eos
        )
        self.sequences = chunk(stream, cfg.seq_len)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95)
        )
        self.step = 0
        self._resume()

    def _hook_layer_outputs(self, layer_ids: tuple[int, ...]) -> None:
        """Capture each chosen layer's output as the engine does: the residual
        stream before any final norm (transformers' ``hidden_states`` ends with
        the normed head input instead), DeepSeek-V4's streams averaged; -1 is
        the embedding output."""
        self._captured: dict[int, torch.Tensor] = {}
        layers = self.target.model.layers

        def keep(i: int, output) -> None:
            h = output[0] if isinstance(output, tuple) else output
            self._captured[i] = h.mean(dim=2) if h.dim() == 4 else h  # [B, T, streams, d]

        if -1 in layer_ids:
            self.target.get_input_embeddings().register_forward_hook(
                lambda module, args, output: keep(-1, output)
            )
        for i in layer_ids:
            if i >= 0:
                layers[i].register_forward_hook(lambda module, args, output, i=i: keep(i, output))

    def features(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's captured layers ``[B, T, m * d]`` and logits ``[B, T, V]``."""
        out = self.target(ids)
        feats = torch.cat([self._captured.pop(i) for i in self.layer_ids], dim=-1)
        return feats, out.logits.float()

    # ---- one step -----------------------------------------------------------------

    def lr_at(self, step: int) -> float:
        cfg = self.cfg
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))

    def batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        rows = torch.randint(0, self.sequences.shape[0], (self.cfg.batch_size,), generator=g)
        return self.sequences[rows]

    def loss(self, ids: torch.Tensor, step: int) -> tuple[torch.Tensor, StepMetrics]:
        cfg, gamma = self.cfg, self.cfg.block_size
        ids = ids.to(self.device)
        b, t = ids.shape
        with torch.no_grad():
            feats, target_logits = self.features(ids)  # [B, T, m * d], [B, T, V]
        g = torch.Generator().manual_seed(self.cfg.seed * 7_919 + step)
        count = min(cfg.anchors, t - 1)
        anchors = (
            torch.rand(b, t - 1, generator=g).argsort(dim=1)[:, :count].sort(dim=1).values
        ).to(self.device)  # [B, A]; drawn on the CPU: the same anchors on every device
        k = torch.arange(gamma, device=self.device)
        slot = anchors[:, :, None] + k  # [B, A, G]: the position each slot predicts from
        valid = slot + 1 < t
        safe = slot.clamp(max=t - 2)
        labels = ids.gather(1, (safe + 1).view(b, -1)).view_as(safe)
        prev = torch.cat([ids.gather(1, anchors)[:, :, None], labels[:, :, :-1]], dim=-1)

        hidden = self.model.train_hidden(feats, ids, anchors, gamma)  # [B, A, G, d]
        logits, conf = self.model.train_logits(hidden, prev)  # [B, A, G, V]
        tgt = target_logits.gather(1, safe.view(b, -1, 1).expand(-1, -1, target_logits.shape[-1]))
        tgt = tgt.view(*safe.shape, -1)
        p_t = torch.softmax(tgt, dim=-1)
        logp_d = torch.log_softmax(logits, dim=-1)
        p_d = logp_d.exp()
        ce = -(p_t * logp_d).sum(-1)  # [B, A, G]
        tv = (p_d - p_t).abs().sum(-1)
        w = torch.exp(-k.float() / 4)[None, None, :] * valid
        main = ((0.1 * ce + 0.9 * tv) * w).sum() / w.sum()
        loss = main
        if conf is not None:
            soft = (1 - 0.5 * tv).detach().clamp(0, 1)
            bce = F.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), soft, reduction="none")
            loss = loss + cfg.confidence_weight * (bce * valid).sum() / valid.sum()
        with torch.no_grad():
            match = (logits.argmax(-1) == tgt.argmax(-1)) & valid
            tau = 1 + match.int().cumprod(dim=-1).sum(-1).float().mean()
            accept = ((1 - 0.5 * tv) * valid).sum() / valid.sum()
        tv_mean = float((tv * valid).sum().detach() / valid.sum())
        return loss, StepMetrics(float(loss.detach()), tv_mean, float(accept), float(tau))

    def train(self, progress: bool = True) -> list[StepMetrics]:
        from tqdm import tqdm

        history = []
        bar = tqdm(
            total=self.cfg.steps,
            initial=self.step,
            disable=not progress,
            desc="train-dspark",
            dynamic_ncols=True,
        )
        self.model.train()
        while self.step < self.cfg.steps:
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr_at(self.step)
            loss, m = self.loss(self.batch(self.step), self.step)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.requires_grad], 1.0
            )
            self.optimizer.step()
            self.step += 1
            history.append(m)
            bar.set_postfix(
                loss=f"{m.loss:.3f}", tv=f"{m.tv:.3f}", accept=f"{m.accept:.2f}", tau=f"{m.tau:.2f}"
            )
            bar.update(1)
            if self.step % self.cfg.save_every == 0 or self.step == self.cfg.steps:
                self.save()
        bar.close()
        self.model.eval()
        return history

    # ---- checkpoints ------------------------------------------------------------------

    def save(self) -> None:
        """The drafter in DeepSpec's format, plus the state to resume from."""
        out = self.cfg.out
        os.makedirs(out, exist_ok=True)
        dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
            self.cfg.dtype
        ]
        state = {}
        if self.v4:  # DeepSeek's layout: mtp.* only, the target's embedding and head shared
            items = self.model.checkpoint_state().items()
        else:
            items = self.model.state_dict().items()
        for key, value in items:
            if not self.cfg.save_embeddings and key in ("embed_tokens.weight", "lm_head.weight"):
                continue
            state[key] = value.detach().to("cpu", dtype).contiguous().clone()
        save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(self.draft_json, f, indent=2)
        torch.save(
            {
                "step": self.step,
                "optimizer": self.optimizer.state_dict(),
                "config": asdict(self.cfg),
            },
            os.path.join(out, STATE_FILE),
        )

    def _resume(self) -> None:
        path = os.path.join(self.cfg.out, STATE_FILE)
        if not os.path.isfile(path):
            return
        state = torch.load(path, weights_only=False, map_location="cpu")
        weights = load_file(os.path.join(self.cfg.out, "model.safetensors"))
        if self.v4:
            targets = self.model.checkpoint_targets()
            with torch.no_grad():
                for key, value in weights.items():
                    targets[self.model.checkpoint_key(key)].copy_(value)
            self.optimizer.load_state_dict(state["optimizer"])
            self.step = int(state["step"])
            return
        own = {
            k: v for k, v in weights.items() if k not in ("embed_tokens.weight", "lm_head.weight")
        }
        missing = self.model.load_state_dict(own, strict=False)
        unexpected = [k for k in missing.unexpected_keys]
        if unexpected:
            raise ValueError(f"resume: {path}: unexpected tensors {unexpected[:3]}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])


def v4_draft_config(cfg: DSparkTrainConfig, target: dict, noise_token_id: int) -> dict:
    """A DeepSeek-V4 drafter's ``config.json``: the target's, with the
    ``dspark_*`` fields its checkpoints carry (the stages follow the target's
    architecture, one per captured layer)."""
    n = int(target["num_hidden_layers"])
    return {
        **target,
        "dtype": cfg.dtype,
        "dspark_block_size": cfg.block_size,
        "dspark_target_layer_ids": list(cfg.target_layer_ids or default_layer_ids(n, 2)),
        "dspark_markov_rank": cfg.markov_rank or 32,
        "dspark_noise_token_id": noise_token_id,
        "enable_confidence_head": True,
    }


def _earlier_entry_wins(model) -> None:
    """Gives this transformers V4 model's indexer the engine's rule for tied
    top-k scores (the earlier entry wins; see docs/models.md), so that the
    features a drafter trains on are the ones it is served: a perturbation
    far below any real score gap, on this model's scorers only."""
    for module in model.modules():
        if type(module).__name__ != "DeepseekV4IndexerScorer":
            continue
        forward = module.forward

        def tie_broken(q, keys, hidden, forward=forward):
            scores = forward(q, keys, hidden)
            order = torch.arange(scores.shape[-1], device=scores.device, dtype=scores.dtype)
            return scores - order * 1e-30

        module.forward = tie_broken


def _init_v4_weights(model: DSparkV4DraftModel, seed: int) -> None:
    def leaf(name: str) -> str:
        return name.rsplit(".", 1)[-1]

    _init_params(
        model,
        seed,
        frozen=("embed.", "head."),
        is_one=lambda n: n.endswith("norm.weight") or leaf(n) == "scale",
        is_zero=lambda n: leaf(n) in ("bias", "base", "attn_sink"),
    )
    with torch.no_grad():
        for stage in model.stages:  # residual branches start small
            stage.attn.wo_b.weight.mul_(0.5)
            stage.ffn.experts.w2.mul_(0.5)
            stage.ffn.shared_experts.w2.weight.mul_(0.5)


def _mask_token_id(tokenizer) -> int:
    for name in ("<|mask|>", "<mask>", "[MASK]"):
        tid = tokenizer.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
            return tid
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    raise ValueError(
        "target tokenizer has no mask or pad token to use as the drafter's mask_token_id"
    )


def _init_weights(model: DSparkDraftModel, seed: int) -> None:
    _init_params(
        model,
        seed,
        frozen=("embed_tokens", "lm_head"),
        is_one=lambda n: "norm" in n,
        is_zero=lambda n: n.endswith("bias"),
    )
    with torch.no_grad():
        for layer in model.layers:  # residual branches start small
            layer.self_attn.o_proj.weight.mul_(0.5)
            layer.mlp.down_proj.weight.mul_(0.5)


def _init_params(
    model: nn.Module,
    seed: int,
    frozen: tuple[str, ...],
    is_one: Callable[[str], bool],
    is_zero: Callable[[str], bool],
) -> None:
    """A fresh drafter: ones, zeros or N(0, 0.02) by parameter name (seeded),
    the target's shared embedding and head (``frozen`` prefixes) untouched."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(frozen):
                continue
            if is_one(name):
                p.fill_(1.0)
            elif is_zero(name):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
