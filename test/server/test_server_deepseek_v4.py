"""A DeepSeek-V4 target behind the real server: OpenAI completions with
logprobs scored against transformers (with the indexer's tie rule), streamed
== not streamed, and every page of every cache group free afterwards."""

from __future__ import annotations

import pytest
import torch

from models_zoo import earlier_entry_wins, random_prompts
from server_harness import running_server
from specserve.tools.tiny_model import make_tiny_model

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory) -> str:
    return make_tiny_model(
        str(tmp_path_factory.mktemp("v4") / "v4"), arch="deepseek_v4", num_layers=5
    )


@pytest.fixture(scope="module")
def server(v4_path, tmp_path_factory):
    with running_server(v4_path, log_dir=str(tmp_path_factory.mktemp("logs"))) as s:
        yield s
        s.wait_idle()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


def test_echo_logprobs_past_the_window_and_compression(server, client, v4_path) -> None:
    """A 70-token prompt scored with echo: positions past the window, the
    CSA and the HCA windows, each against transformers."""
    from transformers import AutoModelForCausalLM

    ids = random_prompts(1, [70], seed=41)[0]
    model = server.http.get("/v1/models").json()["data"][0]["id"]
    r = client.completions.create(
        model=model, prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    got = r.choices[0].logprobs.token_logprobs
    assert len(got) == len(ids) + 1 and got[0] is None
    with earlier_entry_wins(), torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(v4_path, dtype=torch.float32).eval()
        logp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(got[1 : len(ids)], want)) < 1e-4


def test_stream_equals_non_stream(server, client) -> None:
    model = server.http.get("/v1/models").json()["data"][0]["id"]
    prompt = random_prompts(1, [23], seed=43)[0]
    kw = dict(model=model, prompt=[prompt], max_tokens=40, temperature=0, logprobs=2)
    whole = client.completions.create(**kw)
    parts = list(client.completions.create(stream=True, **kw))
    text = "".join(p.choices[0].text for p in parts if p.choices)
    lps = [
        x
        for p in parts
        if p.choices and p.choices[0].logprobs
        for x in p.choices[0].logprobs.token_logprobs
    ]
    assert text == whole.choices[0].text
    assert lps == whole.choices[0].logprobs.token_logprobs
    assert whole.usage.completion_tokens == len(lps) > 0
