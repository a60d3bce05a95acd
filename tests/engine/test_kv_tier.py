"""The disk tier below the device KV cache (`--kv-offload-dir`), engine level over the tiny model.

The workload is a returning chat: a conversation's history is prefilled, other traffic then evicts every one of its
device blocks, and the conversation comes back with one more turn. Without a tier the history is computed again;
with one its blocks are loaded from disk. Greedy tokens must be the same either way, and the same when the tier
fails: a corrupted entry, a write that fails (a full disk), a directory another worker holds or that cannot be
created. Every block goes back to the pool.
"""

from __future__ import annotations

import errno
import random
from pathlib import Path

import pytest
import torch

from engine.core.kv_tier import KVTierError
from kv_transfer.kv_events import BlockRemoved, BlockStored
from tests.engine.tiny_model import BlockRefCounter, assert_no_blocks_held, drain, finals, greedy, make_engine

pytestmark = pytest.mark.usefixtures("torch_single_thread")

BLOCK_SIZE = 4
NUM_BLOCKS = 32  # the history (14 blocks) plus its answer fit; three other prompts of 20 blocks each evict it
HISTORY = random.Random(1).choices(range(3, 600), k=56)
NEXT_TURN = random.Random(2).choices(range(3, 600), k=9)
OTHERS = [random.Random(10 + i).choices(range(3, 600), k=80) for i in range(3)]
MAX_TOKENS = 6
# The first turn's full computed blocks (its last token's KV is never computed): what the returning turn loads.
NUM_COMPUTED_BLOCKS = (len(HISTORY) + MAX_TOKENS - 1) // BLOCK_SIZE
TIER = dict(kv_offload_size_bytes=1 << 20)  # ~500 of the tiny model's 2 KiB blocks: no LRU eviction here
ENTRY_BYTES = 2048 + 52  # a tiny-model block and its header


def _engine(checkpoint, tier_dir: Path | None = None, **overrides):  # noqa: ANN001, ANN202
    tier = {} if tier_dir is None else dict(kv_offload_dir=str(tier_dir), **TIER)
    return make_engine(checkpoint, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, **{**tier, **overrides})


def _run(engine, request_id: str, prompt: list[int]) -> list[int]:  # noqa: ANN001
    engine.add_request(request_id, prompt, greedy(max_tokens=MAX_TOKENS))
    return finals(drain(engine))[request_id].token_ids


def _kv_of_cached(engine, hashes) -> dict[bytes, list]:  # noqa: ANN001
    """The KV (and int8 scales) of each block the device prefix cache holds under one of `hashes`, copied."""
    kv = {}
    for block_hash in hashes:
        block = engine.block_pool.get_cached_block(block_hash)
        if block is not None:
            kv[block_hash] = [t[:, :, block.block_id].clone() for t in (engine.runner.kv_cache, engine.runner.kv_scales)
                              if t is not None]
    return kv


def _returning_chat(engine, after_first=lambda first: None) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """The history's answer, then the returning turn's (history, its answer, the next turn), after other traffic
    evicted the history from the device cache."""
    first = _run(engine, "turn-1", HISTORY)
    after_first(first)
    for i, other in enumerate(OTHERS):
        _run(engine, f"other-{i}", other)
    history_hashes = engine.make_request("probe", HISTORY, greedy()).block_hashes
    assert not any(engine.block_pool.get_cached_block(h) for h in history_hashes), "the history is still cached"
    second = _run(engine, "turn-2", HISTORY + first + NEXT_TURN)
    return first, second


@pytest.fixture
def reference(tiny_checkpoint) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """The returning chat's tokens without a tier (its history recomputed)."""
    engine = _engine(tiny_checkpoint)
    tokens = _returning_chat(engine)
    assert engine.stats().prefix_cache_hits_by_tier == {"device": 0, "peer": 0}
    return tokens


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_returning_turn_loads_the_evicted_history_from_disk(tiny_checkpoint, tmp_path: Path,
                                                           kv_cache_dtype: str) -> None:
    """An int8 cache's blocks travel with their scales."""
    expected = _returning_chat(_engine(tiny_checkpoint, kv_cache_dtype=kv_cache_dtype))
    engine = _engine(tiny_checkpoint, tmp_path, kv_cache_dtype=kv_cache_dtype)
    counter = BlockRefCounter(engine)
    computed = {}

    def remember_history_kv(first: list[int]) -> None:
        computed.update(_kv_of_cached(engine, engine.make_request("p", HISTORY + first, greedy()).block_hashes))

    assert _returning_chat(engine, remember_history_kv) == expected

    assert len(computed) == NUM_COMPUTED_BLOCKS
    loaded = _kv_of_cached(engine, computed)
    assert loaded.keys() == computed.keys()
    for block_hash, tensors in computed.items():  # bit for bit, the values and an int8 cache's scales
        assert all(torch.equal(a, b) for a, b in zip(tensors, loaded[block_hash], strict=True))

    stats = engine.stats()
    assert stats.prefix_cache_hits_by_tier == {"device": 0, "peer": 0, "disk": NUM_COMPUTED_BLOCKS * BLOCK_SIZE}
    assert stats.kv_offload is not None and stats.kv_offload.num_loaded == NUM_COMPUTED_BLOCKS
    assert_no_blocks_held(engine)
    counter.assert_balanced()
    engine.close()


