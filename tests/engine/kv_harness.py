"""What the engine tests of a KV handoff and of a cache's accuracy share: an engine's greedy tokens with the logits
each came from, the agreement of two such runs, and one prompt handed from a prefill engine to a decode engine
through the workers' own source and reservation over a real transport."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kv_transfer.reservation import ReservationSink, Reservation
from engine import SamplingParams
from kv_transfer.base import TransferFault
from kv_transfer.layout import KVHandoff
from prefill_worker.worker import HeldBlocks
from tests.engine.tiny_model import PROMPTS


def steps_until_finished(engine, request_id: str, max_steps: int = 1000) -> list[int]:
    for _ in range(max_steps):
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out.token_ids
    raise AssertionError(f"{request_id} unfinished after {max_steps} steps")


def greedy_with_logits(engine, num_tokens: int) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Per prompt (one at a time, through the engine's step loop): its greedy tokens and the logits each was
    chosen from."""
    model = engine.runner.model
    compute_logits = model.compute_logits
    recorded: list[torch.Tensor] = []

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        recorded.append(logits[0].clone())
        return logits

    model.compute_logits = recording
    results = []
    for i, prompt in enumerate(PROMPTS):
        recorded.clear()
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True))
        finished = []
        while engine.has_unfinished_requests():
            finished += [out for out in engine.step() if out.finished]
        results.append((finished[0].token_ids, list(recorded)))
    return results


def prompt_logits(engine, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced: the logits the engine computes at each position of `text` but the last, [P - 1, vocab], and
    the token each position predicts, [P - 1]. The prompt runs through the engine's own step loop, chunked as its
    `max_num_batched_tokens` cuts it, so a chunk after the first reads its context from the KV cache (quantized, in
    a quantized cache), not from the fresh K/V of its own step. No token is chosen, so no tie between two
    logits can change what is measured."""
    model = engine.runner.model
    compute_logits = model.compute_logits
    recorded: list[torch.Tensor] = []

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        recorded.append(logits.clone())
        return logits

    model.compute_logits = recording
    try:
        request = engine.make_request("teacher-forced", text, SamplingParams(max_tokens=1, prompt_logprobs=0))
        engine.enqueue(request)
        steps_until_finished(engine, "teacher-forced")
    finally:
        model.compute_logits = compute_logits
    # In step order: each chunk's prompt positions (prompt logprobs), then the last position's row (the sample).
    logits = torch.cat(recorded)[:-1]  # [P - 1, vocab]
    assert logits.shape[0] == request.num_prompt_tokens - 1
    return logits, torch.tensor(request.prompt_token_ids[1:])


def agreement(reference: list, quantized: list) -> tuple[list[int], float]:
    """(per prompt, the tokens its outputs agree on before they first differ; the largest |logit difference| at
    those positions and the first differing one, where both still saw the same context)."""
    num_agreeing, max_diff = [], 0.0
    for (ref_tokens, ref_logits), (q_tokens, q_logits) in zip(reference, quantized, strict=True):
        agreeing = 0
        for i in range(min(len(ref_tokens), len(q_tokens))):
            max_diff = max(max_diff, (ref_logits[i] - q_logits[i]).abs().max().item())
            if ref_tokens[i] != q_tokens[i]:
                break
            agreeing += 1
        num_agreeing.append(agreeing)
    return num_agreeing, max_diff


def hand_off_prompt(prefill, decode, sender, sink: ReservationSink, endpoint: str, request_id: str, prompt: str,
                    params: SamplingParams, *, corrupt_last_byte: bool = False) -> tuple[Reservation, int]:
    """Prefill `prompt` on `prefill` (held for a remote decode), reserve its blocks on `decode`, send them with
    `sender` to the receiver at `endpoint` (which writes into `sink`), release the prefill's hold. Returns the
    reservation and the first token. `corrupt_last_byte`: the last block's last byte arrives flipped (an int8
    block's: a scale's), so the checksum fails."""
    layout = prefill.kv_blocks.layout  # the sender's (its tensor-parallel size may differ from the decode's)
    prefill.enqueue(prefill.make_request(request_id, prompt, params, remote_decode=True))
    first = steps_until_finished(prefill, request_id)
    request = decode.make_request(request_id, prompt, params)
    reserved = decode.reserve_remote(request)
    assert reserved is not None
    blocks = decode.kv_blocks
    reservation = Reservation(request_id, request.num_prompt_tokens, reserved.block_ids, blocks.kv_cache,
                              blocks.layout, first_block=reserved.num_held_blocks, kv_scales=blocks.kv_scales,
                              ranks=blocks.ranks)
    sink.add(reservation)
    handoff = KVHandoff(request_id=request_id, transfer_id=uuid.uuid4().hex, num_tokens=request.num_prompt_tokens,
                        layout=layout, first_block=reserved.num_held_blocks,
                        receiver_tensor_parallel_size=blocks.layout.tensor_parallel_size)
    source = HeldBlocks(prefill.kv_blocks.kv_cache, prefill.held_block_ids(request_id), layout,
                        prefill.kv_blocks.kv_scales, ranks=prefill.kv_blocks.ranks, plan=handoff.wire)
    fault = TransferFault(corrupt_block=handoff.wire_indices[-1] if corrupt_last_byte else None, corrupt_byte=-1)
    sender.fault = fault  # type: ignore[attr-defined]
    try:
        result = sender.send(handoff, source, endpoint=endpoint, timeout_s=30)
        assert result.num_bytes == len(handoff.wire_indices) * handoff.wire_layout.block_bytes
    finally:
        prefill.release_held(request_id)
        sink.remove(request_id)
    return reservation, first[0]


@contextmanager
def transfer_link(transport: str, sink: ReservationSink, device: torch.device) -> Iterator[tuple[object, str]]:
    """A receiver of `transport` writing into `sink`, served on a loopback gRPC server, and a sender to it:
    yields (sender, endpoint); closes both and stops the server after."""
    from kv_transfer.registry import make_sender
    from tests.kv_transfer.transfer_peer import serve_receiver

    server, endpoint, receiver = serve_receiver(transport, sink)
    sender = make_sender(transport, worker_id="prefill-0", device=device)
    try:
        yield sender, endpoint
    finally:
        sender.close()
        receiver.close()
        server.stop(grace=None)
