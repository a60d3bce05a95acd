"""Peer fetch between real workers in this process (real gRPC servers and transports, the real SmolLM2): a prefill
worker, a decode worker prefilling locally and a colocated worker each fetch a prompt's cached head from the worker
that holds it instead of computing it, and answer with the very tokens of the holder; a fetch refused (the blocks
gone), one from a dead holder, one whose block fails its CRC-32C and one that times out each end in a recompute with
the same tokens. After each, every worker's KV blocks are back in its pool (the holder's pins included)."""

from __future__ import annotations

import random
import socket
import time

import pytest

from engine.request.sampling_params import SamplingParams
from kv_transfer.base import TransferFault
from protos import serving_pb2
from tests.cluster.worker_harness import StreamResult, slowed_forward, start_worker, stub, wait_blocks_free

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
ENGINE = dict(num_kv_blocks=48, max_model_len=512, block_size=16)
RNG = random.Random(35)
PROMPT = RNG.choices(range(100, 40_000), k=170)  # 10 full blocks and 10 tokens
OTHER = RNG.choices(range(100, 40_000), k=100)
BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2: 30 layers, K and V, 16 tokens, 3 KV heads of 64, float32


def generate(worker, request_id: str, prompt: list[int], *, prefill_endpoint: str = "",
             peer=None) -> StreamResult:
    from engine.request.wire import sampling_params_to_proto

    request = serving_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                          params=sampling_params_to_proto(GREEDY), prefill_endpoint=prefill_endpoint)
    if peer is not None:
        endpoint, num_blocks = peer
        request.peer_fetch.CopyFrom(serving_pb2.PeerFetch(endpoint=endpoint, worker_id="holder",
                                                          num_blocks=num_blocks))
    result = StreamResult()
    for msg in stub(worker).Generate(request, timeout=120):
        result.messages.append(msg)
        result.token_ids.extend(msg.token_ids)
        if msg.finish_reason:
            result.finish_reason, result.error = msg.finish_reason, msg.error
    return result


def load(worker) -> serving_pb2.LoadStats:
    return stub(worker).GetLoad(serving_pb2.LoadRequest(), timeout=10)


@pytest.fixture(scope="module")
def cluster(smollm2_checkpoint):
    """A colocated holder that has served PROMPT (its 10 full blocks cached), a prefill + decode pair and a
    colocated worker that have not; the holder's answer."""
    started = []
    try:
        for role, worker_id in (("colocated", "holder"), ("prefill", "p0"), ("decode", "d0"), ("colocated", "c0")):
            started.append(start_worker(role, smollm2_checkpoint, worker_id=worker_id, timeout_s=3.0, **ENGINE))
        holder = started[0]
        expected = generate(holder, "warm", PROMPT).token_ids
        yield (*started, expected)
    finally:
        for worker in started:
            worker.stop()


def _reset_caches(*workers) -> None:
    """Drop the fetchers' prefix caches so that each test fetches afresh."""
    for worker in workers:
        wait_blocks_free(worker)
        assert worker.runtime.loop.call(lambda e: e.block_pool.reset_prefix_cache())


def test_a_prefill_worker_fetches_the_cached_head_instead_of_computing_it(cluster) -> None:
    holder, prefill, decode, colocated, expected = cluster
    _reset_caches(prefill, decode)
    before = load(prefill)
    result = generate(decode, "disagg", PROMPT, prefill_endpoint=prefill.endpoint, peer=(holder.endpoint, 10))
    assert result.token_ids == expected and result.finish_reason == "length"
    timings = result.messages[0].timings
    assert timings.peer_fetch_bytes == 10 * BLOCK_BYTES and timings.peer_fetch_s > 0
    after = load(prefill)
    assert after.kv_peer_fetch_blocks - before.kv_peer_fetch_blocks == 10
    assert after.prefix_cache_hits_by_tier["peer"] - before.prefix_cache_hits_by_tier["peer"] == 160
    assert after.kv_block_bytes == BLOCK_BYTES
    assert not prefill.runtime.engine.peer_blocks  # unstaged once the request ended
    wait_blocks_free(holder, prefill, decode)


def _hashes(worker, prompt: list[int]) -> list[bytes]:
    return worker.runtime.engine.make_request("probe", prompt, GREEDY).block_hashes


@pytest.mark.parametrize(("role", "holder_role"), [("colocated", "colocated"), ("decode", "colocated"),
                                                   ("colocated", "prefill"), ("colocated", "decode")])
