"""A child rank's end of its KV lanes (kv_transfer/rank_lanes.py has the protocol and rank 0's end): the control
pipe served on a thread of the child's own, the lanes to this rank received into its cache at its own endpoint, the
lanes from this rank sent out of its cache, each on a thread of its own.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import torch

from kv_transfer.base import KVSender, TransferFault
from kv_transfer.handoff_failure import reason_of
from kv_transfer.layout import KVHandoff, KVLayout, KVRefused, KVTransferError
from kv_transfer.rank_lanes import (ENDED_KEPT, EXPECT_WAIT_S, RECEIVE_THREADS, Cancel, Expect, Forget, Reply, Send,
                                    Settled, Start, rank_view)
from kv_transfer.registry import make_receiver, make_sender
from kv_transfer.tp_slices import LaneWrites, RankCache, WireBlocks

logger = logging.getLogger(__name__)


class _Expected:
    """A child's share of one reservation: the lanes to its rank, each opened once, each settled once."""

    def __init__(self, expect: Expect, cache: RankCache, report: Callable[[Settled], None]) -> None:
        self.expect = expect
        self.cache = cache
        self.report = report
        self.lock = threading.Lock()
        self.failed: str | None = None
        self.lanes: dict[tuple[int, int], str] = {}  # lane → "receiving" | "committed" | "failed"

    def open(self, handoff: KVHandoff) -> _LaneWrites:
        e, rank = self.expect, self.cache.rank
        if handoff.lane is None or handoff.lane[1] != rank:
            raise KVRefused(f"handoff {handoff.transfer_id}: rank {rank}'s endpoint takes only lanes to rank {rank}, "
                            f"not {'the whole handoff' if handoff.lane is None else f'lane {handoff.lane}'}",
                            reason="malformed")
        handoff.check_reserved(request_id=e.request_id, source_endpoint=e.source_endpoint, num_tokens=e.num_tokens,
                               num_blocks=len(e.block_ids), first_block=e.first_block)
        with self.lock:
            if self.failed is not None:
                raise KVRefused(f"request {e.request_id}: KV transfer failed ({self.failed}), refusing lane "
                                f"{handoff.lane}", reason="unknown_transfer")
            if handoff.lane in self.lanes:
                raise KVRefused(f"request {e.request_id}: lane {handoff.lane} arrived twice", reason="unknown_transfer")
            self.lanes[handoff.lane] = "receiving"
        return _LaneWrites(self, handoff, WireBlocks(rank_view(self.cache), e.block_ids, handoff.wire, sender=False))

    def fail(self, reason: str) -> None:
        """Refuse every write from now on; returns once none is in flight."""
        with self.lock:
            if self.failed is None:
                self.failed = reason


class _LaneWrites(LaneWrites):
    """One lane's wire blocks into the child's cache, under its expectation's lock."""

    def __init__(self, expected: _Expected, handoff: KVHandoff, blocks: WireBlocks) -> None:
        super().__init__(handoff, blocks, expected.lock)
        self.expected = expected

    def refusal(self) -> str | None:
        e = self.expected
        if e.failed is not None:
            return f"request {e.expect.request_id}: transfer failed ({e.failed}), block dropped"
        if e.lanes.get(self.lane) != "receiving":
            return f"lane {self.lane} is {e.lanes.get(self.lane)}, block dropped"
        return None

    def commit(self) -> None:
        e = self.expected
        with e.lock:
            why = self.refusal()
            if why is not None:
                raise KVTransferError(f"cannot commit lane {self.lane}: {why}")
            e.lanes[self.lane] = "committed"
        e.report(Settled(e.expect.transfer_id, self.lane, self.handoff.layout.tensor_parallel_size, None,
                         self.num_bytes))

    def fail(self, reason: str) -> None:
        e = self.expected
        with e.lock:
            if e.lanes.get(self.lane) != "receiving":
                return
            e.lanes[self.lane] = "failed"
        e.report(Settled(e.expect.transfer_id, self.lane, self.handoff.layout.tensor_parallel_size, reason))


class _ChildSink:
    """The KVSink of a child rank's receiver: lanes to this rank of the reservations rank 0 said to expect."""

    def __init__(self, lanes: ChildLanes) -> None:
        self.lanes = lanes
        self.layout = lanes.layout
        self.device = lanes.device

    def open(self, handoff: KVHandoff) -> _LaneWrites:
        return self.lanes.expected(handoff).open(handoff)


