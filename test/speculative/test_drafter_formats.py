"""Every DSpark checkpoint format: the same weights written in DeepSpec's,
TorchSpec's and speculators' layouts draft the same tokens from the same q;
a reduced draft vocabulary drafts as the token map of its ids does; each
serves what plain decoding serves, with logprobs and a grammar."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from models_zoo import model_path, random_prompts
from spec_helpers import (
    SMALL_SCHEMA,
    assert_rounds_match_scratch,
    assert_same_rounds,
    draft_rounds,
    features,
    proposer_for,
)
from specserve import Engine
from specserve.speculative.drafter_formats import detect_format, read_drafter
from specserve.tools.drafter_layouts import write_deepspec, write_speculators, write_torchspec
from specserve.tools.tiny_model import make_tiny_dspark

# Every fifth token from 2, written in a shuffled order (d2t's offsets go
# both ways; the rows are read back by target id).
DRAFT_IDS = torch.arange(2, 528, 5)[torch.randperm(106, generator=torch.Generator().manual_seed(0))]


# Per captured layer (the tiny Qwen3's one), an RMSNorm weight.
FC_NORM = 1 + 0.2 * torch.randn(1, 64, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    target = model_path("qwen3")
    gated = make_tiny_dspark(
        str(root / "deepspec"), target, markov_head_type="gated", num_layers=2, seed=5
    )
    vanilla = make_tiny_dspark(str(root / "deepspec-vanilla"), target, seed=6)
    torch.save(DRAFT_IDS.tolist(), root / "map.pt")
    return {
        "deepspec": gated,
        "deepspec-vanilla": vanilla,
        "map": str(root / "map.pt"),
        "torchspec": write_torchspec(gated, str(root / "torchspec")),
        "torchspec-converted": write_torchspec(gated, str(root / "ts2"), trained_names=False),
        "torchspec-dflash": write_torchspec(gated, str(root / "ts3"), variant="dflash"),
        "torchspec-classical": write_torchspec(vanilla, str(root / "ts4"), variant="classical"),
        "torchspec-fc-norm": write_torchspec(gated, str(root / "ts5"), fc_norm=FC_NORM),
        "speculators": write_speculators(gated, str(root / "speculators")),
        "speculators-unsaid": write_speculators(gated, str(root / "sp2"), sample_from_anchor=None),
        "speculators-reduced": write_speculators(
            gated, str(root / "sp3"), draft_ids=DRAFT_IDS.tolist()
        ),
        "speculators-anchor-false": write_speculators(
            gated, str(root / "sp4"), sample_from_anchor=False
        ),
        # bf16 weights, as the releases ship them (read into the float32 engine;
        # a reduced vocabulary's own head would be a rounded copy of the
        # target's, which the token map's is not).
        "deepspec-bf16": write_deepspec(gated, str(root / "ds-bf16"), dtype=torch.bfloat16),
        "speculators-bf16": write_speculators(gated, str(root / "sp-bf16"), dtype=torch.bfloat16),
        "torchspec-bf16": write_torchspec(gated, str(root / "ts-bf16"), dtype=torch.bfloat16),
    }


# The layout -> the DeepSpec drafter (and flags) it must draft exactly as.
SAME_AS = {
    "torchspec": ("deepspec", {}),
    "torchspec-converted": ("deepspec", {}),
    "torchspec-dflash": ("deepspec", {}),
    "torchspec-classical": ("deepspec-vanilla", {}),
    "speculators": ("deepspec", {}),
    "speculators-unsaid": ("deepspec", {}),
    "speculators-reduced": ("deepspec", {"token_map": True}),
    "speculators-bf16": ("deepspec-bf16", {}),
    "torchspec-bf16": ("deepspec-bf16", {}),
}


def test_each_format_is_read_into_the_internal_config(layouts) -> None:
    want = read_drafter(layouts["deepspec"]).config
    for name, fmt in [
        ("deepspec", "deepspec"),
        ("torchspec", "torchspec"),
        ("torchspec-dflash", "torchspec"),
        ("speculators", "speculators"),
        ("speculators-reduced", "speculators"),
    ]:
        with open(f"{layouts[name]}/config.json") as f:
            assert detect_format(json.load(f)) == fmt, name
        ckpt = read_drafter(layouts[name], block_hint=4)
        got = ckpt.config
        assert got.target_layer_ids == want.target_layer_ids, name  # speculators' ids - 1
        assert (got.block_size, got.markov_head_type, got.markov_rank) == (4, "gated", 8), name
        assert got.enable_confidence_head and got.confidence_head_with_markov, name
        assert (got.hidden_size, got.num_hidden_layers, got.head_dim) == (
            want.hidden_size, want.num_hidden_layers, want.head_dim,
        ), name  # fmt: skip
    assert read_drafter(layouts["speculators-reduced"]).config.draft_vocab_size == 106
    # TorchSpec records no block: the flags' or its default 7, said in choices.
    ts = read_drafter(layouts["torchspec"])
    assert ts.config.block_size == 7 and any("block size 7" in c for c in ts.choices)
    assert ts.config.num_target_layers == want.num_target_layers  # target_num_hidden_layers
    classical = read_drafter(layouts["torchspec-classical"])
    assert classical.config.markov_head_type == "vanilla"
    assert any("classical" in c for c in classical.choices)
    unsaid = read_drafter(layouts["speculators-unsaid"])
    assert any("sample_from_anchor true (from speculative_tokens 4)" in c for c in unsaid.choices)


@pytest.mark.parametrize("name", list(SAME_AS))
def test_every_layout_drafts_what_deepspecs_drafts(layouts, name) -> None:
    """The strongest oracle: the same weights, another layout, the same
    drafts and distributions (a reduced vocabulary: those of DeepSpec's
    drafter with its ids as the token map)."""
    base, kw = SAME_AS[name]
    if kw:
        kw = {**kw, "map_path": layouts["map"]}
    assert_same_rounds(draft_rounds(layouts[base], **dict(kw)), draft_rounds(layouts[name]))


def test_a_reduced_vocabulary_drafts_its_tokens_alone(layouts) -> None:
    prop, _ = proposer_for(layouts["speculators-reduced"], speculative_dspark_block_size=4)
    assert torch.equal(prop.model.hot_ids, DRAFT_IDS.sort().values)
    tokens = [
        t for rnd in draft_rounds(layouts["speculators-reduced"]) for row in rnd[0] for t in row
    ]
    assert set(tokens) <= set(DRAFT_IDS.tolist())


@pytest.fixture(scope="module")
def plain():
    eng = Engine(model_path=model_path("qwen3"), device="cpu", max_total_tokens=4096, page_size=4)
    yield eng
    eng.shutdown()


PROMPTS = random_prompts(3, [5, 17, 9], seed=71) + [[7, 8, 9, 10] * 5]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
LOGPROBS = {"return_logprob": True, "top_logprobs_num": 2}


def _serve(eng: Engine) -> dict:
    schema = SMALL_SCHEMA
    sampled = [
        {"temperature": 0.9, "max_new_tokens": 12, "ignore_eos": True, "seed": 300 + i}
        for i in range(len(PROMPTS))
    ]
    return {
        "greedy": eng.generate(input_ids=PROMPTS, sampling_params=GREEDY, **LOGPROBS),
        "sampled": eng.generate(input_ids=PROMPTS, sampling_params=sampled),
        "grammar": eng.generate(
            input_ids=PROMPTS[:2],
            sampling_params={
                "json_schema": json.dumps(schema),
                "temperature": 0,
                "max_new_tokens": 24,
            },
        ),
    }


# (TorchSpec's layouts draft what DeepSpec's does, proposal for proposal: above.)
@pytest.mark.parametrize(
    "name", ["speculators", "speculators-reduced", "speculators-anchor-false", "torchspec-fc-norm"]
)
def test_each_format_serves_what_plain_decoding_serves(layouts, plain, name) -> None:
    """Greedy ids and logprobs equal plain's; seeded sampling draws what the
    DeepSpec drafter's engine draws (its map, for a reduced vocabulary); a
    JSON grammar holds."""
    pytest.importorskip("xgrammar")
    want = _serve(plain)
    spec = {"speculative_algorithm": "DSPARK"}
    if name != "speculators-anchor-false":  # (its blocks draft 3)
        spec["speculative_dspark_block_size"] = 4
    with Engine(
        model_path=model_path("qwen3"), device="cpu", max_total_tokens=4096, page_size=4,
        speculative_draft_model_path=layouts[name], **spec,
    ) as eng:  # fmt: skip
        got = _serve(eng)
    for a, b in zip(want["greedy"], got["greedy"]):
        assert b["output_ids"] == a["output_ids"]
        assert b["meta_info"]["spec_verify_ct"] > 0
        lp_a = [t[0] for t in a["meta_info"]["output_token_logprobs"]]
        lp_b = [t[0] for t in b["meta_info"]["output_token_logprobs"]]
        torch.testing.assert_close(torch.tensor(lp_b), torch.tensor(lp_a), atol=1e-5, rtol=0)
    for a, b in zip(want["grammar"], got["grammar"]):
        assert b["output_ids"] == a["output_ids"]
        json.loads(b["text"])
    if name not in SAME_AS:  # no other layout of the same drafter
        return
    base, kw = SAME_AS[name]
    extra = {"speculative_token_map": layouts["map"]} if kw else {}
    with Engine(
        model_path=model_path("qwen3"), device="cpu", max_total_tokens=4096, page_size=4,
        speculative_draft_model_path=layouts[base], **spec, **extra,
    ) as eng:  # fmt: skip
        same_weights = _serve(eng)
    assert [o["output_ids"] for o in got["sampled"]] == [
        o["output_ids"] for o in same_weights["sampled"]
    ]


def test_the_bonus_slot_layout_drafts_from_the_slots_after_it(layouts) -> None:
    """``sample_from_anchor`` false: a block of B positions whose slot 0 is
    the anchor's bonus token drafts B - 1 tokens from slots 1.. (slot k
    predicting anchor + k, the Markov head's previous token the one before
    it): DeepSpec's from-scratch block over the same weights, its first
    slot dropped and the walk started at the next."""
    # A tiny threshold: confidences are computed (and compared) but cut nothing.
    prop, _ = proposer_for(
        layouts["speculators-anchor-false"], speculative_dspark_confidence_threshold=1e-9
    )
    assert (prop.max_drafts, prop.block_len) == (3, 4)
    # DeepSpec's model of the same weights, its blocks one slot longer.
    model = proposer_for(layouts["deepspec"])[0].model
    assert_rounds_match_scratch(prop, model, lead=1)


def test_unsupported_layouts_are_named(layouts, tmp_path) -> None:
    with open(f"{layouts['speculators']}/config.json") as f:
        cfg = json.load(f)
    (tmp_path / "eagle").mkdir()
    (tmp_path / "eagle" / "config.json").write_text(
        json.dumps({**cfg, "speculators_model_type": "eagle3"})
    )
    with pytest.raises(ValueError, match="speculators_model_type 'eagle3' is not a DSpark"):
        read_drafter(str(tmp_path / "eagle"))
    (tmp_path / "window").mkdir()
    (tmp_path / "window" / "config.json").write_text(
        json.dumps({**cfg, "sliding_window_non_causal": True})
    )
    with pytest.raises(ValueError, match="sliding_window_non_causal true .* not supported"):
        read_drafter(str(tmp_path / "window"))
    with pytest.raises(ValueError, match="speculative_token_map: the drafter has its own reduced"):
        proposer_for(layouts["speculators-reduced"], speculative_token_map=layouts["map"])


def test_a_whole_vocabularys_identity_map_is_not_read(layouts, tmp_path) -> None:
    """A speculators export over the whole vocabulary may still carry
    ``d2t`` (all zeros) and ``t2d`` (all true): nothing reads them."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "with-maps"
    shutil.copytree(layouts["speculators"], path)
    state = load_file(str(path / "model.safetensors"))
    state["d2t"] = torch.zeros(528, dtype=torch.long)
    state["t2d"] = torch.ones(528, dtype=torch.bool)
    save_file(state, str(path / "model.safetensors"))
    prop, _ = proposer_for(str(path))
    assert prop.model.hot_ids is None  # drafts over the whole vocabulary


