"""Run one worker as its own process (`python -m prefill_worker` / `python -m decode_worker`), outside Ray.

Prints `ENDPOINT host:port` on stdout once serving, then serves until SIGINT/SIGTERM, on which it aborts every
request (freeing its blocks) and exits 0. Benchmarks, multi-host setups without Ray and `splitserve gateway
--prefill/--decode/--colocated` (deploy/static_workers.py) run workers this way.

Its incarnation is the start time in microseconds since the epoch: a process restarted under the same worker id
gets a larger one, as a controller's restart does, so the prefix index and the gateway tell it from its
predecessor. Its worker id defaults to `<role>-<port>`, or `<role>-<pid>` on a free port (--port 0).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence

from engine.engine_args import add_engine_args, engine_config_from_args
from kv_transfer.registry import TRANSPORTS
from protos.cluster_auth import CLUSTER_SECRET_ENV, add_cluster_auth_args, cluster_auth_from_args
from protos.worker_info import ROLES
from worker.config import WorkerConfig
from worker.fresh_thread import run_on_fresh_thread
from worker.log_config import configure_logging

logger = logging.getLogger(__name__)


def parse_worker_config(argv: Sequence[str] | None, roles: Sequence[str]) -> WorkerConfig:
    package = "prefill_worker" if roles[0] == "prefill" else "decode_worker"
    parser = argparse.ArgumentParser(prog=f"python -m {package}", description=__doc__)
    parser.add_argument("--role", choices=roles, default=roles[0])
    parser.add_argument("--worker-id", default=None, help="default: <role>-<port>, or <role>-<pid> with --port 0")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--kv-transport", choices=TRANSPORTS, default="grpc")
    parser.add_argument("--kv-transfer-timeout", type=float, default=30.0, help="seconds")
    parser.add_argument("--redis-url", default=None, help="publish KV events to this prefix index (default: none)")
    add_cluster_auth_args(parser)
    add_engine_args(parser)
    args = parser.parse_args(argv)
    return WorkerConfig(
        worker_id=args.worker_id or f"{args.role}-{args.port or os.getpid()}",
        role=args.role,
        engine=engine_config_from_args(args),
        host=args.host,
        port=args.port,
        kv_transport=args.kv_transport,
        kv_transfer_timeout_s=args.kv_transfer_timeout,
        redis_url=args.redis_url,
        auth=cluster_auth_from_args(args, os.environ),
        incarnation=time.time_ns() // 1000,  # exact in the index's Lua numbers (below 2**53) until the year 2255
    )


def serve_forever(build: Callable[[WorkerConfig], object], argv: Sequence[str] | None, roles: Sequence[str]) -> int:
    assert set(roles) <= set(ROLES)
    config = parse_worker_config(argv, roles)
    configure_logging()
    if not config.auth.secret:
        logger.warning("no cluster secret (--cluster-secret or $%s): anyone who reaches %s:%s may call this worker",
                       CLUSTER_SECRET_ENV, config.host, config.port or "its port")
    worker = run_on_fresh_thread(lambda: build(config))  # the engine loop's thread: the only OpenMP master
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    endpoint = worker.start()  # type: ignore[attr-defined]
    print(f"ENDPOINT {endpoint}", flush=True)
    stop.wait()
    worker.stop()  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit("run `python -m prefill_worker` or `python -m decode_worker`")