def test_draft_model_speculation_catches_up_over_a_loaded_history(tiny_checkpoint, tmp_path: Path,  # noqa: ANN001
                                                                    reference) -> None:
    """A tier brings back the target's KV only, as a prefix-cache hit does: the draft model catches up over the
    loaded tokens in its first forward, and the answer is the one without tier or speculation."""
    spec = {"method": "draft_model", "model": str(tiny_checkpoint.path), "num_speculative_tokens": 3,
            "policy": "fixed"}
    engine = _engine(tiny_checkpoint, tmp_path, speculative_config=spec)
    counter = BlockRefCounter(engine)
    assert _returning_chat(engine) == reference
    stats = engine.stats()
    assert stats.prefix_cache_hits_by_tier["disk"] == NUM_COMPUTED_BLOCKS * BLOCK_SIZE
    # The draft is the target itself: a draft that caught up over the loaded history proposes the target's greedy
    # tokens, so (nearly) all are accepted; one that read garbage KV for it would propose noise.
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens >= 0.9 * stats.spec_decode_num_draft_tokens
    assert_no_blocks_held(engine)
    counter.assert_balanced()
    engine.close()


def test_corrupted_entries_are_recomputed(tiny_checkpoint, tmp_path: Path, reference) -> None:
    engine = _engine(tiny_checkpoint, tmp_path)
    first = _run(engine, "turn-1", HISTORY)
    for i, other in enumerate(OTHERS):
        _run(engine, f"other-{i}", other)
    assert engine.kv_tier is not None and engine.kv_tier.tier.flush(10)
    files = sorted(tmp_path.rglob("*.kv"))
    assert files
    for path in files:  # one payload byte flipped in every entry: each fails its CRC-32C
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x5A
        path.write_bytes(bytes(data))

    second = _run(engine, "turn-2", HISTORY + first + NEXT_TURN)

    assert (first, second) == reference
    stats = engine.stats()
    assert stats.prefix_cache_hits_by_tier["disk"] == 0
    assert stats.kv_offload is not None and stats.kv_offload.num_corrupt == 1  # the first failure ends the run
    assert_no_blocks_held(engine)
    engine.close()


def test_a_failed_write_drops_the_block_and_the_answer_stays(tiny_checkpoint, tmp_path: Path, reference) -> None:
    engine = _engine(tiny_checkpoint, tmp_path)
    assert engine.kv_tier is not None

    def disk_full(path: Path, data: bytes) -> None:  # the fault hook: every write fails as on a full disk
        path.write_bytes(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    engine.kv_tier.tier._store._write_file = disk_full  # type: ignore[attr-defined]

    assert _returning_chat(engine) == reference

    engine.kv_tier.tier.flush(10)
    stats = engine.stats()
    assert stats.kv_offload is not None and stats.kv_offload.num_write_failures > 0
    assert stats.kv_offload.num_written == 0 and stats.kv_offload.num_blocks == 0
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("*.kv"))  # no half entry left
    assert_no_blocks_held(engine)
    engine.close()


