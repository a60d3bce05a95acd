"""The conformance suite's two ends: a recording KV sink and a deterministic block source, and a command line that
runs either end of a transport in a separate process so that a test can kill (or freeze) it mid-transfer.

    python -m tests.kv_transfer.transfer_peer receiver --transport grpc --layout 2,2,4,8,float32 [--write-delay-s S]
        prints "READY <endpoint>", then "OPENED <transfer_id>" and "WROTE <index>" as its sink sees them
    python -m tests.kv_transfer.transfer_peer sender --transport torch --layout ... --endpoint E --num-tokens N \
        --stall-at-block K
        sends one handoff whose source prints "STALL <K>" and sleeps forever when block K is read
        (--num-tokens N1,N2,...: one handoff of each size in turn, then "SENT"; it lives on until its stdin closes)

Every line is flushed at once: the test reads them to time its kill.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from kv_transfer.base import KVDestination
from kv_transfer.grpc_transport import READ_AHEAD_THREAD
from kv_transfer.layout import KVHandoff, KVLayout, KVTransferError
from kv_transfer.registry import make_receiver, make_sender
from kv_transfer.wire_block import read_wire_block, read_wire_blocks, write_wire_block


class RecordingDestination:
    """One opened handoff in the fake paged cache: records every write, commit and fail."""

    def __init__(self, sink: RecordingSink, handoff: KVHandoff, slots: list[int]) -> None:
        self.sink = sink
        self.handoff = handoff
        self.slots = slots
        self.written: list[int] = []
        self.commits = 0
        self.fail_reasons: list[str] = []
        self.settled = threading.Event()
        self.settled_at_s: float | None = None
        self.scatters = 0  # write_blocks calls (a scattering destination's)
        if sink.scatters:
            self.write_blocks = self.scatter

    def write_block(self, index: int, data: torch.Tensor, crc32c: int | None = None) -> None:
        assert tuple(data.shape) == self.handoff.layout.wire_shape, data.shape
        assert not self.settled.is_set(), "write after commit or fail"
        slot = self.slots[index]
        scales = None if self.sink.scales is None else self.sink.scales[slot]
        # as the decode worker writes it; raises before recording a bad block
        write_wire_block(self.sink.layout, self.sink.cache[slot], scales, data, crc32c)
        self.written.append(index)
        self.sink.on_write(self, index)

    def commit(self) -> None:
        self.commits += 1
        self._settle()

    def scatter(self, first_index: int, data: torch.Tensor) -> None:
        """`write_blocks` of a destination that scatters (RecordingSink(scatters=True)), as the decode worker's
        reservation does: all of `data` at once, unchecked."""
        assert not self.settled.is_set(), "write after commit or fail"
        for slot in range(data.shape[0]):
            write_wire_block(self.sink.layout, self.sink.cache[self.slots[first_index + slot]],
                             None if self.sink.scales is None else self.sink.scales[self.slots[first_index + slot]],
                             data[slot], None)
        self.written.extend(range(first_index, first_index + data.shape[0]))
        self.scatters += 1

    def fail(self, reason: str) -> None:
        self.fail_reasons.append(reason)
        self._settle()

    def _settle(self) -> None:
        if not self.settled.is_set():
            self.settled_at_s = time.monotonic()
            self.settled.set()
            if not self.commits:
                self.sink.release(self.slots)

    @property
    def outcome(self) -> str | None:
        if self.commits and not self.fail_reasons:
            return "committed"
        if self.fail_reasons and not self.commits:
            return "failed"
        return None if not self.settled.is_set() else "both"

    def blocks(self) -> torch.Tensor:
        """[num_blocks, *block_shape]: the values that landed in this handoff's cache slots."""
        return self.sink.cache[self.slots]

    def block_scales(self) -> torch.Tensor:
        """[num_blocks, num_layers, 2, num_kv_heads]: the scales that landed there (int8 layouts)."""
        assert self.sink.scales is not None
        return self.sink.scales[self.slots]


