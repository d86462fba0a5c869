"""Starts the real server in a subprocess on a free port and stops it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

LAUNCH = [sys.executable, "-m", "specserve.launch_server"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(
        self, proc: subprocess.Popen, base: str, log_path: str, api_key: str | None
    ) -> None:
        self.proc, self.base, self.log_path = proc, base, log_path
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # An idle connection is dropped here before the server drops it
        # (uvicorn: after 5 s; httpx's default is also 5 s, and a request sent
        # as the server closed its connection met "Server disconnected").
        limits = httpx.Limits(keepalive_expiry=2.0)
        self.http = httpx.Client(base_url=base, timeout=60, headers=headers, limits=limits)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """Polls until no request runs or waits and every KV page is free."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.http.get("/get_server_info").json()["stats"]
            if (
                not stats["running"]
                and not stats["queued"]
                and stats["free_pages"] == stats["total_pages"]
            ):
                return stats
            assert time.monotonic() < deadline, f"server not idle: {stats}"
            time.sleep(0.05)


def assert_documented(openapi: dict, method: str, path: str, r: httpx.Response) -> None:
    """``r``'s status is one that ``/openapi.json`` lists for the operation,
    and an error's body validates against the schema listed for it."""
    listed = openapi["paths"][path][method]["responses"]
    assert str(r.status_code) in listed, (method, path, r.status_code, sorted(listed), r.text[:300])
    if r.status_code >= 400:
        import jsonschema

        schema = listed[str(r.status_code)]["content"]["application/json"]["schema"]
        jsonschema.validate(r.json(), {**schema, "components": openapi["components"]})


@contextmanager
def running_server(
    model_path: str,
    *flags: str,
    api_key: str | None = None,
    log_dir: str,
    launch: list[str] | None = None,
) -> Iterator[Server]:
    """``launch``: the command line before the flags (default: SGLang's spelling).
    A speculative server verifies what its proposer drafted, every round
    (``--speculative-adaptive off``), unless the flags say otherwise: as for
    the engines tests build (conftest.py), the cost model is timed, so on a
    tiny model it may rightly verify nothing, and a test that checks the
    rounds would then check none."""
    if "--speculative-algorithm" in flags and "--speculative-adaptive" not in flags:
        flags = (*flags, "--speculative-adaptive", "off")
    port = free_port()
    cmd = [
        *(launch or LAUNCH),
        "--model-path",
        model_path,
        "--port",
        str(port),
        "--page-size",
        "4",
        "--max-total-tokens",
        "4096",
        "--chunked-prefill-size",
        "64",
        "--log-level",
        "warning",
        *flags,
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    log_path = os.path.join(log_dir, f"server-{port}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    server = Server(proc, base, log_path, api_key)
    deadline = time.monotonic() + 120
    try:
        while True:
            assert proc.poll() is None, f"server exited early:\n{server.log()}"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"server did not come up:\n{server.log()}"
            time.sleep(0.1)
        yield server
    finally:
        server.http.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
