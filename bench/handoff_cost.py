"""What one KV handoff costs, stage by stage, over each transport: a 1,000-token request in isolation.

    .venv/bin/python bench/handoff_cost.py [--device cpu|cuda] [--transports grpc,ipc,ipc-grpc,torch,inproc]
        [--num-tokens 1000] [--repeats 30] [--warmup 3] [--model smollm2-135m] [--json PATH]

The KV is the dummy shape's (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64), in blocks of 16 tokens, bfloat16
on cuda and float32 on cpu (`--dtype` to change): 1,000 tokens are 63 blocks, 23.2 MB of bf16 (46.5 MB of float32).
Both ends are the workers' own: the sender reads the blocks out of a paged cache through the prefill worker's
`HeldBlocks` (block ids scattered over the cache, as a busy block pool hands them out), and the receiver writes them
into another through the decode worker's `Reservation`, opened by a `ReservationSink`. The receiver runs in its own
process, on a grpc.aio server with a migration thread pool and the workers' channel options, as a decode worker's
(malloc tuned as every worker's); `inproc` is in the sender's process by definition, and the reference: a copy
and a check, no wire. `torch` on cuda needs a second GPU (NCCL between two devices); it is skipped on one.

Each transport sends `--warmup` handoffs first (channels, pair groups, staging buffers, kernels), then the repeats,
interleaved across transports (repeat 1 of each, then repeat 2, ...), one at a time, nothing else running. Printed per
transport: the p50 and p90 of a handoff's wall time on the sender (`KVSender.send`), and the p50 of each stage the
transports time themselves (kv_transfer/stage_clock.py): the sender's, their unlapped rest ("python", waiting and
code between laps), and the receiver's handler's; and, on the clock both processes share, how long after the
sender's call left (its "call" mark; else `send`'s start) the receiver's handler started ("to handler") and how
long after the handler ended `send` returned ("ack back"): what the control RPC itself costs. Stages lapped once per block are summed over the handoff.

Every handoff must commit, the last one's bytes must equal the source's (a CRC-32C of the receiver's cache blocks,
taken outside the timing), and the receiver must hold no reservation afterwards; the command exits 1 otherwise.
`--json PATH` writes every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crc32c  # noqa: E402
import torch  # noqa: E402

from kv_transfer.reservation import ReservationSink, Reservation, ReservationState  # noqa: E402
from engine.loader.dummy_shapes import DUMMY_SHAPES  # noqa: E402
from kv_transfer.layout import KVHandoff, KVLayout  # noqa: E402
from kv_transfer.registry import TRANSPORTS, make_receiver, make_sender  # noqa: E402
from prefill_worker.worker import HeldBlocks  # noqa: E402
from worker.malloc_tuning import tune_malloc  # noqa: E402

BLOCK_SIZE = 16
TIMEOUT_S = 60.0
SPARE_BLOCKS = 3  # a paged cache holds this many times a handoff's blocks, so that its block ids scatter


def make_layout(model: str, dtype: str, block_size: int = BLOCK_SIZE) -> KVLayout:
    config = DUMMY_SHAPES[model]
    return KVLayout(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                    block_size=block_size, dtype=dtype)


def layout_arg(layout: KVLayout) -> str:
    return f"{layout.num_layers},{layout.num_kv_heads},{layout.head_dim},{layout.block_size},{layout.dtype}"


def parse_layout(text: str) -> KVLayout:
    num_layers, num_kv_heads, head_dim, block_size, dtype = text.split(",")
    return KVLayout(num_layers=int(num_layers), num_kv_heads=int(num_kv_heads), head_dim=int(head_dim),
                    block_size=int(block_size), dtype=dtype)


def paged_cache(layout: KVLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
    """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]: a worker's cache, zeroed."""
    num_layers, two, block_size, num_kv_heads, head_dim = layout.block_shape
    return torch.zeros((num_layers, two, num_blocks, block_size, num_kv_heads, head_dim),
                       dtype=getattr(torch, layout.dtype), device=device)


