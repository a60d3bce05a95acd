"""The worker process: what a prefill, decode or colocated worker runs around its engine. Role policy lives in
`prefill_worker/` and `decode_worker/`, which build on this; the engine itself (engine/) knows nothing of gRPC,
Redis or threads.

Imports nothing heavy: `worker.config`, `worker.convert` and the gate load without torch; the runtime loads the engine.

    config.py             WorkerConfig: a worker's identity, endpoint, KV transport, timeouts, prefix index, auth
    runtime.py            WorkerRuntime: the engine on its loop thread, the grpc.aio server, the common RPCs
                          (Health, GetLoad, Abort) in WorkerServicer, RuntimeWorker (what both roles share)
    engine_loop.py        EngineLoop: the engine on a thread of its own, fed by commands between steps
    event_loop_thread.py  the asyncio loop (its own thread) the server, the handlers and aio channels run on
    request_gate.py       RequestGate: counts the request RPCs in flight, shuts to new ones when draining
    kv_event_publisher.py the KV events, off the engine's thread, to the Redis prefix index
    convert.py            the engine's outputs as the Generate stream's messages (the request's own: engine/request)
    main.py               the process entry point (`python -m prefill_worker` / `decode_worker`)
    fresh_thread.py, malloc_tuning.py, log_config.py   process set-up: OpenMP teams, glibc malloc, logging

Tensor parallelism's rank processes have their place here, beside the runtime (rank 0 schedules and serves, every
rank executes).
"""