class RecordingSink:
    """A KVSink over a fake paged cache of `num_cache_blocks` blocks. `refuse` makes `open` raise it."""

    def __init__(self, layout: KVLayout, *, num_cache_blocks: int = 256, device: torch.device | str = "cpu",
                 refuse: KVTransferError | None = None, write_delay_s: float = 0.0, announce: bool = False,
                 scatters: bool = False) -> None:
        """`scatters`: its destinations have `write_blocks` (many blocks at once, as the decode worker's)."""
        self.layout = layout
        self.scatters = scatters
        self.device = torch.device(device)
        self.num_cache_blocks = num_cache_blocks
        # [num_cache_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] of the values' dtype
        self.cache = torch.zeros((num_cache_blocks, *layout.block_shape), dtype=getattr(torch, layout.value_dtype),
                                 device=self.device)
        # int8 only: [num_cache_blocks, num_layers, 2, num_kv_heads] float32
        self.scales = (torch.zeros((num_cache_blocks, *layout.scale_shape), device=self.device)
                       if layout.quantized else None)
        self.refuse = refuse
        self.write_delay_s = write_delay_s
        self.announce = announce
        self.lock = threading.Lock()
        self.free = list(range(num_cache_blocks))
        self.destinations: list[RecordingDestination] = []
        self.open_calls = 0

    def open(self, handoff: KVHandoff) -> KVDestination:
        with self.lock:
            self.open_calls += 1
            if self.refuse is not None:
                raise self.refuse
            if handoff.num_blocks > len(self.free):
                raise KVTransferError(f"no room for {handoff.num_blocks} blocks")
            slots, self.free = self.free[: handoff.num_blocks], self.free[handoff.num_blocks:]
            dest = RecordingDestination(self, handoff, slots)
            self.destinations.append(dest)
        if self.announce:
            print(f"OPENED {handoff.transfer_id}", flush=True)
        return dest

    def release(self, slots: list[int]) -> None:
        with self.lock:
            self.free.extend(slots)

    @property
    def num_used(self) -> int:
        """Cache blocks held: by open handoffs and by committed ones (a failed handoff's come back at once)."""
        with self.lock:
            return self.num_cache_blocks - len(self.free)

    def on_write(self, dest: RecordingDestination, index: int) -> None:
        if self.announce:
            print(f"WROTE {index}", flush=True)
        if self.write_delay_s:
            time.sleep(self.write_delay_s)

    def wait_opened(self, timeout_s: float) -> RecordingDestination:
        """The only destination, once `open` made it (within `timeout_s`)."""
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            with self.lock:
                if self.destinations:
                    break
            time.sleep(0.01)
        return self.only()

    def only(self) -> RecordingDestination:
        with self.lock:
            assert len(self.destinations) == 1, f"{len(self.destinations)} destinations opened, expected 1"
            return self.destinations[0]

    def assert_each_settled_once(self) -> None:
        """Every destination `open` returned ended in exactly one commit or exactly one fail."""
        with self.lock:
            for dest in self.destinations:
                assert dest.commits + len(dest.fail_reasons) == 1, (
                    f"{dest.handoff.transfer_id}: {dest.commits} commits, fails {dest.fail_reasons}"
                )


class PatternSource:
    """A KVBlockSource of seeded random blocks (the tails of a partly filled last block included), held in a paged
    cache laid out as the prefill worker's and read as it reads them: strided views across the layers (an int8
    layout: random int8 values and float32 scales, packed as the prefill worker packs them)."""

    def __init__(self, layout: KVLayout, num_blocks: int, *, seed: int = 0, device: torch.device | str = "cpu",
                 stall_at_block: int | None = None) -> None:
        self.layout = layout
        generator = torch.Generator().manual_seed(seed)
        # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        if layout.quantized:
            self.blocks = torch.randint(-128, 128, (num_blocks, *layout.block_shape), generator=generator,
                                        dtype=torch.int8).to(device)
        else:
            self.blocks = torch.randn((num_blocks, *layout.block_shape), generator=generator).to(
                dtype=getattr(torch, layout.value_dtype), device=device  # the model's dtype, or fp8 values
            )
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]: the same values, paged
        self.cache = self.blocks.permute(1, 2, 0, 3, 4, 5).contiguous()
        # int8: [num_blocks, num_layers, 2, num_kv_heads] float32 scales, and paged [num_layers, 2, num_blocks, Hkv]
        self.scales: torch.Tensor | None = None
        self.scale_cache: torch.Tensor | None = None
        if layout.quantized:
            self.scales = torch.rand((num_blocks, *layout.scale_shape), generator=generator).to(device) + 1e-3
            self.scale_cache = self.scales.permute(1, 2, 0, 3).contiguous()
        self.stall_at_block = stall_at_block

    def read_block(self, index: int) -> torch.Tensor:
        if index == self.stall_at_block:
            print(f"STALL {index}", flush=True)
            time.sleep(3600)
        scales = None if self.scale_cache is None else self.scale_cache[:, :, index]
        return read_wire_block(self.layout, self.cache[:, :, index], scales)

    def read_blocks(self, indices: range, out: torch.Tensor) -> None:
        """Blocks `indices` at once, as the prefill worker's source reads them."""
        if self.stall_at_block in indices:
            self.read_block(self.stall_at_block)
        read_wire_blocks(self.layout, self.cache, self.scale_cache, indices, out)


