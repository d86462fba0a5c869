"""The server a soak run starts, and what it samples of a server process
from /proc (benchmark/soak.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launched:
    """The server soak.py starts, and stops at the end (SIGTERM)."""

    def __init__(self, args: argparse.Namespace) -> None:
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.cmd = [sys.executable, "-m", "specserve.launch_server", "--host", "127.0.0.1"]
        self.cmd += ["--port", str(port), "--log-level", "warning", *shlex.split(args.server_args)]
        if args.model_path:
            self.cmd += ["--model-path", args.model_path]
        if args.speculative_algorithm:
            self.cmd += ["--speculative-algorithm", args.speculative_algorithm]
        self.log_path = args.server_log or tempfile.mkstemp(prefix="soak-server-", suffix=".log")[1]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)

    async def wait_up(self, client: httpx.AsyncClient, timeout: float) -> str | None:
        """None once /health answers, else why not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"the server exited with status {self.proc.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/health", timeout=2.0)).status_code == 200:
                    return None
            await asyncio.sleep(0.2)
        return f"the server did not answer /health within {timeout:g} s"

    def stop(self) -> int | None:
        """SIGTERM, then the exit status (None: it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode

    def log_tail(self, chars: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]


def pid_listening_on(port: int) -> int | None:
    """The process holding the listening TCP socket on ``port`` (same user's only)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":
                    inodes.add(f"socket:[{cols[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return int(pid)
    return None


def proc_sample(pid: int | None) -> dict[str, float | None]:
    """RSS (MB), threads and open file descriptors of ``pid`` from /proc."""
    out: dict[str, float | None] = {"rss_mb": None, "threads": None, "fds": None}
    if pid is None:
        return out
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss_mb"] = int(line.split()[1]) / 1024
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
    with contextlib.suppress(OSError):
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"
