"""A tensor-parallel worker rank that is killed, hangs or raises ends the
engine, not silently: the requests in flight get an error, new ones are
refused, the server exits non-zero within seconds, and no rank is left
behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from models_zoo import model_path
from process_helpers import HAS_PROC, exited, wait_exited
from server_harness import running_server
from specserve import Engine
from specserve.distributed import DistributedError
from specserve.distributed.group import connect
from specserve.distributed.launcher import free_addr
from specserve.distributed.plan import FORWARD, INLINE
from specserve.engine.engine import EngineStopped

pytestmark = pytest.mark.skipif(not HAS_PROC, reason="needs /proc")

LONG = {"max_tokens": 3000, "temperature": 0, "ignore_eos": True}


def _worker_pid(server_pid: int) -> int:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == server_pid and "spawn_main" in cmd:
            return int(entry)
    raise AssertionError("no worker rank found")


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_server_stops_on_a_lost_rank(tmp_path, fault) -> None:
    flags = ["--tp-size", "2", "--dist-timeout", "3", "--grammar-backend", "none"]
    with running_server(model_path("qwen3"), *flags, log_dir=str(tmp_path)) as server:
        worker = _worker_pid(server.proc.pid)
        replies: list[httpx.Response] = []
        body = {"prompt": "def f(n):", **LONG}
        client = threading.Thread(
            target=lambda: replies.append(server.http.post("/v1/completions", json=body))
        )
        client.start()
        time.sleep(1.0)  # the request is decoding
        os.kill(worker, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        start = time.monotonic()
        client.join(timeout=30)
        assert replies and replies[0].status_code == 500, replies
        assert "tensor-parallel rank" in replies[0].json()["error"]["message"]
        code = server.proc.wait(timeout=30)
        took = time.monotonic() - start
        assert code != 0, server.log()
        assert took < 20, took  # seconds: the dist timeout (3 s) and the shutdown
        wait_exited(worker, timeout=10)


def test_a_plan_for_a_rank_stopped_between_forwards_times_out() -> None:
    """Rank 0's plan broadcast returns only once every rank takes part: to a
    rank that hangs between two forwards (alive, in no collective) it fails
    after ``dist_timeout`` instead of waiting for ever."""
    addr = free_addr()
    script = (
        "import sys, time, torch\n"
        "from specserve.distributed.group import connect\n"
        "group = connect(1, 2, sys.argv[1], torch.device('cpu'), timeout=2.0)\n"
        "time.sleep(120)\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", script, addr])
    try:
        group = connect(0, 2, addr, torch.device("cpu"), timeout=2.0)
        start = time.monotonic()
        with pytest.raises(DistributedError, match="broadcasting a plan"):
            group.broadcast_control(torch.zeros(INLINE, dtype=torch.int64))
        assert time.monotonic() - start < 15
    finally:
        worker.kill()
        worker.wait()


def test_rank_0_stops_waiting_for_a_rank_that_died_while_starting() -> None:
    """A worker that exits before it joins (the launcher's watch names it)
    ends rank 0's start-up at once, not after the store's timeout."""
    start = time.monotonic()

    def failure() -> str | None:
        return "rank 1 exited with code 1" if time.monotonic() - start > 0.5 else None

    with pytest.raises(DistributedError, match="rank 1 exited with code 1"):
        connect(0, 2, free_addr(), torch.device("cpu"), timeout=30.0, failure=failure)
    assert time.monotonic() - start < 10


def test_a_raising_rank_stops_the_engine() -> None:
    """A worker that fails (here on a plan with the wrong step id, which it
    must refuse) exits non-zero; the engine stops on it while idle."""
    eng = Engine(model_path=model_path("qwen3"), device="cpu", tp_size=2, max_total_tokens=1024)
    try:
        (worker,) = eng.ranks.pids.values()
        out = eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        assert len(out["output_ids"]) == 2
        bad = torch.zeros(INLINE, dtype=torch.int64)
        bad[:3] = torch.tensor([eng.runner.plans.step_id + 5, FORWARD, 0])
        eng.runner.group.broadcast_control(bad)
        wait_exited(worker, timeout=10)
        deadline = time.monotonic() + 10
        while eng.ranks.lost() is None:  # the watch has seen it
            assert time.monotonic() < deadline, "the launcher's watch missed the exit"
            time.sleep(0.02)
        # The next caller finds the engine stopped on the lost rank.
        out = eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert "rank 1 exited (exit code 1)" in out["meta_info"]["finish_reason"]["message"]
        assert "rank 1 exited (exit code 1)" in eng.error
        with pytest.raises(EngineStopped):
            eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    finally:
        eng.shutdown()
    assert exited(worker)


def test_two_nodes(tmp_path) -> None:
    """``--nnodes 2``: node 1 (its own process, ranks only) and node 0 (the
    server, rank 0) meet at ``--dist-init-addr``; the answers are one rank's;
    node 1 exits 0 once the server stops."""
    import subprocess

    from server_harness import LAUNCH, free_port

    path = model_path("qwen3")
    addr = f"127.0.0.1:{free_port()}"
    common = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    with open(tmp_path / "node1.log", "w") as log:
        node1 = subprocess.Popen(
            [*LAUNCH, "--model-path", path, *common, "--node-rank", "1", "--page-size", "4",
             "--max-total-tokens", "4096", "--chunked-prefill-size", "64"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        flags = [*common, "--node-rank", "0", "--grammar-backend", "none"]
        with running_server(path, *flags, log_dir=str(tmp_path)) as server:
            body = {"prompt": "def f(n):", "max_tokens": 8, "temperature": 0, "logprobs": 3}
            got = server.http.post("/v1/completions", json=body).json()["choices"][0]
        assert node1.wait(timeout=30) == 0, (tmp_path / "node1.log").read_text()
    finally:
        if node1.poll() is None:
            node1.kill()
    with Engine(model_path=path, device="cpu", page_size=4, max_total_tokens=4096) as one:
        ids = one.tokenizer.encode("def f(n):")
        want = one.generate(
            input_ids=ids,
            sampling_params={"temperature": 0, "max_new_tokens": 8},
            return_logprob=True,
        )
    assert got["text"] == want["text"]
    lps = [e[0] for e in want["meta_info"]["output_token_logprobs"]]
    assert got["logprobs"]["token_logprobs"] == pytest.approx(lps, abs=1e-5)


def test_a_forward_failing_on_rank_0_stops_the_group(monkeypatch) -> None:
    """Rank 0 failing inside a forward its workers run too must not be
    retried as one request's failure (the workers may be waiting in one of
    its collectives, which the next forward's would meet): the engine stops,
    the request gets the error, the worker is ended."""
    eng = Engine(model_path=model_path("qwen3"), device="cpu", tp_size=2, max_total_tokens=1024)
    (worker,) = eng.ranks.pids.values()
    model = eng.runner.model

    def broken(hidden):
        raise RuntimeError("injected")

    monkeypatch.setattr(model.lm_head, "forward", broken)  # between two collectives
    try:
        out = eng.generate(input_ids=[[1, 2, 3], [4, 5]], sampling_params={"max_new_tokens": 2})
        assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in out)
        assert "rank 0 failed in a tensor-parallel forward" in eng.error
    finally:
        eng.shutdown()
    wait_exited(worker, timeout=10)


def test_a_script_that_never_shuts_down_still_exits(tmp_path) -> None:
    """Python's exit terminates an engine's worker ranks (daemon children) and
    waits for them: they give SIGTERM a grace period, then go (no hang)."""
    import subprocess
    import sys

    script = tmp_path / "forgets.py"
    script.write_text(
        "from specserve import Engine\n"
        "if __name__ == '__main__':\n"
        f"    eng = Engine(model_path={model_path('qwen3')!r}, device='cpu', tp_size=2,\n"
        "                 max_total_tokens=1024)\n"
        "    print(eng.generate(input_ids=[1, 2], sampling_params={'max_new_tokens': 2}))\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "output_ids" in done.stdout
