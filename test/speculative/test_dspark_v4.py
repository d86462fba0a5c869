"""DeepSeek-V4's bundled DSpark drafter (``mtp.*``, ``dspark_*`` fields).

The drafter's forward is checked against a reference written here from the
public description, on the checkpoint's own tensors: transformers' V4 mHC
and MoE modules for those parts, the stage attention by hand. DSPARK on a V4
target must give plain decoding's ids and logprobs, with the drafter bundled
in the target or in a directory of its own.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from models_zoo import random_prompts
from specserve import Engine
from specserve.tools.tiny_model import make_tiny_dspark_v4, make_tiny_model

BLOCK = 4


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("v4-dspark")
    target = make_tiny_model(str(root / "v4"), arch="deepseek_v4", num_layers=5)
    drafter = make_tiny_dspark_v4(str(root / "drafter"), target, block_size=BLOCK, seed=1)
    bundle = make_tiny_dspark_v4(
        str(root / "bundle"), target, block_size=BLOCK, seed=1, bundle=True
    )
    return {"target": target, "drafter": drafter, "bundle": bundle}


def engine(path: str, **kw) -> Engine:
    args = dict(dtype="float32", page_size=4, max_running_requests=4, chunked_prefill_size=32)
    return Engine(model_path=path, **{**args, **kw})


# ---- the reference ----------------------------------------------------------


def rms(x, weight=None, eps=1e-6):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rope(x, positions, theta, rot, inverse=False):
    """Interleaved pairs of the trailing ``rot`` channels; ``x [T, H, D]``."""
    freqs = positions[:, None].float() / theta ** (torch.arange(0, rot, 2).float() / rot)
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
    if inverse:
        sin = -sin
    head, tail = x[..., :-rot], x[..., -rot:]
    even, odd = tail[..., 0::2], tail[..., 1::2]
    out = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
    return torch.cat([head, out], dim=-1)


def hf_modules(cfg_dict, w, stage):
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
    return hcs, moe


def reference_block(cfg, w, target_w, features, anchor, prev):
    """Base logits ``[G, V]``, Markov-corrected logits ``[G, V]`` (``prev``: the
    token before each slot) and confidences ``[G]`` of one block whose anchor
    sits right after the context ``features [P, m * d]``."""
    n_stage = len(cfg["dspark_target_layer_ids"])
    h, d, window = cfg["num_attention_heads"], cfg["head_dim"], cfg["sliding_window"]
    groups, theta = cfg["o_groups"], cfg["rope_parameters"]["main"]["rope_theta"]
    rot = int(d * cfg["rope_parameters"]["main"]["partial_rotary_factor"])
    eps = cfg["rms_norm_eps"]
    p_len = features.shape[0]
    main_x = rms(features @ w["mtp.0.main_proj.weight"].T, w["mtp.0.main_norm.weight"], eps)
    ids = torch.tensor([anchor] + [cfg["dspark_noise_token_id"]] * (BLOCK - 1))
    block_pos = torch.arange(p_len, p_len + BLOCK)
    ctx_pos = torch.arange(max(0, p_len - window), p_len)
    x = target_w["model.embed_tokens.weight"][ids]
    streams = x[:, None, :].expand(-1, cfg["hc_mult"], -1)[None].contiguous()  # [1, G, N, d]
    for s in range(n_stage):
        a = f"mtp.{s}.attn."
        (hc_attn, hc_ffn), moe = hf_modules(cfg, w, s)
        post, comb, collapsed = hc_attn(streams)
        y = rms(collapsed[0], w[f"mtp.{s}.attn_norm.weight"], eps)  # [G, d]
        q = rms(y @ w[a + "wq_a.weight"].T, w[a + "q_norm.weight"], eps) @ w[a + "wq_b.weight"].T
        q = rope(rms(q.view(BLOCK, h, d), eps=eps), block_pos, theta, rot)
        ck = rope(
            rms(main_x[ctx_pos] @ w[a + "wkv.weight"].T, w[a + "norm.weight"], eps)[:, None],
            ctx_pos,
            theta,
            rot,
        )[:, 0]
        bk = rope(
            rms(y @ w[a + "wkv.weight"].T, w[a + "norm.weight"], eps)[:, None],
            block_pos,
            theta,
            rot,
        )[:, 0]
        keys = torch.cat([ck, bk])  # every block query sees the window and the whole block
        scores = torch.einsum("ghd,kd->ghk", q, keys) * d**-0.5
        sink = w[a + "attn_sink"][None, :, None].expand(BLOCK, h, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        o = rope(torch.einsum("ghk,kd->ghd", probs, keys), block_pos, theta, rot, inverse=True)
        o = o.reshape(BLOCK, groups, -1)
        wo_a = w[a + "wo_a.weight"].view(groups, -1, o.shape[-1])
        out = torch.einsum("gci,cri->gcr", o, wo_a).reshape(BLOCK, -1) @ w[a + "wo_b.weight"].T
        streams = post[..., None] * out[None, :, None, :] + torch.matmul(
            comb.transpose(-1, -2), streams
        )
        post, comb, collapsed = hc_ffn(streams)
        out = moe(rms(collapsed, w[f"mtp.{s}.ffn_norm.weight"], eps))
        streams = post[..., None] * out[:, :, None, :] + torch.matmul(
            comb.transpose(-1, -2), streams
        )
    last = f"mtp.{n_stage - 1}."
    flat = rms(streams[0].flatten(1), eps=eps)
    pre = torch.sigmoid(
        flat @ w[last + "hc_head_fn"].T * w[last + "hc_head_scale"] + w[last + "hc_head_base"]
    )
    collapsed = ((pre + cfg["hc_eps"])[..., None] * streams[0]).sum(1)  # [G, d]
    base = rms(collapsed, w[last + "norm.weight"], eps) @ target_w["head.weight"].T
    embed = w[last + "markov_head.markov_w1.weight"][prev]  # [G, r]
    corrected = base + embed @ w[last + "markov_head.markov_w2.weight"].T
    conf = torch.sigmoid(
        torch.cat([collapsed, embed], -1) @ w[last + "confidence_head.proj.weight"].T
    )
    return base, corrected, conf[:, 0]


def test_drafter_forward_matches_a_reference(paths) -> None:
    eng = engine(paths["target"], speculative_algorithm="DSPARK",
                 speculative_draft_model_path=paths["drafter"])  # fmt: skip
    model = eng.proposer.model
    with open(os.path.join(paths["drafter"], "config.json")) as f:
        cfg = json.load(f)
    w = load_file(os.path.join(paths["drafter"], "model.safetensors"))
    target_w = load_file(os.path.join(paths["target"], "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    m = len(cfg["dspark_target_layer_ids"])
    for p_len in (3, 11):  # a context shorter and longer than the window (8)
        features = torch.randn(p_len, m * cfg["hidden_size"], generator=g)
        anchor, prev = 17, torch.tensor([17, 40, 41, 42])
        with torch.no_grad():
            want_base, want_corr, want_conf = reference_block(
                cfg, w, target_w, features, anchor, prev
            )
            keys = model.context_kv(features, torch.arange(p_len))
            lo = max(0, p_len - model.window)
            ctx = [k[lo:, 0][None] for k, _ in keys]
            attend = model.window_attend(ctx, torch.zeros(1, p_len - lo))
            hidden = model.block_hidden(
                torch.tensor([anchor]), torch.tensor([p_len]), attend, BLOCK
            )
            base = model.base_logits(hidden)[0]
            bias = [
                model.markov_head.step(prev[k : k + 1], hidden[:, k], None) for k in range(BLOCK)
            ]
            corrected = base + torch.cat([b[0] for b in bias])
            conf = model._confidence(hidden, [b[2] for b in bias])[0]
        assert torch.allclose(base, want_base, atol=1e-4)
        assert torch.allclose(corrected, want_corr, atol=1e-4)
        assert torch.allclose(conf, want_conf, atol=1e-5)


@pytest.mark.parametrize("layout", ["bundle", "drafter"])
def test_greedy_dspark_equals_plain(paths, layout) -> None:
    """The drafter bundled in the target (no draft path) or in its own
    directory: ids, logprobs and top-5 as plain decoding gives them."""
    prompts = random_prompts(3, [5, 19, 37], seed=23)
    kw = dict(
        sampling_params={"temperature": 0, "max_new_tokens": 40, "ignore_eos": True},
        return_logprob=True, logprob_start_len=0, top_logprobs_num=5,
    )  # fmt: skip
    plain = engine(paths["target"]).generate(input_ids=prompts, **kw)
    if layout == "bundle":
        spec_eng = engine(paths["bundle"], speculative_algorithm="DSPARK")
    else:
        spec_eng = engine(paths["target"], speculative_algorithm="DSPARK",
                          speculative_draft_model_path=paths["drafter"])  # fmt: skip
    spec = spec_eng.generate(input_ids=prompts, **kw)
    assert spec_eng.core.spec.stats.rounds > 0
    for a, b in zip(plain, spec):
        assert a["output_ids"] == b["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            la, lb = a["meta_info"][key], b["meta_info"][key]
            assert [x[1] for x in la] == [x[1] for x in lb]
            assert max(abs((x[0] or 0) - (y[0] or 0)) for x, y in zip(la, lb)) < 1e-4
        top_a = a["meta_info"]["output_top_logprobs"]
        top_b = b["meta_info"]["output_top_logprobs"]
        assert [[t[1] for t in r] for r in top_a] == [[t[1] for t in r] for r in top_b]


def test_a_v4_target_without_a_drafter_is_named(paths, tmp_path) -> None:
    with pytest.raises(ValueError, match="speculative_draft_model_path is required"):
        engine(paths["target"], speculative_algorithm="DSPARK")
    plain = str(tmp_path / "plain")
    shutil.copytree(paths["target"], plain)
    with pytest.raises(ValueError, match="no DeepSeek-V4 DSpark drafter here"):
        engine(paths["target"], speculative_algorithm="DSPARK", speculative_draft_model_path=plain)
    with pytest.raises(ValueError, match="exceeds the drafter's block size"):
        engine(paths["bundle"], speculative_algorithm="DSPARK", speculative_dspark_block_size=9)


def test_json_schema_with_logprobs_streamed_and_not(paths) -> None:
    """A schema under DSPARK on V4: valid JSON, one logprob per completion
    token, the stream's deltas adding up to the whole answer, and the same
    output as plain decoding."""
    import asyncio

    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "k": {"enum": ["aa", "bb"]},
        },
        "required": ["n", "k"],
    }
    sp = {"json_schema": json.dumps(schema), "temperature": 0, "max_new_tokens": 40}
    prompt = random_prompts(1, [9], seed=29)[0]
    eng = engine(paths["bundle"], speculative_algorithm="DSPARK")
    whole = eng.generate(input_ids=[prompt], sampling_params=sp, return_logprob=True)[0]
    jsonschema.validate(json.loads(whole["text"]), schema)
    lps = whole["meta_info"]["output_token_logprobs"]
    assert len(lps) == whole["meta_info"]["completion_tokens"] == len(whole["output_ids"])

    async def stream():
        return [
            d
            async for d in eng.generate_stream(
                input_ids=prompt, sampling_params=sp, return_logprob=True
            )
        ]

    deltas = asyncio.run(stream())
    assert "".join(d["text"] for d in deltas) == whole["text"]
    streamed = [x for d in deltas for x in d["meta_info"]["output_token_logprobs"]]
    assert streamed == lps
    plain = engine(paths["target"]).generate(input_ids=[prompt], sampling_params=sp)[0]
    assert plain["output_ids"] == whole["output_ids"]
    assert eng.core.spec.stats.rounds > 0 and eng.stats()["grammar_matchers"] == 0


def test_sampled_dspark_is_lossless(paths) -> None:
    """Sampling under DSPARK on V4 gives plain sampling's distribution: six
    allowed tokens (a logit bias the drafter knows nothing of), chi-square of
    homogeneity at the first and a later position, 600 seeded requests each."""
    allowed = [20, 21, 22, 23, 24, 25]
    bias = {t: -100.0 for t in range(528) if t not in allowed}
    n, prompt = 600, [30, 31, 32]
    sps = [
        {
            "temperature": 1.3,
            "max_new_tokens": 4,
            "ignore_eos": True,
            "seed": 1000 + i,
            "logit_bias": bias,
        }
        for i in range(n)
    ]
    spec_eng = engine(paths["bundle"], speculative_algorithm="DSPARK", max_running_requests=64)
    spec = spec_eng.generate(input_ids=[prompt] * n, sampling_params=sps)
    assert spec_eng.core.spec.stats.rounds > 0
    plain = engine(paths["target"], max_running_requests=64).generate(
        input_ids=[prompt] * n, sampling_params=[{**s, "seed": s["seed"] + 10**6} for s in sps]
    )
    for position in (0, 3):
        a = torch.bincount(
            torch.tensor([allowed.index(o["output_ids"][position]) for o in spec]), minlength=6
        )
        b = torch.bincount(
            torch.tensor([allowed.index(o["output_ids"][position]) for o in plain]), minlength=6
        )
        expect = (a + b).float() / 2
        chi2 = (((a - expect) ** 2 + (b - expect) ** 2) / expect.clamp(min=1e-9)).sum()
        assert float(chi2) < 20.5, (position, a.tolist(), b.tolist())  # 0.999 quantile, 5 dof


@pytest.fixture(scope="module")
def trained(paths, tmp_path_factory) -> str:
    """``train-dspark`` on the V4 target's own greedy continuations."""
    from specserve.training.data import write_jsonl
    from specserve.training.train_dspark import DSparkTrainConfig, DSparkTrainer

    root = tmp_path_factory.mktemp("v4-trained")
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 500, (32, 8), generator=g).tolist()
    sp = {"temperature": 0, "max_new_tokens": 56, "ignore_eos": True}
    outs = engine(paths["target"]).generate(input_ids=prompts, sampling_params=sp)
    data = str(root / "data.jsonl")
    write_jsonl(data, (p + o["output_ids"] for p, o in zip(prompts, outs)))
    cfg = DSparkTrainConfig(
        target=paths["target"], data=(data,), out=str(root / "trained"), block_size=BLOCK,
        markov_rank=16, steps=60, batch_size=8, seq_len=64, anchors=8, lr=5e-3, warmup=5,
        save_every=1000, seed=1,
    )  # fmt: skip
    history = DSparkTrainer(cfg).train(progress=False)
    assert history[-1].loss < history[0].loss * 0.9  # it learns
    return cfg.out


