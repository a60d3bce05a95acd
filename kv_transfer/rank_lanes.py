"""Lanes: a KV handoff between tensor-parallel workers, each rank sending and receiving its own KV heads.

A handoff from a prefill worker of TP a to a decode worker of TP b moves, for each (sender rank r, receiver rank s)
pair whose KV heads overlap, those heads of every block (kv_transfer/tp_plan.py). Each such pair is a lane: a
handoff of its own (`KVHandoff.with_lane`, the same transfer id), which sender rank r's process sends out of its
own cache, over the workers' transport (grpc, torch or ipc), to receiver rank s's own endpoint, whose process writes
it into its own cache, each wire block under its CRC-32C. No byte of a lane passes through another rank's process.

    prefill worker (TP a)                                   decode worker (TP b)
    ─────────────────────                                   ────────────────────
    rank 0 reads the decode ranks' endpoints in the         rank 0 reserves the blocks (one block table: the same
      Prefill call, then for each lane (r, s):                ids on every rank) and tells each child rank to
      r = 0: streams it itself                                Expect(transfer id, block ids, prefill worker)
      r > 0: Send(lane, block ids, endpoint) ─pipe─▶ rank r
             rank r streams its heads ──────────── gRPC ───▶ rank s (0: the worker's server; else its own): checks
                                                              the lane against what it expects, writes its heads
      every lane ends (each returns once its receiver       each child reports each lane settled ─pipe─▶ rank 0,
      committed it, or raises); any failure fails the         which commits once every lane of the plan committed;
      handoff, and the blocks stay held until then            any lane failing fails the reservation, and rank 0
                                                              cancels it on every rank (a round trip: then no rank
                                                              writes into the blocks any more)

The control pipes are the ranks' own (engine/distributed/rank_group.py makes one per child beside its step pipe):
`ChildLanes` (kv_transfer/child_lanes.py) serves one on a thread of the child, `RankLanes` reads each on a thread of
rank 0. A child's lanes end with the child: rank 0 sees its pipe close and fails whatever waited on it.

inproc runs no lanes (its two workers share one process; their children do not): it keeps moving every rank's
heads through rank 0's process, which maps its children's caches (`KVBlocks.ranks`). A sender that gets no
decode rank endpoints (a decode worker from before lanes) does the same.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection

from kv_transfer.base import KVBlockSource, KVSender, TransferFault, TransferResult
from kv_transfer.layout import (
    KVChecksumError,
    KVHandoff,
    KVLayout,
    KVRefused,
    KVTransferError,
    KVTransferTimeout,
)
from kv_transfer.tp_slices import RankCache, WireBlocks
from protos.cluster_auth import ClusterAuth

logger = logging.getLogger(__name__)

LANE_TRANSPORTS = ("grpc", "torch", "ipc")  # inproc has no processes to go between
EXPECT_WAIT_S = 10.0  # how long a child rank holds a lane that arrived before rank 0's Expect for it
REPLY_S = 10.0  # how long rank 0 waits for a child's answer to Start or Cancel (a live child answers in ms)
ENDED_KEPT = 4096  # transfer ids a child remembers as ended, so that a late lane is refused at once
RECEIVE_THREADS = 16  # a child's gRPC handler threads: lanes it takes at once


# ── the control messages (rank 0 ⇄ child) ────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Start:
    """Rank 0 → child: make the rank's sender, and (`serve`) its receiver on `host`:0."""

    token: int
    transport: str  # one of LANE_TRANSPORTS
    layout: KVLayout
    auth: ClusterAuth
    host: str
    advertise_host: str
    worker_id: str
    serve: bool


@dataclass(frozen=True)
class Expect:
    """Rank 0 → child: a reservation's lanes may arrive for `transfer_id`."""

    transfer_id: str
    request_id: str
    block_ids: tuple[int, ...]
    first_block: int
    num_tokens: int
    source_endpoint: str


@dataclass(frozen=True)
class Forget:
    """Rank 0 → child: the reservation ended (committed, or its request went); refuse its lanes from now on."""

    transfer_id: str