def test_a_worker_prefilling_locally_fetches_for_its_own_prefill(cluster, role, holder_role) -> None:
    """A colocated worker, and a decode worker prefilling a prompt itself (the gateway's local prefill: no
    prefill endpoint in the request), from a holder of each role."""
    colocated_holder, prefill, decode, colocated, expected = cluster
    worker = colocated if role == "colocated" else decode
    holder = {"colocated": colocated_holder, "prefill": prefill, "decode": decode}[holder_role]
    if holder.runtime.loop.call(lambda e: e.num_leading_blocks_held(_hashes(holder, PROMPT)[:10])) < 10:
        # Make it hold the prompt: a prefill worker runs it for the decode worker, which receives its blocks.
        assert generate(decode, f"hold-{holder_role}", PROMPT, prefill_endpoint=prefill.endpoint).token_ids == expected
    _reset_caches(worker)
    before = load(worker).prefix_cache_hits_by_tier["peer"]
    result = generate(worker, f"local-{role}-{holder_role}", PROMPT, peer=(holder.endpoint, 10))
    assert result.token_ids == expected
    assert result.messages[0].timings.peer_fetch_bytes == 10 * BLOCK_BYTES
    assert load(worker).prefix_cache_hits_by_tier["peer"] - before == 160
    # Its own cache now holds the head: a second request fetches nothing more.
    again = generate(worker, f"local-{role}-{holder_role}-again", PROMPT, peer=(holder.endpoint, 10))
    assert again.token_ids == expected and again.messages[0].timings.peer_fetch_bytes == 0
    wait_blocks_free(holder, worker)


def _failures(worker) -> dict[str, int]:
    return dict(load(worker).kv_peer_fetch_failures)


def test_failed_fetches_end_in_a_recompute_with_the_same_tokens(cluster) -> None:
    holder, prefill, decode, colocated, expected = cluster
    # The holder does not hold this prompt (the index was wrong, or it evicted it): refused, nothing pinned.
    _reset_caches(prefill)
    other_expected = generate(colocated, "other-ref", OTHER).token_ids
    _reset_caches(colocated)
    gone = generate(decode, "gone", OTHER, prefill_endpoint=prefill.endpoint, peer=(holder.endpoint, 6))
    assert gone.token_ids == other_expected and _failures(prefill).get("gone") == 1

    # A holder that is not there.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    _reset_caches(prefill)
    assert generate(decode, "dead", PROMPT, prefill_endpoint=prefill.endpoint,
                    peer=(dead, 10)).token_ids == expected
    assert _failures(prefill).get("unavailable") == 1

    # A block corrupted on the wire: the receiver's CRC-32C check fails the fetch; nothing of it is served.
    sender = holder.runtime.sender()
    sender.fault = TransferFault(corrupt_block=3)  # type: ignore[attr-defined]
    try:
        _reset_caches(prefill)
        assert generate(decode, "corrupt", PROMPT, prefill_endpoint=prefill.endpoint,
                        peer=(holder.endpoint, 10)).token_ids == expected
    finally:
        sender.fault = TransferFault()  # type: ignore[attr-defined]  # none: what a sender starts with
    assert sum(_failures(prefill).values()) == 3
    assert load(prefill).prefix_cache_hits_by_tier["peer"] == 160  # only the first test's fetch served
    wait_blocks_free(holder, prefill, decode, colocated)


def test_a_fetch_that_stalls_times_out_and_the_holder_unpins(cluster, monkeypatch) -> None:
    import threading

    holder, prefill, decode, _, expected = cluster
    sender = holder.runtime.sender()
    send = sender.send
    go_on = threading.Event()

    def slow_send(*args, **kwargs):
        go_on.wait(60)  # past the fetcher's 3 s timeout, the blocks pinned meanwhile
        return send(*args, **kwargs)

    monkeypatch.setattr(sender, "send", slow_send)
    _reset_caches(prefill)
    began = time.monotonic()
    result = generate(decode, "stall", PROMPT, prefill_endpoint=prefill.endpoint, peer=(holder.endpoint, 10))
    assert result.token_ids == expected
    assert time.monotonic() - began < 60  # the fetch gave up at its timeout; no wait for the holder
    assert _failures(prefill).get("timeout") == 1
    assert load(holder).kv_blocks_used == 10  # pinned while its send still runs
    go_on.set()
    # and unpinned when it ends (it fails: the fetch was cancelled)
    wait_blocks_free(holder, prefill, decode, timeout_s=30)


