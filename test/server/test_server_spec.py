"""The server with a DSpark drafter: lossless greedy output, sampling, n > 1,
accept metrics."""

from __future__ import annotations

import pytest

from models_zoo import model_path, random_prompts
from server_harness import running_server
from specserve import Engine
from specserve.tools.tiny_model import make_tiny_dspark

openai = pytest.importorskip("openai")


def _dspark_server(root, *extra: str):
    drafter = make_tiny_dspark(str(root / "drafter"), model_path("qwen3"), markov_head_type="gated")
    flags = ("--speculative-algorithm", "dspark", "--speculative-draft-model-path", drafter)
    return running_server(model_path("qwen3"), *flags, *extra, log_dir=str(root))


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    """Fixed verify lengths (the harness's default), so every round verifies."""
    with _dspark_server(tmp_path_factory.mktemp("spec-server")) as s:
        yield s
        stats = s.wait_idle()
        assert stats["grammar_matchers"] == 0


def test_greedy_and_sampled_requests(spec_server) -> None:
    prompts = random_prompts(3, [5, 12, 20], seed=61)
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    plain = Engine(model_path=model_path("qwen3"), device="cpu", max_total_tokens=1024)
    try:
        expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=sp)]
    finally:
        plain.shutdown()
    got = spec_server.http.post(
        "/generate", json={"input_ids": prompts, "sampling_params": sp}
    ).json()
    assert [o["output_ids"] for o in got] == expected
    assert all(
        o["meta_info"]["spec_verify_ct"] > 0 and o["meta_info"]["spec_accept_length"] >= 1
        for o in got
    )

    client = openai.OpenAI(base_url=spec_server.base + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(
        model=client.models.list().data[0].id,
        prompt="abc",
        n=2,
        max_tokens=8,
        temperature=1.0,
        seed=3,
    )
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens <= 16
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0.7,
        stream=True,
    )
    assert [c for c in stream if c.choices][-1].choices[0].finish_reason in ("stop", "length")


def test_accept_length_in_server_info_and_metrics(spec_server) -> None:
    spec_server.http.post(
        "/generate", json={"text": "warm", "sampling_params": {"max_new_tokens": 8}}
    )
    info = spec_server.http.get("/get_server_info").json()["speculative"]
    assert info["algorithm"] == "DSPARK" and info["max_drafts"] == 4
    assert info["verify_rounds"] > 0 and info["mean_accept_length"] >= 1.0
    metrics = spec_server.http.get("/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("specserve_spec_accept_length "))
    assert float(line.split()[1]) == pytest.approx(info["mean_accept_length"])
    # Each draft position's verified and accepted rounds (a chain near its
    # request's token limit is shorter: fewer rounds reach later positions).
    stats = spec_server.http.get("/get_server_info").json()["stats"]
    verified, accepted = stats["spec_verified_per_position"], stats["spec_accepted_per_position"]
    assert len(verified) == 4 and verified == sorted(verified, reverse=True)
    assert 0 < verified[0] <= info["verify_rounds"]
    for k, (n, a) in enumerate(zip(verified, accepted)):
        assert 0 <= a <= n
        assert f'specserve_spec_verified_drafts_total{{position="{k}"}} {n}' in metrics
        assert f'specserve_spec_accepted_drafts_total{{position="{k}"}} {a}' in metrics


def test_the_cost_models_decisions_in_server_info_and_metrics(tmp_path) -> None:
    """The adaptive planner reports its steps: the drafts histogram in
    /metrics counts every decode step /get_server_info counts, its 0 bucket
    the plain ones."""
    with _dspark_server(tmp_path, "--speculative-adaptive", "on") as s:
        _check_planner_reports(s)


def _check_planner_reports(server) -> None:
    server.http.post("/generate", json={"text": "again", "sampling_params": {"max_new_tokens": 8}})
    body = server.http.get("/get_server_info").json()
    info, stats = body["speculative"], body["stats"]
    assert info["adaptive"] is True and stats["spec_steps"] > 0
    assert info["plain_step_share"] == pytest.approx(
        stats["spec_plain_steps"] / stats["spec_steps"]
    )
    per_step = {int(k): v for k, v in stats["spec_drafts_per_step"].items()}
    assert sum(per_step.values()) == stats["spec_steps"]
    assert stats["spec_measured_step_seconds"] > 0 and stats["spec_predicted_step_seconds"] > 0
    metrics = dict(
        line.rsplit(" ", 1) for line in server.http.get("/metrics").text.splitlines()
        if line.startswith("specserve_spec_") and not line.startswith("#")
    )  # fmt: skip
    # Scraped after server_info: no step ran in between (the server is idle).
    assert int(metrics["specserve_spec_drafts_per_step_count"]) == stats["spec_steps"]
    assert int(metrics['specserve_spec_drafts_per_step_bucket{le="0"}']) == per_step.get(0, 0)
    assert int(metrics["specserve_spec_drafts_per_step_sum"]) == sum(
        k * v for k, v in per_step.items()
    )
    assert int(float(metrics["specserve_spec_plain_steps_total"])) == stats["spec_plain_steps"]