def scattered_ids(num_blocks: int, num_cache_blocks: int, seed: int) -> list[int]:
    return torch.randperm(num_cache_blocks, generator=torch.Generator().manual_seed(seed))[:num_blocks].tolist()


def blocks_crc(kv_cache: torch.Tensor, block_ids: list[int]) -> int:
    """CRC-32C of blocks `block_ids` of a paged cache in wire order ([num_blocks, num_layers, 2, ...])."""
    blocks = kv_cache[:, :, block_ids].permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
    return crc32c.crc32c(memoryview(blocks.view(-1).view(torch.uint8).numpy()))


# ── the receiver: a decode worker's sink, reserving the same blocks for every handoff ───────────────────────


class ReservingSink(ReservationSink):
    """A ReservationSink that reserves its handoff's blocks as the handoff opens (a decode worker reserves them before
    it calls the prefill worker; here nobody calls), always the same scattered block ids. Committed reservations
    are let go at once, as if their request had run."""

    def __init__(self, layout: KVLayout, device: torch.device, num_blocks: int) -> None:
        super().__init__(layout, device)
        self.kv_cache = paged_cache(layout, SPARE_BLOCKS * num_blocks, device)
        self.block_ids = scattered_ids(num_blocks, SPARE_BLOCKS * num_blocks, seed=1)
        self.num_committed = 0
        self.num_failed = 0
        self.last_committed: list[int] | None = None  # the block ids of the last committed handoff
        self._outcome_lock = threading.Lock()

    def open(self, handoff: KVHandoff) -> Reservation:
        reservation = _Reservation(self, handoff.request_id, handoff.num_tokens, self.block_ids[:handoff.num_blocks],
                                   self.kv_cache, self.layout, transfer_id=handoff.transfer_id,
                                   first_block=handoff.first_block)
        self.add(reservation)
        return super().open(handoff)

    def settled(self, reservation: Reservation, ok: bool) -> None:
        self.remove(reservation.request_id)
        with self._outcome_lock:
            if ok:
                self.num_committed += 1
                self.last_committed = reservation.block_ids
            else:
                self.num_failed += 1

    @property
    def num_open(self) -> int:
        with self._lock:
            return len(self._reservations)


