"""vLLM's --max-loras: the most LoRA adapters running at once. Control plane: no torch (a request's adapter is an
opaque object here, one per loaded adapter)."""

from __future__ import annotations

from collections.abc import Iterable

from engine.core.request import Request


def one_adapter_too_many(running: Iterable[Request], request: Request, limit: int | None) -> bool:
    """Whether admitting `request` would make one adapter more run than `limit` (None: any number may)."""
    if limit is None or request.lora is None:
        return False
    adapters = {r.lora for r in running if r.lora is not None}
    return request.lora not in adapters and len(adapters) >= limit
