"""Start real prefill / decode / colocated workers in this process (real gRPC servers, real transports) and talk
to them over gRPC the way the router does."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.request.sampling_params import SamplingParams
from engine.request.wire import sampling_params_to_proto
from protos import serving_pb2, serving_pb2_grpc
from protos.cluster_auth import OPEN, ClusterAuth, sync_channel
from worker.config import WorkerConfig

# One torch thread: this process runs a prefill and a decode engine at once, beside another test file (the suite
# runs two), on two cores.
ENGINE = dict(num_kv_blocks=192, max_model_len=1024, max_num_batched_tokens=1024, num_threads=1)


def engine_config(**overrides: object) -> EngineConfig:
    return EngineConfig(**{**ENGINE, **overrides})  # type: ignore[arg-type]


def start_worker(role: str, checkpoint, *, transport: str = "grpc", worker_id: str | None = None,
                 timeout_s: float = 10.0, redis_url: str | None = None, incarnation: int = 0,
                 auth: ClusterAuth = OPEN, **engine_overrides: object):
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    config = WorkerConfig(
        worker_id=worker_id or role,
        role=role,
        engine=engine_config(**engine_overrides),
        kv_transport=transport,
        kv_transfer_timeout_s=timeout_s,
        redis_url=redis_url,
        incarnation=incarnation,
        auth=auth,
    )
    worker = PrefillWorker(config, checkpoint) if role == "prefill" else DecodeWorker(config, checkpoint)
    worker.start()
    return worker


def stub(worker, auth: ClusterAuth = OPEN) -> serving_pb2_grpc.WorkerStub:
    return serving_pb2_grpc.WorkerStub(sync_channel(worker.endpoint, auth))


@dataclass
class StreamResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    error: str = ""
    messages: list[serving_pb2.GenerateResponse] = field(default_factory=list)


def generate(
    decode_stub: serving_pb2_grpc.WorkerStub,
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    prefill_endpoint: str = "",
    timeout_s: float = 120.0,
) -> StreamResult:
    request = serving_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        params=sampling_params_to_proto(params),
        prefill_endpoint=prefill_endpoint,
    )
    result = StreamResult()
    for msg in decode_stub.Generate(request, timeout=timeout_s):
        result.messages.append(msg)
        result.token_ids.extend(msg.token_ids)
        result.text += msg.text_delta
        if msg.finish_reason:
            result.finish_reason = msg.finish_reason
            result.error = msg.error
    return result


def wait_blocks_free(*workers, timeout_s: float = 10.0) -> None:
    """Every worker's KV blocks back in its pool (prefix-cached blocks count as free), read over gRPC."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = [stub(w).GetLoad(serving_pb2.LoadRequest(), timeout=10) for w in workers]
        if all(load.kv_blocks_used == 0 and load.kv_blocks_free == load.kv_blocks_total for load in loads):
            return
        if time.monotonic() > deadline:
            raise AssertionError("KV blocks still in use: " + "; ".join(
                f"{load.worker_id}: {load.kv_blocks_used} used" for load in loads))
        time.sleep(0.05)


@contextlib.contextmanager
def slowed_forward(worker, sleep_s: float) -> Iterator[threading.Event]:
    """Inside the block, every forward of `worker`'s model sleeps `sleep_s` first, without the GIL and without the
    engine's lock (the step computes: LLMEngine._computing), as a long prefill would take; the event is set as the
    first such forward starts. On the way out the model's forward is its own again."""
    model = worker.runtime.engine.runner.model
    forward = model.forward
    computing = threading.Event()

    def slow_forward(*args, **kwargs):  # noqa: ANN202
        computing.set()
        time.sleep(sleep_s)
        return forward(*args, **kwargs)

    model.forward = slow_forward
    try:
        yield computing
    finally:
        del model.forward  # the instance attribute goes: the class's forward again
