"""A disaggregated request's TTFT when its decode worker is busy decoding: the handoff's reservation and commit
between two decode steps (the baseline) against while a step computes (EngineLoop.call_now, ours), one run.

One prefill and one decode worker in this process (real gRPC, real KV handoffs over --transport, the real SmolLM2,
one torch thread each). The decode worker keeps `--streams` colocated streams decoding (its steps at that batch);
meanwhile `--requests` disaggregated requests of `--prompt-tokens` random tokens arrive one after another, each
timed at the client from sending it to its first streamed token. The two modes alternate round by round on the same
workers; the baseline's decode worker has `call_now` replaced by `call` (every reservation and commit waits for the
step that runs to end, as before).

    PYTHONPATH=. python bench/handoff_busy_decode.py [--streams 16] [--requests 10] [--rounds 3] [--interval 1.2]

One after another (the default), a mode whose requests end sooner sends them more often, which costs the busy
streams more; `--interval` sends them at fixed times instead, so that both modes offer the same load.

Prints per mode the TTFT p50 and mean, the decode worker's mean step time meanwhile and its busy streams' tokens a
second (what the handoffs cost them), and ours / baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from decode_worker.worker import DecodeWorker  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.loader.checkpoint import load_checkpoint  # noqa: E402
from engine.request.sampling_params import SamplingParams  # noqa: E402
from engine.request.wire import sampling_params_to_proto  # noqa: E402
from prefill_worker.worker import PrefillWorker  # noqa: E402
from protos import serving_pb2, serving_pb2_grpc  # noqa: E402
from protos.cluster_auth import OPEN, sync_channel  # noqa: E402
from worker.config import WorkerConfig  # noqa: E402

MODES = ("baseline", "ours")


def start(role: str, checkpoint, transport: str, num_kv_blocks: int):  # noqa: ANN001, ANN201
    config = WorkerConfig(worker_id=f"{role}-bench", role=role, kv_transport=transport,
                          engine=EngineConfig(model="smollm2-135m", num_kv_blocks=num_kv_blocks, max_model_len=2048,
                                              max_num_batched_tokens=2048, num_threads=1, max_num_seqs=64))
    worker = (PrefillWorker if role == "prefill" else DecodeWorker)(config, checkpoint)
    worker.start()
    return worker


def first_token_s(stub: serving_pb2_grpc.WorkerStub, request: serving_pb2.GenerateRequest) -> float:
    began = time.perf_counter()
    stream = stub.Generate(request, timeout=300)
    first = next(stream)
    took = time.perf_counter() - began
    if first.error:
        raise RuntimeError(first.error)
    for _ in stream:  # the rest of its tokens
        pass
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=16, help="colocated streams keeping the decode worker busy")
    p.add_argument("--requests", type=int, default=10, help="disaggregated requests timed per mode and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--transport", default="grpc")
    p.add_argument("--interval", type=float, default=None,
                   help="send the timed requests this many seconds apart (an open loop: the same load in both modes); "
                        "default: one after another, each when the previous one ended")
    args = p.parse_args()
    checkpoint = load_checkpoint("smollm2-135m")
    prefill = start("prefill", checkpoint, args.transport, 512)
    decode = start("decode", checkpoint, args.transport, 2048)
    own_call_now = decode.runtime.call_now
    stub = serving_pb2_grpc.WorkerStub(sync_channel(decode.endpoint, OPEN))
    rng = random.Random(0)
    vocab = checkpoint.config.vocab_size
    stop = threading.Event()
    steps: list[float] = []  # the decode worker's step times while the requests were timed
    step = decode.runtime.engine.step

    def timed_step():  # noqa: ANN202
        began = time.perf_counter()
        try:
            return step()
        finally:
            if recording.is_set():
                steps.append(time.perf_counter() - began)

    recording = threading.Event()
    decode.runtime.engine.step = timed_step
    streamed, counted = [0], threading.Lock()  # the busy streams' tokens while the requests were timed

    def keep_busy(index: int) -> None:
        n = 0
        while not stop.is_set():
            request = serving_pb2.GenerateRequest(
                request_id=f"busy-{index}-{n}", prompt_token_ids=[rng.randrange(3, vocab) for _ in range(32)],
                params=sampling_params_to_proto(SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)))
            for msg in stub.Generate(request, timeout=600):
                if stop.is_set():
                    break
                if recording.is_set():
                    with counted:
                        streamed[0] += len(msg.token_ids)
            n += 1

    busy = [threading.Thread(target=keep_busy, args=(i,), daemon=True) for i in range(args.streams)]
    for thread in busy:
        thread.start()
    time.sleep(5)  # the streams' prompts computed: the worker decodes at batch --streams
    ttft: dict[str, list[float]] = {mode: [] for mode in MODES}
    step_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    busy_tokens_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    params = sampling_params_to_proto(SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    try:
        for r in range(args.rounds):
            for mode in MODES:
                decode.runtime.call_now = own_call_now if mode == "ours" else decode.runtime.call
                steps.clear()
                streamed[0] = 0
                began = time.perf_counter()
                recording.set()
                requests = [serving_pb2.GenerateRequest(
                    request_id=f"{mode}-{r}-{i}", prefill_endpoint=prefill.endpoint, params=params,
                    prompt_token_ids=[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)])
                    for i in range(args.requests)]
                if args.interval is None:  # one after another
                    ttft[mode].extend(first_token_s(stub, request) for request in requests)
                else:  # at fixed times, whatever the TTFT: both modes offer the same load
                    timed: list[float] = []

                    def send(at_s: float, request: serving_pb2.GenerateRequest) -> None:
                        time.sleep(max(at_s - time.perf_counter(), 0.0))
                        timed.append(first_token_s(stub, request))

                    senders = [threading.Thread(target=send, args=(began + i * args.interval, request))
                               for i, request in enumerate(requests)]
                    for sender in senders:
                        sender.start()
                    for sender in senders:
                        sender.join()
                    ttft[mode].extend(timed)
                recording.clear()
                busy_tokens_s[mode].append(streamed[0] / (time.perf_counter() - began))
                step_s[mode].append(statistics.mean(steps) if steps else 0.0)
                print(f"round {r} {mode:8s}: TTFT p50 {statistics.median(ttft[mode][-args.requests:]) * 1e3:7.1f} ms, "
                      f"decode step {step_s[mode][-1] * 1e3:6.1f} ms, busy streams "
                      f"{busy_tokens_s[mode][-1]:6.1f} tok/s", flush=True)
    finally:
        stop.set()
        decode.runtime.call_now = own_call_now
        prefill.stop()
        decode.stop()
    summary = {mode: {"ttft_p50_s": round(statistics.median(ttft[mode]), 4),
                      "ttft_mean_s": round(statistics.mean(ttft[mode]), 4),
                      "decode_step_s": round(statistics.mean(step_s[mode]), 4),
                      "busy_tokens_s": round(statistics.mean(busy_tokens_s[mode]), 1)} for mode in MODES}
    summary["ratio_ttft_p50"] = round(summary["ours"]["ttft_p50_s"] / summary["baseline"]["ttft_p50_s"], 3)
    summary["ratio_ttft_mean"] = round(summary["ours"]["ttft_mean_s"] / summary["baseline"]["ttft_mean_s"], 3)
    summary["ratio_busy_tokens_s"] = round(summary["ours"]["busy_tokens_s"] / summary["baseline"]["busy_tokens_s"], 3)
    summary["config"] = {"streams": args.streams, "requests": args.requests, "rounds": args.rounds,
                         "prompt_tokens": args.prompt_tokens, "transport": args.transport, "interval": args.interval}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
