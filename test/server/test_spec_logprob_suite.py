"""The logprob and grammar integration suite under speculation, at the server.

Every speculative algorithm and logprobs mode against a plain-decoding
server on the same tiny target: same tokens, same numbers, same invariants.
"""

from __future__ import annotations

import json
from contextlib import ExitStack

import httpx
import pytest

from models_zoo import model_path, random_prompts
from server_harness import running_server
from specserve.tools.tiny_model import make_tiny_dspark, make_tiny_dspark_v4, make_tiny_model

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

TOL = 1e-4
ALGORITHMS = ("DSPARK", "DFLASH", "NGRAM")
# DeepSeek-V4 rows: its bundled drafter (no draft path) and NGRAM.
V4_ALGORITHMS = ("DSPARK-v4", "NGRAM-v4")
MODES = ("raw", "processed")
PROMPTS = random_prompts(3, [6, 14, 23], seed=81) + [[9, 10, 11, 12] * 5]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("suite")
    drafter = make_tiny_dspark(str(root / "dspark"), model_path("qwen3"), markov_head_type="gated")
    v4: list[str] = []  # the V4 target with its drafter inside, built on first use
    started: dict[tuple[str, str], object] = {}
    with ExitStack() as stack:

        def get(alg: str, mode: str):
            key = (alg, mode)
            if key not in started:
                target = model_path("qwen3")
                if alg.endswith("-v4"):
                    if not v4:
                        plain_v4 = make_tiny_model(str(root / "v4"), "deepseek_v4", num_layers=5)
                        v4.append(
                            make_tiny_dspark_v4(str(root / "v4-bundle"), plain_v4, bundle=True)
                        )
                    target, alg = v4[0], alg.removesuffix("-v4")
                flags = ["--logprobs-mode", mode]
                if alg != "plain":
                    # Fixed lengths (server_harness's default): every round
                    # verifies what was drafted, so
                    # the suite tests speculation itself (the cost model,
                    # timed, would take plain steps on these random drafters;
                    # test_planner.py covers the mixed runs).
                    flags += ["--speculative-algorithm", alg]
                if alg in ("DSPARK", "DFLASH") and target == model_path("qwen3"):
                    flags += ["--speculative-draft-model-path", drafter]
                started[key] = stack.enter_context(
                    running_server(target, *flags, log_dir=str(root))
                )
            return started[key]

        yield get
        for s in started.values():
            stats = s.wait_idle()
            assert stats["grammar_matchers"] == 0


