"""API keys, per-key rate limits and HTTPS at the gateway, through the unmodified `openai` client (fake workers
behind a real uvicorn router)."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import httpx
import openai
import pytest

from engine.tokenizer.tokenizer import Tokenizer
from router.api_keys import AccessControl, ApiKeyRing, key_id
from router.rate_limit import RateLimiter, RateLimits
from router.server import GatewayTls, RouterServer
from tests.router.conftest import MODEL, info_of, serve_router
from tests.router.fake_worker import FakeWorker
from tests.tls_certs import Certs, make_certs

KEY, OTHER_KEY = "sk-test-0123456789", "sk-test-other"


def _serve(fakes: dict[str, FakeWorker], tokenizer: Tokenizer, access: AccessControl,
           tls: GatewayTls | None = None) -> RouterServer:
    for worker in fakes.values():
        worker.reset()
    return serve_router([info_of(fakes["prefill-0"]), info_of(fakes["decode-0"])], tokenizer, access=access,
                        tls=tls)


@pytest.fixture
def keyed(fakes: dict[str, FakeWorker], tokenizer: Tokenizer) -> Iterator[RouterServer]:
    server = _serve(fakes, tokenizer, AccessControl(ring=ApiKeyRing([KEY, OTHER_KEY])))
    yield server
    server.stop()


def _client(server: RouterServer, key: str = KEY, **kwargs: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=30.0,
                         **kwargs)  # type: ignore[arg-type]


def test_no_key_wrong_key_right_key(keyed: RouterServer) -> None:
    no_key = {"Authorization": openai.Omit()}  # the client sends no Authorization header at all
    with pytest.raises(openai.AuthenticationError) as missing:
        _client(keyed).completions.create(model=MODEL, prompt="Say hi", max_tokens=5, extra_headers=no_key)
    assert missing.value.status_code == 401
    assert missing.value.body == {"message": "a valid API key is required: send Authorization: Bearer <key>",
                                  "type": "AuthenticationError", "param": None, "code": 401}
    assert missing.value.response.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        _client(keyed, key="sk-wrong").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=5)
    with pytest.raises(openai.AuthenticationError):
        _client(keyed, key=KEY + "x").models.list()
    completion = _client(keyed).completions.create(model=MODEL, prompt="Say hi", max_tokens=5)
    assert completion.choices[0].text == "Hello"
    assert [m.id for m in _client(keyed, key=OTHER_KEY).models.list()] == [MODEL]


def test_open_routes_and_metrics(keyed: RouterServer, fakes: dict[str, FakeWorker], tokenizer: Tokenizer) -> None:
    with httpx.Client(base_url=keyed.url, timeout=30.0) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/openapi.json").status_code == 200
        assert http.get("/version").json() == {"version": version("splitserve")}  # vLLM's, open like /health
        # refused before its body is read: a malformed body without a key is a 401, not a 400
        assert http.post("/v1/completions", content=b"{not json").status_code == 401
        assert http.get("/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401
        assert http.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
        _client(keyed).completions.create(model=MODEL, prompt="Say hi", max_tokens=5)
        metrics = http.get("/metrics")
        assert metrics.status_code == 200  # open without --metrics-require-key
        text = metrics.text
        assert f'splitserve:api_key_requests_total{{key_id="{key_id(KEY)}"}} 1.0' in text
        assert 'splitserve:api_key_rejections_total{reason="missing_key"} 2.0' in text
        assert 'splitserve:api_key_rejections_total{reason="invalid_key"} 1.0' in text
        assert KEY not in text and OTHER_KEY not in text
        for path, body in (("/tokenize", {"prompt": "Say hi"}), ("/detokenize", {"tokens": [72, 105]})):
            assert http.post(path, json=body).status_code == 401  # keyed as /v1/* (vLLM leaves them open)
            assert http.post(path, json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    guarded = _serve(fakes, tokenizer, AccessControl(ring=ApiKeyRing([KEY]), metrics_require_key=True))
    try:
        with httpx.Client(base_url=guarded.url, timeout=30.0) as http:
            assert http.get("/metrics").status_code == 401
            assert http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
            assert http.get("/health").status_code == 200
    finally:
        guarded.stop()


def test_rate_limits_answer_429_with_retry_after(fakes: dict[str, FakeWorker], tokenizer: Tokenizer) -> None:
    limiter = RateLimiter(RateLimits(requests_per_minute=2, tokens_per_minute=10_000))
    server = _serve(fakes, tokenizer, AccessControl(ring=ApiKeyRing([KEY, OTHER_KEY]), limiter=limiter))
    try:
        client = _client(server)
        for _ in range(2):
            client.completions.create(model=MODEL, prompt="Say hi", max_tokens=5)
        with pytest.raises(openai.RateLimitError) as limited:
            client.completions.create(model=MODEL, prompt="Say hi", max_tokens=5)
        assert 1 <= int(limited.value.response.headers["retry-after"]) <= 30
        assert limited.value.body["type"] == "RateLimitError"
        _client(server, key=OTHER_KEY).models.list()  # another key has its own bucket
    finally:
        server.stop()
    tokens = RateLimiter(RateLimits(tokens_per_minute=10))
    server = _serve(fakes, tokenizer, AccessControl(ring=ApiKeyRing([KEY]), limiter=tokens))
    try:
        client = _client(server)
        completion = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=5)
        assert completion.usage is not None and completion.usage.total_tokens == 11  # charged: 1 token in debt
        with pytest.raises(openai.RateLimitError) as limited:
            client.completions.create(model=MODEL, prompt="Say hi", max_tokens=5)
        assert limited.value.response.headers["retry-after"] == "6"  # 1 token at 10/min: 6 s
    finally:
        server.stop()


def test_key_file_reloads(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# gateway keys\n{KEY}\n\n")
    ring = ApiKeyRing(key_file=str(path))
    assert ring.match(KEY) == key_id(KEY) and ring.match(OTHER_KEY) is None
    path.write_text(f"{OTHER_KEY}\n")
    assert ring.reload() == 1
    assert ring.match(KEY) is None and ring.match(OTHER_KEY) == key_id(OTHER_KEY)
    path.write_text("")  # an emptied file keeps the keys in force (a half-written file must not lock all out)
    assert ring.reload() == 1 and ring.match(OTHER_KEY) is not None
    path.unlink()
    assert ring.reload() == 1
    with pytest.raises(ValueError):
        ApiKeyRing(key_file=str(path))
    assert KEY not in repr(ring) and OTHER_KEY not in repr(ring)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("gateway-certs"))


def test_gateway_over_tls(fakes: dict[str, FakeWorker], tokenizer: Tokenizer, certs: Certs) -> None:
    tls = GatewayTls(keyfile=str(certs.server_key), certfile=str(certs.server_cert), ca_certs=str(certs.ca))
    server = _serve(fakes, tokenizer, AccessControl(ring=ApiKeyRing([KEY])), tls=tls)
    try:
        assert server.url.startswith("https://127.0.0.1:")
        trusted = ssl.create_default_context(cafile=str(certs.ca))
        trusted.load_cert_chain(str(certs.client_cert), str(certs.client_key))
        with httpx.Client(verify=trusted) as http:
            completion = _client(server, http_client=http).completions.create(model=MODEL, prompt="Say hi",
                                                                               max_tokens=5)
            assert completion.choices[0].text == "Hello"
        no_client_cert = ssl.create_default_context(cafile=str(certs.ca))  # --ssl-ca-certs requires one
        untrusting = ssl.create_default_context(cafile=str(certs.other_ca))
        untrusting.load_cert_chain(str(certs.client_cert), str(certs.client_key))
        for context in (no_client_cert, untrusting):
            with httpx.Client(verify=context) as http, pytest.raises(openai.APIConnectionError):
                _client(server, http_client=http).models.list()
        with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port
            httpx.get(server.url.replace("https://", "http://") + "/health", timeout=5.0)
    finally:
        server.stop()
