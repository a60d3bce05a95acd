"""A tiny random-weight Llama checkpoint for engine-mechanics tests, and helpers to drive an engine over it.

The checkpoint is a real HF directory, read by the same loader as any other:

    config.json             a 2-layer, 64-wide Llama (GQA 4:2, untied head), vocabulary = the tokenizer's
    model.safetensors       seeded random weights, scaled so that logits spread over many tokens
    tokenizer.json          a ~700-token byte-level BPE trained in-test (`tests.engine.tokenizer.corpus`)
    tokenizer_config.json   BOS <|endoftext|> (0), EOS <|im_end|> (2), a ChatML chat template

Building and loading it takes milliseconds and stepping an engine over it about a millisecond, so the engine's
scheduling, block accounting, sampling and output plumbing can be tested without the real model. Its text is
gibberish but deterministic: tests derive what they expect (a stop string, an EOS id) from a first greedy run.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from tests.engine.tokenizer.corpus import train_tokenizer, write_hf_dir

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.loader.checkpoint import Checkpoint
    from engine.outputs import RequestOutput
    from engine.request.sampling_params import SamplingParams

TINY_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)
BOS_ID, EOS_ID = 0, 2  # <|endoftext|>, <|im_end|> in the trained tokenizer

# Engine settings for the tiny model: small blocks so that a short prompt spans several, and a pool small enough
# to keep the runner's KV tensors tiny (the default 2 GiB of KV would be ~260k blocks of this model).
TINY_ENGINE = dict(block_size=4, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=256)

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "def main():\n    for i in range(10):",
    "Serving language models needs careful scheduling",
]


def tiny_weights(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named weights for `TINY_DIMS` with `vocab_size` tokens; projections scaled ~1/sqrt(fan_in)."""
    d = TINY_DIMS
    hidden, inter = d["hidden_size"], d["intermediate_size"]
    head_dim = hidden // d["num_attention_heads"]
    q_out, kv_out = d["num_attention_heads"] * head_dim, d["num_key_value_heads"] * head_dim
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    weights = {
        "model.embed_tokens.weight": randn(vocab_size, hidden, std=1.0),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": randn(vocab_size, hidden, std=0.3),  # logits with a spread of ~2.4: varied samples
    }
    for i in range(d["num_hidden_layers"]):
        p = f"model.layers.{i}"
        weights |= {
            f"{p}.input_layernorm.weight": torch.ones(hidden),
            f"{p}.post_attention_layernorm.weight": torch.ones(hidden),
            f"{p}.self_attn.q_proj.weight": randn(q_out, hidden, std=hidden**-0.5),
            f"{p}.self_attn.k_proj.weight": randn(kv_out, hidden, std=hidden**-0.5),
            f"{p}.self_attn.v_proj.weight": randn(kv_out, hidden, std=hidden**-0.5),
            f"{p}.self_attn.o_proj.weight": randn(hidden, q_out, std=q_out**-0.5),
            f"{p}.mlp.gate_proj.weight": randn(inter, hidden, std=hidden**-0.5),
            f"{p}.mlp.up_proj.weight": randn(inter, hidden, std=hidden**-0.5),
            f"{p}.mlp.down_proj.weight": randn(hidden, inter, std=inter**-0.5),
        }
    return weights


def write_tiny_checkpoint(directory: Path, seed: int = 0) -> Path:
    """Write the tiny HF checkpoint (see the module docstring) into `directory` and return it."""
    from safetensors.torch import save_file

    from engine.tokenizer.tokenizer import Tokenizer

    write_hf_dir(train_tokenizer("smollm"), "smollm", directory)
    vocab_size = Tokenizer.from_hf_dir(directory).vocab_size
    config = dict(model_type="llama", vocab_size=vocab_size, tie_word_embeddings=False, bos_token_id=BOS_ID,
                  eos_token_id=EOS_ID, **TINY_DIMS)
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    save_file(tiny_weights(vocab_size, seed), str(directory / "model.safetensors"))
    return directory


