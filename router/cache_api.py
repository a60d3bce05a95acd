"""vLLM's `POST /reset_prefix_cache` (SGLang's `/flush_cache`): every worker forgets the KV blocks its prefix cache
holds, for a benchmark that must start cold without restarting the cluster.

    POST /reset_prefix_cache  → 200 {"reset": true, "workers": [{"worker_id", "reset", "kv_blocks_used"}, ...]}
                              → 409 the same with "reset": false when a worker holds blocks (requests running, or a
                                peer's fetch) or did not answer ("error"): nothing changed there; call it again idle
                              → 503 without a healthy worker

Each worker resets between two engine steps, and its prefix index entries go with it (AllBlocksCleared). A KV offload
tier (--kv-offload-dir) keeps its blocks. Keyed like /v1/* when API keys are set (router/api_keys.py): vLLM serves it
only in its development mode, since a reset costs every later request its cached prefix.
"""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from protos import serving_pb2
from router.errors import error_body
from router.worker_registry import WorkerRegistry

RESET_PATHS = ("/reset_prefix_cache",)
_RESET_TIMEOUT_S = 30.0  # a reset waits for the worker's step to end


def install_cache_routes(app: FastAPI, registry: WorkerRegistry) -> None:
    @app.post("/reset_prefix_cache", include_in_schema=False)
    async def reset_prefix_cache() -> JSONResponse:
        workers = [s.info.worker_id for s in registry.snapshots() if s.healthy]
        if not workers:
            return JSONResponse(error_body(503, "no healthy worker"), status_code=503)
        results = await asyncio.gather(*(_reset(registry, worker_id) for worker_id in workers))
        reset = all(r["reset"] for r in results)
        return JSONResponse({"reset": reset, "workers": list(results)}, status_code=200 if reset else 409)


async def _reset(registry: WorkerRegistry, worker_id: str) -> dict[str, object]:
    try:
        reply = await registry.stub(worker_id).ResetPrefixCache(serving_pb2.ResetPrefixCacheRequest(),
                                                                timeout=_RESET_TIMEOUT_S)
    except KeyError:  # it left the list meanwhile
        return {"worker_id": worker_id, "reset": False, "error": "left the cluster"}
    except grpc.aio.AioRpcError as error:
        return {"worker_id": worker_id, "reset": False,
                "error": f"{error.code().name}: {error.details() or ''}".strip()}
    return {"worker_id": worker_id, "reset": reply.reset, "kv_blocks_used": reply.kv_blocks_used}
