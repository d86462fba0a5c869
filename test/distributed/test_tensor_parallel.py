"""Tensor parallelism on 2 gloo ranks (this process and one spawned worker)
against one rank of the same checkpoint: greedy ids equal, logprobs, top-k
and requested ids within 1e-5, seeded sampling equal, grammar-constrained
output equal, for plain decoding and every speculative algorithm, on Qwen3
and Llama (tied embeddings, one KV head replicated over the ranks, a
vocabulary that does not divide by the ranks)."""

from __future__ import annotations

import json

import pytest
import torch

from models_zoo import model_path, random_prompts
from spec_helpers import record_drafts as _record_drafts
from specserve import Engine
from specserve.tools.tiny_model import make_tiny_dspark, make_tiny_model

PROMPTS = random_prompts(4, [3, 17, 40, 9], seed=7) + [[7, 8, 9, 10] * 6]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}},
    "required": ["a", "b"],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-models")
    qwen3 = model_path("qwen3")
    # A hot vocabulary for --speculative-token-map: every third token.
    torch.save(torch.arange(0, 528, 3), root / "token_map.pt")
    return {
        "token_map": str(root / "token_map.pt"),
        "qwen3": qwen3,
        "llama-tied": model_path("llama-tied"),
        # One KV head (replicated on both ranks), 527 ids (one padding row).
        "llama-1kv": make_tiny_model(
            str(root / "llama-1kv"), "llama", num_kv_heads=1, extra_vocab=15, seed=4
        ),
        "vanilla": make_tiny_dspark(str(root / "v"), qwen3, markov_head_type="vanilla"),
        "gated": make_tiny_dspark(str(root / "g"), qwen3, markov_head_type="gated", seed=1),
        "rnn": make_tiny_dspark(str(root / "r"), qwen3, markov_head_type="rnn", seed=2),
        "dflash": make_tiny_dspark(
            str(root / "d"), qwen3, markov_rank=0, confidence_head=False, seed=3
        ),
    }


# The drafter split over the group (the CPU's default is rank 0 alone).
SPLIT = {"speculative_draft_tensor_parallel_size": 2}
# The one case whose drafter runs on rank 0 alone, with whole copies of the
# target's embedding and head.
ON_RANK_0 = "dspark-gated"


