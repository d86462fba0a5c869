"""A worker rank of a tensor-parallel group: loads its shard of the target,
sizes its KV pool with the others, then runs rank 0's forwards until rank 0
stops it (or goes away)."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import torch

from specserve.config import EngineConfig
from specserve.distributed.group import RankGroup, connect
from specserve.distributed.launcher import WorkerRanks, exit_with_parent, free_addr
from specserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def run_worker(rank: int, size: int, addr: str, config: EngineConfig, log_level: int) -> None:
    """The worker process's main (``WorkerRanks`` spawns it). Any error ends
    the process with a non-zero exit: rank 0 sees its collectives fail and
    its watch report the exit, and stops."""
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s"
    )
    exit_with_parent()
    # The ranks on this machine share its cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.parallel.ranks_per_node))
    try:
        device = torch.device(config.device)
        if device.type == "cuda":  # the rank-th of this node's devices from rank 0's
            device = torch.device(
                "cuda", (device.index or 0) + rank % config.parallel.ranks_per_node
            )
            torch.cuda.set_device(device)
            config = dataclasses.replace(config, device=str(device))
        group = connect(rank, size, addr, device, config.parallel.dist_timeout)
        runner = ModelRunner(config, group=group, allocate_kv=False)
        join_drafter(config, runner)
        logger.info("rank %d of %d: serving its shard", rank, size)
        runner.serve_plans()
    except BaseException:
        logger.exception("rank %d of %d failed", rank, size)
        sys.stderr.flush()
        os._exit(1)
    # Gloo's threads may still hold the groups: leave without tearing them down.
    sys.stdout.flush()
    os._exit(0)


def join_drafter(config: EngineConfig, runner: ModelRunner) -> None:
    """Sizes a worker's KV pools: with a DSpark / DFlash drafter split over
    the group, its shard loads first, as on rank 0, and its pool is counted
    and made."""
    if config.spec.algorithm not in ("DSPARK", "DFLASH") or config.draft_tp_size == 1:
        runner.allocate_kv()
        return
    from specserve.speculative.draft_shard import attach_draft_shard
    from specserve.speculative.drafter_loader import draft_kv_pool, load_drafter

    loaded = load_drafter(config, runner)
    runner.allocate_kv(loaded.kv_bytes_per_page, loaded.activation_bytes)
    attach_draft_shard(config, runner, loaded, draft_kv_pool(config, runner, loaded))


def start_workers(config: EngineConfig) -> tuple[RankGroup, WorkerRanks]:
    """Rank 0's side of start-up: spawns ranks 1..tp_size-1 and joins the
    group with them (rank 0 stays in this process)."""
    par = config.parallel
    addr = par.dist_init_addr or free_addr()
    level = logging.getLogger("specserve").getEffectiveLevel()
    ranks = WorkerRanks(run_worker, par.node_ranks[1:], par.tp_size, addr, (config, level))
    try:
        group = connect(
            0, par.tp_size, addr, torch.device(config.device), par.dist_timeout, ranks.lost
        )
    except BaseException:
        ranks.close()
        raise
    return group, ranks


def serve_node(config: EngineConfig) -> int:
    """A node other than node 0 (``--node-rank`` > 0): runs its ranks until
    rank 0 stops them; returns the exit status (non-zero when a rank failed:
    the others are killed then)."""
    par = config.parallel
    assert par.node_rank > 0 and par.dist_init_addr is not None
    level = logging.getLogger("specserve").getEffectiveLevel()
    ranks = WorkerRanks(
        run_worker, par.node_ranks, par.tp_size, par.dist_init_addr, (config, level)
    )
    logger.info(
        "node %d of %d: ranks %d-%d, meeting at %s",
        par.node_rank, par.nnodes, par.node_ranks[0], par.node_ranks[-1], par.dist_init_addr,
    )  # fmt: skip
    failed = ranks.wait()
    ranks.close()
    return 0 if failed is None else 1
