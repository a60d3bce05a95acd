"""The real SmolLM2 under a LoRA adapter gives, greedy, the tokens HF transformers gives with the adapter merged
into its weights (W + scaling * B @ A, PEFT's merge), float32, token for token; base-model requests in the same
batch keep the base model's tokens."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.engine.distributed.tp_compare import SampledLogits, assert_tp_matches
from tests.engine.lora.peft_adapter import make_adapter
from tests.engine.prompts import CHAT_CONVERSATIONS, SHORT_PROMPTS
from tests.engine.test_exactness import hf_greedy, make_engine

pytestmark = pytest.mark.slow

TARGETS = ("q_proj", "v_proj", "gate_proj", "down_proj")
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def adapter(smollm2_checkpoint, tmp_path_factory):
    return make_adapter(tmp_path_factory.mktemp("lora") / "smol", smollm2_checkpoint.weights,
                        smollm2_checkpoint.config.num_layers, rank=8, alpha=16, targets=TARGETS, seed=7, b_std=0.02)


def test_greedy_tokens_equal_hf_with_the_adapter_merged(smollm2_checkpoint, hf_reference, adapter):
    from safetensors.torch import load_file

    tok = smollm2_checkpoint.tokenizer
    prompts = [tok.encode(p) for p in SHORT_PROMPTS]
    prompts += [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
                for c in CHAT_CONVERSATIONS[:2]]
    engine = make_engine(smollm2_checkpoint, enable_lora=True, lora_modules=(("smol", str(adapter)),))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"lora-{i}", ids, params, lora_name="smol")
        engine.add_request(f"base-{i}", ids, params)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        got |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    assert engine.block_pool.num_used_blocks == 0

    base = {i: hf_greedy(hf_reference, ids, MAX_TOKENS) for i, ids in enumerate(prompts)}
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    params_by_name = dict(hf_reference.named_parameters())
    saved = {}
    try:
        with torch.no_grad():
            for key, a in tensors.items():
                if key.endswith("lora_A.weight"):
                    name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
                    b = tensors[key.replace("lora_A", "lora_B")]
                    saved[name] = params_by_name[name].detach().clone()
                    params_by_name[name] += 2.0 * (b.double() @ a.double()).float()
            merged = {i: hf_greedy(hf_reference, ids, MAX_TOKENS) for i, ids in enumerate(prompts)}
    finally:
        with torch.no_grad():
            for name, original in saved.items():
                params_by_name[name].copy_(original)
    assert len(saved) == len(TARGETS) * smollm2_checkpoint.config.num_layers
    for i in range(len(prompts)):
        assert got[f"base-{i}"] == base[i], f"prompt {i}: the base model's tokens changed"
        assert got[f"lora-{i}"] == merged[i], f"prompt {i}: the adapter's tokens differ from HF's merged model"
    assert sum(merged[i] != base[i] for i in range(len(prompts))) >= len(prompts) // 2, "the adapter changes little"


def test_tensor_parallel_3_gives_tp_1s_tokens_under_the_adapter(smollm2_checkpoint, adapter):
    """SmolLM2's 9 query / 3 KV heads split three ways, each rank holding its shard of the adapter: TP 1's tokens but
    for reported rounding flips of near-ties, every logits row within 1e-3 (tests/engine/distributed/tp_compare.py).
    Base-model requests at TP 3: tests/engine/test_exactness.py."""
    tok = smollm2_checkpoint.tokenizer
    prompts = {f"lora-{i}": tok.encode(p) for i, p in enumerate(SHORT_PROMPTS[:3])}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got, logits = {}, {}
    num_threads = torch.get_num_threads()
    for tp in (1, 3):
        engine = make_engine(smollm2_checkpoint, enable_lora=True, lora_modules=(("smol", str(adapter)),),
                             tensor_parallel_size=tp, num_threads=1)
        try:
            logits[tp] = SampledLogits.install(engine)
            for request_id, ids in prompts.items():
                engine.add_request(request_id, ids, params, lora_name="smol")
            got[tp] = {}
            while engine.has_unfinished_requests():
                got[tp] |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
            assert engine.block_pool.num_used_blocks == 0
        finally:
            engine.close()
            torch.set_num_threads(num_threads)  # an engine with num_threads sets them process-wide
    assert_tp_matches(prompts, got[1], got[3], logits[1], logits[3])
