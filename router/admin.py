"""The gateway's admin API: scale the pools, list every worker. Off unless an admin token is configured.

    POST /admin/scale   {"prefill": N, "decode": M} (or {"colocated": K})  → 200 {"workers": [...]} once each named
                        pool has its new size (new workers serve, removed ones are gone); the pools scale one by one,
                        each on its own (a pool not named is left alone)
    GET  /admin/pools   → 200 {"workers": [{"worker_id", "role", "state", "endpoint", "pid", "rank_pids", "node",
                                            "node_id", "incarnation", "load": {...} | null}]}
                        ("node": the host of its endpoint; "node_id": its Ray node, "" when not known;
                        "rank_pids": every tensor-parallel rank's process, rank 0's (= "pid") first)

Guarded by `Authorization: Bearer <token>` (`--admin-token` / SPLITSERVE_ADMIN_TOKEN): without a token configured
the routes do not exist (404, as any unknown path); a missing or wrong token is a 401. The token is compared in
constant time and never logged (`AdminApi`'s repr hides it).

`state`: "starting" (being launched by a scale-up, not yet routed to), "serving" (published: the router sends it
requests), "draining" (chosen by a scale-down: routed nothing new, finishing its requests within --drain-timeout,
then stopped). The controller, which does the work, is behind the small `PoolController` protocol, so the routes
are tested without Ray.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from router.errors import ApiError
from router.worker_registry import WorkerRegistry

ADMIN_TOKEN_ENV = "SPLITSERVE_ADMIN_TOKEN"
MAX_WORKERS_PER_POOL = 256  # a typo guard, not a capacity statement
STATES = ("starting", "serving", "draining")


@dataclass(frozen=True, kw_only=True)
class PoolWorker:
    """One worker as the controller sees it."""

    worker_id: str
    role: str
    state: str  # one of STATES
    endpoint: str = ""  # "" while starting
    pid: int = 0
    rank_pids: tuple[int, ...] = ()  # a tensor-parallel worker's ranks 1..N-1 (rank 0 is `pid`)
    incarnation: int = 0
    node_id: str = ""  # its Ray node


class PoolController(Protocol):
    """What the admin API needs from the cluster controller. Both calls may block (run in a thread)."""

    def scale(self, role: str, num_workers: int) -> None: ...

    def pool_workers(self) -> list[PoolWorker]: ...


@dataclass(frozen=True, kw_only=True)
class AdminApi:
    token: str = field(repr=False)
    controller: PoolController

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("the admin token must be non-empty")


def scale_targets(body: object, roles: Sequence[str]) -> dict[str, int]:
    """The pool sizes a /admin/scale body asks for, in `roles` order; ApiError 400 when it is not a JSON object of
    pool sizes for this cluster's pools (integers 1..MAX_WORKERS_PER_POOL: scaling a needed pool to 0 would take
    the service down)."""
    if not isinstance(body, dict) or not body:
        example = json.dumps(dict.fromkeys(roles, 2))
        raise ApiError(status_code=400, message=f"expected a JSON object of pool sizes, e.g. {example}")
    unknown = sorted(set(body) - set(roles))
    if unknown:
        raise ApiError(status_code=400, message=f"unknown pool(s) {', '.join(unknown)}: this cluster has "
                       f"{', '.join(roles)}", param=unknown[0])
    targets = {}
    for role in roles:
        if role not in body:
            continue
        n = body[role]
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_WORKERS_PER_POOL:
            raise ApiError(status_code=400, message=f"{role} must be an integer in 1..{MAX_WORKERS_PER_POOL}, got "
                           f"{n!r}", param=role)
        targets[role] = n
    return targets


def install_admin_routes(app: FastAPI, admin: AdminApi, registry: WorkerRegistry, roles: Sequence[str]) -> None:
    """Add /admin/scale and /admin/pools to `app`, guarded by `admin.token`."""

    def authorized(request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), admin.token.encode()):
            raise ApiError(status_code=401, message="a valid admin token is required (Authorization: Bearer ...)",
                           headers={"WWW-Authenticate": "Bearer"})

    routes = APIRouter(prefix="/admin", dependencies=[Depends(authorized)], include_in_schema=False)

    @routes.post("/scale")
    async def scale(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(status_code=400, message="the body is not JSON") from None
        for role, n in scale_targets(body, roles).items():
            try:
                await asyncio.to_thread(admin.controller.scale, role, n)
            except (ValueError, RuntimeError) as exc:
                raise ApiError(status_code=503, message=f"scaling {role} to {n} failed: {exc}") from exc
        await registry.refresh()  # route to the new pools at once, not after the next refresh
        return JSONResponse({"workers": await _pools(admin, registry)})

    @routes.get("/pools")
    async def pools() -> JSONResponse:
        return JSONResponse({"workers": await _pools(admin, registry)})

    app.include_router(routes)


async def _pools(admin: AdminApi, registry: WorkerRegistry) -> list[dict[str, Any]]:
    workers = await asyncio.to_thread(admin.controller.pool_workers)
    loads = {s.info.worker_id: s for s in registry.snapshots()}
    listed = []
    for worker in workers:
        snapshot = loads.get(worker.worker_id)
        stats = snapshot.stats if snapshot is not None else None
        listed.append({
            "worker_id": worker.worker_id, "role": worker.role, "state": worker.state, "endpoint": worker.endpoint,
            "pid": worker.pid, "rank_pids": [worker.pid, *worker.rank_pids] if worker.pid else [],
            "node": worker.endpoint.rpartition(":")[0] or None, "node_id": worker.node_id,
            "incarnation": worker.incarnation,
            "load": None if stats is None else {
                "healthy": snapshot.healthy,  # type: ignore[union-attr]
                "num_requests_running": stats.num_requests_running,
                "num_requests_waiting": stats.num_requests_waiting,
                "num_requests_receiving_kv": stats.num_requests_receiving_kv,
                "kv_blocks_used": stats.kv_blocks_used, "kv_blocks_total": stats.kv_blocks_total,
                "kv_cache_usage": stats.kv_cache_usage,
            },
        })
    return listed
