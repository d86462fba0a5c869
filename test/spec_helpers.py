"""Shared by the speculative tests: a test-double proposer, and DeepSeek-V4's
DSpark drafter (tiny checkpoints, a reference block forward, the target
features it reads) written out independently of the code under test."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch

from models_zoo import model_path
from specserve.config import EngineConfig
from specserve.core import Req
from specserve.runner.model_runner import ModelRunner
from specserve.speculative.base import DraftProposal, Proposer
from specserve.speculative.dspark import DSparkProposer

# A JSON schema whose answers are short whatever the model (a bounded number
# and an enum): grammar-constrained requests finish within a few dozen tokens.
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "k": {"enum": ["aa", "bb"]},
    },
    "required": ["n", "k"],
}


class OracleProposer(Proposer):
    """Proposes the target's own greedy continuation, corrupted at a chosen
    draft index each round, so that the accept length of round k is known."""

    def __init__(
        self, continuations: dict[str, list[int]], schedule: list[int], max_drafts: int
    ) -> None:
        self.continuations = continuations
        self.schedule = schedule
        self.max_drafts = max_drafts
        self.planned: dict[str, list[int]] = {}
        self.observed: dict[str, list[int]] = {}
        self.last_len: dict[str, int] = {}
        self.last_committed: dict[str, int] = {}  # by verify rounds, at the last proposal

    def propose(self, reqs: Sequence[Req], max_lens: Sequence[int]) -> DraftProposal:
        out = []
        for r, limit in zip(reqs, max_lens):
            plan = self.planned.setdefault(r.rid, [])
            if r.rid in self.last_len:  # what the last round committed tells its accept length
                self.observed.setdefault(r.rid, []).append(
                    len(r.output_ids) - self.last_len[r.rid] - 1
                )
            self.last_len[r.rid] = len(r.output_ids)
            self.last_committed[r.rid] = r.spec.committed
            known = self.continuations.get(r.rid, [])
            truth = known[len(r.output_ids) : len(r.output_ids) + limit]
            cut = self.schedule[len(plan) % len(self.schedule)]
            drafts = list(truth)
            if cut < len(drafts):
                drafts[cut] = (drafts[cut] + 1) % 500
            plan.append(min(cut, len(drafts)))
            out.append(drafts)
        return DraftProposal(out, [None] * len(reqs))

    def release(self, req: Req) -> None:
        """A finished request's last round is observed here (nothing is
        proposed after it; a plain step may follow it)."""
        self.last_len.pop(req.rid, None)
        last = self.last_committed.pop(req.rid, None)
        if last is not None and req.finished and req.spec.committed > last:
            self.observed.setdefault(req.rid, []).append(req.spec.committed - last - 1)
        super().release(req)


class VerifyRecorder:
    """Records every chain an engine verifies, as the target saw it: the
    request, the number of tokens it had committed (its anchor the last) and
    the drafts after the anchor. Wraps the engine's one verify call, so it
    sees what was verified, whichever proposer drew it and whatever cut it."""

    def __init__(self, eng) -> None:
        self.chains: list[tuple[str, int, list[int]]] = []
        spec = eng.core.spec
        inner = spec.verify

        def verify(batch, *args, **kwargs):
            for step in batch.steps:
                if step.verify:
                    self.chains.append((step.req.rid, len(step.req.output_ids), list(step.drafts)))
            return inner(batch, *args, **kwargs)

        spec.verify = verify

    def accepted(self, outputs: dict[str, list[int]]) -> list[int]:
        """Per chain, how many of its drafts the final output kept: the length of
        the drafts' common prefix with the output after the anchor (greedy
        decoding keeps exactly those)."""
        out = []
        for rid, committed, drafts in self.chains:
            truth = outputs[rid][committed : committed + len(drafts)]
            n = 0
            while n < len(truth) and drafts[n] == truth[n]:
                n += 1
            out.append(n)
        return out

    def taus(self, outputs: dict[str, list[int]]) -> dict[str, tuple[int, float]]:
        """Per request: its verify rounds and the tokens they committed per
        round, counted from the chains and the final output (the accepted
        drafts and the target's own token after them, cut at the output's end)."""
        rounds: dict[str, list[int]] = {}
        for (rid, committed, _), kept in zip(self.chains, self.accepted(outputs)):
            rounds.setdefault(rid, []).append(min(kept + 1, len(outputs[rid]) - committed))
        return {rid: (len(c), sum(c) / len(c)) for rid, c in rounds.items()}

    def per_position(self, outputs: dict[str, list[int]]) -> tuple[list[int], list[int]]:
        """Per draft position: the chains that verified it, and that kept it
        (cut, as the round's commit is, at the output's end)."""
        verified: list[int] = []
        accepted: list[int] = []
        for (rid, committed, drafts), kept in zip(self.chains, self.accepted(outputs)):
            kept = min(kept, len(outputs[rid]) - committed - 1)
            for counts, n in ((verified, len(drafts)), (accepted, kept)):
                counts += [0] * (n - len(counts))
                for k in range(n):
                    counts[k] += 1
        return verified, accepted + [0] * (len(verified) - len(accepted))


# ---- DeepSeek-V4's DSpark drafter, written out from its description ---------


def v4_checkpoints(root: str, block: int) -> dict[str, str]:
    """A tiny 5-layer DeepSeek-V4 target (window 8) and a random DSpark drafter
    for it with ``block`` slots, in its own directory and bundled in a copy
    of the target."""
    from specserve.tools.tiny_model import make_tiny_dspark_v4, make_tiny_model

    target = make_tiny_model(os.path.join(root, "v4"), arch="deepseek_v4", num_layers=5)
    drafter = make_tiny_dspark_v4(os.path.join(root, "drafter"), target, block_size=block, seed=1)
    bundle = make_tiny_dspark_v4(
        os.path.join(root, "bundle"), target, block_size=block, seed=1, bundle=True
    )
    return {"target": target, "drafter": drafter, "bundle": bundle}


class V4Reference:
    """The V4 drafter's block forward over a drafter directory's own tensors:
    transformers' V4 mHC and MoE modules for those parts, the stage attention
    (sliding window, sinks, grouped output) by hand."""

    def __init__(self, drafter: str, target: str) -> None:
        from safetensors.torch import load_file

        with open(os.path.join(drafter, "config.json")) as f:
            self.cfg = json.load(f)
        self.w = load_file(os.path.join(drafter, "model.safetensors"))
        self.target_w = load_file(os.path.join(target, "model.safetensors"))
        self.block = self.cfg["dspark_block_size"]
        self.modules = [_hf_v4_modules(self.cfg, self.w, s) for s in range(self.num_stages)]

    @property
    def num_stages(self) -> int:
        return len(self.cfg["dspark_target_layer_ids"])

    @torch.no_grad()
    def block_forward(
        self, features: torch.Tensor, anchor: int, prev: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Base logits ``[G, V]``, Markov-corrected logits ``[G, V]`` (``prev
        [G]``: the token before each slot) and confidences ``[G]`` of the block
        whose anchor sits right after the context ``features [P, m * d]``."""
        cfg, w, g = self.cfg, self.w, self.block
        h, d, window = cfg["num_attention_heads"], cfg["head_dim"], cfg["sliding_window"]
        groups, theta = cfg["o_groups"], cfg["rope_parameters"]["main"]["rope_theta"]
        rot = int(d * cfg["rope_parameters"]["main"]["partial_rotary_factor"])
        eps = cfg["rms_norm_eps"]
        p_len = features.shape[0]
        main_x = _rms(features @ w["mtp.0.main_proj.weight"].T, w["mtp.0.main_norm.weight"], eps)
        ids = torch.tensor([anchor] + [cfg["dspark_noise_token_id"]] * (g - 1))
        block_pos = torch.arange(p_len, p_len + g)
        ctx_pos = torch.arange(max(0, p_len - window), p_len)  # the window before the anchor
        x = self.target_w["model.embed_tokens.weight"][ids]
        streams = x[:, None, :].expand(-1, cfg["hc_mult"], -1)[None].contiguous()  # [1, G, N, d]
        for s, ((hc_attn, hc_ffn), moe) in enumerate(self.modules):
            a = f"mtp.{s}.attn."
            post, comb, collapsed = hc_attn(streams)
            y = _rms(collapsed[0], w[f"mtp.{s}.attn_norm.weight"], eps)  # [G, d]
            q = (
                _rms(y @ w[a + "wq_a.weight"].T, w[a + "q_norm.weight"], eps)
                @ w[a + "wq_b.weight"].T
            )
            q = _rope(_rms(q.view(g, h, d), eps=eps), block_pos, theta, rot)

            def key(z: torch.Tensor, pos: torch.Tensor, a: str = a) -> torch.Tensor:
                k = _rms(z @ w[a + "wkv.weight"].T, w[a + "norm.weight"], eps)[:, None]
                return _rope(k, pos, theta, rot)[:, 0]

            # Every block query sees the window and the whole block (keys = values).
            keys = torch.cat([key(main_x[ctx_pos], ctx_pos), key(y, block_pos)])
            scores = torch.einsum("ghd,kd->ghk", q, keys) * d**-0.5
            sink = w[a + "attn_sink"][None, :, None].expand(g, h, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
            o = torch.einsum("ghk,kd->ghd", probs, keys)
            o = _rope(o, block_pos, theta, rot, inverse=True).reshape(g, groups, -1)
            wo_a = w[a + "wo_a.weight"].view(groups, -1, o.shape[-1])
            out = torch.einsum("gci,cri->gcr", o, wo_a).reshape(g, -1) @ w[a + "wo_b.weight"].T
            streams = post[..., None] * out[None, :, None, :] + torch.matmul(
                comb.transpose(-1, -2), streams
            )
            post, comb, collapsed = hc_ffn(streams)
            out = moe(_rms(collapsed, w[f"mtp.{s}.ffn_norm.weight"], eps))
            streams = post[..., None] * out[:, :, None, :] + torch.matmul(
                comb.transpose(-1, -2), streams
            )
        last = f"mtp.{self.num_stages - 1}."
        flat = _rms(streams[0].flatten(1), eps=eps)
        pre = torch.sigmoid(
            flat @ w[last + "hc_head_fn"].T * w[last + "hc_head_scale"] + w[last + "hc_head_base"]
        )
        collapsed = ((pre + cfg["hc_eps"])[..., None] * streams[0]).sum(1)  # [G, d]
        base = _rms(collapsed, w[last + "norm.weight"], eps) @ self.target_w["head.weight"].T
        embed = w[last + "markov_head.markov_w1.weight"][prev]  # [G, r]
        corrected = base + embed @ w[last + "markov_head.markov_w2.weight"].T
        conf = torch.sigmoid(
            torch.cat([collapsed, embed], -1) @ w[last + "confidence_head.proj.weight"].T
        )
        return base, corrected, conf[:, 0]


def hf_v4_features(model, ids: list[int], layer_ids: Sequence[int]) -> torch.Tensor:
    """What a V4 drafter reads of a transformers V4 target over ``ids``: each
    of ``layer_ids``' output streams averaged, concatenated ``[T, m * d]``."""
    out: dict[int, torch.Tensor] = {}

    def hook(i: int):
        return lambda module, args, streams: out.__setitem__(i, streams[0].mean(dim=1))

    hooks = [model.model.layers[i].register_forward_hook(hook(i)) for i in layer_ids]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for handle in hooks:
            handle.remove()
    return torch.cat([out[i] for i in layer_ids], dim=-1)


def _rms(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def _rope(x, positions, theta, rot, inverse=False) -> torch.Tensor:
    """Interleaved pairs of the trailing ``rot`` channels; ``x [T, H, D]``."""
    freqs = positions[:, None].float() / theta ** (torch.arange(0, rot, 2).float() / rot)
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
    if inverse:
        sin = -sin
    head, tail = x[..., :-rot], x[..., -rot:]
    even, odd = tail[..., 0::2], tail[..., 1::2]
    out = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
    return torch.cat([head, out], dim=-1)


def _hf_v4_modules(cfg_dict: dict, w: dict[str, torch.Tensor], stage: int):
    """transformers' mHC and MoE modules holding stage ``stage``'s tensors."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    cfg = DeepseekV4Config(**{k: v for k, v in cfg_dict.items() if not k.startswith("dspark")})
    p = f"mtp.{stage}."
    hcs = []
    for site in ("attn", "ffn"):
        hc = hf.DeepseekV4HyperConnection(cfg)
        hc.fn.data, hc.base.data = w[p + f"hc_{site}_fn"], w[p + f"hc_{site}_base"]
        hc.scale.data = w[p + f"hc_{site}_scale"]
        hcs.append(hc)
    moe = hf.DeepseekV4SparseMoeBlock(cfg, layer_idx=cfg.num_hidden_layers - 1)
    assert not moe.is_hash
    e = cfg.n_routed_experts
    moe.gate.weight.data = w[p + "ffn.gate.weight"]
    moe.gate.e_score_correction_bias.data = w[p + "ffn.gate.bias"]
    moe.experts.gate_up_proj.data = torch.stack(
        [
            torch.cat([w[p + f"ffn.experts.{i}.w1.weight"], w[p + f"ffn.experts.{i}.w3.weight"]])
            for i in range(e)
        ]
    )
    moe.experts.down_proj.data = torch.stack(
        [w[p + f"ffn.experts.{i}.w2.weight"] for i in range(e)]
    )
    for name, key in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        getattr(moe.shared_experts, name).weight.data = w[p + f"ffn.shared_experts.{key}.weight"]
    return hcs, moe.eval()


def record_drafts(eng) -> list[list[list[int]]]:
    """Every proposal's draft tokens from now on (none without a proposer)."""
    rounds: list[list[list[int]]] = []
    proposer = eng.proposer
    if proposer is None:
        return rounds
    propose = proposer.propose

    def recorded(reqs, limits):
        proposal = propose(reqs, limits)
        rounds.append(proposal.tokens)
        return proposal

    proposer.propose = recorded
    return rounds


def proposer_for(path: str, target: str | None = None, **kw) -> tuple[DSparkProposer, ModelRunner]:
    """The DSpark proposer of the target at ``target`` (by default the tiny
    Qwen3) with the drafter at ``path``."""
    cfg = EngineConfig.from_kwargs(
        target or model_path("qwen3"),
        device="cpu",
        max_total_tokens=512,
        page_size=4,
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=path,
        **kw,
    )
    runner = ModelRunner(cfg)
    return DSparkProposer.from_config(cfg, runner), runner


def features(n: int, width: int, seed: int) -> torch.Tensor:
    """Random context features ``[n, width]``."""
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def draft_rounds(path: str, **kw) -> list:
    """Three rounds of drafts, their q and confidences for two sampled
    requests (seeded) and a greedy one, fed the same context features
    (``kw``: ``proposer_for``'s; ``token_map`` True with ``map_path``)."""
    from specserve.sampling.params import SamplingParams

    flags = {"speculative_dspark_block_size": 4}
    if kw.pop("token_map", None):
        flags["speculative_token_map"] = kw.pop("map_path")
    prop, _ = proposer_for(path, **flags, **kw)
    width = prop.model.fc.in_features
    reqs = [
        Req("a", [5] * 7, SamplingParams(temperature=1.0, seed=11)),
        Req("b", [6] * 3, SamplingParams(temperature=0.8, seed=12)),
        Req("c", [7] * 5, SamplingParams(temperature=0.0)),
    ]
    for i, r in enumerate(reqs):
        prop.on_target_features(r, 0, features(r.prompt_len, width, i))
        r.output_ids = [40 + i]
    out = []
    for rnd in range(3):
        for r in reqs:
            r.generator = torch.Generator().manual_seed(100 + rnd)
        got = prop.propose(reqs, [4, 4, 4])
        out.append((got.tokens, got.q, got.confidence))
        for i, r in enumerate(reqs):
            start = r.seq_len - 1
            prop.on_target_features(r, start, features(2, width, 10 * rnd + i))
            r.output_ids += [50 + rnd, 51 + rnd]
    for r in reqs:
        prop.release(r)
    return out


def assert_same_rounds(want: list, got: list) -> None:
    """``draft_rounds`` of two drafters: the same drafts, q (exactly) and confidences."""
    for (wt, wq, wc), (gt, gq, gc) in zip(want, got):
        assert gt == wt
        for a, b in zip(wq, gq):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(b, a, atol=0, rtol=0)
        assert gc == wc


def assert_rounds_match_scratch(prop: DSparkProposer, model, lead: int = 0) -> None:
    """Three cached rounds of ``prop`` for two seeded sampled requests of
    different context lengths (padding) equal ``model``'s from-scratch
    blocks over the same features: drafts, their q and confidences (``prop``
    needs its confidences on). ``lead``: slots of ``model``'s block before
    the first draft's (dropped, the walk starting after them)."""
    from specserve.sampling.params import SamplingParams

    width = model.fc.in_features
    drafts = prop.max_drafts
    sp = SamplingParams(temperature=1.0, seed=11)
    reqs = [Req("a", [5] * 7, sp), Req("b", [6] * 3, sp)]
    feats = {"a": features(20, width, 1), "b": features(20, width, 2)}
    for r in reqs:
        prop.on_target_features(r, 0, feats[r.rid][: r.prompt_len])
        r.output_ids = [40 + len(r.rid)]
    for rnd in range(3):
        for r in reqs:
            r.generator = torch.Generator().manual_seed(100 + rnd)
        got = prop.propose(reqs, [drafts, drafts])
        for i, r in enumerate(reqs):
            p, anchor = r.seq_len - 1, r.output_ids[-1]
            hidden = model.naive_block(feats[r.rid][:p], anchor, lead + drafts)[lead:]
            gen = torch.Generator().manual_seed(100 + rnd)
            tokens, probs, conf = model.draft(
                hidden[None], torch.tensor([anchor]), torch.tensor([1.0]), [gen]
            )
            assert got.tokens[i] == tokens[0].tolist()
            torch.testing.assert_close(got.q[i], probs[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(torch.tensor(got.confidence[i]), conf[0], atol=1e-5, rtol=0)
        # Commit two more positions per request: their features extend the context.
        for r in reqs:
            start = r.seq_len - 1
            prop.on_target_features(r, start, feats[r.rid][start : start + 2])
            r.output_ids += [50, 51]
    for r in reqs:
        prop.release(r)
    assert prop.block_pool.free_pages() == prop.block_pool.total_pages()