def test_per_layer_feature_norms_apply_before_the_concatenation(layouts, tmp_path) -> None:
    """A TorchSpec export with ``fc_norm.{i}``: each captured layer RMS-normed
    by its own weight before ``fc``; otherwise DeepSpec's drafter of the
    same weights, fed the normed features itself."""
    ckpt = read_drafter(layouts["torchspec-fc-norm"])
    assert ckpt.config.feature_norms
    normed_model = proposer_for(layouts["torchspec-fc-norm"])[0].model
    plain_model = proposer_for(layouts["deepspec"])[0].model
    feats = features(9, 64, 3)
    normed = F.rms_norm(feats.view(9, 1, 64), (64,), eps=1e-6) * FC_NORM
    want = plain_model.context_hidden(normed.view(9, 64))
    torch.testing.assert_close(normed_model.context_hidden(feats), want, atol=1e-6, rtol=0)
    assert (plain_model.context_hidden(feats) - want).abs().max() > 1e-3
    # Found among the tensors when the config does not say.
    import shutil

    unsaid = shutil.copytree(layouts["torchspec-fc-norm"], tmp_path / "unsaid")
    with open(f"{unsaid}/config.json") as f:
        cfg = json.load(f)
    cfg.pop("fc_norm")
    with open(f"{unsaid}/config.json", "w") as f:
        json.dump(cfg, f)
    ckpt = read_drafter(unsaid)
    assert ckpt.config.feature_norms and any("fc_norm" in c for c in ckpt.choices)
