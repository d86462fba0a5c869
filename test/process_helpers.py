"""Processes as Linux's /proc shows them, for tests that check what a
component leaves running (and that skip where there is no /proc)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

HAS_PROC = os.path.isdir("/proc")


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name; None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """The process exists, a zombie included (a parent must reap what it kills)."""
    return _stat(pid) is not None


def exited(pid: int) -> bool:
    """Our child: ready to be reaped (every thread gone). Another process:
    gone, or a zombie (whoever adopted it may not have reaped it yet)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        fields = _stat(pid)
        return fields is None or fields[0] == "Z"


def children(pid: int) -> set[int]:
    """Every process whose parent is ``pid``."""
    kids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and int(fields[1]) == pid:
                kids.add(int(entry))
    return kids


def cpu_ticks(pid: int) -> int:
    """User + system time of ``pid`` in clock ticks."""
    fields = _stat(pid)
    assert fields is not None, f"process {pid} is gone"
    return int(fields[11]) + int(fields[12])


def wait_exited(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not exited(pid):
        assert time.monotonic() < deadline, f"process {pid} did not exit"
        time.sleep(0.01)


def wait_busy(pid: int, waiting: Callable[[], bool], ticks: int = 5, timeout: float = 60.0) -> None:
    """Polls until ``pid`` has run ``ticks`` more clock ticks of CPU while
    ``waiting()`` holds (its caller still waits for it)."""
    start = cpu_ticks(pid)
    deadline = time.monotonic() + timeout
    while cpu_ticks(pid) - start < ticks:
        assert waiting(), "the caller ended before the process got busy"
        assert time.monotonic() < deadline, f"process {pid} never got busy"
        time.sleep(0.02)
