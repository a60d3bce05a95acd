"""Prefill and decode workers end to end over real gRPC and each real KV transport, without Ray: outputs equal the
offline engine's token for token, and every exit path (finish, first-token stop, abort, a transfer cut half-way,
no room, bad input) leaves every KV block free."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from engine.request.sampling_params import SamplingParams
from tests.cluster.worker_harness import engine_config, generate, start_worker, stub, wait_blocks_free

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Write a long story about a lighthouse keeper. " * 40,  # ~400 tokens: many blocks in the handoff
]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0)


@pytest.fixture(scope="module")
def prompt_ids(smollm2_checkpoint) -> list[list[int]]:
    tok = smollm2_checkpoint.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Name three colors."}], add_generation_prompt=True)
    return [tok.encode(p) for p in PROMPTS] + [tok.encode(chat) if isinstance(chat, str) else list(chat)]


@pytest.fixture(scope="module")
def offline(smollm2_checkpoint, prompt_ids) -> list[tuple[list[int], str]]:
    """The offline engine's greedy outputs, each prompt alone."""
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(), smollm2_checkpoint)
    outs = []
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"ref{i}", ids, GREEDY)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs.append((out.token_ids, out.finish_reason))
    return outs


@pytest.fixture(scope="module", params=["grpc", "torch", "ipc", "inproc"])
def pair(request, smollm2_checkpoint):
    transport = request.param
    prefill = start_worker("prefill", smollm2_checkpoint, transport=transport, worker_id=f"p-{transport}")
    decode = start_worker("decode", smollm2_checkpoint, transport=transport, worker_id=f"d-{transport}")
    yield prefill, decode
    prefill.stop()
    decode.stop()


def test_disaggregated_matches_offline(pair, prompt_ids, offline) -> None:
    prefill, decode = pair
    d = stub(decode)
    results: dict[int, object] = {}

    def run(i: int) -> None:
        results[i] = generate(d, f"req{i}", prompt_ids[i], GREEDY, prefill.endpoint)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompt_ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, (expected, finish_reason) in enumerate(offline):
        assert results[i].token_ids == expected, f"prompt {i}"
        assert results[i].finish_reason == finish_reason
    first = results[2].messages[0]
    assert first.timings.kv_transfer_bytes > 0 and first.timings.prefill_s > 0
    assert results[2].messages[-1].usage.completion_tokens == len(offline[2][0])
    wait_blocks_free(prefill, decode)