@dataclass(frozen=True)
class Cancel:
    """Rank 0 → child: fail the reservation's lanes; answered (Reply) once no write into its blocks is in flight."""

    token: int
    transfer_id: str
    reason: str


@dataclass(frozen=True)
class Send:
    """Rank 0 → child: stream lane `handoff` (its heads of blocks `block_ids`) to `endpoint`; answered (Reply)."""

    token: int
    handoff: KVHandoff
    block_ids: tuple[int, ...]
    endpoint: str
    timeout_s: float
    fault: TransferFault | None = None  # test hook: this send misbehaves so (kv_transfer/base.py)


@dataclass(frozen=True)
class Reply:
    """Child → rank 0: the answer to message `token`; `error` (and its `reason`, kv_transfer/handoff_failure.py)
    when it failed."""

    token: int
    endpoint: str = ""  # Start: the rank's lane endpoint ("" when it does not serve)
    num_bytes: int = 0  # Send: the lane's bytes
    seconds: float = 0.0
    error: str = ""
    reason: str = ""


@dataclass(frozen=True)
class Settled:
    """Child → rank 0: a lane it received committed (`error` None) or failed. `rank` is the child's; a lane
    (-1, rank) with an error: the child is gone, so are its lanes."""

    transfer_id: str
    lane: tuple[int, int]
    sender_tensor_parallel_size: int
    error: str | None
    num_bytes: int = 0


def rank_view(cache: RankCache) -> list[RankCache | None]:
    """`cache` at its rank's index of its engine's ranks (None at the others'): what WireBlocks reads one lane's
    units from, which all name this rank."""
    return [cache if rank == cache.rank else None for rank in range(cache.layout.tensor_parallel_size)]


def lane_error(text: str, reason: str) -> KVTransferError:
    """The exception a failed lane raised in another process, rebuilt from its text and reason."""
    if reason == "kv_transfer_timeout":
        return KVTransferTimeout(text)
    if reason == "kv_transfer_checksum":
        return KVChecksumError(text)
    if reason == "kv_transfer_refused":
        return KVRefused(text, reason="malformed")
    return KVTransferError(text)


# ── rank 0 ───────────────────────────────────────────────────────────────────────────────────────────────────


class RankLanes:
    """Rank 0's end of its children's control pipes (ranks 1..N-1, in order). Thread-safe."""

    def __init__(self, conns: Sequence[Connection], world_size: int,
                 on_stuck: Callable[[str], None] | None = None) -> None:
        """`on_stuck(why)`: a child did not confirm a cancel in time; it must be stopped before the cancel returns
        (engine/distributed/rank_group.py fails the group, killing every child), since it might still write."""
        self.world_size = world_size
        self._on_stuck = on_stuck
        self._conns = list(conns)
        self._send_locks = [threading.Lock() for _ in conns]
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._waiting: dict[int, tuple[int, Future[Reply]]] = {}  # token → (the child's rank, its answer)
        self._settle: dict[str, Callable[[Settled], None]] = {}  # transfer id → its reservation's callback
        self._gone: dict[int, str] = {}  # rank → why its pipe is gone
        # Settled callbacks run here, not on a reader: a callback that fails a reservation cancels it on every
        # child, a round trip whose answer a reader must be free to read.
        self._dispatch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tp-lanes-settle")
        self._cancels = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tp-lanes-cancel")  # cancel_later
        self.endpoints: list[str] = []  # ranks 1..N-1's lane endpoints, after start(serve=True)
        # Bytes of the lanes each rank sent out of its own cache and committed into it (rank 0's counted by
        # `count`, its children's from their answers).
        self.bytes_sent: collections.Counter[int] = collections.Counter()
        self.bytes_received: collections.Counter[int] = collections.Counter()
        for rank, conn in enumerate(self._conns, start=1):
            threading.Thread(target=self._read, args=(rank, conn), name=f"tp-lanes-rank{rank}", daemon=True).start()

    def start(self, transport: str, layout: KVLayout, auth: ClusterAuth, *, host: str, advertise_host: str,
              worker_id: str, serve: bool) -> list[str]:
        """Every child's sender of `transport`, and (`serve`) receiver; returns ranks 1..N-1's lane endpoints ([]
        unless `serve`). KVTransferError when a child cannot."""
        if transport not in LANE_TRANSPORTS:
            raise ValueError(f"KV lanes run over {', '.join(LANE_TRANSPORTS)}, not {transport}")
        futures = [self._ask(rank, lambda token: Start(token, transport, layout, auth, host, advertise_host, worker_id,
                                                       serve))
                   for rank in range(1, self.world_size)]
        replies = [self._answer(rank, future, REPLY_S * 3, "start its KV lanes")
                   for rank, future in enumerate(futures, start=1)]
        self.endpoints = [reply.endpoint for reply in replies] if serve else []
        return self.endpoints

    def expect(self, expect: Expect, on_settled: Callable[[Settled], None]) -> None:
        """Tell every child to take `expect.transfer_id`'s lanes; `on_settled` hears each lane a child settles (on a
        thread of this object's, never the caller's)."""
        with self._lock:
            self._settle[expect.transfer_id] = on_settled
            gone = dict(self._gone)
        for rank in range(1, self.world_size):
            if rank not in gone:
                self._post(rank, expect)
        for rank, why in gone.items():
            self._call_back(on_settled, Settled(expect.transfer_id, (-1, rank), 0, why))

    def forget(self, transfer_id: str) -> None:
        """The reservation ended: no child takes its lanes any more (no answer waited for)."""
        with self._lock:
            self._settle.pop(transfer_id, None)
        for rank in range(1, self.world_size):
            self._post(rank, Forget(transfer_id))

    def cancel(self, transfer_id: str, reason: str) -> None:
        """Fail the reservation's lanes on every child and wait until each answered: after this, no child writes
        into its blocks. A child that is gone writes nothing either."""
        with self._lock:
            self._settle.pop(transfer_id, None)
        futures = [(rank, self._ask(rank, lambda token: Cancel(token, transfer_id, reason)))
                   for rank in range(1, self.world_size)]
        deadline = time.monotonic() + REPLY_S
        for rank, future in futures:
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except KVTransferError:
                pass  # gone: its cache went with it
            except TimeoutError:
                why = (f"tensor-parallel rank {rank} did not confirm cancelling KV transfer {transfer_id} within "
                       f"{REPLY_S:.0f} s")
                logger.error("%s; stopping the ranks, since it might still write into the blocks", why)
                if self._on_stuck is not None:
                    self._on_stuck(why)

    def cancel_later(self, transfer_id: str, reason: str, then: Callable[[], None]) -> None:
        """`cancel` on a thread of this object's, then `then()` (however the cancel ended): for callers that must
        not wait (an asyncio loop)."""
        def run() -> None:
            try:
                self.cancel(transfer_id, reason)
            finally:
                then()

        try:
            self._cancels.submit(run)
        except RuntimeError:  # closed: the children are stopped, nothing of theirs writes any more
            then()

    def send(self, rank: int, handoff: KVHandoff, block_ids: Sequence[int], endpoint: str,
             timeout_s: float, *, fault: TransferFault | None = None) -> Future[TransferResult]:
        """Child `rank` streams lane `handoff` to `endpoint`: a future of its TransferResult, or of the
        KVTransferError it failed with. `fault`: a test's misbehaving sender."""
        result: Future[TransferResult] = Future()

        def done(answer: Future[Reply]) -> None:
            try:
                reply = answer.result()
            except KVTransferError as exc:
                result.set_exception(exc)
                return
            if reply.error:
                result.set_exception(lane_error(f"lane {handoff.lane} from rank {rank}: {reply.error}", reply.reason))
            else:
                with self._lock:
                    self.bytes_sent[rank] += reply.num_bytes
                result.set_result(TransferResult(num_bytes=reply.num_bytes, seconds=reply.seconds))

        self._ask(rank, lambda token: Send(token, handoff, tuple(block_ids), endpoint, timeout_s, fault)
                  ).add_done_callback(done)
        return result

    def count(self, rank: int, *, sent: int = 0, received: int = 0) -> None:
        """Add to rank `rank`'s lane bytes (rank 0's own lanes, which no child reports)."""
        with self._lock:
            self.bytes_sent[rank] += sent
            self.bytes_received[rank] += received

    def close(self) -> None:
        self._dispatch.shutdown(wait=False, cancel_futures=True)
        self._cancels.shutdown(wait=False)

    def _ask(self, rank: int, make: Callable[[int], object]) -> Future[Reply]:
        future: Future[Reply] = Future()
        token = next(self._tokens)
        with self._lock:
            why = self._gone.get(rank)
            if why is None:
                self._waiting[token] = (rank, future)
        if why is not None:
            future.set_exception(KVTransferError(why))
            return future
        if not self._post(rank, make(token)):
            with self._lock:
                self._waiting.pop(token, None)
            future.set_exception(KVTransferError(self._gone.get(rank, f"tensor-parallel rank {rank} is gone")))
        return future

    def _answer(self, rank: int, future: Future[Reply], timeout_s: float, what: str) -> Reply:
        try:
            reply = future.result(timeout=timeout_s)
        except TimeoutError:
            raise KVTransferError(f"tensor-parallel rank {rank} did not {what} within {timeout_s:.0f} s") from None
        if reply.error:
            raise KVTransferError(f"tensor-parallel rank {rank} could not {what}: {reply.error}")
        return reply

    def _post(self, rank: int, message: object) -> bool:
        try:
            with self._send_locks[rank - 1]:
                self._conns[rank - 1].send(message)
            return True
        except (OSError, ValueError):  # the pipe broke (or closed): its reader reports the child gone
            return False

    def _call_back(self, callback: Callable[[Settled], None], message: Settled) -> None:
        try:
            self._dispatch.submit(callback, message)
        except RuntimeError:  # closed: the group is stopping, its reservations with it
            pass

    def _read(self, rank: int, conn: Connection) -> None:
        try:
            while True:
                message = conn.recv()  # a broken or garbled pipe ends the child for us (below)
                try:
                    self._take(rank, message)
                except Exception:  # noqa: BLE001 - one message's trouble; the pipe goes on
                    logger.exception("tensor-parallel rank %d: a KV lane message failed", rank)
        except Exception as exc:  # noqa: BLE001 - EOF (the child exited), or a pipe we cannot read any more
            if not isinstance(exc, (EOFError, OSError)):
                logger.error("tensor-parallel rank %d: its KV lane pipe failed (%s)", rank, exc)
            self._lost(rank)

    def _take(self, rank: int, message: object) -> None:
        if isinstance(message, Reply):
            with self._lock:
                _, future = self._waiting.pop(message.token, (rank, None))
            if future is not None:
                future.set_result(message)
        elif isinstance(message, Settled):
            with self._lock:
                callback = self._settle.get(message.transfer_id)
                if message.error is None:
                    self.bytes_received[rank] += message.num_bytes
            if callback is not None:
                self._call_back(callback, message)

    def _lost(self, rank: int) -> None:
        """Child `rank`'s pipe closed (the child died, or the group closed): fail what waits on it, and every
        reservation's lanes (its share of them never settles)."""
        why = f"tensor-parallel rank {rank} is gone (its KV lanes with it)"
        with self._lock:
            self._gone[rank] = why
            tokens = [token for token, (r, _) in self._waiting.items() if r == rank]
            waiting = [self._waiting.pop(token)[1] for token in tokens]
            callbacks = list(self._settle.items())
        for future in waiting:
            future.set_exception(KVTransferError(why))
        for transfer_id, callback in callbacks:
            self._call_back(callback, Settled(transfer_id, (-1, rank), 0, why))