def write_gguf(path: Path, architecture: str = "llama", vocab_size: int = 32) -> Path:
    """A small, well-formed GGUF with F32 weights for `TINY_DIMS` (no tokenizer: only for tests that expect the
    load to fail, e.g. after damaging the file or for an unsupported architecture)."""
    import gguf

    d = TINY_DIMS
    hidden, inter, layers = d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"]
    heads, kv_heads = d["num_attention_heads"], d["num_key_value_heads"]
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(layers)
    writer.add_context_length(d["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(d["rms_norm_eps"])
    writer.add_uint32(f"{architecture}.vocab_size", vocab_size)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab_size, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (heads * head_dim, hidden),
            f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_output.weight": (hidden, heads * head_dim),
            f"blk.{i}.ffn_gate.weight": (inter, hidden),
            f"blk.{i}.ffn_up.weight": (inter, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, inter),
        }
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def greedy(max_tokens: int = 8, **kwargs: object) -> SamplingParams:
    """Greedy decoding of exactly `max_tokens` tokens (EOS ignored) unless a stop in `kwargs` ends it first."""
    from engine.request.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def make_engine(checkpoint: Checkpoint, **overrides: object) -> LLMEngine:
    """A fresh engine over an already loaded checkpoint (cheap: the weights are shared, the KV cache is new)."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    config = EngineConfig(model=str(checkpoint.path), **{**TINY_ENGINE, **overrides})  # type: ignore[arg-type]
    return LLMEngine(config, checkpoint=checkpoint)


def drain(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    """Step until no request is unfinished; every output of every request, in step order."""
    outputs: dict[str, list[RequestOutput]] = defaultdict(list)
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return dict(outputs)
        for out in engine.step():
            outputs[out.request_id].append(out)
    raise AssertionError(f"engine still has unfinished requests after {max_steps} steps")


def finals(outputs: dict[str, list[RequestOutput]]) -> dict[str, RequestOutput]:
    """The finished output of each request; asserts each request finished exactly once, last."""
    result = {}
    for request_id, outs in outputs.items():
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], request_id
        result[request_id] = outs[-1]
    return result


def assert_no_blocks_held(engine: LLMEngine) -> None:
    """Every KV block back in the pool and no request left anywhere in the engine."""
    pool = engine.block_pool
    assert pool.num_used_blocks == 0, f"{pool.num_used_blocks} KV blocks leaked"
    assert pool.num_free_blocks == engine.num_kv_blocks
    assert engine.kv_cache.num_requests == 0, "a block table outlived its request"
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0


class BlockRefCounter:
    """Counts every block reference the pool hands out (allocate, touch) and takes back (free).

    Installed on one engine's pool; `assert_balanced` checks that each reference was returned exactly once
    (the pool itself raises on a second free of the same reference).
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.num_taken = 0
        self.num_returned = 0
        pool = engine.block_pool
        allocate, touch, free = pool.allocate, pool.touch, pool.free

        def counted_allocate(num_blocks: int):  # noqa: ANN202
            blocks = allocate(num_blocks)
            self.num_taken += len(blocks)
            return blocks

        def counted_touch(blocks) -> None:  # noqa: ANN001
            blocks = list(blocks)
            touch(blocks)
            self.num_taken += len(blocks)

        def counted_free(blocks) -> None:  # noqa: ANN001
            blocks = list(blocks)
            free(blocks)
            self.num_returned += len(blocks)

        pool.allocate = counted_allocate  # type: ignore[method-assign]
        pool.touch = counted_touch  # type: ignore[method-assign]
        pool.free = counted_free  # type: ignore[method-assign]

    def assert_balanced(self) -> None:
        assert self.num_taken > 0, "the workload allocated nothing: the counter is not installed"
        assert self.num_returned == self.num_taken, f"took {self.num_taken} block refs, returned {self.num_returned}"


def pick_stop_string(text: str, length: int = 3, start: int = 4) -> str:
    """An ASCII-alphanumeric substring of `text` starting at or after `start`: a stop string the output is known
    to reach (ASCII, so no half-decoded character can hide or fake it)."""
    for i in range(start, len(text) - length + 1):
        candidate = text[i : i + length]
        if candidate.isascii() and candidate.isalnum():
            return candidate
    raise AssertionError(f"no ASCII stop string candidate in {text!r}")


def num_tokens_to_reach(tokenizer, token_ids: list[int], stop: str) -> int:  # noqa: ANN001
    """How many of `token_ids` it takes for their text to contain `stop`."""
    for k in range(1, len(token_ids) + 1):
        if stop in tokenizer.decode(token_ids[:k]):
            return k
    raise AssertionError(f"{stop!r} never appears in the text of {token_ids}")