def test_restart_on_the_same_dir_finds_and_announces_its_blocks(tiny_checkpoint, tmp_path: Path, reference) -> None:
    first_engine = _engine(tiny_checkpoint, tmp_path)
    first = _run(first_engine, "turn-1", HISTORY)
    assert first == reference[0]
    first_engine.close()  # writes its device prefix cache down: the history among it

    engine = _engine(tiny_checkpoint, tmp_path)  # a new incarnation
    history_hashes = engine.make_request("probe", HISTORY, greedy()).block_hashes
    assert set(history_hashes) <= set(engine.cached_block_hashes())  # the publisher's first snapshot lists them
    assert set(history_hashes) <= set(engine.cached_blocks()["disk"])  # under the tier they are on
    events = []
    engine.kv_event_sink = events.extend

    second = _run(engine, "turn-2", HISTORY + first + NEXT_TURN)

    assert second == reference[1]
    assert engine.stats().prefix_cache_hits_by_tier["disk"] == NUM_COMPUTED_BLOCKS * BLOCK_SIZE
    stored = [(h, e.tier) for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    loaded = [(h, tier) for h, tier in stored if h in set(history_hashes)]
    # Loaded from the tier: announced once more, as moved onto the device (held all along).
    assert sorted(loaded) == sorted((h, "device") for h in history_hashes[:NUM_COMPUTED_BLOCKS])
    assert not any(isinstance(e, BlockRemoved) and set(e.block_hashes) & set(history_hashes) for e in events)
    assert_no_blocks_held(engine)
    engine.close()


def test_another_namespace_on_the_same_dir_is_ignored(tiny_checkpoint, tmp_path: Path) -> None:
    first_engine = _engine(tiny_checkpoint, tmp_path)
    _run(first_engine, "turn-1", HISTORY)
    first_engine.close()
    files = sorted(tmp_path.rglob("*.kv"))
    assert files

    other = _engine(tiny_checkpoint, tmp_path, model_id="another-model")
    assert other.kv_tier is not None and len(other.kv_tier.tier) == 0
    _run(other, "turn-1", HISTORY)
    assert other.stats().prefix_cache_hits_by_tier["disk"] == 0
    other.close()
    assert set(files) <= set(tmp_path.rglob("*.kv"))  # the first namespace's entries untouched


def test_a_prompt_whose_kv_arrives_from_a_prefill_worker_loads_its_tiered_head_first(tiny_checkpoint,
                                                                                    tmp_path: Path) -> None:
    """A decode worker reserving blocks for a prompt (`reserve_remote`) loads the blocks its tier holds after its
    device hits into the reserved ones: they count as held, and the prefill worker sends only the rest."""
    engine = _engine(tiny_checkpoint, tmp_path)
    first = _run(engine, "turn-1", HISTORY)
    hashes = engine.make_request("p", HISTORY + first, greedy()).block_hashes
    computed = _kv_of_cached(engine, hashes)
    assert len(computed) == NUM_COMPUTED_BLOCKS
    for i, other in enumerate(OTHERS):  # evicts the history into the tier
        _run(engine, f"other-{i}", other)
    assert not any(engine.block_pool.get_cached_block(h) for h in computed)
    request = engine.make_request("remote", HISTORY + first + NEXT_TURN, greedy())
    reserved = engine.reserve_remote(request)
    assert reserved is not None and reserved.num_held_blocks == NUM_COMPUTED_BLOCKS
    for block_id, block_hash in zip(reserved.block_ids, hashes[:NUM_COMPUTED_BLOCKS], strict=False):
        assert torch.equal(engine.runner.kv_cache[:, :, block_id], computed[block_hash][0])
    assert engine.stats().prefix_cache_hits_by_tier["disk"] == NUM_COMPUTED_BLOCKS * BLOCK_SIZE
    engine.abort_request(["remote"])  # the handoff failed, say: every block back, the loaded ones stay cached
    assert_no_blocks_held(engine)
    assert all(engine.block_pool.get_cached_block(h) for h in computed)
    engine.close()


def test_evicting_into_the_tier_keeps_blocks_announced(tiny_checkpoint, tmp_path: Path) -> None:
    engine = _engine(tiny_checkpoint, tmp_path, kv_offload_size_bytes=20 * ENTRY_BYTES)
    events = []
    engine.kv_event_sink = events.extend
    _run(engine, "turn-1", HISTORY)
    history_hashes = set(engine.make_request("probe", HISTORY, greedy()).block_hashes)
    _run(engine, "other-0", OTHERS[0])  # evicts some of the history into the tier
    assert engine.kv_tier.tier.flush(60)
    engine.publish_kv_events()
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert not removed & history_hashes, "a block written to the tier was announced as gone"
    on_disk = {h for e in events if isinstance(e, BlockStored) and e.tier == "disk" for h in e.block_hashes}
    evicted = history_hashes - set(engine.block_pool.cached_block_hashes())
    assert evicted and evicted <= on_disk, "a block evicted into the tier was not announced under it"

    for i, other in enumerate(OTHERS[1:]):  # the tier's LRU then drops the history: now it is gone
        _run(engine, f"other-{i + 1}", other)
    assert engine.kv_tier.tier.flush(60)
    engine.publish_kv_events()
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    # every history block held nowhere any more (neither device nor tier) was announced gone, and the LRU did drop
    # history (which of its blocks are dropped last depends on the device cache's eviction order)
    gone = history_hashes - set(engine.cached_block_hashes())
    assert gone and gone <= removed
    assert set(engine.cached_block_hashes()) == {
        h for h in engine.kv_tier.tier.hashes()} | set(engine.block_pool.cached_block_hashes())
    engine.close()


def test_unusable_dir_is_a_start_up_error(tiny_checkpoint, tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(KVTierError, match="--kv-offload-dir .*cannot use it"):
        _engine(tiny_checkpoint, not_a_dir / "tier")


def test_two_live_workers_on_one_dir_keep_their_own_entries(tiny_checkpoint, tmp_path: Path, reference) -> None:
    """`serve` gives its workers on one machine the same flags: each takes a slot of the directory."""
    engine = _engine(tiny_checkpoint, tmp_path)
    _run(engine, "turn-1", HISTORY)
    other = _engine(tiny_checkpoint, tmp_path)
    assert other.kv_tier is not None and engine.kv_tier is not None
    engine.close()
    assert len(other.kv_tier.tier) == 0  # the first one's blocks are in its own slot
    other.close()
    again = _engine(tiny_checkpoint, tmp_path)  # restarted: the first free slot, the first worker's
    assert len(again.kv_tier.tier) == NUM_COMPUTED_BLOCKS
    assert _run(again, "turn-2", HISTORY + reference[0] + NEXT_TURN) == reference[1]
    again.close()


def test_host_memory_tier_is_refused_on_cpu(tiny_checkpoint) -> None:
    with pytest.raises(ValueError, match="--kv-offload-memory .*on cpu the KV cache is already in host memory"):
        make_engine(tiny_checkpoint, device="cpu", kv_offload_memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="--kv-offload-memory .*on cpu"):  # auto resolves to cpu here
        make_engine(tiny_checkpoint, kv_offload_memory_bytes=1 << 20)


def test_offload_flags() -> None:
    import argparse

    from engine.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--kv-offload-dir", "/tmp/kv", "--kv-offload-size", "20GiB",
                                                        "--kv-offload-memory", "512MiB"]))
    assert (config.kv_offload_dir, config.kv_offload_size_bytes, config.kv_offload_memory_bytes) == (
        "/tmp/kv", 20 << 30, 512 << 20)
    assert engine_config_from_args(parser.parse_args([])).kv_offload_dir is None
    with pytest.raises(ValueError, match="--kv-offload-dir and --kv-offload-size go together"):
        engine_config_from_args(parser.parse_args(["--kv-offload-dir", "/tmp/kv"]))