def read_ahead_threads_gone(timeout_s: float = 5.0) -> bool:
    """Whether every gRPC receiver read-ahead thread has ended within `timeout_s`."""
    deadline_s = time.monotonic() + timeout_s
    while any(t.name == READ_AHEAD_THREAD for t in threading.enumerate()):
        if time.monotonic() > deadline_s:
            return False
        time.sleep(0.01)
    return True


def make_handoff(layout: KVLayout, num_tokens: int, *, request_id: str = "req") -> KVHandoff:
    return KVHandoff(request_id=request_id, transfer_id=uuid.uuid4().hex, num_tokens=num_tokens, layout=layout)


def parse_layout(text: str) -> KVLayout:
    """`num_layers,num_kv_heads,head_dim,block_size,dtype[,kv_cache_dtype]`."""
    num_layers, num_kv_heads, head_dim, block_size, dtype, *kv_cache_dtype = text.split(",")
    return KVLayout(num_layers=int(num_layers), num_kv_heads=int(num_kv_heads), head_dim=int(head_dim),
                    block_size=int(block_size), dtype=dtype, kv_cache_dtype=(kv_cache_dtype or ["auto"])[0])


def format_layout(layout: KVLayout) -> str:
    return (f"{layout.num_layers},{layout.num_kv_heads},{layout.head_dim},{layout.block_size},{layout.dtype},"
            f"{layout.kv_cache_dtype}")


def serve_receiver(transport: str, sink: RecordingSink) -> tuple[grpc.Server, str, object]:
    """A real gRPC server on a free loopback port with the transport's receiver attached; started."""
    server = grpc.server(ThreadPoolExecutor(max_workers=16))
    port = server.add_insecure_port("127.0.0.1:0")
    endpoint = f"127.0.0.1:{port}"
    receiver = make_receiver(transport, sink)
    receiver.attach(server, endpoint)
    server.start()
    return server, endpoint, receiver


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("receiver", "sender"))
    parser.add_argument("--transport", required=True)
    parser.add_argument("--layout", required=True, type=parse_layout)
    parser.add_argument("--device", default="cpu", help="the sink's (receiver) or the source's (sender) device")
    parser.add_argument("--write-delay-s", type=float, default=0.0)
    parser.add_argument("--endpoint")
    parser.add_argument("--num-tokens", default="64", help="tokens of each handoff, comma-separated, sent in turn "
                        "(the i-th with source seed i)")
    parser.add_argument("--stall-at-block", type=int)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--ipc-keep-bytes", type=int, help="the ipc sender's KEEP_BYTES (larger handoffs: one-off "
                        "buffers)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.role == "receiver":
        sink = RecordingSink(args.layout, device=args.device, write_delay_s=args.write_delay_s, announce=True)
        _server, endpoint, _receiver = serve_receiver(args.transport, sink)
        print(f"READY {endpoint}", flush=True)
        sys.stdin.read()  # serve until the test closes our stdin (or kills us)
        return 0
    if args.ipc_keep_bytes is not None:
        from kv_transfer import ipc_transport

        ipc_transport.KEEP_BYTES = args.ipc_keep_bytes
    sender = make_sender(args.transport, worker_id="peer-sender", device=torch.device(args.device))
    for seed, num_tokens in enumerate(int(n) for n in args.num_tokens.split(",")):
        handoff = make_handoff(args.layout, num_tokens)
        source = PatternSource(args.layout, handoff.num_blocks, seed=seed, device=args.device,
                               stall_at_block=args.stall_at_block)
        try:
            sender.send(handoff, source, endpoint=args.endpoint, timeout_s=args.timeout_s)
        except KVTransferError as exc:
            print(f"ERROR {exc}", flush=True)
            return 1
    print("SENT", flush=True)
    sys.stdin.read()  # alive, its buffers with it, until the test closes our stdin (or kills us)
    return 0


if __name__ == "__main__":
    sys.exit(main())
