"""A KV tier below the device cache: full blocks the prefix cache evicts, kept by block hash, with their own LRU and
size bound, in a directory (`--kv-offload-dir`) or in host memory (`--kv-offload-memory`). Control plane: bytes
and block hashes only, no torch; the runtime turns a block into bytes and back (engine/kv_tier_blocks.py).

    engine thread                                       writer thread
    ─────────────                                       ─────────────
    block pool evicts h ─▶ offer(h, bytes) ─▶ queue (bounded, 256 MiB: full ⇒ the block is dropped, never waited for)
                                                 └────▶ CRC-32C, header, write `<h>.kv.tmp`, rename to `<h>.kv`,
                                                        index it, evict the least recently used past the bound
    a lookup misses the device ─▶ `h in tier` (index or queue) ─▶ read(h): the bytes, checked, or None

An entry on disk is one file, named by its block hash, under a subdirectory named by the namespace's root hash
(model identity with its quantization, block size, KV dtype: kv_transfer/block_hash.py), in a slot of its own per
worker (the first one no live worker holds a lock on: `DirectoryStore`):

    <dir>/<namespace root hex>/<slot>/<block hash hex>.kv     magic "SSKVBLK1" | namespace root (16) |
                                                              block hash (16) | payload bytes (u64 LE) |
                                                              CRC-32C of the payload (u32 LE) | payload

A restarted worker finds its entries by listing its slot (least recently written first); a worker of another
namespace has its own subdirectory, which this one never reads, counts or deletes. A file is checked when it is
read (its header names this namespace and this hash, the payload has the block's size and its CRC-32C); one that
fails is deleted and its block recomputed, never served. A write that fails (a full disk, an I/O error) drops that
block from the tier; nothing waits on it.

`removed` (taken by `take_removed`) lists the hashes that left the tier (LRU eviction, a dropped or failed write,
a failed check), so that the engine can tell the prefix index (engine/core/kv_tier_events.py).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kv_transfer.block_hash import HASH_SIZE_BYTES, BlockHash, BlockHashNamespace
from kv_transfer.layout import block_checksum

logger = logging.getLogger(__name__)

MAGIC = b"SSKVBLK1"
_HEADER = struct.Struct(f"<8s{HASH_SIZE_BYTES}s{HASH_SIZE_BYTES}sQI")
HEADER_BYTES = _HEADER.size
SUFFIX = ".kv"
# The write queue's bound, in bytes of blocks copied and not written yet: a burst of evictions (one prompt chunk's
# allocation evicts up to max_num_batched_tokens / block_size blocks at once: 128 of SmolLM2's 720 KiB blocks in
# one step) fits, and a full queue drops what comes after.
DEFAULT_MAX_QUEUED_BYTES = 256 << 20


class KVTierError(ValueError):
    """The tier cannot start (a directory it cannot use, one another worker holds): a start-up error."""


class BlockStore(Protocol):
    """Where a tier's entries live: whole entries (header and payload) by block hash. Thread-safe for one writer
    thread and one reader thread on different keys; a key being deleted while read raises OSError on the read."""

    def put(self, block_hash: BlockHash, entry: bytes | memoryview) -> int: ...  # the bytes it takes up

    def get(self, block_hash: BlockHash) -> bytes | bytearray: ...  # OSError if absent or unreadable

    def delete(self, block_hash: BlockHash) -> None: ...

    def scan(self) -> list[tuple[BlockHash, int]]: ...  # (hash, bytes) of every entry, oldest first

    def close(self) -> None: ...


@dataclass
class TierStats:
    """Counters since start (blocks and bytes), and the gauges `num_blocks`, `size_bytes`."""

    num_offered: int = 0  # blocks queued for writing
    num_dropped: int = 0  # offered while the queue was full: not written
    num_written: int = 0
    num_write_failures: int = 0
    num_evicted: int = 0  # by the tier's own LRU, past its size bound
    num_loaded: int = 0  # reads that passed their check
    num_corrupt: int = 0  # reads that failed their check (or the file was unreadable): dropped
    bytes_written: int = 0  # payload bytes
    bytes_read: int = 0
    num_blocks: int = 0
    size_bytes: int = 0


class KVTier:
    """One tier: an LRU of block entries up to `size_bytes`, written by a background thread. See the module doc."""

    def __init__(self, store: BlockStore, *, namespace: BlockHashNamespace, size_bytes: int, block_nbytes: int,
                 max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES, name: str = "kv-tier") -> None:
        if size_bytes <= 0:
            raise KVTierError(f"a KV tier needs a positive size, got {size_bytes} bytes")
        self._store = store
        self._root = namespace.root
        self.size_limit_bytes = size_bytes
        self.block_nbytes = block_nbytes
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first → entry bytes
        self._pending: dict[BlockHash, bytes | memoryview] = {}  # offered, not written yet
        self._removed: list[BlockHash] = []
        # A block to write; an Event to set once what was queued before it is written (flush); None: stop.
        self.max_queued_blocks = max(1, min(max_queued_bytes, size_bytes) // block_nbytes)
        self._queue: queue.Queue[tuple[BlockHash, bytes | memoryview] | threading.Event | None] = queue.Queue(
            self.max_queued_blocks)
        self._closed = False
        for block_hash, num_bytes in store.scan():
            self._index[block_hash] = num_bytes
            self.stats.size_bytes += num_bytes
        self._evict_over_bound()  # the bound may have shrunk since the entries were written
        self._removed.clear()  # never announced by this incarnation
        self.stats.num_blocks = len(self._index)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- engine thread ---------------------------------------------------------------------------------------
    def __contains__(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._index or block_hash in self._pending

    def __len__(self) -> int:
        with self._lock:
            return len(self._index.keys() | self._pending.keys())

    def hashes(self) -> list[BlockHash]:
        """Every hash the tier holds or is writing, least recently used first."""
        with self._lock:
            return [*self._index, *(h for h in self._pending if h not in self._index)]

    def wants(self, block_hash: BlockHash) -> bool:
        """Whether `offer` would queue this block now (not held yet, room in the queue): ask before copying it."""
        return not self._queue.full() and block_hash not in self

    def offer(self, block_hash: BlockHash, payload: bytes | memoryview, *, wait_s: float = 0.0) -> bool:
        """Queue a block's bytes for writing. Never blocks unless `wait_s` > 0 (a shutdown's write-back waits that
        long for room): False, not queued, if the tier holds it already or the queue is full (the block is dropped
        from the tier). `payload` must not change afterwards."""
        if len(payload) != self.block_nbytes:
            raise ValueError(f"a block is {self.block_nbytes} bytes, got {len(payload)}")
        with self._lock:
            if block_hash in self._index or block_hash in self._pending:
                return False
            self._pending[block_hash] = payload  # before the writer can see it
        try:
            self._queue.put((block_hash, payload), block=wait_s > 0, timeout=wait_s if wait_s > 0 else None)
        except queue.Full:
            with self._lock:
                del self._pending[block_hash]
                self.stats.num_dropped += 1
            return False
        with self._lock:
            self.stats.num_offered += 1
        return True

    def read(self, block_hash: BlockHash) -> bytes | memoryview | None:
        """The block's bytes, checked; None if the tier does not hold it or its entry fails its check (then it is
        dropped: the caller recomputes the block). A hit becomes the most recently used entry."""
        with self._lock:
            pending = self._pending.get(block_hash)
            if pending is not None:  # still in memory, as the device held it
                self.stats.num_loaded += 1
                self.stats.bytes_read += len(pending)
                return pending
            if block_hash not in self._index:
                return None
            self._index.move_to_end(block_hash)
        try:
            entry = self._store.get(block_hash)
            payload = self._check(block_hash, entry)
        except (OSError, _BadEntry) as exc:
            logger.warning("KV tier: block %s failed its check (%s); dropped, it is recomputed",
                           block_hash.hex(), exc)
            with self._lock:
                self.stats.num_corrupt += 1
                self._drop(block_hash)
            return None
        with self._lock:
            self.stats.num_loaded += 1
            self.stats.bytes_read += len(payload)
        return payload

    def stats_snapshot(self) -> TierStats:
        """A copy of the counters, taken under the writer's lock."""
        with self._lock:
            return dataclasses.replace(self.stats)

    def take_removed(self) -> list[BlockHash]:
        """The hashes that left the tier since the last call, in the order they left."""
        with self._lock:
            removed, self._removed = self._removed, []
            return removed

    def clear(self) -> None:
        """Drop every entry (a prefix-cache reset): what is queued is dropped once written. Its hashes are not
        listed in `take_removed` (the caller announces the whole cache cleared)."""
        self.flush()
        with self._lock:
            for block_hash in list(self._index):
                self._drop(block_hash)
            self._removed.clear()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every block queued so far is written (or failed); False if `timeout_s` passed first. May
        wait for room in the queue: not for the step's path."""
        if self._closed:
            return True
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued (within `timeout_s`), then stop the writer and release the store. Idempotent."""
        if self._closed:
            return
        self.flush(timeout_s)
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._store.close()

    # -- writer thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            self._write(*item)

    def _write(self, block_hash: BlockHash, payload: bytes | memoryview) -> None:
        header = _HEADER.pack(MAGIC, self._root, block_hash, len(payload), block_checksum(payload))
        try:
            num_bytes = self._store.put(block_hash, header + bytes(payload))
        except Exception as exc:  # noqa: BLE001 - an OSError (a full disk) or anything else: never the writer's end
            with self._lock:
                self.stats.num_write_failures += 1
                del self._pending[block_hash]
                self._removed.append(block_hash)
                first = self.stats.num_write_failures == 1
            (logger.warning if first else logger.debug)(
                "KV tier: writing block %s failed (%s); it is dropped from the tier", block_hash.hex(), exc)
            return
        with self._lock:
            del self._pending[block_hash]
            self._index[block_hash] = num_bytes
            self.stats.size_bytes += num_bytes
            self.stats.num_written += 1
            self.stats.bytes_written += len(payload)
            self._evict_over_bound()
            self.stats.num_blocks = len(self._index)

    # -- under the lock --------------------------------------------------------------------------------------
    def _evict_over_bound(self) -> None:
        while self.stats.size_bytes > self.size_limit_bytes and self._index:
            block_hash = next(iter(self._index))
            self.stats.num_evicted += 1
            self._drop(block_hash)

    def _drop(self, block_hash: BlockHash) -> None:
        num_bytes = self._index.pop(block_hash, None)
        if num_bytes is None:
            return
        self.stats.size_bytes -= num_bytes
        self.stats.num_blocks = len(self._index)
        self._removed.append(block_hash)
        try:
            self._store.delete(block_hash)
        except OSError as exc:
            logger.warning("KV tier: cannot delete block %s (%s)", block_hash.hex(), exc)

    def _check(self, block_hash: BlockHash, entry: bytes | bytearray) -> memoryview:
        if len(entry) < HEADER_BYTES:
            raise _BadEntry(f"{len(entry)} bytes, shorter than its header")
        magic, root, stored_hash, num_bytes, crc = _HEADER.unpack_from(entry)
        payload = memoryview(entry)[HEADER_BYTES:]
        if magic != MAGIC:
            raise _BadEntry("not a KV tier entry")
        if root != self._root:
            raise _BadEntry("written under another namespace")
        if stored_hash != block_hash:
            raise _BadEntry(f"holds block {stored_hash.hex()}")
        if num_bytes != len(payload) or num_bytes != self.block_nbytes:
            raise _BadEntry(f"{len(payload)} payload bytes, header says {num_bytes}, a block is {self.block_nbytes}")
        if block_checksum(payload) != crc:
            raise _BadEntry("CRC-32C mismatch")
        return payload


class _BadEntry(Exception):
    pass


# -- stores ------------------------------------------------------------------------------------------------------
class DirectoryStore:
    """Entries as files `<hash hex>.kv` in a slot of `<path>/<namespace root hex>/`: the first of `0/`, `1/`, ...
    whose lock file no live process holds. So the workers of one machine (`serve`'s, all given the same flags) each
    take a slot of their own, and a restarted worker takes a free one, its own when it alone restarted (any slot of
    the namespace holds valid blocks). Raises KVTierError at construction for a directory it cannot create, read or
    write, or when every slot is held."""

    def __init__(self, path: str | Path, namespace: BlockHashNamespace,
                 write_file: Callable[[Path, bytes], None] | None = None, max_slots: int = 64) -> None:
        base = Path(path) / namespace.root.hex()
        try:
            base.mkdir(parents=True, exist_ok=True)
            (base / "namespace.txt").write_text(
                f"model={namespace.model}\nblock_size={namespace.block_size}\nkv_dtype={namespace.kv_dtype}\n")
            for slot in range(max_slots):
                self.path = base / str(slot)
                self.path.mkdir(exist_ok=True)
                self._lock_file = open(self.path / "lock", "a+")  # noqa: SIM115 - held for the store's life
                try:
                    fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    self._lock_file.close()
            else:
                raise KVTierError(f"--kv-offload-dir {path}: all {max_slots} slots of {base} are held by live "
                                  "workers")
        except OSError as exc:
            raise KVTierError(f"--kv-offload-dir {path}: cannot use it ({exc})") from None
        # The fault hook: tests replace it to fail a write as a full disk would.
        self._write_file = write_file or _write_file

    def put(self, block_hash: BlockHash, entry: bytes | memoryview) -> int:
        final = self.path / f"{block_hash.hex()}{SUFFIX}"
        tmp = final.with_suffix(".tmp")
        try:
            self._write_file(tmp, bytes(entry))
            os.replace(tmp, final)  # a reader sees the whole entry or none
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        return len(entry)

    def get(self, block_hash: BlockHash) -> bytearray:
        with open(self.path / f"{block_hash.hex()}{SUFFIX}", "rb") as f:
            size = os.fstat(f.fileno()).st_size
            entry = bytearray(size)  # writable: the runtime copies from it without another copy
            if f.readinto(entry) != size:
                raise OSError(errno.EIO, "short read")
        return entry

    def delete(self, block_hash: BlockHash) -> None:
        (self.path / f"{block_hash.hex()}{SUFFIX}").unlink(missing_ok=True)

    def scan(self) -> list[tuple[BlockHash, int]]:
        found = []
        for entry in os.scandir(self.path):
            name = entry.name
            if name.endswith(".tmp"):  # a write cut short by a crash
                Path(entry.path).unlink(missing_ok=True)
                continue
            stem = name.removesuffix(SUFFIX)
            if not name.endswith(SUFFIX) or len(stem) != 2 * HASH_SIZE_BYTES:
                continue
            try:
                block_hash = bytes.fromhex(stem)
                stat = entry.stat()
            except (ValueError, OSError):
                continue
            found.append((stat.st_mtime_ns, block_hash, stat.st_size))
        return [(block_hash, size) for _, block_hash, size in sorted(found)]

    def close(self) -> None:
        self._lock_file.close()  # releases the lock


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


class MemoryStore:
    """Entries in host memory (the `--kv-offload-memory` tier, for a device cache that is not in host memory)."""

    def __init__(self) -> None:
        self._entries: dict[BlockHash, bytes] = {}

    def put(self, block_hash: BlockHash, entry: bytes | memoryview) -> int:
        self._entries[block_hash] = bytes(entry)
        return len(entry)

    def get(self, block_hash: BlockHash) -> bytes:
        try:
            return self._entries[block_hash]
        except KeyError:
            raise OSError(errno.ENOENT, "not in the tier") from None

    def delete(self, block_hash: BlockHash) -> None:
        self._entries.pop(block_hash, None)

    def scan(self) -> list[tuple[BlockHash, int]]:
        return []

    def close(self) -> None:
        self._entries.clear()
