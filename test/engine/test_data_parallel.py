"""``--dp-size 2``: two engine replicas behind one server. 64 concurrent
requests (greedy with logprobs, and seeded sampling) all come back, each
equal to one replica's answer, spread over both replicas; the server's
statistics sum them."""

from __future__ import annotations

import concurrent.futures

import pytest

from models_zoo import model_path, random_prompts
from server_harness import running_server
from specserve import DataParallelEngine, Engine
from specserve.config import EngineConfig
from specserve.engine.data_parallel import replica_device

PROMPTS = random_prompts(64, [5, 12, 30, 7], seed=9)


def _body(i: int, ids: list[int]) -> dict:
    seeded = i % 2 == 1
    return {
        "input_ids": ids,
        "sampling_params": {
            "temperature": 0.9 if seeded else 0,
            "seed": i if seeded else None,
            "max_new_tokens": 10,
            "ignore_eos": True,
        },
        "return_logprob": True,
    }


def test_dp2_serves_64_concurrent_requests_as_one_replica(tmp_path) -> None:
    path = model_path("qwen3")
    with running_server(path, "--dp-size", "2", log_dir=str(tmp_path)) as server:
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            replies = list(
                pool.map(
                    lambda a: server.http.post("/generate", json=_body(*a)),
                    enumerate(PROMPTS),
                )
            )
        info = server.http.get("/get_server_info").json()
        metrics = server.http.get("/metrics").text
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies][:3]
    got = [r.json() for r in replies]
    stats = info["stats"]
    assert len(stats["replicas"]) == 2
    served = [sum(st["finished"].values()) for st in stats["replicas"]]
    assert sum(served) == 64 and min(served) > 0, served  # both replicas served
    assert stats["generated_tokens"] == 640
    assert f"specserve_generation_tokens_total {stats['generated_tokens']}" in metrics
    with Engine(model_path=path, device="cpu", page_size=4, max_total_tokens=4096) as one:
        for i, (ids, out) in enumerate(zip(PROMPTS, got)):
            body = _body(i, ids)
            want = one.generate(
                input_ids=ids, sampling_params=body["sampling_params"], return_logprob=True
            )
            assert out["output_ids"] == want["output_ids"], i
            lp = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
            ref = [e[0] for e in want["meta_info"]["output_token_logprobs"]]
            assert lp == pytest.approx(ref, abs=1e-5)


def test_offline_front_routes_and_refuses_dp_in_one_engine() -> None:
    path = model_path("qwen3")
    with pytest.raises(ValueError, match="dp_size"):
        Engine(model_path=path, device="cpu", dp_size=2)
    with DataParallelEngine(path, device="cpu", dp_size=2, max_total_tokens=1024) as dp:
        outs = dp.generate(
            input_ids=PROMPTS[:6], sampling_params={"temperature": 0, "max_new_tokens": 4}
        )
        assert [len(o["output_ids"]) for o in outs] == [4] * 6
        per = [sum(st["finished"].values()) for st in dp.stats()["replicas"]]
        assert sum(per) == 6 and min(per) > 0, per
        assert dp.free_pages() == dp.total_pages()


def test_dp2_of_tp2_groups() -> None:
    """Two replicas, each a tensor-parallel group of two ranks: four ranks,
    the answers one rank's."""
    path = model_path("qwen3")
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    with Engine(model_path=path, device="cpu", max_total_tokens=1024) as one:
        want = [o["output_ids"] for o in one.generate(input_ids=PROMPTS[:4], sampling_params=sp)]
    with DataParallelEngine(path, device="cpu", dp_size=2, tp_size=2, max_total_tokens=1024) as dp:
        assert [len(e.ranks.pids) for e in dp.replicas] == [1, 1]
        got = [o["output_ids"] for o in dp.generate(input_ids=PROMPTS[:4], sampling_params=sp)]
    assert got == want


def test_replica_devices() -> None:
    """CUDA replicas take devices in blocks of tp_size from the configured
    one (an explicit --device included); CPU replicas share the CPU."""
    for device, tp, want in (
        ("cuda", 1, ["cuda:0", "cuda:1"]),
        ("cuda:2", 2, ["cuda:2", "cuda:4"]),
    ):
        cfg = EngineConfig.from_kwargs(model_path("qwen3"), device=device, dp_size=2, tp_size=tp)
        assert [replica_device(cfg, r)["device"] for r in range(2)] == want
    cfg = EngineConfig.from_kwargs(model_path("qwen3"), device="cpu", dp_size=2)
    assert replica_device(cfg, 1) == {}
