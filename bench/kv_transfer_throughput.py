"""KV transfer throughput of each transport against a raw TCP socket copy of the same bytes, in one run.

    .venv/bin/python bench/kv_transfer_throughput.py [--num-bytes 134217728] [--num-tokens 1000] [--trials 10]
        [--transports tcp,tcp-paged,grpc-bare,grpc,torch,inproc] [--pin] [--block-size 16]

Each transport moves the same handoffs: `num_tokens` tokens of SmolLM2-135M's KV (30 layers, 3 KV heads, head
dim 64, block size 16, float32: 63 blocks, 46 MB per 1,000 tokens), repeated until `num_bytes` have moved. Both
ends are laid out as the workers': the sender reads each block as a strided view of a paged cache (as the
prefill worker's `HeldBlocks` does) and the receiver's sink writes it into another (as the decode worker's
reservation does, verifying the checksum as it copies); both caches, like the workers', are in huge pages
(engine/huge_pages.py), and so are the baselines' buffers. The receiver runs in a separate process (a real gRPC
server with the transport's receiver and a worker's gRPC options and malloc settings, see
worker/malloc_tuning.py), except for `inproc`, whose receiver lives in the sender's process by
definition. The baseline `tcp` is a sender `sendall`-ing each handoff's bytes (gathered once, before timing) over
loopback to a receiver process that `recv_into`s a preallocated buffer and acks each handoff with one byte. The
reference `grpc-bare` sends the same pre-gathered blocks as bare gRPC messages (no protobuf framing, no checksum,
received into a preallocated buffer): what Python gRPC itself costs, the ceiling for the `grpc` transport. The
reference `tcp-paged` is the raw socket doing what any transport must: the sender gathers each block out of the
paged cache with its CRC-32C in one pass (`block_copy.gather`) and `sendall`s it and the CRC; the receiver
`recv_into`s one reused block buffer and writes it into its paged cache with the checked copy the sinks use.

Every transport is set up first (one warm-up handoff each opens channels and pair groups); then the passes are
interleaved, pass 1 of every transport, then pass 2, and so on, so that the shared machine's drift hits all of
them alike. The table gives each transport's best pass and its median pass, both against the raw socket's, and
the CPU time each side spent per handoff (median pass; the kernel's part included; for `inproc` both sides are one
process). `--pin` runs the sender on one vCPU and every receiver on another, as if on two hosts (by default the two
processes share all the machine's vCPUs). Import `measure_all` and `format_table` to reuse them (the disaggregation
benchmark does).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.huge_pages import zeros_with_huge_pages  # noqa: E402
from kv_transfer.block_copy import copy_checked, gather  # noqa: E402
from kv_transfer.layout import KVHandoff, KVLayout  # noqa: E402
from worker.malloc_tuning import tune_malloc  # noqa: E402

SMOLLM2_LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
# "grpc-bare" is a reference, not a transport: the same blocks as bare gRPC messages (no protobuf framing, no
# checksum, no paged-cache layout) through one client stream into a preallocated buffer: Python gRPC's ceiling.
# "tcp-paged" is another: the raw socket plus the work every transport does (gather + CRC-32C out of the paged
# cache, checked copy into it), what a transport with no overhead of its own would reach.
TRANSPORTS = ("tcp", "tcp-paged", "grpc-bare", "grpc", "torch", "ipc", "inproc")
BASELINE = "tcp"
TIMEOUT_S = 120.0


class _CopySink:
    """The benchmark's decode side: a paged cache laid out as the decode worker's (every layer in one tensor), into
    which each block is written with the same single strided copy `kv_transfer.reservation` makes."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        self.layout = layout
        self.device = torch.device("cpu")
        num_layers, two, block_size, num_kv_heads, head_dim = layout.block_shape
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.cache = zeros_with_huge_pages(num_layers, two, num_blocks, block_size, num_kv_heads, head_dim,
                                           dtype=getattr(torch, layout.dtype))

    def open(self, handoff: KVHandoff) -> _CopySink:
        return self

    def write_block(self, index: int, data: torch.Tensor, crc32c: int | None = None) -> None:
        copy_checked(self.cache[:, :, index], data, crc32c)

    def commit(self) -> None:
        pass

    def fail(self, reason: str) -> None:
        print(f"receiver: handoff failed: {reason}", file=sys.stderr, flush=True)


