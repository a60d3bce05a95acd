"""The gateway: an OpenAI-compatible HTTP API (FastAPI) that dispatches requests to workers over gRPC.

Imports nothing heavy, and the whole package never imports torch or ray: the router runs on any machine.

    config.py           GatewayConfig (the gateway's settings, one field a flag), ServedEngine, RouterConfig
    config_checks.py    range checks declared on config fields (`checked(POSITIVE, default=30.0)`)
    protocol.py         OpenAI request bodies and their conversion to the workers' SamplingParams
    prompt.py           prompt / chat messages -> token ids; max_tokens against the context length
    responses.py        OpenAI response and stream-chunk shapes, logprobs shapes
    errors.py           ApiError and OpenAI's JSON error shape
    api_keys.py         API keys: an ASGI guard on /v1/* (401), the key ring (file reloaded on SIGHUP)
    rate_limit.py       per-key token buckets (requests and tokens per minute; 429 with Retry-After)
    routing.py          the routing policy: pure functions over worker load snapshots
    worker_registry.py  the workers: gRPC channels, periodic GetLoad polling, health
    dispatcher.py       one request's Generate call: route, dispatch, retry, cancel + Abort
    metrics.py          Prometheus metrics on a private registry (`splitserve:` names)
    app.py              create_app: the FastAPI routes
    server.py           serving an app with uvicorn (blocking, or in a background thread)
"""


def package_version() -> str:
    """splitserve's installed version ("unknown" when run from a source tree that was never installed): GET
    /version, and the bench reports."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("splitserve")
    except PackageNotFoundError:
        return "unknown"