def _dspark(drafter: str, **kw) -> dict:
    return {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": drafter, **kw}


CASES = {
    "qwen3-plain": ("qwen3", lambda m: {}),
    "llama-tied-plain": ("llama-tied", lambda m: {}),
    "llama-1kv-plain": ("llama-1kv", lambda m: {}),
    "dspark-vanilla": ("qwen3", lambda m: _dspark(m["vanilla"])),
    "dspark-gated": ("qwen3", lambda m: _dspark(m["gated"])),
    # The budget schedule profiles verify forwards at start-up (through plans).
    "dspark-budget-token-map": (
        "qwen3",
        lambda m: _dspark(
            m["vanilla"],
            speculative_dspark_schedule="budget",
            speculative_token_map=m["token_map"],
        ),
    ),
    "dspark-rnn-ngram-first": (
        "qwen3",
        lambda m: _dspark(m["rnn"], speculative_ngram_first=True),
    ),
    "dflash": (
        "qwen3",
        lambda m: {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": m["dflash"]},
    ),
    "ngram": ("llama-1kv", lambda m: {"speculative_algorithm": "NGRAM"}),
}


def _run(eng: Engine) -> dict:
    """Every kind of request, in batches: greedy with prompt and output
    logprobs (top-k and requested ids), seeded sampling, a JSON schema."""
    greedy = eng.generate(
        input_ids=PROMPTS,
        sampling_params={"temperature": 0, "max_new_tokens": 16, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
        token_ids_logprob=[0, 5, 77],
    )
    sampled = eng.generate(
        input_ids=PROMPTS,
        sampling_params=[
            {"temperature": 0.8, "top_p": 0.9, "seed": 11 + i, "max_new_tokens": 12}
            for i in range(len(PROMPTS))
        ],
    )
    grammar = eng.generate(
        input_ids=PROMPTS[:2],
        sampling_params={"json_schema": json.dumps(SCHEMA), "max_new_tokens": 40},
    )
    return {"greedy": greedy, "sampled": sampled, "grammar": grammar}


def _entries(out: dict, key: str) -> list:
    return out["meta_info"][key] or []


def _assert_close_logprobs(a: dict, b: dict) -> None:
    for key in ("input_token_logprobs", "output_token_logprobs"):
        ea, eb = _entries(a, key), _entries(b, key)
        assert [e[1] for e in ea] == [e[1] for e in eb]
        for x, y in zip(ea, eb):
            if x[0] is None:
                assert y[0] is None
            else:
                assert x[0] == pytest.approx(y[0], abs=1e-5)
    for key in (
        "input_top_logprobs",
        "input_token_ids_logprobs",
        "output_top_logprobs",
        "output_token_ids_logprobs",
    ):
        for ra, rb in zip(_entries(a, key), _entries(b, key)):
            if ra is None:  # the first prompt position: nothing scores it
                assert rb is None
                continue
            assert [e[1] for e in ra] == [e[1] for e in rb]  # the same ids, in order
            assert [e[0] for e in ra] == pytest.approx([e[0] for e in rb], abs=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_equals_tp1(models, case, tmp_path) -> None:
    model, spec = CASES[case]
    kw = dict(device="cpu", max_total_tokens=4096, page_size=4, **spec(models))
    budget = case == "dspark-budget-token-map"
    if budget:
        # The schedule follows measured step times: TP=2 profiles (its verify
        # forwards go through plans) and saves the table, TP=1 reuses it, so
        # both verify the same drafts and draw the same random numbers.
        kw["speculative_dspark_sps_table_path"] = str(tmp_path / "sps.json")
    split = SPLIT if spec(models) and case not in (ON_RANK_0, "ngram") else {}
    with Engine(model_path=models[model], tp_size=2, **kw, **split) as two:
        assert two.runner.group.size == 2
        drafter = getattr(two.proposer, "drafter", two.proposer)  # (ngram-first's)
        if case == ON_RANK_0:
            assert drafter.shard is None
            assert drafter.model.lm_head.weight.shape[0] == two.runner.vocab_size
        elif split:
            assert drafter.shard is not None
        got_drafts = _record_drafts(two)
        got = _run(two)
        assert two.free_pages() == two.total_pages()
        assert not budget or two.core.spec.planner is not None
    with Engine(model_path=models[model], **kw) as one:
        want_drafts = _record_drafts(one)
        want = _run(one)
    # The drafter in the group drafts what it drafts on one device.
    assert got_drafts == want_drafts
    for a, b in zip(want["greedy"], got["greedy"]):
        assert a["output_ids"] == b["output_ids"]
        _assert_close_logprobs(a, b)
    assert [o["output_ids"] for o in got["sampled"]] == [o["output_ids"] for o in want["sampled"]]
    assert [o["text"] for o in got["grammar"]] == [o["text"] for o in want["grammar"]]
    for o in got["grammar"]:
        if o["meta_info"]["finish_reason"]["type"] == "stop":
            json.loads(o["text"], strict=False)  # complete output parses
    if spec(models):
        # A round was verified in the group. (The budget schedule's lengths
        # follow a table timed at start-up, which on a busy machine may cut
        # a greedy request's every chain; a seeded sampled request keeps
        # its proposer's lengths.)
        verified = got["sampled"] if budget else got["greedy"][:1]
        assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in verified)


def test_shards_hold_their_slices(models) -> None:
    """Each rank's weights are its slice of the checkpoint's (read from
    the files by an independent reader), the padding rows zero."""
    from safetensors.torch import load_file

    from specserve.config import ModelConfig
    from specserve.distributed import RankGroup
    from specserve.models.loader import checkpoint_files, load_model

    path = models["llama-1kv"]
    full: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(path):
        full.update(load_file(f))
    cfg = ModelConfig.from_path(path)
    d, v = cfg.head_dim, cfg.vocab_size
    for rank in (0, 1):
        # A group of 2 that no collective is asked of: loading runs none.
        model = load_model(path, cfg, torch.float32, "cpu", 64, RankGroup(rank, 2))
        attn = model.model.layers[0].self_attn
        q_rows = cfg.num_attention_heads // 2 * d
        q = full["model.layers.0.self_attn.q_proj.weight"][rank * q_rows : (rank + 1) * q_rows]
        k = full["model.layers.0.self_attn.k_proj.weight"]  # one KV head: every rank has it
        w = attn.qkv_proj.weight
        assert torch.equal(w[:q_rows], q) and torch.equal(w[q_rows : q_rows + d], k)
        o = full["model.layers.0.self_attn.o_proj.weight"][:, rank * q_rows : (rank + 1) * q_rows]
        assert torch.equal(attn.o_proj.weight, o)
        inter = cfg.intermediate_size // 2
        down = full["model.layers.0.mlp.down_proj.weight"][:, rank * inter : (rank + 1) * inter]
        assert torch.equal(model.model.layers[0].mlp.down_proj.weight, down)
        per = -(-v // 2)
        emb = model.model.embed_tokens.weight
        assert emb.shape[0] == per
        real = min(per, v - rank * per)
        assert torch.equal(
            emb[:real], full["model.embed_tokens.weight"][rank * per : rank * per + real]
        )
        assert not emb[real:].any()
        head = full["lm_head.weight"][rank * per : rank * per + real]
        assert torch.equal(model.lm_head.weight[:real], head)


def test_shard_loading_reads_only_slices(models, monkeypatch) -> None:
    """Under tensor parallelism no split tensor is read whole."""
    from safetensors import safe_open

    from specserve.config import ModelConfig
    from specserve.distributed import RankGroup
    from specserve.models import loader

    read_whole: list[str] = []

    class Spy:
        def __init__(self, path, framework):
            self.f = safe_open(path, framework=framework)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, key):
            read_whole.append(key)
            return self.inner.get_tensor(key)

        def get_slice(self, key):
            return self.inner.get_slice(key)

    monkeypatch.setattr(loader, "safe_open", Spy)
    path = models["qwen3"]
    cfg = ModelConfig.from_path(path)
    loader.load_model(path, cfg, torch.float32, "cpu", 64, RankGroup(1, 2))
    split = ("proj.weight", "embed_tokens.weight", "lm_head.weight")
    assert read_whole and not [k for k in read_whole if k.endswith(split)]
    assert all("norm" in k for k in read_whole)  # only the replicated norms


def test_a_plan_longer_than_one_message(models) -> None:
    """A 1,500-token prefill's plan (past ``INLINE``) reaches the worker
    whole: the same greedy tokens and prompt logprobs as one rank."""
    from specserve.distributed.plan import INLINE

    prompt = random_prompts(1, [1500], seed=3)[0]
    assert len(prompt) > INLINE
    kw = dict(device="cpu", max_total_tokens=4096, chunked_prefill_size=2048)
    args = dict(
        input_ids=prompt,
        sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=1400,
    )
    with Engine(model_path=models["qwen3"], **kw) as one:
        want = one.generate(**args)
    with Engine(model_path=models["qwen3"], tp_size=2, **kw) as two:
        got = two.generate(**args)
    assert got["output_ids"] == want["output_ids"]
    _assert_close_logprobs(want, got)


def test_tp4_equals_tp1(models) -> None:
    """Four ranks: each KV head replicated on two of them, the vocabulary
    split in four; DSPARK as plain decoding at one rank."""
    kw = dict(device="cpu", max_total_tokens=4096, page_size=4, **_dspark(models["vanilla"]))
    args = dict(
        input_ids=PROMPTS,
        sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
        return_logprob=True,
        top_logprobs_num=3,
    )
    with Engine(model_path=models["qwen3"], **kw) as one:
        want = one.generate(**args)
    split = {"speculative_draft_tensor_parallel_size": 4}
    with Engine(model_path=models["qwen3"], tp_size=4, **kw, **split) as four:
        assert four.runner.heads.kv_count == 1 and len(four.ranks.pids) == 3
        got = four.generate(**args)
    for a, b in zip(want, got):
        assert a["output_ids"] == b["output_ids"]
        _assert_close_logprobs(a, b)


def test_prompt_rows_never_leave_the_shards(models) -> None:
    """A prompt scored from position 0: only its sampling row's logits are
    gathered (its logit bias keeps them from the argmax on the shards), the
    29 prompt rows are scored on the shards (raw mode); in processed mode
    (the request's logit bias applies to them) they travel."""
    prompt = random_prompts(1, [30], seed=8)[0]
    args = dict(
        input_ids=prompt,
        sampling_params={"temperature": 0, "max_new_tokens": 2, "logit_bias": {"9": 1.5}},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
    )
    for mode, prefill_rows in (("raw", 1), ("processed", 30)):
        kw = dict(device="cpu", max_total_tokens=1024, logprobs_mode=mode)
        with Engine(model_path=models["qwen3"], **kw) as one:
            want = one.generate(**args)
        with Engine(model_path=models["qwen3"], tp_size=2, **kw) as two:
            gathered = _count_gathers(two)
            got = two.generate(**args)
        assert gathered == [prefill_rows, 1], mode  # the prefill, then one decode row
        assert got["output_ids"] == want["output_ids"]
        _assert_close_logprobs(want, got)


def _count_gathers(eng: Engine) -> list[int]:
    """The rows of every gather of logits to rank 0 from now on."""
    gathered: list[int] = []
    group = eng.runner.group

    def counted(x, real=group.gather_to_first):
        gathered.append(x.shape[0])
        return real(x)

    group.gather_to_first = counted
    return gathered


def test_greedy_rows_never_leave_the_shards(models) -> None:
    """Greedy rows (plain and verify) are decided on the shards by the
    vocab-parallel argmax and scored there: no logits are gathered at all,
    and ids and logprobs equal one device's. A sampled request's rows still
    travel, alone: its greedy batch-mate's do not."""
    greedy = dict(
        input_ids=PROMPTS[:3],
        sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
        token_ids_logprob=[3, 77],
    )
    kw = dict(device="cpu", max_total_tokens=2048, **_dspark(models["vanilla"]))
    for mode in ("raw", "processed"):
        with Engine(model_path=models["qwen3"], logprobs_mode=mode, **kw) as one:
            want = one.generate(**greedy)
        with Engine(
            model_path=models["qwen3"], logprobs_mode=mode, tp_size=2, **kw, **SPLIT
        ) as two:
            gathered = _count_gathers(two)
            got = two.generate(**greedy)
        assert gathered == [], mode
        assert sum(o["meta_info"]["spec_verify_ct"] for o in got) > 0
        for a, b in zip(want, got):
            assert a["output_ids"] == b["output_ids"], mode
            _assert_close_logprobs(a, b)

    mixed = dict(
        input_ids=PROMPTS[:2],
        sampling_params=[
            {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
            {"temperature": 0.8, "seed": 5, "max_new_tokens": 3, "ignore_eos": True},
        ],
    )
    kw = dict(device="cpu", max_total_tokens=1024)
    with Engine(model_path=models["qwen3"], **kw) as one:
        want = one.generate(**mixed)
    with Engine(model_path=models["qwen3"], tp_size=2, **kw) as two:
        gathered = _count_gathers(two)
        got = two.generate(**mixed)
    assert gathered == [1, 1, 1]  # the sampled request's row of each forward
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]


def test_the_drafter_runs_on_the_shards(tmp_path) -> None:
    """The demo's DSpark drafter (which drafts well) in the TP group: every
    rank holds its heads and shares the target's split embedding and head;
    greedy and seeded sampled drafts, and so every round's acceptance, are
    one device's, and the output ids too. With a token map (its hot ids
    split unevenly by the shards) as well, and its weights read as a
    speculators drafter of the 1 + N slot layout (blocks a slot longer)."""
    from specserve.tools.drafter_layouts import write_speculators

    demo = "python/specserve/assets/demo/"
    bonus = write_speculators(demo + "dspark", str(tmp_path / "1+n"), sample_from_anchor=False)
    prompts = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n", "Once"]
    params = [
        {"temperature": 0, "max_new_tokens": 40},
        {"temperature": 0.7, "seed": 3, "max_new_tokens": 40},
        {"temperature": 0, "max_new_tokens": 40},
        {"temperature": 1.0, "seed": 5, "max_new_tokens": 40},
    ]
    for drafter, extra in (
        (demo + "dspark", {}),
        (demo + "dspark", {"speculative_token_map": demo + "token_map.pt"}),
        (bonus, {}),
    ):
        kw = dict(device="cpu", **_dspark(drafter), **extra)
        with Engine(model_path=demo + "target", tp_size=2, **kw, **SPLIT) as two:
            drafter, target = two.proposer.model, two.runner.model
            assert two.proposer.shard is not None
            assert drafter.lm_head is target.lm_head
            assert drafter.embed_tokens is target.model.embed_tokens
            full_q = drafter.config.num_attention_heads * drafter.config.head_dim
            assert drafter.layers[0].self_attn.q_proj.weight.shape[0] == full_q // 2
            got = two.generate(prompt=prompts, sampling_params=params)
        with Engine(model_path=demo + "target", **kw) as one:
            want = one.generate(prompt=prompts, sampling_params=params)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        accept = [o["meta_info"]["spec_accept_length"] for o in got]
        assert accept == [o["meta_info"]["spec_accept_length"] for o in want]
        if drafter != bonus:  # (trained for DeepSpec's layout, it drafts poorly in the other)
            assert sum(accept) / len(accept) > 2  # the drafts matter