class _Source:
    """The benchmark's prefill side: a paged cache laid out as the prefill worker's, read as `HeldBlocks` reads it
    (a strided view of one block across the layers, which the transport gathers as it sends)."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        self.layout = layout
        num_layers, two, block_size, num_kv_heads, head_dim = layout.block_shape
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        dtype = getattr(torch, layout.dtype)
        self.cache = zeros_with_huge_pages(num_layers, two, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
        self.cache.copy_(torch.randn(self.cache.shape, generator=torch.Generator().manual_seed(0)))
        # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]: the same bytes, gathered once, for the
        # raw-socket baseline and the bare gRPC reference, which send them as they are
        self.blocks = zeros_with_huge_pages(num_blocks, *layout.block_shape, dtype=dtype)
        self.blocks.copy_(self.cache.permute(2, 0, 1, 3, 4, 5))

    def read_block(self, index: int) -> torch.Tensor:
        return self.cache[:, :, index]


def _layout_arg(layout: KVLayout) -> str:
    return f"{layout.num_layers},{layout.num_kv_heads},{layout.head_dim},{layout.block_size},{layout.dtype}"


def _parse_layout(text: str) -> KVLayout:
    num_layers, num_kv_heads, head_dim, block_size, dtype = text.split(",")
    return KVLayout(num_layers=int(num_layers), num_kv_heads=int(num_kv_heads), head_dim=int(head_dim),
                    block_size=int(block_size), dtype=dtype)


# ── the receiver process ─────────────────────────────────────────────────────────────────────────────────────


def _serve_transport(transport: str, layout: KVLayout, num_blocks: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from kv_transfer.registry import make_receiver

    from kv_transfer.grpc_link import CHANNEL_OPTIONS

    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)  # as a worker's server
    port = server.add_insecure_port("127.0.0.1:0")
    endpoint = f"127.0.0.1:{port}"
    receiver = make_receiver(transport, _CopySink(layout, num_blocks))
    receiver.attach(server, endpoint)
    server.start()
    print(f"READY {endpoint}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    receiver.close()
    server.stop(grace=None)


def _serve_grpc_bare(handoff_bytes: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from kv_transfer.grpc_link import CHANNEL_OPTIONS

    view = memoryview(zeros_with_huge_pages(handoff_bytes, dtype=torch.uint8).numpy())

    def transfer(messages, context) -> bytes:
        filled = 0
        for message in messages:
            view[filled : filled + len(message)] = message
            filled += len(message)
        return b"\x01" if filled == handoff_bytes else b"\x00"

    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
    handler = grpc.stream_unary_rpc_method_handler(transfer)  # no (de)serializers: bytes in, bytes out
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Bare", {"Transfer": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"READY 127.0.0.1:{port}", flush=True)
    sys.stdin.read()
    server.stop(grace=None)


def _accept_one() -> socket.socket:
    """The raw-socket receivers' one connection, on a loopback port announced as READY."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"READY 127.0.0.1:{listener.getsockname()[1]}", flush=True)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _recv_exactly(conn: socket.socket, view: memoryview) -> bool:
    """Fill `view` from `conn`; False when the sender closed the connection first."""
    filled = 0
    while filled < len(view):
        n = conn.recv_into(view[filled:], len(view) - filled)
        if n == 0:
            return False
        filled += n
    return True


def _serve_tcp(handoff_bytes: int) -> None:
    conn = _accept_one()
    view = memoryview(zeros_with_huge_pages(handoff_bytes, dtype=torch.uint8).numpy())
    while _recv_exactly(conn, view):
        conn.sendall(b"\x01")  # the handoff arrived whole: ack, as the transports' receivers do


