"""Mutual TLS through `splitserve serve` (real Ray, real workers, the real model): `--grpc-tls-cert/key/ca` on serve
reach every worker Ray starts, and every gRPC link (gateway → decode, decode → prefill, the KV handoff, the worker
hosts' health checks) runs on certificates the test makes (tests/tls_certs.py).

- A completion, its KV handed over by the grpc transport, equals the decode worker's own greedy Generate of the
  prompt, asked over TLS with a client certificate the CA signed; every block is free after.
- On every worker port the admin API lists, a raw gRPC client with no client certificate, with one another CA
  signed, or in plaintext is refused at the handshake; the CA's client certificate is let in.
- SIGINT stops it all, exit 0, nothing left (tests.deploy.processes.serving).

The other transports whose control travels over gRPC (torch, ipc), and a worker without TLS refused by a TLS
gateway: tests/deploy/test_static_gateway_mtls.py, over worker processes without Ray.
"""

from __future__ import annotations

import httpx
import pytest

from protos.cluster_auth import CLUSTER_SECRET_ENV
from tests.cluster.test_serve_openai import wait_until_every_block_is_free
from tests.deploy.processes import serve_argv, serving
from tests.deploy.test_static_gateway_mtls import (
    MAX_TOKENS,
    PROMPT,
    SECRET,
    assert_only_the_cas_clients_get_in,
    own_generate,
    tls_flags,
)
from tests.tls_certs import make_certs

pytestmark = [pytest.mark.slow, pytest.mark.ray]

ADMIN_TOKEN = "mtls-admin"


def test_serve_over_mutual_tls(smollm2_gguf: str, tmp_path) -> None:
    from router.server import load_tokenizer

    certs = make_certs(tmp_path / "certs")
    tok, _ = load_tokenizer(smollm2_gguf)
    argv = serve_argv(smollm2_gguf, "--prefill-workers", "1", "--decode-workers", "1", "--kv-transport", "grpc",
                      "--max-model-len", "512", "--admin-token", ADMIN_TOKEN, *tls_flags(certs),
                      "--disagg-prefill-threshold", "0")  # the prompt's KV through the handoff
    with serving(argv, stderr_path=tmp_path / "stderr.txt", env={CLUSTER_SECRET_ENV: SECRET}) as serve:
        response = httpx.post(f"{serve.url}/v1/completions", timeout=120, json={
            "model": smollm2_gguf, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert response.status_code == 200, response.text
        pools = httpx.get(f"{serve.url}/admin/pools", headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
                          timeout=30).json()["workers"]
        endpoints = {w["role"]: w["endpoint"] for w in pools}
        assert sorted(endpoints) == ["decode", "prefill"] and len(pools) == 2, pools
        expected = own_generate(endpoints["decode"], certs, tok.encode(PROMPT))
        assert response.json()["choices"][0]["text"] == tok.decode(expected, skip_special_tokens=True)
        metrics = wait_until_every_block_is_free(serve.url)
        assert metrics["splitserve:kv_transfer_bytes_total"]["prefill-0"] > 0  # the KV went over the transport
        for endpoint in endpoints.values():
            assert_only_the_cas_clients_get_in(endpoint, certs)