def test_next_turn_moves_only_the_blocks_the_decode_worker_lacks(pair, prompt_ids, smollm2_checkpoint) -> None:
    """A chat's next turn (the last prompt, its answer, a new message) on the decode worker that served the last
    one: the prefill worker sends only the blocks after those the decode worker still caches, and the output is
    still the offline engine's."""
    from engine.llm_engine import LLMEngine

    prefill, decode = pair
    d = stub(decode)
    first = generate(d, "turn1", prompt_ids[2], GREEDY, prefill.endpoint)
    next_turn = prompt_ids[2] + first.token_ids + prompt_ids[0]
    second = generate(d, "turn2", next_turn, GREEDY, prefill.endpoint)

    engine = LLMEngine(engine_config(), smollm2_checkpoint)
    engine.add_request("ref", next_turn, GREEDY)
    expected = None
    while engine.has_unfinished_requests():
        expected = next((out.token_ids for out in engine.step() if out.finished), expected)
    assert second.token_ids == expected
    layout = decode.runtime.layout
    # What the decode worker computed for turn 1 (its last token's KV never is) in whole blocks; at least one
    # token of the new prompt is always left out of a prefix hit.
    held = min((len(prompt_ids[2]) + len(first.token_ids) - 1) // layout.block_size,
               (len(next_turn) - 1) // layout.block_size)
    num_blocks = -(-len(next_turn) // layout.block_size)
    assert held >= 20  # the ~370-token first turn
    assert second.messages[0].timings.kv_transfer_bytes == (num_blocks - held) * layout.block_bytes
    wait_blocks_free(prefill, decode)


def test_colocated_matches_offline(smollm2_checkpoint, prompt_ids, offline) -> None:
    worker = start_worker("colocated", smollm2_checkpoint)
    try:
        for i, ids in enumerate(prompt_ids):
            result = generate(stub(worker), f"c{i}", ids, GREEDY)
            assert (result.token_ids, result.finish_reason) == offline[i]
        wait_blocks_free(worker)
    finally:
        worker.stop()


def test_first_token_that_finishes_moves_no_kv(pair, prompt_ids) -> None:
    prefill, decode = pair
    result = generate(stub(decode), "one", prompt_ids[0], SamplingParams(max_tokens=1, temperature=0.0),
                      prefill.endpoint)
    assert len(result.token_ids) == 1 and result.finish_reason == "length"
    assert result.messages[0].timings.kv_transfer_bytes == 0
    wait_blocks_free(prefill, decode)


def test_a_stop_on_the_first_token_keeps_its_kind_through_both_workers(
    pair, prompt_ids, offline, smollm2_checkpoint
) -> None:
    """The prefill worker ends the request on its first token; what stopped it, a stop token id or a stop string,
    reaches the decode worker's stream as that kind (it travelled as text, token 7 and string "7" alike)."""
    prefill, decode = pair
    first = offline[0][0][0]
    first_text = smollm2_checkpoint.tokenizer.decode([first])
    for request_id, params, kind, value in [
        ("stop-id", SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=[first]), "stop_token_id", first),
        ("stop-str", SamplingParams(max_tokens=4, temperature=0.0, stop=[first_text]), "stop_string", first_text),
    ]:
        result = generate(stub(decode), request_id, prompt_ids[0], params, prefill.endpoint)
        assert (result.token_ids, result.finish_reason) == ([first], "stop"), request_id
        stop_reason = result.messages[-1].stop_reason
        assert stop_reason.WhichOneof("reason") == kind and getattr(stop_reason, kind) == value
        assert result.messages[0].timings.kv_transfer_bytes == 0
    wait_blocks_free(prefill, decode)


def test_cancelled_stream_frees_blocks_on_both_workers(pair, prompt_ids) -> None:
    prefill, decode = pair
    from engine.request.wire import sampling_params_to_proto
    from protos import serving_pb2

    call = stub(decode).Generate(serving_pb2.GenerateRequest(
        request_id="cancel-me", prompt_token_ids=prompt_ids[2],
        params=sampling_params_to_proto(SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)),
        prefill_endpoint=prefill.endpoint))
    next(call)
    next(call)
    call.cancel()
    wait_blocks_free(prefill, decode)


def test_bad_prompt_is_invalid_argument_and_allocates_nothing(pair) -> None:
    prefill, decode = pair
    with pytest.raises(grpc.RpcError) as info:
        generate(stub(decode), "too-long", [1] * 2000, GREEDY, prefill.endpoint)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in info.value.details()
    wait_blocks_free(prefill, decode)


def test_transfer_cut_half_way_fails_cleanly(smollm2_checkpoint, prompt_ids) -> None:
    from kv_transfer.base import TransferFault

    prefill = start_worker("prefill", smollm2_checkpoint, worker_id="p-cut")
    decode = start_worker("decode", smollm2_checkpoint, worker_id="d-cut", timeout_s=5.0)
    try:
        prefill.sender.fault = TransferFault(stop_after_blocks=3)
        start = time.monotonic()
        result = generate(stub(decode), "cut", prompt_ids[2], GREEDY, prefill.endpoint)
        assert result.finish_reason == "error" or result.error, result
        assert time.monotonic() - start < 30
    except grpc.RpcError as exc:  # the decode worker ends the stream with a status naming the failed transfer
        assert exc.code() is grpc.StatusCode.ABORTED and "KV transfer" in exc.details()
    finally:
        prefill.sender.fault = TransferFault()
    try:
        # the pair still works after the failure
        ok = generate(stub(decode), "after-cut", prompt_ids[0], GREEDY, prefill.endpoint)
        assert ok.finish_reason == "length"
        wait_blocks_free(prefill, decode)
        assert stub(prefill).GetLoad(__import__("protos.serving_pb2").serving_pb2.LoadRequest()).num_kv_transfer_failures == 1
    finally:
        prefill.stop()
        decode.stop()