def test_a_trained_drafter_gets_drafts_accepted(paths, trained) -> None:
    """The checkpoint ``train-dspark`` writes is in the published layout, and
    DSPARK with it equals plain decoding (ids, every logprob field) with
    drafts accepted."""
    with open(os.path.join(trained, "config.json")) as f:
        conf = json.load(f)
    assert conf["dspark_block_size"] == BLOCK and conf["dspark_markov_rank"] == 16
    assert all(k.startswith("mtp.") for k in load_file(os.path.join(trained, "model.safetensors")))
    spec = engine(
        paths["target"], speculative_algorithm="DSPARK", speculative_draft_model_path=trained
    )
    prompts = torch.randint(4, 500, (6, 8), generator=torch.Generator().manual_seed(99)).tolist()
    kw = dict(
        sampling_params={"temperature": 0, "max_new_tokens": 48, "ignore_eos": True},
        return_logprob=True, logprob_start_len=2, top_logprobs_num=5, token_ids_logprob=[4, 77],
    )  # fmt: skip
    want = engine(paths["target"]).generate(input_ids=prompts, **kw)
    got = spec.generate(input_ids=prompts, **kw)
    for a, b in zip(want, got):
        assert a["output_ids"] == b["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            la, lb = a["meta_info"][key], b["meta_info"][key]
            assert max(abs((x[0] or 0) - (y[0] or 0)) for x, y in zip(la, lb)) < 1e-4
        for key in ("output_top_logprobs", "output_token_ids_logprobs"):
            ra, rb = a["meta_info"][key], b["meta_info"][key]
            assert [[t[1] for t in r] for r in ra] == [[t[1] for t in r] for r in rb]
            assert max(abs(x[0] - y[0]) for r, q in zip(ra, rb) for x, y in zip(r, q)) < 1e-4
    tau = spec.core.spec.stats.accept_length
    assert tau > 1.0, tau  # some drafts accepted


def test_a_token_map_keeps_v4_drafting_exact(paths, trained, tmp_path) -> None:
    """The trained drafter drafting from a token map (the tokens plain decoding
    emits, and 40 others): the same ids and logprobs, drafts still accepted."""
    prompts = torch.randint(4, 500, (4, 8), generator=torch.Generator().manual_seed(98)).tolist()
    kw = dict(
        sampling_params={"temperature": 0, "max_new_tokens": 40, "ignore_eos": True},
        return_logprob=True,
    )
    want = engine(paths["target"]).generate(input_ids=prompts, **kw)
    hot = sorted({t for o in want for t in o["output_ids"]} | set(range(100, 140)))
    torch.save(torch.tensor(hot), tmp_path / "map.pt")
    spec = engine(
        paths["target"], speculative_algorithm="DSPARK", speculative_draft_model_path=trained,
        speculative_token_map=str(tmp_path / "map.pt"),
    )  # fmt: skip
    assert spec.proposer.model.hot_ids.tolist() == hot
    got = spec.generate(input_ids=prompts, **kw)
    for a, b in zip(want, got):
        assert a["output_ids"] == b["output_ids"]
        la, lb = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        assert max(abs(x[0] - y[0]) for x, y in zip(la, lb)) < 1e-4
    assert spec.core.spec.stats.accept_length > 1.0


def test_limits_and_stops_cut_accepted_runs(paths, trained) -> None:
    """Every output length from 1 to 24 and stop strings at many offsets, in
    one batch of one prompt: wherever a cut falls (inside an accepted run
    too), the output is plain decoding's."""
    spec = engine(
        paths["target"], speculative_algorithm="DSPARK", speculative_draft_model_path=trained
    )
    base = {"temperature": 0, "ignore_eos": True}
    # Of prompts the drafter was trained on, the one whose drafts are accepted
    # most: the same prompt in every request below drafts the same runs.
    candidates = torch.randint(4, 500, (32, 8), generator=torch.Generator().manual_seed(0))[:8]
    tried = spec.generate(
        input_ids=candidates.tolist(), sampling_params={**base, "max_new_tokens": 24}
    )
    taus = [o["meta_info"]["spec_accept_length"] for o in tried]
    assert max(taus) > 1.0, taus
    prompt = candidates[taus.index(max(taus))].tolist()
    plain = engine(paths["target"])
    full = plain.generate(input_ids=[prompt], sampling_params={**base, "max_new_tokens": 24})[0]
    text = full["text"]
    stops = sorted({text[i : i + 2] for i in range(1, len(text) - 2, 3) if text[i : i + 2].strip()})
    sps = [{**base, "max_new_tokens": n} for n in range(1, 25)]
    sps += [{**base, "max_new_tokens": 24, "stop": [s]} for s in stops]
    want = plain.generate(input_ids=[prompt] * len(sps), sampling_params=sps)
    got = spec.generate(input_ids=[prompt] * len(sps), sampling_params=sps)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert [o["text"] for o in got] == [o["text"] for o in want]


@pytest.mark.parametrize(
    "schedule",
    [{"speculative_dspark_confidence_threshold": 0.5}, {"speculative_dspark_schedule": "budget"}],
    ids=["threshold", "budget"],
)
def test_confidence_scheduled_verify_lengths(paths, schedule, tmp_path) -> None:
    """The confidence head chooses how many drafts to verify (a static
    threshold, or the budget scheduler over a profiled steps/s table): still
    plain decoding's output."""
    prompts = random_prompts(3, [6, 17, 30], seed=31)
    sp = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    want = engine(paths["target"]).generate(input_ids=prompts, sampling_params=sp)
    extra = (
        {"speculative_dspark_sps_table_path": str(tmp_path / "sps.json")}
        if "speculative_dspark_schedule" in schedule
        else {}
    )
    spec = engine(paths["bundle"], speculative_algorithm="DSPARK", **schedule, **extra)
    got = spec.generate(input_ids=prompts, sampling_params=sp)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert spec.core.spec.stats.rounds > 0
