"""Pools of different `--quantization` (README, `--quantization`: only the KV dtype must match): a prefill worker
running SmolLM2's GGUF blocks (`gguf`) hands its prompt KV to a decode worker running float32 weights (`none`),
over real gRPC and a real KV handoff.

The request is served; its first token is the one the prefill pool's weights choose (the gguf engine's colocated
first token), and the tokens after it come from the decode pool's weights reading the gguf-computed prompt KV: the
same as a `none` engine continuing from that KV, computed here by handing the same blocks to an offline `none`
engine. Every block of both workers comes back.
"""

from __future__ import annotations

import pytest

from engine.request.sampling_params import SamplingParams
from tests.cluster.worker_harness import generate, start_worker, stub, wait_blocks_free

pytestmark = [pytest.mark.slow]

ENGINE = dict(num_kv_blocks=48, max_model_len=512, num_threads=1)
PROMPT = "The three primary colours of light are red, green and"
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf_checkpoint(smollm2_gguf: str):  # noqa: ANN201
    from engine.loader.checkpoint import load_checkpoint

    return load_checkpoint(smollm2_gguf, quantization="gguf")


def test_a_gguf_prefill_pool_feeds_a_float_decode_pool(smollm2_checkpoint, gguf_checkpoint) -> None:
    import torch

    from kv_transfer.reservation import ReservationSink
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from tests.engine.kv_harness import hand_off_prompt, steps_until_finished, transfer_link

    prompt_ids = smollm2_checkpoint.tokenizer.encode(PROMPT)
    # What the mixed pair must give: a gguf engine prefills, a `none` engine decodes from that very KV.
    offline_prefill = LLMEngine(EngineConfig(quantization="gguf", **ENGINE), gguf_checkpoint)
    offline_decode = LLMEngine(EngineConfig(**ENGINE), smollm2_checkpoint)
    sink = ReservationSink(offline_decode.kv_blocks.layout, torch.device("cpu"))
    with transfer_link("grpc", sink, torch.device("cpu")) as (sender, endpoint):
        _, first = hand_off_prompt(offline_prefill, offline_decode, sender, sink, endpoint, "ref", prompt_ids, PARAMS)
    offline_decode.commit_remote("ref", first, None)
    expected = steps_until_finished(offline_decode, "ref")
    offline_prefill.add_request("gguf", prompt_ids, PARAMS)
    gguf_alone = steps_until_finished(offline_prefill, "gguf")
    assert expected[0] == gguf_alone[0] == first  # the prompt's last position: the prefill pool's weights

    prefill = start_worker("prefill", gguf_checkpoint, worker_id="prefill-gguf", quantization="gguf", **ENGINE)
    decode = start_worker("decode", smollm2_checkpoint, worker_id="decode-none", **ENGINE)
    try:
        assert prefill.runtime.layout == decode.runtime.layout  # the KV dtype matches; the weights differ
        result = generate(stub(decode), "mixed", prompt_ids, PARAMS, prefill_endpoint=prefill.endpoint)
        assert result.error == "" and result.finish_reason == "length"
        assert result.token_ids == expected
        wait_blocks_free(prefill, decode)
    finally:
        decode.stop()
        prefill.stop()
