"""A KV handoff between tensor-parallel engines: through each side's rank 0 against as lanes, in the same run.

    .venv/bin/python bench/tp_lanes.py [--model llama-3.2-1b] [--prompt-tokens 2000] [--sender-tp 2]
                                       [--receiver-tp 2] [--transport grpc] [--reps 7]

Two engines of the named shape (dummy float32 weights), a "prefill" one at TP a and a "decode" one at TP b, each
rank its own process. A handoff moves the KV of a `--prompt-tokens` prompt (its blocks' bytes, whatever the caches
hold: no prompt runs, a handoff moves bytes). Each rep, in turn:

- baseline, through rank 0: one stream from the prefill engine's process, which reads each rank's heads out of the
  children's shared memory, to the decode engine's process, which writes each rank's heads into theirs;
- ours, as lanes (kv_transfer/rank_lanes.py): each prefill rank sends its own heads from its own process to each
  decode rank's own endpoint.

Prints each side's median seconds and GB/s, and the baseline's time over ours (>1: lanes faster). On a 2-core host
the lanes' extra senders and receivers share the same two cores; where each rank has cores (and a NIC) of its own
they run in parallel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402
import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from kv_transfer.layout import KVHandoff, cdiv  # noqa: E402
from kv_transfer.rank_lanes import LANE_TRANSPORTS, send_lanes  # noqa: E402
from kv_transfer.registry import make_receiver, make_sender  # noqa: E402
from kv_transfer.reservation import Reservation, ReservationSink, ReservationState  # noqa: E402
from kv_transfer.tp_slices import RankCache, WireBlocks, rank_caches  # noqa: E402
from protos.cluster_auth import OPEN  # noqa: E402


def engine(args: argparse.Namespace, tp: int) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=args.model, load_format="dummy", dtype="float32", tensor_parallel_size=tp, num_threads=1,
        max_model_len=args.prompt_tokens + 64, num_kv_blocks=args.num_blocks + 4, enable_prefix_caching=False,
        seed=0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--sender-tp", type=int, default=2)
    p.add_argument("--receiver-tp", type=int, default=2)
    p.add_argument("--transport", default="grpc", choices=LANE_TRANSPORTS)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    args.num_blocks = cdiv(args.prompt_tokens, 16)
    cpu = torch.device("cpu")
    prefill, decode = engine(args, args.sender_tp), engine(args, args.receiver_tp)
    server = grpc.server(ThreadPoolExecutor(max_workers=16))
    try:
        layout = decode.kv_blocks.layout
        assert layout.block_size == 16, layout
        sink = ReservationSink(layout, cpu)
        port = server.add_insecure_port("127.0.0.1:0")
        endpoint = f"127.0.0.1:{port}"
        receiver = make_receiver(args.transport, sink)
        receiver.attach(server, endpoint)
        server.start()
        hubs = {}
        for name, eng, serve in (("prefill", prefill, False), ("decode", decode, True)):
            hub = eng.rank_lanes()
            children = [] if hub is None else hub.start(args.transport, eng.kv_blocks.layout, OPEN, host="127.0.0.1",
                                                        advertise_host="", worker_id=name, serve=serve)
            hubs[name] = (hub, [endpoint, *children])
        sender = make_sender(args.transport, worker_id="prefill", device=cpu)
        block_ids = list(range(args.num_blocks))
        blocks = prefill.kv_blocks
        own = RankCache(layout=blocks.layout, rank=0, kv_cache=blocks.kv_cache, kv_scales=blocks.kv_scales)
        whole_source_caches = rank_caches(blocks.layout, blocks.ranks)

        def once(lanes: bool, tag: str) -> tuple[float, int]:
            d = decode.kv_blocks
            transfer_id = uuid.uuid4().hex
            reservation = Reservation(tag, args.prompt_tokens, block_ids, d.kv_cache, d.layout, kv_scales=d.kv_scales,
                                      transfer_id=transfer_id, ranks=d.ranks,
                                      lanes=hubs["decode"][0] if lanes else None)
            sink.add(reservation)
            handoff = KVHandoff(request_id=tag, transfer_id=transfer_id, num_tokens=args.prompt_tokens,
                                layout=blocks.layout, receiver_tensor_parallel_size=args.receiver_tp)
            start_s = time.perf_counter()
            try:
                if lanes:
                    result = send_lanes(handoff, own=own, block_ids=block_ids, endpoints=hubs["decode"][1],
                                        sender=sender, ranks=hubs["prefill"][0], timeout_s=60)
                else:
                    source = WireBlocks(whole_source_caches, block_ids, handoff.wire, sender=True)
                    result = sender.send(handoff, source, endpoint=endpoint, timeout_s=60)
                assert reservation.done.wait(10) and reservation.state is ReservationState.COMMITTED
                return time.perf_counter() - start_s, result.num_bytes
            finally:
                sink.remove(tag)

        once(False, "warm-whole")
        once(True, "warm-lanes")
        times: dict[bool, list[float]] = {False: [], True: []}
        num_bytes = 0
        for rep in range(args.reps):
            for lanes in (False, True) if rep % 2 == 0 else (True, False):
                seconds, num_bytes = once(lanes, f"r{rep}-{lanes}")
                times[lanes].append(seconds)
        sender.close()
        receiver.close()
        print(f"\n{args.model}, dummy float32, {args.prompt_tokens} tokens ({args.num_blocks} blocks, "
              f"{num_bytes / 1e6:.1f} MB), TP {args.sender_tp} -> TP {args.receiver_tp} over {args.transport}, "
              f"{os.cpu_count()} cores; medians of {args.reps}")
        base, ours = statistics.median(times[False]), statistics.median(times[True])
        for label, seconds in (("through rank 0 (baseline)", base), ("lanes, rank to rank", ours)):
            print(f"  {label:28s} {seconds * 1e3:8.1f} ms  {num_bytes / seconds / 1e9:6.2f} GB/s")
        print(f"  baseline / lanes: {base / ours:.2f}x (>1: lanes faster)")
    finally:
        server.stop(grace=None)
        prefill.close()
        decode.close()


if __name__ == "__main__":
    main()