@pytest.mark.slow
def test_smollm2_returning_turn_from_disk_matches_recompute(smollm2_checkpoint, tmp_path: Path) -> None:
    """The real model: a 320-token history evicted by two other prompts, then its next turn, with the tier and
    without; the same greedy tokens, the history's blocks loaded (not computed) with it."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    rng = random.Random(3)
    history, others = rng.choices(range(100, 40_000), k=320), [rng.choices(range(100, 40_000), k=400) for _ in "ab"]
    answers = {}
    for tier in (False, True):
        config = EngineConfig(dtype="float32", block_size=16, num_kv_blocks=40, max_model_len=640,
                              **(dict(kv_offload_dir=str(tmp_path), kv_offload_size_bytes=1 << 30) if tier else {}))
        engine = LLMEngine(config, smollm2_checkpoint)
        first = _run(engine, "turn-1", history)
        for i, other in enumerate(others):
            _run(engine, f"other-{i}", other)
        second = _run(engine, "turn-2", history + first + [28, 198])
        answers[tier] = (first, second)
        hits = engine.stats().prefix_cache_hits_by_tier
        assert hits.get("disk", 0) == (320 // 16 * 16 if tier else 0) and hits["device"] == 0
        assert_no_blocks_held(engine)
        engine.close()
    assert answers[True] == answers[False]


def test_generate_keeps_its_prefix_cache_on_disk_between_runs(capsys, tiny_model_dir: Path, tmp_path: Path) -> None:
    from deploy.cli import main
    from tests.engine.test_cli import TINY_FLAGS

    argv = ["generate", "--model", str(tiny_model_dir), *TINY_FLAGS, "--kv-offload-dir", str(tmp_path),
            "--kv-offload-size", "1MiB", "--temperature", "0", "--max-tokens", "8", "--json",
            "--prompt", "The quick brown fox jumps over the lazy dog."]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert list(tmp_path.rglob("*.kv")), "the run's prefix cache was not written down at exit"
    assert main(argv) == 0
    assert capsys.readouterr().out == first


@pytest.mark.parametrize(("flags", "fragment"), [
    (["--kv-offload-memory", "1GiB"], "--kv-offload-memory is a host-memory tier under a GPU's KV cache"),
    (["--kv-offload-dir", "/proc/no-such-dir", "--kv-offload-size", "1GiB"], "--kv-offload-dir /proc/no-such-dir"),
    (["--kv-offload-size", "1GiB"], "--kv-offload-dir and --kv-offload-size go together"),
])
def test_a_tier_that_cannot_start_is_one_error_line(capsys, tiny_model_dir: Path, flags, fragment: str) -> None:
    from deploy.cli import main
    from tests.engine.test_cli import TINY_FLAGS, _assert_one_line_error

    rc = main(["generate", "--model", str(tiny_model_dir), *TINY_FLAGS, "--device", "cpu", *flags, "--prompt", "hi"])
    _assert_one_line_error(capsys, rc, fragment)
