"""``RankGroup``: one tensor-parallel group as seen from one of its ranks.

Two process groups per group, built on torch.distributed's own backends
without its process-wide default group (several engines, and so several
groups, can live in one process): the device group carries the forwards'
collectives (gloo on the CPU, NCCL on CUDA) under ``dist_timeout``; the
control group (gloo, on the host) carries rank 0's step plans and waits as
long as the server is idle.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# The control group waits for the next plan while the server is idle.
IDLE_TIMEOUT = datetime.timedelta(days=365)


class DistributedError(RuntimeError):
    """A rank was lost, hung past ``dist_timeout`` or failed: the group, and
    so the engine, is unusable (``engine_core.is_fatal``)."""


@dataclass
class RankGroup:
    rank: int
    size: int
    device_pg: dist.ProcessGroup | None = None  # the forwards' collectives
    control_pg: dist.ProcessGroup | None = None  # plans (gloo, host tensors)
    # Why the group broke when a rank is known to have died (the launcher's
    # watch says so), for the errors raised here.
    failure: Callable[[], str | None] = field(default=lambda: None)
    store: object = None  # the rendezvous store, kept alive with the groups
    timeout: datetime.timedelta | None = None  # dist_timeout: how long a live rank may lag

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def _wait(self, work: dist.Work, what: str, timeout: datetime.timedelta | None = None) -> None:
        try:
            work.wait() if timeout is None else work.wait(timeout)
        except RuntimeError as e:
            known = self.failure()
            cause = f"{known}; " if known else ""
            raise DistributedError(
                f"tensor-parallel rank {self.rank} of {self.size}: {what} failed: {cause}{e}"
            ) from e

    # ---- forward collectives (the device group) ----------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the ranks in place (and returns it)."""
        if self.size == 1:
            return x
        assert self.device_pg is not None
        self._wait(self.device_pg.allreduce([x]), "all-reduce")
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        assert self.device_pg is not None
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._wait(self.device_pg.allreduce([x], opts), "all-reduce (max)")
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape everywhere), in rank order."""
        if self.size == 1:
            return [x]
        assert self.device_pg is not None
        out = [torch.empty_like(x) for _ in range(self.size)]
        self._wait(self.device_pg.allgather([out], [x.contiguous()]), "all-gather")
        return out

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` on rank 0 (in rank order); None elsewhere."""
        if self.size == 1:
            return [x]
        assert self.device_pg is not None
        opts = dist.GatherOptions()
        opts.rootRank = 0
        out = [[torch.empty_like(x) for _ in range(self.size)]] if self.is_first else []
        self._wait(self.device_pg.gather(out, [x.contiguous()], opts), "gather")
        return out[0] if self.is_first else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape), in place."""
        if self.size == 1:
            return x
        assert self.device_pg is not None
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._wait(self.device_pg.broadcast([x], opts), "broadcast")
        return x

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (sizes each rank computed
        from its own memory, e.g. KV pages), the same on every rank."""
        if self.size == 1:
            return value
        t = torch.tensor([-value], dtype=torch.int64)
        assert self.control_pg is not None
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._wait(self.control_pg.allreduce([t], opts), "agreeing on a size")
        return -int(t.item())

    # ---- control messages (the host group) ---------------------------------

    def broadcast_control(self, t: torch.Tensor, what: str = "a plan") -> torch.Tensor:
        """Rank 0's host tensor ``t`` into every rank's ``t`` (same shape).
        A worker waits as long as the server idles; rank 0 at most
        ``timeout``: its broadcast returns only once every rank takes part,
        and a rank stopped between two forwards would hold it forever."""
        if self.size == 1:
            return t
        assert self.control_pg is not None
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        work = self.control_pg.broadcast([t], opts)
        self._wait(work, f"broadcasting {what}", self.timeout if self.is_first else None)
        return t


SINGLE = RankGroup(0, 1)


def connect(
    rank: int,
    size: int,
    init_addr: str,
    device: torch.device,
    timeout: float,
    failure: Callable[[], str | None] = lambda: None,
) -> RankGroup:
    """Joins the group of ``size`` ranks that meet at ``init_addr``
    (host:port; rank 0 hosts the store). Blocks until every rank has come;
    rank 0 stops waiting as soon as ``failure`` names a reason (a worker
    that died while starting) or after ``max(timeout, 60)`` seconds."""
    host, _, port = init_addr.rpartition(":")
    join_timeout = max(timeout, 60.0)
    store = dist.TCPStore(
        host, int(port), size, rank == 0,
        timeout=datetime.timedelta(seconds=join_timeout), wait_for_workers=False,
    )  # fmt: skip
    if rank == 0:
        _wait_for_ranks(store, size, join_timeout, failure)
    else:
        store.set(f"joined/{rank}", "1")
    op_timeout = datetime.timedelta(seconds=timeout)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = op_timeout
        device_pg = dist.ProcessGroupNCCL(dist.PrefixStore("device", store), rank, size, opts)
    else:
        device_pg = dist.ProcessGroupGloo(dist.PrefixStore("device", store), rank, size, op_timeout)
    control_pg = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, size, IDLE_TIMEOUT)
    return RankGroup(rank, size, device_pg, control_pg, failure, store, op_timeout)


def _wait_for_ranks(
    store: dist.TCPStore, size: int, timeout: float, failure: Callable[[], str | None]
) -> None:
    """Rank 0: until every other rank has said it joined the store, polling
    ``failure`` between looks (the store's own wait could not be cut short)."""
    keys = [f"joined/{r}" for r in range(1, size)]
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        why = failure()
        if why is not None:
            raise DistributedError(f"tensor-parallel start-up failed: {why}")
        if time.monotonic() > deadline:
            missing = [k.split("/")[1] for k in keys if not store.check([k])]
            raise DistributedError(
                f"tensor-parallel start-up: rank(s) {', '.join(missing)} did not join "
                f"within {timeout:.0f}s"
            )
        time.sleep(0.05)
