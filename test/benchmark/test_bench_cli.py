"""Each benchmark says what is missing and exits non-zero, instead of a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmark", script), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("script", ["bench_spec.py", "bench_offline.py", "bench_growth.py"])
def test_a_missing_model_is_named(script, tmp_path) -> None:
    missing = str(tmp_path / "no-such-model")
    done = run(script, "--model-path", missing)
    assert done.returncode == 1
    assert f"{script[:-3]}: no checkpoint at {missing}" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_missing_server_is_named() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = run("bench_serving.py", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1")
    assert done.returncode == 1
    assert f"cannot reach http://127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr
