"""Rank 0's handle on its children (ranks 1..N-1): spawn them, hand each its weight shard, wait until they are
ready, send them each step's message, notice when one dies, stop them.

    start()   spawn N-1 processes (the `spawn` method: no forked copy of rank 0's threads or weights), each
              says hello → rank 0 joins the group (every rank has) → each child gets its shard → waits for Ready
    send()    one message to every child, in rank order (their pipes)
    check()   RankDiedError if a child is gone, naming its rank, pid and exit code
    close()   Shutdown to each, join; a child still alive after a few seconds is killed. Idempotent.

Children die with rank 0 whatever kills it (rank_worker watches its parent), and are daemonic (multiprocessing
terminates them when rank 0 exits normally); `close` runs when the engine closes or is collected too.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Callable
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

from engine.distributed import step_message
from engine.distributed.group import make_group, make_store
from engine.model.tp_group import TPGroup
from engine.distributed.rank_worker import Hello, RankSpec, Ready, run_rank
from engine.distributed.shared_weights import share
from engine.distributed.shm_collectives import SharedFile, ShmCollectives

if TYPE_CHECKING:
    from kv_transfer.rank_lanes import RankLanes

logger = logging.getLogger(__name__)

_JOIN_S = 5.0  # how long close() waits for a child to exit before killing it


class RankDiedError(RuntimeError):
    """A rank of a tensor-parallel engine died or failed: the engine cannot compute any further step."""


class RankGroup:
    def __init__(self, specs: list[RankSpec], *, device: torch.device, dtype: torch.dtype, timeout_s: float,
                 startup_timeout_s: float, shm_file: SharedFile | None = None) -> None:
        """`specs`: one per child, ranks 1..N-1 in order (not started until `start`). `shm_file`: the memory of the
        group's collectives on cpu (each child is handed its descriptor after its hello), closed here once every
        child has mapped it."""
        self.specs = specs
        self.device = device
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self.lane_conns: list[Connection] = []  # each child's control pipe for KV lanes (kv_transfer/rank_lanes.py)
        self.lanes: RankLanes | None = None  # rank 0's end of them, once every child is ready
        self.ready: list[Ready] = []
        self.failure: RankDiedError | None = None
        self.shm_file = shm_file
        self._shm: ShmCollectives | None = None
        self._closed = False

    @property
    def world_size(self) -> int:
        return len(self.specs) + 1

    @property
    def pids(self) -> list[int]:
        """The children's pids, rank 1 first."""
        return [p.pid for p in self.processes if p.pid is not None]

    def start(self, store: Any, shards: Callable[[int], dict[str, torch.Tensor]]) -> TPGroup:
        """Start the children over `store` (rank 0's, serving at each spec's `store_port`), give rank r the weights
        `shards(r)` returns, and return rank 0's group once every child is ready. Raises RankDiedError (the
        children stopped) if one fails to start within the start-up timeout."""
        ctx = multiprocessing.get_context("spawn")
        try:
            for spec in self.specs:
                parent_end, child_end = ctx.Pipe()
                lanes_end, child_lanes_end = ctx.Pipe()
                process = ctx.Process(target=run_rank, args=(spec, child_end, child_lanes_end), daemon=True,
                                      name=f"splitserve-tp-rank{spec.rank}")
                process.start()
                child_end.close()
                child_lanes_end.close()
                self.processes.append(process)
                self.conns.append(parent_end)
                self.lane_conns.append(lanes_end)
            for rank, (conn, process) in enumerate(zip(self.conns, self.processes, strict=True), start=1):
                self._expect(conn, rank, Hello)
                if self.shm_file is not None:  # the descriptor itself, over the pipe's Unix socket
                    reduction.send_handle(conn, self.shm_file.fd, process.pid)
            group = make_group(store, rank=0, world_size=self.world_size, device=self.device,
                               timeout_s=self.timeout_s, shm_fd=None if self.shm_file is None else self.shm_file.fd)
            self._shm = group.shm  # type: ignore[assignment]
            if self._shm is not None:
                self._shm.peers_dead = self.dead
            for rank, conn in enumerate(self.conns, start=1):
                shared = share(shards(rank), self.dtype)
                conn.send(shared)
                self.ready.append(self._expect(conn, rank, Ready))  # the child's model holds its shard now
                del shared
            if self.shm_file is not None:
                self.shm_file.close()  # every rank has it mapped
            # A child that does not confirm a cancelled handoff in time is stopped (every child, the group failed)
            # before the cancel returns: it might otherwise still write into blocks the engine frees.
            from kv_transfer.rank_lanes import RankLanes  # gRPC's side of the house: imported where it is used

            self.lanes = RankLanes(self.lane_conns, self.world_size, on_stuck=lambda why: self.fail(why))
            return group
        except BaseException:
            self.close()
            raise

    def _expect(self, conn: Connection, rank: int, kind: type) -> Any:
        deadline = time.monotonic() + self.startup_timeout_s
        while not conn.poll(0.1):
            self.check()
            if time.monotonic() > deadline:
                raise RankDiedError(f"tensor-parallel rank {rank} did not start within {self.startup_timeout_s:.0f} s")
        try:
            message = conn.recv()
        except EOFError:
            self.check()
            raise RankDiedError(f"tensor-parallel rank {rank} closed its pipe while starting") from None
        if not isinstance(message, kind):
            raise RankDiedError(f"tensor-parallel rank {rank} sent {message!r} while starting, not {kind.__name__}")
        return message

    def send(self, message: step_message.StepMessage) -> None:
        """`message` to every child; RankDiedError if one is gone (or the group already failed)."""
        if self.failure is not None:
            raise self.failure
        data = step_message.encode(message)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            raise self.fail(f"a pipe to a rank broke ({exc})") from exc

    def send_each(self, messages: list[bytes]) -> None:
        """messages[i] (encoded: step_message.encode) to rank i + 1; RankDiedError as `send`."""
        if self.failure is not None:
            raise self.failure
        try:
            for conn, data in zip(self.conns, messages, strict=True):
                conn.send_bytes(data)
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            raise self.fail(f"a pipe to a rank broke ({exc})") from exc

    def dead(self) -> str | None:
        """Which children are gone, or why the group failed; None while every rank runs. No side effect: safe from
        any thread while the engine steps (a liveness probe)."""
        if self.failure is not None:
            return str(self.failure)
        dead = [f"rank {spec.rank} (pid {p.pid}) {_exit_status(p.exitcode)}"
                for spec, p in zip(self.specs, self.processes, strict=False) if not p.is_alive()]
        return "; ".join(dead) or None

    def check(self) -> None:
        """RankDiedError naming every child that is no longer running."""
        if self.failure is not None:
            raise self.failure
        dead = [(spec.rank, p) for spec, p in zip(self.specs, self.processes, strict=False) if not p.is_alive()]
        if dead:
            raise self.fail("")

    def fail(self, cause: str) -> RankDiedError:
        """Record the group as failed (every later call raises the same error), stop the children, and return the
        error: which ranks died and how (waiting briefly for a dying one's exit code)."""
        if self.failure is not None:
            return self.failure
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and all(p.is_alive() for p in self.processes):
            time.sleep(0.01)
        dead = [f"rank {spec.rank} (pid {p.pid}) {_exit_status(p.exitcode)}"
                for spec, p in zip(self.specs, self.processes, strict=False) if not p.is_alive()]
        what = "; ".join(dead) or "no rank exited, but a collective or a pipe failed"
        self.failure = RankDiedError(f"tensor-parallel engine failed: {what}" + (f": {cause}" if cause else "")
                                     + "; the engine cannot run another step")
        self.close()
        return self.failure

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._shm is not None:
            self._shm.abort()  # a child waiting in a collective stops waiting
        if self.shm_file is not None:
            self.shm_file.close()
        data = step_message.encode(step_message.Shutdown())
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except OSError:
                pass
        deadline = time.monotonic() + _JOIN_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                logger.warning("tensor-parallel %s did not exit; killing it", process.name)
                process.kill()
                process.join(_JOIN_S)
        for conn in (*self.conns, *self.lane_conns):
            conn.close()
        if self.lanes is not None:
            self.lanes.close()


def _exit_status(exitcode: int | None) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def start_store(world_size: int, timeout_s: float) -> tuple[Any, int]:
    """Rank 0's rendezvous store on a free loopback port, and that port."""
    store = make_store(rank=0, world_size=world_size, port=0, timeout_s=timeout_s)
    return store, store.port  # type: ignore[attr-defined]