class ChildLanes:
    """A child rank's end of its control pipe: serves it on a thread of its own until the pipe closes."""

    def __init__(self, conn: Connection, *, rank: int, device: torch.device, kv_cache: torch.Tensor,
                 kv_scales: torch.Tensor | None) -> None:
        self.conn = conn
        self.rank = rank
        self.device = device
        self.kv_cache = kv_cache
        self.kv_scales = kv_scales
        self.layout: KVLayout | None = None
        self.cache: RankCache | None = None
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._expected: dict[str, _Expected] = {}
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._sender = None
        self._start_message: Start | None = None
        self._receiver = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def serve_in_background(self) -> None:
        threading.Thread(target=self._serve, name=f"tp-lanes-rank{self.rank}", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except Exception:  # noqa: BLE001 - EOF: rank 0 is gone, and this process ends with it (rank_worker
                return  # watches its parent); a garbled pipe: rank 0 sees its cancels unanswered and stops us
            try:
                self._handle(message)
            except Exception:  # noqa: BLE001 - one message's trouble; the pipe goes on
                logger.exception("rank %d: a KV lane message failed", self.rank)

    def _reply(self, message: object) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, ValueError):
            pass  # rank 0 is gone

    def _handle(self, message: object) -> None:
        if isinstance(message, Send):  # a thread each: one slow receiver never holds up another's lanes
            threading.Thread(target=self._send, args=(message,), name=f"tp-lane-send{self.rank}",
                             daemon=True).start()
        elif isinstance(message, Expect):
            assert self.cache is not None, "Expect before Start"
            with self._cond:
                self._expected[message.transfer_id] = _Expected(message, self.cache, self._reply)
                self._cond.notify_all()
        elif isinstance(message, Forget):
            expected = self._end(message.transfer_id)
            if expected is not None:  # committed (or let go): a lane still open here writes no more
                expected.fail("the reservation ended")
        elif isinstance(message, Cancel):
            expected = self._end(message.transfer_id)
            if expected is not None:
                expected.fail(message.reason)  # under its lock: no write is in flight once this returns
            self._reply(Reply(message.token))
        elif isinstance(message, Start):
            try:
                self._reply(Reply(message.token, endpoint=self._start(message)))
            except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the worker's start
                logger.exception("rank %d: starting KV lanes failed", self.rank)
                self._reply(Reply(message.token, error=f"{type(exc).__name__}: {exc}"))

    def _end(self, transfer_id: str) -> _Expected | None:
        with self._cond:
            expected = self._expected.pop(transfer_id, None)
            self._ended[transfer_id] = None
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
            self._cond.notify_all()
        return expected

    def expected(self, handoff: KVHandoff) -> _Expected:
        """The reservation lane `handoff` belongs to, waiting briefly for rank 0's Expect (which a fast sender may
        beat here); KVRefused when it never comes or its reservation ended."""
        deadline = time.monotonic() + EXPECT_WAIT_S
        with self._cond:
            while True:
                expected = self._expected.get(handoff.transfer_id)
                if expected is not None:
                    return expected
                left = deadline - time.monotonic()
                if handoff.transfer_id in self._ended or left <= 0:
                    raise KVRefused(f"rank {self.rank}: no blocks are reserved for transfer {handoff.transfer_id} "
                                    f"(request {handoff.request_id})", reason="unknown_transfer")
                self._cond.wait(left)

    def _start(self, message: Start) -> str:
        self.layout = message.layout
        self.cache = RankCache(layout=message.layout, rank=self.rank, kv_cache=self.kv_cache,
                               kv_scales=self.kv_scales)
        self._start_message = message
        self._sender = self._make_sender()
        if not message.serve:
            return ""
        self._receiver = make_receiver(message.transport, _ChildSink(self))
        return self._serve_grpc(message)

    def _make_sender(self, fault: TransferFault | None = None) -> KVSender:
        start = self._start_message
        assert start is not None
        sender = make_sender(start.transport, worker_id=f"{start.worker_id}-rank{self.rank}", device=self.device,
                             auth=start.auth)
        if fault is not None:
            sender.fault = fault  # type: ignore[attr-defined]  # every transport's sender reads it
        return sender

    def _serve_grpc(self, message: Start) -> str:
        import grpc

        from kv_transfer.grpc_link import CHANNEL_OPTIONS
        from protos.cluster_auth import SERVER_KEEPALIVE, add_port, server_interceptors

        loop = self._loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name=f"tp-lanes-grpc{self.rank}", daemon=True).start()

        async def make() -> grpc.aio.Server:
            pool = ThreadPoolExecutor(max_workers=RECEIVE_THREADS, thread_name_prefix=f"tp-lane-recv{self.rank}")
            return grpc.aio.server(migration_thread_pool=pool, options=(*CHANNEL_OPTIONS, *SERVER_KEEPALIVE),
                                   interceptors=server_interceptors(message.auth))

        server = asyncio.run_coroutine_threadsafe(make(), loop).result()
        port = add_port(server, f"{message.host}:0", message.auth)
        if port == 0:
            raise RuntimeError(f"cannot bind {message.host}:0")
        endpoint = f"{message.advertise_host or message.host}:{port}"
        assert self._receiver is not None
        self._receiver.attach(server, endpoint)
        asyncio.run_coroutine_threadsafe(server.start(), loop).result()
        self._server = server
        return endpoint

    def _send(self, message: Send) -> None:
        start_s = time.monotonic()
        try:
            assert self.cache is not None and self._sender is not None, "Send before Start"
            source = WireBlocks(rank_view(self.cache), message.block_ids, message.handoff.wire, sender=True)
            # a test's fault: a sender of its own, so that no other send misbehaves
            sender = self._sender if message.fault is None else self._make_sender(message.fault)
            try:
                result = sender.send(message.handoff, source, endpoint=message.endpoint, timeout_s=message.timeout_s)
            finally:
                if sender is not self._sender:
                    sender.close()
            self._reply(Reply(message.token, num_bytes=result.num_bytes, seconds=result.seconds))
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the handoff
            self._reply(Reply(message.token, seconds=time.monotonic() - start_s, error=str(exc) or type(exc).__name__,
                              reason=reason_of(exc)))