@pytest.fixture(
    params=[(a, m) for a in ALGORITHMS + V4_ALGORITHMS for m in MODES],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def pair(request, servers):
    alg, mode = request.param
    plain = "plain-v4" if alg.endswith("-v4") else "plain"
    return servers(alg, mode), servers(plain, mode), mode


def gen(server, **body) -> dict | list:
    r = server.http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def close(a, b) -> None:
    assert [t[1] for t in a] == [t[1] for t in b]
    assert [t[0] for t in a] == pytest.approx([t[0] for t in b], abs=TOL)


def test_greedy_tokens_and_every_logprob_field_match_plain(pair) -> None:
    spec, plain, _ = pair
    body = dict(
        input_ids=PROMPTS,
        sampling_params={"temperature": 0, "max_new_tokens": 20, "ignore_eos": True},
        return_logprob=True,
        top_logprobs_num=5,
        token_ids_logprob=[[4, 9], [300], [4, 5, 6, 7], [11]],  # ragged
        logprob_start_len=[0, 3, 13, 0],
    )
    got, want = gen(spec, **body), gen(plain, **body)
    for g, w, p, start in zip(got, want, PROMPTS, body["logprob_start_len"]):
        assert g["output_ids"] == w["output_ids"]
        gm, wm = g["meta_info"], w["meta_info"]
        assert len(gm["input_token_logprobs"]) == len(p) - start
        for kind in ("input", "output"):
            close(gm[f"{kind}_token_logprobs"][1:], wm[f"{kind}_token_logprobs"][1:])
            for a, b in zip(gm[f"{kind}_top_logprobs"], wm[f"{kind}_top_logprobs"]):
                if a is not None:
                    close(a, b)
            for a, b in zip(gm[f"{kind}_token_ids_logprobs"], wm[f"{kind}_token_ids_logprobs"]):
                if a is not None:
                    close(a, b)
        assert gm["spec_verify_ct"] > 0


def test_decode_logprobs_equal_prefill_rescoring(pair) -> None:
    spec, _, mode = pair
    temp = 0.7 if mode == "processed" else 1.0
    p = PROMPTS[3]
    out = gen(
        spec,
        input_ids=p,
        sampling_params={"temperature": temp, "max_new_tokens": 16, "seed": 3, "ignore_eos": True},
        return_logprob=True,
    )
    again = gen(
        spec,
        input_ids=p,
        sampling_params={"temperature": temp, "max_new_tokens": 16, "seed": 3, "ignore_eos": True},
        return_logprob=True,
    )
    assert again["output_ids"] == out["output_ids"]  # a seed reproduces tokens and numbers
    assert again["meta_info"]["output_token_logprobs"] == out["meta_info"]["output_token_logprobs"]
    seq = p + out["output_ids"]
    rescored = gen(
        spec,
        input_ids=seq,
        sampling_params={"temperature": temp, "max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=len(p),
    )
    close(rescored["meta_info"]["input_token_logprobs"], out["meta_info"]["output_token_logprobs"])
    # The completions echo path scores the same sequence the same way (raw numbers).
    if mode == "raw":
        c = spec.http.post(
            "/v1/completions", json={"prompt": [seq], "echo": True, "logprobs": 1, "max_tokens": 0}
        ).json()
        echo = c["choices"][0]["logprobs"]["token_logprobs"][len(p) :]
        assert echo == pytest.approx(
            [t[0] for t in out["meta_info"]["output_token_logprobs"]], abs=TOL
        )


def test_counts_after_stops_limits_and_grammar(pair) -> None:
    spec, plain, _ = pair
    p = PROMPTS[1]
    base = gen(
        plain,
        input_ids=p,
        sampling_params={"temperature": 0, "max_new_tokens": 40, "ignore_eos": True},
    )
    ids, text = base["output_ids"], base["text"]
    schema = {
        "type": "object",
        "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["v"],
    }
    for sp in (
        {"temperature": 0, "max_new_tokens": 7, "ignore_eos": True},
        {"temperature": 0, "max_new_tokens": 40, "stop_token_ids": [ids[5]]},
        {
            "temperature": 0,
            "max_new_tokens": 40,
            "stop": [text[len(text) // 2 : len(text) // 2 + 2]],
        },
        {"temperature": 0, "max_new_tokens": 40, "json_schema": json.dumps(schema)},
    ):
        got = gen(spec, input_ids=p, sampling_params=sp, return_logprob=True, top_logprobs_num=2)
        want = gen(plain, input_ids=p, sampling_params=sp, return_logprob=True, top_logprobs_num=2)
        meta = got["meta_info"]
        assert got["output_ids"] == want["output_ids"]
        assert (
            len(meta["output_token_logprobs"])
            == meta["completion_tokens"]
            == len(meta["output_top_logprobs"])
        )
        if "json_schema" in sp:
            jsonschema.validate(json.loads(got["text"]), schema)
            assert got["text"].endswith("}")


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_top_k_counts_and_order(pair, k) -> None:
    spec, _, _ = pair
    c = spec.http.post(
        "/v1/completions",
        json={"prompt": "count", "max_tokens": 6, "temperature": 0.8, "seed": 2, "logprobs": k},
    ).json()
    lp = c["choices"][0]["logprobs"]
    for tok, top in zip(lp["tokens"], lp["top_logprobs"]):
        # The sampled token is always listed; tokens that decode to the same
        # text share one key, so a dict may hold fewer than k entries.
        assert tok in top and 1 <= len(top) <= k + 1
    r = gen(
        spec,
        text="count",
        sampling_params={"max_new_tokens": 6, "seed": 2},
        return_logprob=True,
        top_logprobs_num=k,
    )
    tops = r["meta_info"]["output_top_logprobs"]
    if k == 0:
        assert tops is None
    else:
        for top in tops:
            values = [v for v, _, _ in top]
            assert len(top) == k and values == sorted(values, reverse=True)


def test_concurrent_mixed_batch_equals_solo_runs(pair) -> None:
    import concurrent.futures

    spec, _, _ = pair
    bodies = [
        dict(
            input_ids=PROMPTS[0],
            sampling_params={"temperature": 0, "max_new_tokens": 12},
            return_logprob=True,
            top_logprobs_num=3,
        ),
        dict(
            input_ids=PROMPTS[1],
            sampling_params={"temperature": 0.5, "seed": 1, "max_new_tokens": 12},
            return_logprob=True,
            token_ids_logprob=[4, 5],
        ),
        dict(
            input_ids=PROMPTS[2],
            sampling_params={"temperature": 1.2, "seed": 2, "max_new_tokens": 12},
        ),
        dict(
            input_ids=PROMPTS[3],
            sampling_params={"temperature": 0, "max_new_tokens": 12},
            return_logprob=True,
            token_ids_logprob=[7],
        ),
    ]
    solo = [gen(spec, **b) for b in bodies]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda b: gen(spec, **b), bodies * 2))
    for i, out in enumerate(together):
        ref = solo[i % 4]
        assert out["output_ids"] == ref["output_ids"]
        if "output_token_logprobs" in ref["meta_info"]:
            close(
                out["meta_info"]["output_token_logprobs"], ref["meta_info"]["output_token_logprobs"]
            )


def test_streaming_equals_non_streaming(pair) -> None:
    spec, _, _ = pair
    client = openai.OpenAI(
        base_url=spec.base + "/v1", api_key="x", max_retries=0, http_client=httpx.Client(timeout=60)
    )
    model = client.models.list().data[0].id
    kw = dict(model=model, prompt=[PROMPTS[3]], max_tokens=16, temperature=0, logprobs=3)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    lps = [
        x
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for x in c.choices[0].logprobs.token_logprobs
    ]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert lps == full.choices[0].logprobs.token_logprobs
    ckw = dict(
        model=model,
        messages=[{"role": "user", "content": "repeat after me"}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    chat = client.chat.completions.create(**ckw)
    items = [
        i
        for c in client.chat.completions.create(stream=True, **ckw)
        if c.choices and c.choices[0].logprobs
        for i in c.choices[0].logprobs.content
    ]
    assert [(i.token, i.logprob) for i in items] == [
        (i.token, i.logprob) for i in chat.choices[0].logprobs.content
    ]
    assert len(items) == chat.usage.completion_tokens