def test_a_fetch_from_a_busy_holder_does_not_wait_for_its_step(cluster) -> None:
    """The holder is computing a long step (its forward slowed to STEP_S, as a long prefill would take): its pin
    of the cached blocks takes the engine's lock while the forward runs, and the fetch ends long before the step
    does. Pinned between steps instead, it waited for the step to end."""
    import threading

    holder, _, _, colocated, expected = cluster
    step_s = 3.0
    busy = threading.Thread(target=lambda: generate(holder, "busy", OTHER))
    try:
        with slowed_forward(holder, step_s) as computing:
            busy.start()
            assert computing.wait(60)
            _reset_caches(colocated)
            began = time.monotonic()
            result = generate(colocated, "from-busy", PROMPT, peer=(holder.endpoint, 10))
            took = time.monotonic() - began
    finally:
        if busy.ident is not None:  # started
            busy.join(60)
    assert result.token_ids == expected
    fetched = result.messages[0].timings
    assert fetched.peer_fetch_bytes == 10 * BLOCK_BYTES
    assert fetched.peer_fetch_s < step_s / 2 and took < step_s, (fetched.peer_fetch_s, took)
    wait_blocks_free(holder, colocated)


def test_a_holder_killed_mid_fetch_ends_in_a_recompute(cluster, smollm2_gguf, tmp_path) -> None:
    """A holder in a process of its own stalls half-way through its send (a fault file), and is SIGKILLed there:
    the fetcher's call fails at once, it computes the prompt itself, and nothing leaks on the fetching side."""
    import sys
    import threading

    from tests.deploy.processes import WORKER_READY, ServeProcess
    from worker.peer_fetch import FAULT_STALL_ENV

    _, prefill, decode, _, expected = cluster
    stall = tmp_path / "stall"
    argv = [sys.executable, "-m", "decode_worker", "--role", "colocated", "--model", smollm2_gguf,
            "--num-kv-blocks", "48", "--max-model-len", "512", "--block-size", "16", "--num-threads", "1"]
    holder = ServeProcess(argv, stderr_path=tmp_path / "holder.stderr", ready=WORKER_READY,
                          env={FAULT_STALL_ENV: str(stall)})
    try:
        endpoint = holder.wait_ready(300)
        remote = type("Remote", (), {"endpoint": endpoint})()  # what `stub` needs of a worker
        assert generate(remote, "warm-remote", PROMPT).token_ids == expected
        _reset_caches(prefill)
        failures_before = sum(_failures(prefill).values())
        stall.touch()
        result: list[StreamResult] = []
        fetching = threading.Thread(target=lambda: result.append(generate(
            decode, "holder-killed", PROMPT, prefill_endpoint=prefill.endpoint, peer=(endpoint, 10))))
        fetching.start()
        deadline = time.monotonic() + 60
        while "stalled" not in stall.read_text():
            assert time.monotonic() < deadline, holder.output()
            time.sleep(0.05)
        holder.close()  # SIGKILL, mid-send
        fetching.join(60)
        assert result and result[0].token_ids == expected
        assert sum(_failures(prefill).values()) == failures_before + 1
        assert load(prefill).prefix_cache_hits_by_tier["peer"] == 160  # still only the first test's fetch
        wait_blocks_free(prefill, decode)
    finally:
        holder.close()


def test_a_worker_at_tp3_fetches_whole_blocks_into_every_rank_and_holds_for_others(cluster,
                                                                                    smollm2_checkpoint) -> None:
    """A colocated worker at TP 3 (each rank one of SmolLM2's 3 KV heads) stages the holder's whole blocks and loads
    each rank's head into that rank's cache: the holder's tokens. Then it holds the prompt for a TP 1 worker, its
    wire plan cutting each block for a receiver of size 1: the same tokens again."""
    holder, prefill, decode, colocated, expected = cluster
    wide = start_worker("colocated", smollm2_checkpoint, worker_id="c3", timeout_s=3.0, tensor_parallel_size=3,
                        **ENGINE)
    try:
        result = generate(wide, "tp3-fetch", PROMPT, peer=(holder.endpoint, 10))
        assert result.token_ids == expected and result.finish_reason == "length"
        assert result.messages[0].timings.peer_fetch_bytes == 10 * BLOCK_BYTES
        stats = load(wide)
        assert stats.prefix_cache_hits_by_tier["peer"] == 160 and not dict(stats.kv_peer_fetch_failures)
        assert not wide.runtime.engine.peer_blocks  # unstaged once the request ended
        _reset_caches(colocated)
        again = generate(colocated, "from-tp3", PROMPT, peer=(wide.endpoint, 10))
        assert again.token_ids == expected and again.messages[0].timings.peer_fetch_bytes == 10 * BLOCK_BYTES
        wait_blocks_free(holder, wide, colocated)
    finally:
        wide.stop()
