"""Logging for splitserve's processes (the CLI, `serve`, each worker): our packages' records from
SPLITSERVE_LOGGING_LEVEL up (default INFO, as vLLM's VLLM_LOGGING_LEVEL) reach stderr; other libraries keep the
levels they set. Under Ray, a worker's stderr reaches the `serve` terminal, prefixed with its actor and pid."""

from __future__ import annotations

import logging
import os

LEVEL_ENV = "SPLITSERVE_LOGGING_LEVEL"
_PACKAGES = ("engine", "kv_transfer", "router", "deploy", "worker", "prefill_worker", "decode_worker")


def configure_logging() -> None:
    """Idempotent. Adds a stderr handler to the root logger only when nobody configured one (a host process, a
    test runner, keeps its own); the root's own level stays WARNING for everyone else's loggers."""
    level = os.environ.get(LEVEL_ENV, "INFO").upper()
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in _PACKAGES:
        logging.getLogger(name).setLevel(level)