class _Reservation(Reservation):
    def __init__(self, sink: ReservingSink, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._sink = sink

    def commit(self) -> None:
        super().commit()
        self._sink.settled(self, ok=True)

    def fail(self, reason: str) -> None:
        was_open = self.state in (ReservationState.RESERVED, ReservationState.RECEIVING)
        super().fail(reason)
        if was_open:
            print(f"receiver: handoff failed: {reason}", file=sys.stderr, flush=True)
            self._sink.settled(self, ok=False)


def report(receiver, sink: ReservingSink) -> dict:
    """What the receiver saw since the last report: its stage records, outcomes, the last handoff's bytes."""
    records = receiver.stage_log.take() if hasattr(receiver, "stage_log") else []
    last = sink.last_committed
    return {
        "records": [dataclasses.asdict(r) for r in records],
        "num_committed": sink.num_committed,
        "num_failed": sink.num_failed,
        "num_open": sink.num_open,
        "last_crc32c": None if last is None else blocks_crc(sink.kv_cache, last),
    }


def serve(transport: str, layout: KVLayout, device: torch.device, num_blocks: int) -> None:
    """The receiver process: a grpc.aio server on its own loop thread, sync handlers on a migration pool (as a
    worker's); prints READY <endpoint>, then answers each REPORT line on stdin with a REPORT <json> line."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from kv_transfer.grpc_link import CHANNEL_OPTIONS
    from worker.event_loop_thread import EventLoopThread

    sink = ReservingSink(layout, device, num_blocks)
    receiver = make_receiver(transport, sink)
    aio = EventLoopThread("bench-grpc")

    async def make_server() -> grpc.aio.Server:
        return grpc.aio.server(migration_thread_pool=ThreadPoolExecutor(max_workers=16), options=CHANNEL_OPTIONS)

    server = aio.run(make_server())
    port = server.add_insecure_port("127.0.0.1:0")
    endpoint = f"127.0.0.1:{port}"
    receiver.attach(server, endpoint)
    aio.run(server.start())
    print(f"READY {endpoint}", flush=True)
    for line in sys.stdin:
        if line.strip() == "REPORT":
            print("REPORT " + json.dumps(report(receiver, sink)), flush=True)
    receiver.close()
    aio.run(server.stop(None))
    aio.stop()


# ── the sender ───────────────────────────────────────────────────────────────────────────────────────────────


class Peer:
    """One transport's receiver: a process of its own (`serve`), or this process for inproc."""

    def __init__(self, transport: str, layout: KVLayout, receiver_device: torch.device, num_blocks: int) -> None:
        self.transport = transport
        self.proc: subprocess.Popen[str] | None = None
        if transport == "inproc":
            self.sink = ReservingSink(layout, receiver_device, num_blocks)
            self.receiver = make_receiver(transport, self.sink)
            self.endpoint = f"inproc://bench-{uuid.uuid4().hex[:8]}"
            self.receiver.attach(None, self.endpoint)
            return
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", transport, "--layout", layout_arg(layout),
             "--device", str(receiver_device), "--num-blocks", str(num_blocks)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if line[:1] != ["READY"]:
            raise RuntimeError(f"the {transport} receiver did not start (said {line!r})")
        self.endpoint = line[1]

    def report(self) -> dict:
        if self.proc is None:
            return report(self.receiver, self.sink)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("REPORT\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line.startswith("REPORT "):
            raise RuntimeError(f"the {self.transport} receiver answered {line!r}")
        return json.loads(line[len("REPORT "):])

    def close(self) -> None:
        if self.proc is None:
            self.receiver.close()
            return
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@dataclasses.dataclass
class Run:
    """One transport's handoffs, as the sender timed them, and the receiver's records of them."""

    transport: str
    totals_s: list[float] = dataclasses.field(default_factory=list)
    sender_stages: list[dict[str, float]] = dataclasses.field(default_factory=list)
    # transfer id -> when send began (or its call left: the sender's "call" mark), when it returned
    spans: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    receiver_records: dict[str, dict] = dataclasses.field(default_factory=dict)
    last_source_crc: int | None = None
    problems: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> dict:
        if not self.totals_s:
            return {"transport": self.transport, "num_handoffs": 0, "problems": self.problems or ["no handoff"]}

        def stage_table(rows: list[dict[str, float]]) -> dict[str, dict[str, float]]:
            names = list(dict.fromkeys(name for row in rows for name in row))
            return {name: {"p50_ms": percentile([row.get(name, 0.0) for row in rows], 0.5) * 1e3,
                           "p90_ms": percentile([row.get(name, 0.0) for row in rows], 0.9) * 1e3} for name in names}

        sender_rows = [dict(row, python=total - sum(row.values())) for row, total in
                       zip(self.sender_stages, self.totals_s)]
        receiver_rows, to_handler, ack_back = [], [], []
        for transfer_id, (start_s, end_s) in self.spans.items():
            record = self.receiver_records.get(transfer_id)
            if record is None:
                continue
            handler_s = record["end_s"] - record["start_s"]
            receiver_rows.append(dict(record["stages_s"], handler=handler_s))
            to_handler.append(record["start_s"] - start_s)
            ack_back.append(end_s - record["end_s"])
        return {
            "transport": self.transport,
            "num_handoffs": len(self.totals_s),
            "total_p50_ms": percentile(self.totals_s, 0.5) * 1e3,
            "total_p90_ms": percentile(self.totals_s, 0.9) * 1e3,
            "total_min_ms": min(self.totals_s) * 1e3,
            "totals_ms": [t * 1e3 for t in self.totals_s],
            "sender_stages": stage_table(sender_rows) if self.sender_stages and self.sender_stages[0] else {},
            "receiver_stages": stage_table(receiver_rows) if receiver_rows else {},
            "to_handler_p50_ms": percentile(to_handler, 0.5) * 1e3 if to_handler else None,
            "ack_back_p50_ms": percentile(ack_back, 0.5) * 1e3 if ack_back else None,
            "problems": self.problems,
        }


# Baselines measured beside a transport, in the same run: the transport with an optimisation turned off.
BASELINES = {"ipc-grpc": "ipc"}  # every control call over gRPC, the receiver's doorbell never rung


def make_bench_sender(transport: str, device: torch.device) -> object:
    if transport == "ipc-grpc":
        from kv_transfer import ipc_transport

        return ipc_transport.Sender(worker_id="bench-prefill", device=device, doorbell=False)
    return make_sender(transport, worker_id="bench-prefill", device=device)


def measure(transports: list[str], layout: KVLayout, device: torch.device, *, num_tokens: int, repeats: int,
            warmup: int, receiver_layout: KVLayout | None = None) -> list[dict]:
    num_blocks = -(-num_tokens // layout.block_size)
    num_cache_blocks = SPARE_BLOCKS * num_blocks
    block_ids = scattered_ids(num_blocks, num_cache_blocks, seed=0)
    # Two sources of different bytes, alternated, so that a handoff that wrote nothing cannot pass the last check.
    caches = []
    for seed in range(2):
        cache = paged_cache(layout, num_cache_blocks, device)
        cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(seed)).to(cache.dtype))
        caches.append(cache)
    source_crcs = [blocks_crc(cache, block_ids) for cache in caches]
    runs = {t: Run(t) for t in transports}
    peers: dict[str, Peer] = {}
    senders = {}
    try:
        for transport in transports:
            receiver_device = device
            if transport == "torch" and device.type == "cuda":
                receiver_device = torch.device("cuda", 1)  # NCCL moves blocks between two devices
            peers[transport] = Peer(BASELINES.get(transport, transport), receiver_layout or layout, receiver_device,
                                    num_blocks)
            senders[transport] = make_bench_sender(transport, device)
        for i in range(warmup + repeats):
            for transport in transports:
                which = i % 2
                source = HeldBlocks(caches[which], block_ids, layout)
                handoff = KVHandoff(request_id=f"r{i}-{transport}", transfer_id=uuid.uuid4().hex,
                                    num_tokens=num_tokens, layout=layout, source_endpoint="bench")
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start_s = time.perf_counter()
                try:
                    result = senders[transport].send(handoff, source, endpoint=peers[transport].endpoint,
                                                     timeout_s=TIMEOUT_S)
                except Exception as exc:  # noqa: BLE001 - reported, the run fails
                    runs[transport].problems.append(f"handoff {i} failed: {exc}")
                    continue
                end_s = time.perf_counter()
                run = runs[transport]
                run.last_source_crc = source_crcs[which]
                if i >= warmup:
                    run.totals_s.append(end_s - start_s)
                    run.sender_stages.append(dict(getattr(result, "stages_s", {})))
                    run.spans[handoff.transfer_id] = (getattr(result, "marks_s", {}).get("call", start_s), end_s)
        for transport in transports:
            run, answer = runs[transport], peers[transport].report()
            run.receiver_records = {r["transfer_id"]: r for r in answer["records"]}
            if answer["num_failed"]:
                run.problems.append(f"{answer['num_failed']} handoffs failed on the receiver")
            if answer["num_open"]:
                run.problems.append(f"{answer['num_open']} reservations still open on the receiver")
            if answer["num_committed"] != warmup + repeats:
                run.problems.append(f"{answer['num_committed']} of {warmup + repeats} handoffs committed")
            if answer["last_crc32c"] != run.last_source_crc:
                run.problems.append(f"the last handoff's bytes differ from the source's (CRC-32C "
                                    f"{answer['last_crc32c']} against {run.last_source_crc})")
    finally:
        for sender in senders.values():
            sender.close()
        for peer in peers.values():
            peer.close()
    return [runs[t].summary() for t in transports]


def format_summary(summary: dict) -> str:
    if not summary["num_handoffs"]:
        return "\n".join([f"{summary['transport']:7s} no handoff completed"]
                         + [f"        FAILED: {problem}" for problem in summary["problems"][:3]])

    def stages(table: dict[str, dict[str, float]]) -> str:
        return "  ".join(f"{name} {row['p50_ms']:.3f}" for name, row in table.items()) or "(no stage timers)"

    lines = [f"{summary['transport']:7s} total p50 {summary['total_p50_ms']:8.3f} ms   p90 "
             f"{summary['total_p90_ms']:8.3f} ms   min {summary['total_min_ms']:8.3f} ms   "
             f"({summary['num_handoffs']} handoffs)",
             f"        sender ms p50:   {stages(summary['sender_stages'])}"]
    if summary["receiver_stages"]:
        lines.append(f"        receiver ms p50: {stages(summary['receiver_stages'])}")
    if summary["to_handler_p50_ms"] is not None:
        lines.append(f"        rpc ms p50:      to handler {summary['to_handler_p50_ms']:.3f}  "
                     f"ack back {summary['ack_back_p50_ms']:.3f}")
    for problem in summary["problems"]:
        lines.append(f"        FAILED: {problem}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    tune_malloc()  # as every worker process does (both ends)
    torch.set_num_threads(1)
    if argv[:1] == ["--serve"]:
        p = argparse.ArgumentParser()
        p.add_argument("--serve", required=True)
        p.add_argument("--layout", required=True, type=parse_layout)
        p.add_argument("--device", required=True)
        p.add_argument("--num-blocks", required=True, type=int)
        args = p.parse_args(argv)
        serve(args.serve, args.layout, torch.device(args.device), args.num_blocks)
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--transports", default="grpc,ipc,torch,inproc")
    p.add_argument("--num-tokens", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--model", default="smollm2-135m", choices=sorted(DUMMY_SHAPES))
    p.add_argument("--dtype", help="the KV dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--receiver-dtype", help="a check of the checks: receivers of this KV dtype refuse every handoff "
                   "of another, and the run fails")
    args = p.parse_args(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    layout = make_layout(args.model, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    transports = [t for t in args.transports.split(",") if t]
    for transport in transports:
        if transport not in TRANSPORTS and transport not in BASELINES:
            p.error(f"unknown transport {transport!r} (of {', '.join([*TRANSPORTS, *BASELINES])})")
    skipped = []
    if device.type == "cuda" and "torch" in transports and torch.cuda.device_count() < 2:
        transports.remove("torch")
        skipped.append("torch (NCCL needs a second GPU)")
    handoff = KVHandoff(request_id="", transfer_id="", num_tokens=args.num_tokens, layout=layout)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.model} KV, {layout.dtype}, {args.num_tokens} tokens = {handoff.num_blocks} blocks of "
          f"{layout.block_bytes} bytes = {handoff.num_bytes / 1e6:.1f} MB per handoff, on {where}; "
          f"{args.warmup} warm-up + {args.repeats} handoffs per transport, interleaved"
          + (f"; skipped: {', '.join(skipped)}" if skipped else ""))
    receiver_layout = dataclasses.replace(layout, dtype=args.receiver_dtype) if args.receiver_dtype else None
    summaries = measure(transports, layout, device, num_tokens=args.num_tokens, repeats=args.repeats,
                        warmup=args.warmup, receiver_layout=receiver_layout)
    for summary in summaries:
        print(format_summary(summary))
    failed = [s["transport"] for s in summaries if s["problems"]]
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"device": where, "layout": dataclasses.asdict(layout), "num_tokens": args.num_tokens,
                       "num_bytes": handoff.num_bytes, "skipped": skipped, "transports": summaries}, out, indent=1)
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