def _serve_tcp_paged(layout: KVLayout, num_blocks: int) -> None:
    conn = _accept_one()
    sink = _CopySink(layout, num_blocks)
    block = zeros_with_huge_pages(layout.block_bytes + 4, dtype=torch.uint8)  # the block's bytes, then its CRC
    view = memoryview(block.numpy())
    data = block[: layout.block_bytes].view(getattr(torch, layout.dtype)).view(layout.block_shape)
    while True:
        for index in range(num_blocks):
            if not _recv_exactly(conn, view):
                return
            sink.write_block(index, data, int.from_bytes(view[layout.block_bytes:], "little"))
        conn.sendall(b"\x01")


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread, exited ones included) of process `pid` so far: Linux's per-process
    CPU clock, which any process may read (clock id = MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED))."""
    return time.clock_gettime(((~pid) << 3) | 2)


def _pin_process(cpu: int) -> None:
    """Every thread of this process (and so every thread it starts later) onto vCPU `cpu`."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {cpu})


class _ReceiverProcess:
    def __init__(self, *args: str, cpu: int | None = None) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))  # before exec: all its threads
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", *args], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=pin)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "READY":
            self.close()
            raise RuntimeError(f"receiver process failed to start: {line}")
        self.endpoint = line[1]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ── the sender side ──────────────────────────────────────────────────────────────────────────────────────────


class _Runner:
    """One transport, set up once: `send_one()` moves one handoff and returns when the receiver confirmed it.
    `receiver_cpu`: the vCPU to pin the receiver process to (None: not pinned)."""

    def __init__(self, transport: str, source: _Source, handoff: KVHandoff, receiver_cpu: int | None = None) -> None:
        self.transport = transport
        self.receiver_pid: int | None = None  # None: the receiver runs in this process (inproc)
        self._receiver_cpu = receiver_cpu
        self._closers: list = []
        if transport == "tcp":
            self._setup_tcp(source, handoff.num_bytes)
        elif transport == "tcp-paged":
            self._setup_tcp_paged(source, handoff)
        elif transport == "grpc-bare":
            self._setup_grpc_bare(source, handoff.num_bytes)
        elif transport == "inproc":
            from kv_transfer.registry import make_receiver

            endpoint = f"inproc://bench-{uuid.uuid4().hex}"
            receiver = make_receiver("inproc", _CopySink(handoff.layout, handoff.num_blocks))
            receiver.attach(None, endpoint)  # type: ignore[arg-type]  # inproc needs no gRPC server
            self._closers.append(receiver.close)
            self._setup_sender(source, handoff, endpoint)
        else:
            process = self._start_receiver(transport, _layout_arg(handoff.layout), str(handoff.num_blocks))
            self._setup_sender(source, handoff, process.endpoint)
        self.send_one()  # warm-up: connections, pair groups, first-touch of the receiver's buffers

    def _start_receiver(self, *args: str) -> _ReceiverProcess:
        process = _ReceiverProcess(*args, cpu=self._receiver_cpu)
        self._closers.append(process.close)
        self.receiver_pid = process.proc.pid
        return process

    def _setup_sender(self, source: _Source, handoff: KVHandoff, endpoint: str) -> None:
        from kv_transfer.registry import make_sender

        sender = make_sender(self.transport, worker_id="bench-prefill", device=torch.device("cpu"))
        self._closers.append(sender.close)

        def send_one() -> None:
            attempt = KVHandoff(request_id=handoff.request_id, transfer_id=uuid.uuid4().hex,
                                num_tokens=handoff.num_tokens, layout=handoff.layout)
            sender.send(attempt, source, endpoint=endpoint, timeout_s=TIMEOUT_S)

        self.send_one = send_one

    def _connect(self, *receiver_args: str) -> socket.socket:
        """A raw-socket receiver process started, and this side's connection to it."""
        host, port = self._start_receiver(*receiver_args).endpoint.rsplit(":", 1)
        conn = socket.create_connection((host, int(port)))
        self._closers.append(conn.close)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _setup_tcp(self, source: _Source, handoff_bytes: int) -> None:
        conn = self._connect("tcp", str(handoff_bytes))
        data = memoryview(source.blocks.view(-1).view(torch.uint8).numpy())

        def send_one() -> None:
            conn.sendall(data)
            if conn.recv(1) != b"\x01":
                raise RuntimeError("tcp baseline receiver went away")

        self.send_one = send_one

    def _setup_tcp_paged(self, source: _Source, handoff: KVHandoff) -> None:
        conn = self._connect("tcp-paged", _layout_arg(handoff.layout), str(handoff.num_blocks))

        def send_one() -> None:
            for index in range(handoff.num_blocks):
                block, crc32c = gather(source.read_block(index))
                conn.sendall(memoryview(block.view(-1).view(torch.uint8).numpy()))
                conn.sendall(crc32c.to_bytes(4, "little"))
            if conn.recv(1) != b"\x01":
                raise RuntimeError("tcp-paged receiver went away")

        self.send_one = send_one

    def _setup_grpc_bare(self, source: _Source, handoff_bytes: int) -> None:
        import grpc

        from kv_transfer.grpc_link import CHANNEL_OPTIONS

        process = self._start_receiver("grpc-bare", str(handoff_bytes))
        channel = grpc.insecure_channel(process.endpoint, options=CHANNEL_OPTIONS)
        self._closers.append(channel.close)
        transfer = channel.stream_unary("/bench.Bare/Transfer")
        blocks = [bytes(memoryview(block.view(-1).view(torch.uint8).numpy())) for block in source.blocks]

        def send_one() -> None:
            if transfer(iter(blocks), timeout=TIMEOUT_S) != b"\x01":
                raise RuntimeError("grpc-bare receiver got a short handoff")

        self.send_one = send_one

    def timed_pass(self, num_handoffs: int) -> tuple[float, float, float | None]:
        """Seconds for `num_handoffs` handoffs, and the CPU seconds this process and the receiver's spent on them
        (None for a receiver in this process)."""
        receiver_cpu_s = None if self.receiver_pid is None else _cpu_seconds(self.receiver_pid)
        sender_cpu_s, start_s = _cpu_seconds(os.getpid()), time.perf_counter()
        for _ in range(num_handoffs):
            self.send_one()
        seconds, sender_cpu_s = time.perf_counter() - start_s, _cpu_seconds(os.getpid()) - sender_cpu_s
        if receiver_cpu_s is not None:
            receiver_cpu_s = _cpu_seconds(self.receiver_pid) - receiver_cpu_s
        return seconds, sender_cpu_s, receiver_cpu_s

    def close(self) -> None:
        for close in reversed(self._closers):
            close()