def test_no_room_on_the_decode_worker_is_resource_exhausted(smollm2_checkpoint) -> None:
    prefill = start_worker("prefill", smollm2_checkpoint, worker_id="p-full")
    decode = start_worker("decode", smollm2_checkpoint, worker_id="d-full", timeout_s=1.0, num_kv_blocks=8,
                          max_model_len=128)
    loop = decode.runtime.loop
    try:
        # Another request's reservation holds 7 of the 8 blocks; a 60-token prompt needs 4.
        hog = loop.call(lambda e: e.make_request("hog", list(range(1000, 1100)), GREEDY))
        assert loop.call(lambda e: e.reserve_remote(hog)) is not None
        with pytest.raises(grpc.RpcError) as info:
            generate(stub(decode), "no-room", list(range(2000, 2060)), GREEDY, prefill.endpoint)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        assert "no room in the KV cache" in info.value.details()
        loop.call(lambda e: e.abort_request(["hog"]))
        wait_blocks_free(prefill, decode)
    finally:
        prefill.stop()
        decode.stop()


def test_a_draining_pair_refuses_new_requests_and_finishes_the_one_it_holds(
    smollm2_checkpoint, prompt_ids, offline, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.runtime import FAULT_STEP_SLEEP_ENV
    from protos import serving_pb2

    prefill = start_worker("prefill", smollm2_checkpoint, worker_id="p-drain")
    monkeypatch.setenv(FAULT_STEP_SLEEP_ENV, "0.05")  # decode steps paced: the held stream lasts about a second
    decode = start_worker("decode", smollm2_checkpoint, worker_id="d-drain")
    try:
        held: dict = {}
        stream = threading.Thread(target=lambda: held.update(
            result=generate(stub(decode), "held", prompt_ids[0], GREEDY, prefill.endpoint)))
        stream.start()
        deadline = time.monotonic() + 30
        while not stub(decode).GetLoad(serving_pb2.LoadRequest(), timeout=10).num_requests_running:
            assert time.monotonic() < deadline and stream.is_alive(), "the held request never ran"
            time.sleep(0.01)
        drained: dict = {}
        drains = [threading.Thread(target=lambda w=w: drained.update({w.worker_id: w.drain(30.0)}))
                  for w in (decode, prefill)]
        for thread in drains:
            thread.start()
        while not (decode.runtime.gate.draining and prefill.runtime.gate.draining):
            time.sleep(0.001)
        assert decode.runtime.gate.num_in_flight == 1  # the held stream, still running
        with pytest.raises(grpc.RpcError) as refused:  # a new request: refused at once, retryably
            generate(stub(decode), "new", prompt_ids[1], GREEDY, prefill.endpoint)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
        with pytest.raises(grpc.RpcError) as refused:
            stub(prefill).Prefill(serving_pb2.PrefillRequest(request=serving_pb2.GenerateRequest(
                request_id="new-prefill", prompt_token_ids=prompt_ids[1])), timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
        stream.join(60)
        for thread in drains:
            thread.join(60)
        assert drained == {"d-drain": 0, "p-drain": 0}  # both drained within the timeout
        result = held["result"]
        assert (result.token_ids, result.finish_reason) == offline[0]  # finished, untouched by the drain
        wait_blocks_free(prefill, decode)
    finally:
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculating_decode_worker_matches_offline(smollm2_checkpoint, smollm2_gguf, prompt_ids, offline,
                                                   method: str) -> None:
    """The decode worker speculates on what the prefill worker handed off (prompt lookup; the target as its own
    draft model, which catches up over the received prompt and then has every draft accepted): the same greedy
    tokens, its acceptance counts in GetLoad, every block free afterwards on both sides."""
    spec: dict = {"method": method, "num_speculative_tokens": 4, "policy": "fixed"}
    if method == "draft_model":
        spec["model"] = smollm2_gguf
    prefill = start_worker("prefill", smollm2_checkpoint, worker_id="p-spec")
    decode = start_worker("decode", smollm2_checkpoint, worker_id="d-spec", speculative_config=spec)
    try:
        d = stub(decode)
        for i in (2, 3):  # the long prompt (repetitive: prompt lookup drafts a lot) and the chat one
            result = generate(d, f"spec{i}", prompt_ids[i], GREEDY, prefill.endpoint)
            assert (result.token_ids, result.finish_reason) == offline[i], f"prompt {i}"
        load = d.GetLoad(__import__("protos.serving_pb2").serving_pb2.LoadRequest())
        assert load.spec_decode_num_accepted_tokens > 0
        assert load.spec_decode_num_draft_tokens >= load.spec_decode_num_accepted_tokens
        if method == "draft_model":
            assert load.spec_decode_num_draft_tokens == load.spec_decode_num_accepted_tokens
        assert sum(load.spec_decode_chosen_k) > 0
        wait_blocks_free(prefill, decode)
    finally:
        prefill.stop()
        decode.stop()


CHOICES = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, logit_bias={11: 2.0})


@pytest.fixture(scope="module")
def offline_choices(smollm2_checkpoint, prompt_ids) -> dict[int, list]:
    """The offline engine's n = 4 seeded choices over the long prompt, and its prompt logprobs (index -1)."""
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(), smollm2_checkpoint)
    engine.add_request("ref", prompt_ids[2], CHOICES)
    engine.add_request("lp", prompt_ids[0], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    choices: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "lp" and out.prompt_logprobs is not None:
                choices[-1] = [lp.logprob for lp in out.prompt_logprobs]  # type: ignore[misc]
            elif out.finished and out.request_id != "lp":
                choices[out.index] = out.token_ids
    return choices


def _by_choice(result) -> dict[int, list[int]]:
    choices: dict[int, list[int]] = {}
    for message in result.messages:
        choices.setdefault(message.index, []).extend(message.token_ids)
    return choices


def test_n_choices_fork_on_the_decode_worker_after_the_kv_arrives(pair, prompt_ids, offline_choices) -> None:
    """n = 4 over a handoff: the prompt prefilled once on the prefill worker (choice 0's first token sampled there,
    logit_bias applied), the other choices forked on the decode worker; the offline engine's very choices, usage
    with the prompt once, prompt logprobs from the prefill worker; every block free after a finish, after choice 0
    ending on the prefill worker, and after a cancelled stream."""
    prefill, decode = pair
    d = stub(decode)
    result = generate(d, "n4", prompt_ids[2], CHOICES, prefill.endpoint)
    assert _by_choice(result) == {i: offline_choices[i] for i in range(4)}
    assert sum(1 for m in result.messages if m.finish_reason) == 4 and result.messages[-1].finish_reason
    assert result.messages[-1].usage.prompt_tokens == len(prompt_ids[2])
    assert result.messages[-1].usage.completion_tokens == 4 * 6
    wait_blocks_free(prefill, decode)

    scored = generate(d, "lp", prompt_ids[0], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                      prefill.endpoint)
    got = [lp.logprob for lp in scored.messages[0].prompt_logprobs]
    assert len(got) == len(prompt_ids[0]) - 1
    assert max(abs(a - b) for a, b in zip(got, offline_choices[-1], strict=True)) < 1e-4

    early = generate(d, "early", prompt_ids[0], SamplingParams(n=3, max_tokens=1, temperature=1.0, seed=3),
                     prefill.endpoint)  # choice 0 ends on the prefill worker: the others compute the prompt here
    assert sorted(len(t) for t in _by_choice(early).values()) == [1, 1, 1]
    assert early.messages[-1].usage.completion_tokens == 3
    wait_blocks_free(prefill, decode)

    from engine.request.wire import sampling_params_to_proto
    from protos import serving_pb2

    call = d.Generate(serving_pb2.GenerateRequest(
        request_id="n4-cancel", prompt_token_ids=prompt_ids[2], prefill_endpoint=prefill.endpoint,
        params=sampling_params_to_proto(SamplingParams(n=4, max_tokens=500, temperature=1.0, ignore_eos=True))))
    seen = {next(call).index for _ in range(8)}
    num_prompt_blocks = -(-len(prompt_ids[2]) // decode.runtime.layout.block_size)
    used = d.GetLoad(serving_pb2.LoadRequest()).kv_blocks_used
    assert seen == {0, 1, 2, 3} and used < 2 * num_prompt_blocks  # the prompt's blocks once, not 4 times
    call.cancel()
    wait_blocks_free(prefill, decode)
