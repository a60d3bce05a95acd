"""Serving the app: RouterServer's start/stop, and build_router_app over the real SmolLM2 tokenizer."""

from __future__ import annotations

import httpx
import pytest

from router.config import GatewayConfig, ServedEngine
from router.server import RouterServer, build_router_app, read_chat_template
from tests.router.conftest import MODEL, info_of
from tests.router.fake_worker import FakeWorker


def test_router_server_starts_and_stops(fakes: dict[str, FakeWorker], tokenizer) -> None:
    from tests.router.conftest import serve_router

    server = serve_router([info_of(fakes["colocated-0"])], tokenizer, mode="colocated")
    assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}"
    assert httpx.get(f"{server.url}/health").status_code == 200
    server.stop()
    server.stop()  # idempotent
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=2)


@pytest.mark.slow
def test_build_router_app_with_the_real_tokenizer(fakes: dict[str, FakeWorker], smollm2_gguf: str) -> None:
    """build_router_app resolves the model name itself; the fixture only makes sure the file is fetched."""
    for fake in fakes.values():
        fake.reset()
    decode = fakes["decode-0"]
    always_disaggregate = GatewayConfig(disagg_prefill_threshold_tokens=0)
    app = build_router_app(always_disaggregate, ServedEngine(model=MODEL, max_model_len=2048),
                           lambda: [info_of(fakes["prefill-0"]), info_of(decode)])
    server = RouterServer(app).start()
    try:
        with httpx.Client(base_url=server.url) as client:
            assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 2048
            response = client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 4})
            assert response.status_code == 200, response.text
    finally:
        server.stop()
    prompt = list(decode.requests[0].prompt_token_ids)
    # SmolLM2's ChatML: <|im_start|> is id 1, and the template adds its default system prompt.
    assert prompt[0] == 1 and prompt.count(1) == 3 and len(prompt) > 20


@pytest.mark.slow
def test_served_model_names_are_the_apis_names_for_the_model(fakes: dict[str, FakeWorker], smollm2_gguf: str) -> None:
    """`--served-model-name llama-3 alias` (vLLM's flag): /v1/models lists those, the first first; a request
    naming either is served and answered under the name it used; --model's own name is then no name of it."""
    for fake in fakes.values():
        fake.reset()
    config = GatewayConfig(served_model_names=("llama-3", "alias"))
    app = build_router_app(config, ServedEngine(model=MODEL, mode="colocated"),
                           lambda: [info_of(fakes["colocated-0"])])
    server = RouterServer(app).start()
    try:
        with httpx.Client(base_url=server.url) as client:
            assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["llama-3", "alias"]
            for name in ("llama-3", "alias"):
                response = client.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 2})
                assert response.status_code == 200, response.text
                assert response.json()["model"] == name
            response = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert response.status_code == 404 and "llama-3, alias" in response.json()["error"]["message"]
    finally:
        server.stop()


def test_read_chat_template_takes_a_file_or_the_template_itself(tmp_path) -> None:
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    assert read_chat_template(str(path)) == template == read_chat_template(template)
    (tmp_path / "latin1.jinja").write_bytes(b"{{ '\xe9' }}")
    for value, message in ((str(tmp_path / "missing.jinja"), "no file .*missing.jinja.*no Jinja template either"),
                           (str(tmp_path), "no file"),
                           ("{% for m in messages %}", "chat template does not parse"),
                           (str(tmp_path / "latin1.jinja"), "cannot read .*latin1.jinja: 'utf-8' codec can't decode")):
        with pytest.raises(ValueError, match=f"^--chat-template: {message}"):
            read_chat_template(value)


@pytest.mark.slow
def test_a_chat_template_over_the_models_renders_the_chat_prompt(fakes: dict[str, FakeWorker], smollm2_gguf: str,
                                                                  tmp_path) -> None:
    """--chat-template FILE: /v1/chat/completions sends the decode worker the operator's template's rendering of the
    messages, not SmolLM2's ChatML."""
    from router.server import load_tokenizer

    for fake in fakes.values():
        fake.reset()
    path = tmp_path / "chat.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    app = build_router_app(GatewayConfig(chat_template=str(path)), ServedEngine(model=MODEL, mode="colocated"),
                           lambda: [info_of(fakes["colocated-0"])])
    server = RouterServer(app).start()
    try:
        with httpx.Client(base_url=server.url) as client:
            response = client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 2})
            assert response.status_code == 200, response.text
    finally:
        server.stop()
    tokenizer, _ = load_tokenizer(MODEL)
    expected = tokenizer.encode("[user] What is 2+2?\n", add_special_tokens=False)
    assert list(fakes["colocated-0"].requests[0].prompt_token_ids) == expected