def measure_all(transports: list[str], num_bytes: int, *, layout: KVLayout = SMOLLM2_LAYOUT,
                num_tokens: int = 1000, trials: int = 10, pin: bool = False) -> list[dict]:
    """Move at least `num_bytes` per pass, as handoffs of `num_tokens` tokens, over each transport ("tcp" is the
    raw-socket baseline). Passes are interleaved (pass 1 of every transport, then pass 2, ...) so that the
    machine's drift hits every transport alike; each transport's figure is its best pass. `pin`: this process on
    one vCPU, the receivers on another (the caller's threads stay pinned). Returns one dict per transport:
    transport, num_bytes (moved per pass), num_handoffs, seconds (best pass), median_s, gb_per_s (1e9 bytes per
    second, best pass), sender_cpu_ms and receiver_cpu_ms (CPU per handoff, median pass; receiver None when it
    runs in the sender's process), cross_process."""
    for transport in transports:
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}; choose from {', '.join(TRANSPORTS)}")
    receiver_cpu = None
    if pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise ValueError("--pin needs two vCPUs")
        _pin_process(cpus[0])
        receiver_cpu = cpus[1]
    handoff = KVHandoff(request_id="bench", transfer_id="", num_tokens=num_tokens, layout=layout)
    num_handoffs = max(1, -(-num_bytes // handoff.num_bytes))
    source = _Source(layout, handoff.num_blocks)
    runners: list[_Runner] = []
    try:
        for transport in transports:
            runners.append(_Runner(transport, source, handoff, receiver_cpu))
        passes: dict[str, list[tuple[float, float, float | None]]] = {t: [] for t in transports}
        for _ in range(trials):
            for runner in runners:
                passes[runner.transport].append(runner.timed_pass(num_handoffs))
    finally:
        for runner in runners:
            runner.close()
    moved = num_handoffs * handoff.num_bytes

    def cpu_ms(cpu_s: list[float | None]) -> float | None:  # per handoff, median pass
        measured = [c for c in cpu_s if c is not None]
        return statistics.median(measured) / num_handoffs * 1e3 if len(measured) == len(cpu_s) else None

    results = []
    for t in transports:
        seconds = [p[0] for p in passes[t]]
        results.append({"transport": t, "num_bytes": moved, "num_handoffs": num_handoffs, "seconds": min(seconds),
                        "median_s": statistics.median(seconds), "gb_per_s": moved / min(seconds) / 1e9,
                        "sender_cpu_ms": cpu_ms([p[1] for p in passes[t]]),
                        "receiver_cpu_ms": cpu_ms([p[2] for p in passes[t]]), "cross_process": t != "inproc"})
    return results


def format_table(results: list[dict]) -> str:
    """One row per transport: GB/s and the ratio to the raw TCP socket row (when there is one), and the CPU
    milliseconds each side spent per handoff."""
    baseline = next((r["gb_per_s"] for r in results if r["transport"] == BASELINE), None)
    median_baseline = next((r["num_bytes"] / r["median_s"] / 1e9 for r in results if r["transport"] == BASELINE), None)
    lines = [f"{'transport':10s} {'MB moved':>9s} {'handoffs':>8s} {'best s':>8s} {'GB/s':>7s} {'vs tcp':>7s} "
             f"{'median GB/s':>12s} {'vs tcp':>7s} {'send CPU ms':>12s} {'recv CPU ms':>12s}"]
    for r in results:
        median_gb_per_s = r["num_bytes"] / r["median_s"] / 1e9
        ratio = f"{r['gb_per_s'] / baseline:6.2f}x" if baseline else "      -"
        median_ratio = f"{median_gb_per_s / median_baseline:6.2f}x" if median_baseline else "      -"
        cpu = [f"{ms:12.1f}" if ms is not None else f"{'-':>12s}" for ms in (r["sender_cpu_ms"], r["receiver_cpu_ms"])]
        note = "" if r["cross_process"] else "  (same process)"
        lines.append(f"{r['transport']:10s} {r['num_bytes'] / 1e6:9.1f} {r['num_handoffs']:8d} {r['seconds']:8.3f} "
                     f"{r['gb_per_s']:7.3f} {ratio} {median_gb_per_s:12.3f} {median_ratio} {cpu[0]} {cpu[1]}{note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    tune_malloc()  # as every worker process does (both ends: the receiver here, the sender below)
    if argv[:1] == ["--serve"]:  # the receiver process
        torch.set_num_threads(1)
        if argv[1] == "tcp":
            _serve_tcp(int(argv[2]))
        elif argv[1] == "grpc-bare":
            _serve_grpc_bare(int(argv[2]))
        elif argv[1] == "tcp-paged":
            _serve_tcp_paged(_parse_layout(argv[2]), int(argv[3]))
        else:
            _serve_transport(argv[1], _parse_layout(argv[2]), int(argv[3]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-bytes", type=int, default=128 << 20, help="bytes to move per pass and transport")
    p.add_argument("--num-tokens", type=int, default=1000, help="tokens per handoff")
    p.add_argument("--trials", type=int, default=10, help="passes per transport, interleaved across transports")
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--pin", action="store_true", help="sender on one vCPU, receivers on another (as on two hosts)")
    p.add_argument("--block-size", type=int, default=SMOLLM2_LAYOUT.block_size,
                   help="tokens per KV block (vLLM's flag); over 68 tokens a SmolLM2 block is split into chunks")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    layout = dataclasses.replace(SMOLLM2_LAYOUT, block_size=args.block_size)
    handoff = KVHandoff(request_id="bench", transfer_id="", num_tokens=args.num_tokens, layout=layout)
    print(f"SmolLM2-135M KV, {args.num_tokens} tokens per handoff = {handoff.num_blocks} blocks of "
          f"{layout.block_bytes} bytes = {handoff.num_bytes / 1e6:.1f} MB; {args.trials} interleaved passes each"
          + ("; sender and receivers pinned to a vCPU each" if args.pin else ""))
    results = measure_all(args.transports.split(","), args.num_bytes, layout=layout, num_tokens=args.num_tokens,
                          trials=args.trials, pin=args.pin)
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
