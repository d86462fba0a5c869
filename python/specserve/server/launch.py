"""Starts the HTTP server: uvicorn on a helper thread, the engine on the main one.

The engine loop runs on the main thread because torch's CPU thread pool
serves the main thread markedly faster than any other; HTTP I/O is light
and lives happily on its own thread and event loop.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import threading
import time

logger = logging.getLogger("specserve.server")


def share_cpu_cores(args: argparse.Namespace) -> None:
    """On the CPU, this process's share of the cores when it is one of
    several ranks or replicas on this machine (its workers take theirs):
    more threads than cores leave every rank waiting on the others."""
    import os

    import torch

    from specserve.config import default_device

    on_node = args.tp_size // args.nnodes * args.dp_size
    if on_node > 1 and (args.device or default_device()) == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // on_node))
        logger.info("CPU threads: %d of this process's (%d ranks and replicas)",
                    torch.get_num_threads(), on_node)  # fmt: skip


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from specserve.engine.engine import Engine
    from specserve.server.app import create_app
    from specserve.server.args import apply_demo_defaults, engine_kwargs, server_config

    try:
        apply_demo_defaults(args)
        cfg = server_config(args)
    except ValueError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("specserve").setLevel(cfg.log_level.upper())
    share_cpu_cores(args)
    if args.node_rank > 0:  # this node runs ranks only; node 0 serves
        from specserve.config import EngineConfig
        from specserve.runner.tp_worker import serve_node

        try:
            config = EngineConfig.from_kwargs(args.model_path, **engine_kwargs(args))
        except ValueError as e:
            print(f"specserve: error: {e}", file=sys.stderr)
            return 2
        return serve_node(config)
    try:
        if args.dp_size > 1:
            from specserve.engine.data_parallel import DataParallelEngine

            engine = DataParallelEngine(args.model_path, **engine_kwargs(args))
        else:
            engine = Engine(model_path=args.model_path, **engine_kwargs(args))
    except (ValueError, OSError) as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    # Everything built so far (modules, weights, tokenizer) lives as long as the
    # process: keep it out of the collector's full passes, which otherwise
    # stall every step that allocates many small objects (logprob entries).
    gc.collect()
    gc.freeze()
    app = create_app(engine, cfg)
    server = uvicorn.Server(
        uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=False)
    )
    http = threading.Thread(target=server.run, name="specserve-http", daemon=True)

    engine.claim_loop()  # before the first request can arrive
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    http.start()
    while not server.started:  # port taken, bad host, ...: uvicorn's thread ends
        if not http.is_alive():
            engine.shutdown()
            print(f"specserve: error: could not serve on {cfg.host}:{cfg.port}", file=sys.stderr)
            return 1
        time.sleep(0.05)
    logger.info("serving %s on http://%s:%d", app.state.ctx.model_name, cfg.host, cfg.port)
    threading.Thread(target=lambda: (http.join(), stop.set()), daemon=True).start()
    try:
        engine.run_loop(stop, cfg.stats_interval)
    finally:
        logger.info("shutting down")
        engine.shutdown()  # in-flight requests end with finish_reason "abort"
        server.should_exit = True
        http.join(timeout=30)
    if engine.error is not None:
        print(f"specserve: error: the engine stopped: {engine.error}", file=sys.stderr)
        return 1
    return 0
