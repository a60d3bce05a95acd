"""--generation-config (engine/request/generation_config.py): the model's generation_config.json gives the sampling
values a request leaves unset and caps max_tokens, as vLLM's default "auto" does; "vllm" reads none; a folder reads
its own."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from engine.request.generation_config import NONE, load_generation_defaults
from router.config import GatewayConfig, ServedEngine
from router.server import RouterServer, build_router_app
from tests.router.conftest import info_of
from tests.router.fake_worker import FakeWorker

LLAMA_3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.0,
           "max_new_tokens": 5, "bos_token_id": 1, "eos_token_id": [2]}  # top_k 50 and penalty 1.0: HF's defaults


def _folder(root: Path, config: object) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "generation_config.json").write_text(json.dumps(config))
    return root


def test_auto_takes_what_differs_from_hfs_defaults(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "model", LLAMA_3)
    defaults = load_generation_defaults("auto", folder)
    assert dict(defaults.sampling) == {"temperature": 0.6, "top_p": 0.9} and defaults.max_new_tokens == 5
    assert load_generation_defaults("vllm", folder) == NONE
    other = _folder(tmp_path / "other", {"top_k": 20, "min_p": 0.05})
    assert dict(load_generation_defaults(str(other), folder).sampling) == {"top_k": 20, "min_p": 0.05}


def test_auto_without_a_file_changes_nothing(tmp_path: Path) -> None:
    assert load_generation_defaults("auto", tmp_path) == NONE  # an HF directory without the file
    assert load_generation_defaults("auto", tmp_path / "model.gguf") == NONE  # a GGUF file: none
    assert load_generation_defaults("auto", None) == NONE  # a dummy shape: none


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{not json", "cannot read .*generation_config.json"),
        ([1, 2], "holds no JSON object"),
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"top_k": 2.5}, "top_k must be a number, got 2.5"),
        ({"top_p": True}, "top_p must be a number, got True"),
        ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer, got 0"),
    ],
)
def test_a_bad_file_is_an_error_naming_the_flag(tmp_path: Path, config: object, message: str) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(ValueError, match=f"^--generation-config: .*{message}"):
        load_generation_defaults("auto", folder)


def test_the_override_sets_its_keys_over_the_file_or_over_nothing(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "model", LLAMA_3)
    over = load_generation_defaults("auto", folder, '{"temperature": 0.3, "top_k": 50, "max_new_tokens": 64}')
    assert dict(over.sampling) == {"temperature": 0.3, "top_p": 0.9, "top_k": 50} and over.max_new_tokens == 64
    alone = load_generation_defaults("vllm", folder, '{"repetition_penalty": 1.1}')
    assert dict(alone.sampling) == {"repetition_penalty": 1.1} and alone.max_new_tokens is None
    for override, message in (("{", "not JSON"), ("[1]", "holds no JSON object"),
                              ('{"temprature": 0.3}', "unknown keys temprature"),
                              ('{"max_new_tokens": -1}', "max_new_tokens must be a positive integer")):
        with pytest.raises(ValueError, match=f"^--override-generation-config.*{message}"):
            load_generation_defaults("vllm", None, override)


def test_a_folder_must_hold_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^--generation-config .*: no generation_config.json there"):
        load_generation_defaults(str(tmp_path), None)
    with pytest.raises(ValueError, match="^--generation-config .*missing: no such folder"):
        load_generation_defaults(str(tmp_path / "missing"), None)


def test_the_models_defaults_reach_the_worker_for_what_a_request_leaves_unset(
        fakes: dict[str, FakeWorker], tmp_path: Path) -> None:
    """An HF model directory with Llama 3's generation_config.json, served over a fake colocated worker: a request
    without temperature / top_p gets the model's, one with them keeps its own, and max_tokens is capped at
    max_new_tokens (the completion default of 16 and a request's 10 alike); with "vllm", none of it; with an
    override, its keys."""
    from tests.engine.tiny_model import write_tiny_checkpoint

    model = _folder(write_tiny_checkpoint(tmp_path / "tiny"), LLAMA_3)
    worker = fakes["colocated-0"]
    for setting, override, expected in (
            ("auto", None, [(0.6, 0.9, 5), (0.2, 0.5, 5), (0.6, 0.9, 5)]),
            ("vllm", None, [(1.0, 1.0, 16), (0.2, 0.5, 10), (1.0, 1.0, None)]),
            ("auto", '{"temperature": 0.7, "max_new_tokens": 8}', [(0.7, 0.9, 8), (0.2, 0.5, 8), (0.7, 0.9, 8)])):
        worker.reset()
        app = build_router_app(GatewayConfig(generation_config=setting, override_generation_config=override),
                               ServedEngine(model=str(model), mode="colocated"), lambda: [info_of(worker)])
        server = RouterServer(app).start()
        try:
            with httpx.Client(base_url=server.url) as client:
                for body in ({"prompt": "Hi"}, {"prompt": "Hi", "temperature": 0.2, "top_p": 0.5, "max_tokens": 10},
                             {"messages": [{"role": "user", "content": "Hi"}]}):
                    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                    response = client.post(path, json={"model": str(model), **body})
                    assert response.status_code == 200, response.text
        finally:
            server.stop()
        got = []
        for request, (temperature, top_p, max_tokens) in zip(worker.requests, expected, strict=True):
            params = request.params
            got.append((round(params.temperature, 4), round(params.top_p, 4),
                        params.max_tokens if max_tokens is not None else None))
        assert got == expected, setting
