"""Through the server, plain and DSPARK: a temperature beyond float32 under a
JSON grammar is a valid sample (200, not an abort), and a request whose
logits rows are poisoned with NaN gets a 500 in the OpenAI error shape while
a request beside it answers as when alone."""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import textwrap

import pytest

from server_harness import running_server
from specserve.assets import DEMO_ROOT, demo_path

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(DEMO_ROOT, "target", "config.json")),
    reason="demo assets not built",
)

# A server whose forward fills with NaN every logits row of a request whose
# prompt starts with 7, 7, 7 (from its first step), or 7, 7, 8 (once it has
# two output tokens: decode rows, verify rows under DSPARK).
POISONING = textwrap.dedent(
    """
    import sys
    import torch
    from specserve.runner.model_runner import ModelRunner

    forward = ModelRunner.forward

    def poisoned(self, batch):
        fwd = forward(self, batch)
        with torch.inference_mode():
            for i, s in enumerate(batch.steps):
                head, done = s.req.prompt_ids[:3], len(s.req.output_ids)
                if head == [7, 7, 7] or (head == [7, 7, 8] and done >= 2):
                    fwd.logits[fwd.row_offsets[i] : fwd.row_offsets[i + 1]] = float("nan")
        return fwd

    ModelRunner.forward = poisoned
    from specserve.cli import main
    sys.exit(main(["serve", *sys.argv[1:]]))
    """
)


@pytest.fixture(scope="module", params=["plain", "dspark"])
def server(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"extreme-{request.param}")
    script = root / "poisoning_server.py"
    script.write_text(POISONING)
    flags: tuple[str, ...] = ()
    if request.param == "dspark":
        flags = ("--speculative-algorithm", "DSPARK")
        flags += ("--speculative-draft-model-path", demo_path("dspark"))
    launch = [sys.executable, str(script)]
    with running_server(demo_path("target"), *flags, log_dir=str(root), launch=launch) as s:
        yield s
        s.wait_idle()


def test_chat_at_temperature_1e308_with_json_object_is_a_sample(server) -> None:
    body = {
        "messages": [{"role": "user", "content": "Give me a JSON object."}],
        "temperature": 1e308,
        "response_format": {"type": "json_object"},
        "max_tokens": 8,
        "seed": 1,
    }
    r = server.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length"), choice
    content = choice["message"]["content"]
    assert content.startswith("{"), content
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    # The same on /generate: several prompts, top_p and frequency_penalty beside it.
    sp = {
        "temperature": 1e308,
        "json_object": True,
        "top_p": 0.9,
        "frequency_penalty": 1.0,
        "max_new_tokens": 8,
    }
    r = server.http.post("/generate", json={"text": ["a", "b = ", "{"], "sampling_params": sp})
    assert r.status_code == 200, r.text
    for out in r.json():
        assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length"), out
        assert out["text"].startswith("{"), out["text"]


def test_a_request_with_nan_logits_gets_a_500_and_its_neighbour_is_untouched(server) -> None:
    innocent = {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    alone = server.http.post("/v1/completions", json=innocent).json()["choices"][0]["text"]
    poisoned = [
        {"prompt": [7, 7, 7, 1], "max_tokens": 4, "temperature": 0},
        {
            "prompt": [7, 7, 8, 1],
            "max_tokens": 8,
            "temperature": 0.8,
            "seed": 2,
            "ignore_eos": True,
        },
    ]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        bad = [pool.submit(server.http.post, "/v1/completions", json=b) for b in poisoned]
        good = pool.submit(server.http.post, "/v1/completions", json=innocent)
        for f in bad:
            r = f.result()
            assert r.status_code == 500, r.text
            error = r.json()["error"]
            assert error["type"] == "server_error"
            assert "the model's logits at this position are not finite" in error["message"]
        assert good.result().json()["choices"][0]["text"] == alone
    server.wait_idle()
