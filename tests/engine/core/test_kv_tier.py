"""The KV tier's control plane (engine/core/kv_tier.py, kv_tier_events.py) on exact state: its LRU and size bound,
its bounded write queue (a full one drops, never blocks), entry checks, a restart's scan, and the union events the
prefix index hears. No torch."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from engine.core.kv_tier import HEADER_BYTES, DirectoryStore, KVTier, KVTierError, MemoryStore
from engine.core.kv_tier_events import TieredEvents
from kv_transfer.block_hash import BlockHashNamespace
from kv_transfer.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

NS = BlockHashNamespace(model="m", block_size=4, kv_dtype="float32")
BLOCK = 64  # payload bytes
ENTRY = BLOCK + HEADER_BYTES


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(i: int) -> bytes:
    return bytes([i % 256]) * BLOCK


def tier_over(store, num_entries: int = 3, namespace: BlockHashNamespace = NS, **kwargs) -> KVTier:  # noqa: ANN001
    return KVTier(store, namespace=namespace, size_bytes=num_entries * ENTRY, block_nbytes=BLOCK, **kwargs)


def test_lru_keeps_the_most_recently_used_within_its_bound(tmp_path: Path) -> None:
    tier = tier_over(DirectoryStore(tmp_path, NS))
    for i in range(3):
        assert tier.offer(h(i), payload(i))
    assert tier.flush(5)
    assert tier.read(h(0)) == payload(0)  # 0 becomes the most recently used: 1 goes first
    tier.offer(h(3), payload(3))
    tier.flush(5)

    assert tier.hashes() == [h(2), h(0), h(3)]
    assert tier.take_removed() == [h(1)]
    assert tier.read(h(1)) is None
    assert sorted(p.name for p in (tmp_path / NS.root.hex() / "0").glob("*.kv")) == sorted(
        f"{h(i).hex()}.kv" for i in (0, 2, 3))
    assert (tier.stats.num_written, tier.stats.num_evicted, tier.stats.size_bytes) == (4, 1, 3 * ENTRY)
    tier.close()


def test_a_full_queue_drops_the_block_and_never_waits() -> None:
    gate = threading.Event()

    class SlowStore(MemoryStore):
        def put(self, block_hash, entry):  # noqa: ANN001, ANN202
            gate.wait(10)
            return super().put(block_hash, entry)

    tier = tier_over(SlowStore(), num_entries=10, max_queued_bytes=2 * BLOCK)
    started = time.monotonic()
    results = [tier.offer(h(i), payload(i)) for i in range(6)]  # one being written, two queued, three dropped
    assert time.monotonic() - started < 1.0
    assert results.count(True) in (2, 3) and results[:2] == [True, True]
    assert tier.stats.num_dropped == results.count(False)
    queued = [h(i) for i, ok in enumerate(results) if ok]
    assert all(x in tier for x in queued) and tier.read(queued[0]) == payload(0)  # served from memory meanwhile
    gate.set()
    tier.flush(5)
    assert tier.hashes() == queued
    tier.close()


def test_an_entry_failing_its_check_is_dropped(tmp_path: Path) -> None:
    tier = tier_over(DirectoryStore(tmp_path, NS))
    for i in range(3):
        tier.offer(h(i), payload(i))
    tier.flush(5)
    directory = tmp_path / NS.root.hex() / "0"
    damaged = bytearray((directory / f"{h(0).hex()}.kv").read_bytes())
    damaged[-1] ^= 1
    (directory / f"{h(0).hex()}.kv").write_bytes(damaged)
    (directory / f"{h(1).hex()}.kv").write_bytes((directory / f"{h(2).hex()}.kv").read_bytes())  # another block's
    (directory / f"{h(2).hex()}.kv").write_bytes(b"short")

    assert [tier.read(h(i)) for i in range(3)] == [None, None, None]
    assert tier.stats.num_corrupt == 3 and len(tier) == 0
    assert tier.take_removed() == [h(0), h(1), h(2)]
    assert not list(directory.glob("*.kv"))
    tier.close()


def test_another_namespace_in_a_header_fails_the_check(tmp_path: Path) -> None:
    other = BlockHashNamespace(model="other", block_size=4, kv_dtype="float32")
    writer = tier_over(DirectoryStore(tmp_path, other), namespace=other)
    writer.offer(h(0), payload(0))
    writer.close()
    moved = tmp_path / NS.root.hex() / "0" / f"{h(0).hex()}.kv"
    moved.parent.mkdir(parents=True)
    (tmp_path / other.root.hex() / "0" / f"{h(0).hex()}.kv").rename(moved)

    tier = tier_over(DirectoryStore(tmp_path, NS))
    assert h(0) in tier  # found by name; its header says otherwise
    assert tier.read(h(0)) is None and tier.stats.num_corrupt == 1
    tier.close()


def test_a_restart_finds_its_entries_oldest_first_within_a_smaller_bound(tmp_path: Path) -> None:
    tier = tier_over(DirectoryStore(tmp_path, NS), num_entries=4)
    for i in range(4):
        tier.offer(h(i), payload(i))
        tier.flush(5)
        time.sleep(0.01)  # distinct modification times
    tier.close()
    (tmp_path / NS.root.hex() / "0" / f".{h(9).hex()}.tmp").write_bytes(b"a write cut short")

    again = tier_over(DirectoryStore(tmp_path, NS), num_entries=2)  # the bound shrank: the oldest two go

    assert again.hashes() == [h(2), h(3)]
    assert again.take_removed() == []  # never announced by this incarnation
    assert again.read(h(3)) == payload(3)
    assert not list((tmp_path / NS.root.hex() / "0").glob("*.tmp"))
    assert len(list((tmp_path / NS.root.hex() / "0").glob("*.kv"))) == 2
    again.close()


def test_a_failed_write_is_dropped_and_listed_removed(tmp_path: Path) -> None:
    def disk_full(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    tier = tier_over(DirectoryStore(tmp_path, NS, write_file=disk_full))
    assert tier.offer(h(0), payload(0))
    tier.flush(5)
    assert h(0) not in tier and tier.take_removed() == [h(0)]
    assert tier.stats.num_write_failures == 1 and tier.stats.num_written == 0
    tier.close()


def test_each_live_worker_takes_a_slot_of_its_own(tmp_path: Path) -> None:
    first, second = DirectoryStore(tmp_path, NS), DirectoryStore(tmp_path, NS)
    assert (first.path.name, second.path.name) == ("0", "1")
    other = DirectoryStore(tmp_path, BlockHashNamespace(model="other", block_size=4, kv_dtype="float32"))
    assert other.path.name == "0" and other.path.parent != first.path.parent
    first.close()  # a worker that stops (or dies) frees its slot for the next start
    again = DirectoryStore(tmp_path, NS)
    assert again.path == first.path
    with pytest.raises(KVTierError, match="all 2 slots .* are held"):
        DirectoryStore(tmp_path, NS, max_slots=2)
    for store in (second, other, again):
        store.close()


def test_size_must_be_positive_and_blocks_whole() -> None:
    with pytest.raises(KVTierError, match="positive size"):
        KVTier(MemoryStore(), namespace=NS, size_bytes=0, block_nbytes=BLOCK)
    tier = tier_over(MemoryStore())
    with pytest.raises(ValueError, match="a block is 64 bytes"):
        tier.offer(h(0), b"x")
    tier.close()


def test_union_events_announce_moves_between_device_and_tier_as_stores_under_the_tier() -> None:
    device: set[bytes] = set()
    tier: set[bytes] = {h(9)}  # found again at start: announced by the first snapshot, under the tier
    events = TieredEvents(device.__contains__, tier.__contains__, tier="disk", announced=tier)
    assert events.announced == {h(9): "disk"}

    device |= {h(0), h(1)}
    assert events.merge([BlockStored(block_hashes=(h(0), h(1)))], []) == [BlockStored(block_hashes=(h(0), h(1)))]
    device -= {h(0), h(1)}
    tier |= {h(0)}  # the device evicts both; the tier takes 0 (held, now on disk), its queue drops 1 (gone)
    assert events.merge([BlockRemoved(block_hashes=(h(0), h(1)))], []) == [
        BlockRemoved(block_hashes=(h(1),)), BlockStored(block_hashes=(h(0),), tier="disk")]
    device |= {h(0), h(9)}  # loaded back from the tier: held as before, on the device now
    assert events.merge([BlockStored(block_hashes=(h(0), h(9)))], []) == [
        BlockStored(block_hashes=(h(0), h(9)), tier="device")]
    tier -= {h(0), h(9)}  # the tier's LRU drops them while the device holds them: nothing changes for the index
    assert events.merge([], [h(0), h(9)]) == []
    device -= {h(0)}
    assert events.merge([BlockRemoved(block_hashes=(h(0),))], []) == [BlockRemoved(block_hashes=(h(0),))]
    assert events.announced == {h(9): "device"}
    assert events.merge([AllBlocksCleared()], []) == [AllBlocksCleared()] and events.announced == {}