# ── a prefill worker's handoff as lanes ──────────────────────────────────────────────────────────────────────

WAIT_SLACK_S = 10.0  # past the handoff's timeout, how long rank 0 waits for a lane's end before it gives it up


def send_lanes(handoff: KVHandoff, *, own: RankCache, block_ids: Sequence[int], endpoints: Sequence[str],
               sender: KVSender, ranks: RankLanes | None, timeout_s: float,
               wrap: Callable[[KVBlockSource, KVHandoff], KVBlockSource] | None = None) -> TransferResult:
    """Send `handoff` (the whole of it) as its lanes: rank 0's (`own`, its cache) through `sender`, each on a thread
    of its own, every other sender rank's by its own process (`ranks`), each lane to its receiver rank's endpoint
    (`endpoints`, receiver rank 0 first). Returns once every lane's receiver committed it; otherwise waits until
    every lane ended (so that no rank still reads the blocks when the caller frees them; each lane's send is bounded
    by `timeout_s`) and raises the first failure that says why (a timeout, a checksum, a refusal) over the others'
    knock-on errors. `wrap` (fault injection) wraps rank 0's source of the lane to receiver rank 0."""
    start_s = time.monotonic()
    if len(endpoints) != handoff.receiver_tensor_parallel_size:
        raise KVTransferError(f"handoff {handoff.transfer_id}: {len(endpoints)} decode rank endpoints for "
                              f"tensor-parallel size {handoff.receiver_tensor_parallel_size}")
    lanes = handoff.all_lanes
    if ranks is None and any(sender_rank > 0 for sender_rank, _ in lanes):
        raise KVTransferError(f"handoff {handoff.transfer_id}: its lanes {lanes} need this worker's child ranks")
    ended: list[tuple[float, tuple[int, int], BaseException | None]] = []
    ended_lock = threading.Lock()
    futures: list[tuple[tuple[int, int], Future[TransferResult]]] = []

    def note(lane: tuple[int, int], future: Future[TransferResult]) -> None:
        with ended_lock:
            ended.append((time.monotonic(), lane, future.exception()))

    for sender_rank, receiver_rank in lanes:
        lane = handoff.with_lane(sender_rank, receiver_rank)
        endpoint = endpoints[receiver_rank]
        if sender_rank == 0:
            source: KVBlockSource = WireBlocks(rank_view(own), block_ids, lane.wire, sender=True)
            if wrap is not None and receiver_rank == 0:
                source = wrap(source, lane)
            future = _on_thread(functools.partial(sender.send, lane, source, endpoint=endpoint, timeout_s=timeout_s),
                                f"kv-lane-{sender_rank}-{receiver_rank}")
        else:
            assert ranks is not None
            future = ranks.send(sender_rank, lane, block_ids, endpoint, timeout_s)
        futures.append(((sender_rank, receiver_rank), future))
        future.add_done_callback(functools.partial(note, (sender_rank, receiver_rank)))
    num_bytes = 0
    deadline = time.monotonic() + timeout_s + WAIT_SLACK_S
    for lane, future in futures:
        try:
            lane_bytes = future.result(timeout=max(0.0, deadline - time.monotonic())).num_bytes
            num_bytes += lane_bytes
            if lane[0] == 0 and ranks is not None:
                ranks.count(0, sent=lane_bytes)
        except TimeoutError:
            with ended_lock:
                ended.append((time.monotonic(), lane, KVTransferTimeout(
                    f"handoff {handoff.transfer_id}: lane {lane} did not end within {timeout_s:.3g} s")))
        except Exception:  # noqa: BLE001 - noted by its callback; the failure to raise is chosen below
            pass
    with ended_lock:
        failures = sorted(((type(exc) is KVTransferError or not isinstance(exc, KVTransferError), t), lane, exc)
                          for t, lane, exc in ended if exc is not None)
    if failures:
        _, lane, exc = failures[0]
        raise exc if isinstance(exc, KVTransferError) else KVTransferError(f"lane {lane}: {exc}")
    return TransferResult(num_bytes=num_bytes, seconds=time.monotonic() - start_s)


def _on_thread(call: Callable[[], TransferResult], name: str) -> Future[TransferResult]:
    """`call()` on a new daemon thread: a future of its result or exception."""
    future: Future[TransferResult] = Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
