"""vLLM's --max-loras: the most LoRA adapters running at once. Control plane: no torch (a request's adapter is an
opaque object here, one per loaded adapter)."""

from __future__ import annotations

from collections.abc import Iterable

from engine.core.request import Request


def adapters_of(requests: Iterable[Request]) -> set[object]:
    return {r.lora for r in requests if r.lora is not None}


def one_adapter_too_many(adapters: set[object], request: Request, limit: int | None) -> bool:
    """Whether admitting `request` beside requests running `adapters` would make one adapter more run than `limit`
    (None: any number may)."""
    return limit is not None and request.lora is not None and request.lora not in adapters and len(adapters) >= limit


def first_admissible(waiting: Iterable[Request], running: Iterable[Request], limit: int | None) -> Request | None:
    """The first of `waiting` that admission considers: one under one adapter too many is passed over."""
    adapters = adapters_of(running)
    return next((r for r in waiting if not one_adapter_too_many(adapters, r, limit)), None)
