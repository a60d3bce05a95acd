"""CORS at the gateway, as vLLM's flags and defaults (--allowed-origins '["*"]' ...): a browser's preflight is
answered before the API key is checked, the call itself still needs the key, and a refusal carries the CORS headers;
a list of origins admits those only; no origin sends no CORS headers."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import httpx
import pytest

from deploy.config_flags import json_string_list
from router.api_keys import AccessControl, ApiKeyRing
from tests.router.conftest import MODEL

KEY = "sk-cors-0123456789"
PAGE = "https://chat.example.com"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
BODY = {"model": MODEL, "prompt": "abc", "max_tokens": 2}


@pytest.fixture
def serve(serve_gateway) -> Callable[..., httpx.Client]:  # type: ignore[no-untyped-def]
    return lambda **config: serve_gateway(access=AccessControl(ring=ApiKeyRing([KEY])), **config)


def test_any_origin_by_default_the_preflight_without_a_key_and_the_call_with_one(serve) -> None:
    with serve() as http:
        preflight = http.options("/v1/completions", headers=PREFLIGHT)
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "*"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        refused = http.post("/v1/completions", json=BODY, headers={"Origin": PAGE})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
        served = http.post("/v1/completions", json=BODY, headers={"Origin": PAGE, "Authorization": f"Bearer {KEY}"})
        assert served.status_code == 200 and served.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in served.headers


def test_listed_origins_only(serve) -> None:
    with serve(allowed_origins=(PAGE,), allowed_methods=("POST",), allow_credentials=True) as http:
        preflight = http.options("/v1/completions", headers=PREFLIGHT)
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == PAGE
        assert preflight.headers["access-control-allow-credentials"] == "true"
        other = http.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        put = http.options("/v1/completions", headers={**PREFLIGHT, "Access-Control-Request-Method": "PUT"})
        assert put.status_code == 400
        served = http.post("/v1/completions", json=BODY,
                           headers={"Origin": "https://evil.example", "Authorization": f"Bearer {KEY}"})
        assert served.status_code == 200 and "access-control-allow-origin" not in served.headers  # the browser refuses


def test_no_origin_no_cors(serve) -> None:
    with serve(allowed_origins=()) as http:
        preflight = http.options("/v1/completions", headers=PREFLIGHT)
        assert "access-control-allow-origin" not in preflight.headers
        assert preflight.status_code in (401, 405)  # no CORS layer: the key guard, or the route, answers


def test_the_flags_take_json_lists() -> None:
    from deploy.cli import build_parser
    from deploy.serve_args import gateway_config_from_args

    config = gateway_config_from_args(build_parser().parse_args(
        ["gateway", "--allowed-origins", f'["{PAGE}", "http://localhost:3000"]', "--allowed-headers", "[]",
         "--allow-credentials"]))
    assert config.allowed_origins == (PAGE, "http://localhost:3000") and config.allowed_headers == ()
    assert config.allowed_methods == ("*",) and config.allow_credentials
    for text in (PAGE, '{"origin": 1}', '["a", 2]'):
        with pytest.raises(argparse.ArgumentTypeError, match="not a JSON list of strings"):
            json_string_list(text)
