"""Mutual TLS between real components without Ray: `splitserve gateway --prefill/--decode` over real worker
processes (`python -m prefill_worker` / `decode_worker`, the real model), every gRPC link on certificates the test
makes (tests/tls_certs.py), once per KV transport whose control travels over gRPC beside the grpc transport, which
tests/cluster/test_mtls.py runs through `splitserve serve`: torch (its Open / Commit; its TCPStore and gloo
sockets are not gRPC, docs/security.md) and ipc (its first IpcTransfer call; later ones ring the decode worker's
same-user Unix socket, docs/security.md). inproc moves no byte between processes.

- A completion through the gateway, its KV handed over by the transport (`kv_transfer_bytes_total`), equals the
  decode worker's own greedy Generate of the prompt, asked over TLS with a client certificate the CA signed; every
  block is free after.
- A raw gRPC client that presents no client certificate, one that another CA signed, or that speaks plaintext is
  refused at the handshake (UNAVAILABLE, though it carries the right cluster secret) on every worker port; the CA's
  client certificate is let in on each.
- A worker started without TLS is refused by a TLS gateway at once (exit 1, the endpoint and the flags named),
  not after --worker-wait-timeout.

The grpc transport, through `splitserve serve` (Ray): tests/cluster/test_mtls.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from engine.request.sampling_params import SamplingParams
from protos import serving_pb2, serving_pb2_grpc
from protos.cluster_auth import METADATA_KEY, ClusterAuth, sync_channel
from tests.cluster.test_serve_openai import wait_until_every_block_is_free
from tests.cluster.worker_harness import generate
from tests.deploy.processes import REPO_ROOT, TEST_KV_CACHE_MEMORY, WORKER_READY, ServeProcess
from tests.tls_certs import Certs, make_certs

pytestmark = pytest.mark.slow

SECRET = "mtls-test-secret"
MAX_TOKENS = 8
PROMPT = "The three primary colors are red, yellow and"  # 10 tokens: a block travels


def tls_flags(certs: Certs) -> list[str]:
    """A worker's or gateway's flags: the CA's leaf as its certificate (server and client), the CA as the peers'."""
    return ["--grpc-tls-cert", str(certs.server_cert), "--grpc-tls-key", str(certs.server_key),
            "--grpc-tls-ca", str(certs.ca)]


def trusted(certs: Certs) -> ClusterAuth:
    """A client the workers must let in: the cluster secret and a client certificate the CA signed."""
    return ClusterAuth(secret=SECRET, tls_cert_path=str(certs.client_cert), tls_key_path=str(certs.client_key),
                       tls_ca_path=str(certs.ca))


def _health(channel: grpc.Channel, *, secret: bool) -> serving_pb2.HealthResponse:
    metadata = ((METADATA_KEY, SECRET),) if secret else None
    return serving_pb2_grpc.WorkerStub(channel).Health(serving_pb2.HealthRequest(), timeout=10, metadata=metadata)


def assert_only_the_cas_clients_get_in(endpoint: str, certs: Certs) -> None:
    """At `endpoint`: the CA's client certificate gets Health; no client certificate, another CA's, or plaintext
    is refused at the handshake (UNAVAILABLE, not UNAUTHENTICATED: each carries the right secret)."""
    with sync_channel(endpoint, trusted(certs)) as channel:
        assert _health(channel, secret=False).ok  # the secret comes from `trusted`
    ca = certs.ca.read_bytes()
    refused = {
        "no client certificate": grpc.ssl_channel_credentials(root_certificates=ca),
        "another CA's client certificate": grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=certs.other_client_key.read_bytes(),
            certificate_chain=certs.other_client_cert.read_bytes()),
        "plaintext": None,
    }
    for what, credentials in refused.items():
        channel = (grpc.insecure_channel(endpoint) if credentials is None
                   else grpc.secure_channel(endpoint, credentials))
        with channel, pytest.raises(grpc.RpcError) as error:
            _health(channel, secret=True)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE, (what, endpoint, error.value)


def own_generate(endpoint: str, certs: Certs, prompt_ids: list[int]) -> list[int]:
    """The decode worker's own greedy tokens for the prompt (it prefills it itself: no handoff), asked over TLS."""
    with sync_channel(endpoint, trusted(certs)) as channel:
        result = generate(serving_pb2_grpc.WorkerStub(channel), f"own-{time.monotonic_ns()}", prompt_ids,
                          SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert not result.error and result.finish_reason in ("length", "stop"), result
    return result.token_ids


@dataclass
class TlsCluster:
    transport: str
    url: str
    prefill: ServeProcess
    decode: ServeProcess
    certs: Certs
    tmp: Path


def _worker(module: str, model: str, tmp: Path, *flags: str) -> ServeProcess:
    argv = [sys.executable, "-m", module, "--model", model, "--kv-cache-memory", TEST_KV_CACHE_MEMORY,
            "--max-model-len", "512", "--num-threads", "1", *flags]
    return ServeProcess(argv, stderr_path=tmp / f"{module}-{len(flags)}.stderr", ready=WORKER_READY,
                        env={"SPLITSERVE_CLUSTER_SECRET": SECRET})


def _gateway_argv(prefill: str, decode: str, certs: Certs, *flags: str) -> list[str]:
    return [sys.executable, "-m", "deploy.cli", "gateway", "--prefill", prefill, "--decode", decode, "--port", "0",
            *tls_flags(certs), *flags]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module", params=["torch", "ipc"])
def tls_cluster(request: pytest.FixtureRequest, smollm2_gguf: str, certs: Certs,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsCluster]:
    transport = request.param
    tmp = tmp_path_factory.mktemp(f"mtls-{transport}")
    flags = ("--kv-transport", transport, *tls_flags(certs))
    prefill = _worker("prefill_worker", smollm2_gguf, tmp, *flags)
    decode = _worker("decode_worker", smollm2_gguf, tmp, *flags)
    gateway = None
    try:
        p, d = prefill.wait_ready(300), decode.wait_ready(300)
        gateway = ServeProcess(_gateway_argv(p, d, certs, "--worker-wait-timeout", "120",
                                             "--disagg-prefill-threshold", "0"),  # every prompt handed off
                               stderr_path=tmp / "gateway.stderr", env={"SPLITSERVE_CLUSTER_SECRET": SECRET})
        yield TlsCluster(transport=transport, url=gateway.wait_ready(120), prefill=prefill, decode=decode,
                         certs=certs, tmp=tmp)
        for process in (gateway, prefill, decode):
            assert process.proc.poll() is None, f"died meanwhile:\n{process.output()}"
            process.proc.send_signal(signal.SIGTERM)
            assert process.proc.wait(60) == 0, process.output()
    finally:
        for process in (gateway, prefill, decode):
            if process is not None:
                process.close()


def test_completions_over_mutual_tls_and_only_the_cas_clients_get_in(tls_cluster: TlsCluster,
                                                                     smollm2_gguf: str) -> None:
    from router.server import load_tokenizer

    c = tls_cluster
    assert c.prefill.url is not None and c.decode.url is not None
    tok, _ = load_tokenizer(smollm2_gguf)
    response = httpx.post(f"{c.url}/v1/completions", timeout=120, json={
        "model": smollm2_gguf, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert response.status_code == 200, response.text
    expected = own_generate(c.decode.url, c.certs, tok.encode(PROMPT))
    assert response.json()["choices"][0]["text"] == tok.decode(expected, skip_special_tokens=True)
    metrics = wait_until_every_block_is_free(c.url)
    sent = {w: v for w, v in metrics["splitserve:kv_transfer_bytes_total"].items() if w.startswith("prefill")}
    assert len(sent) == 1 and next(iter(sent.values())) > 0, sent  # the prompt's KV went over the transport
    for endpoint in (c.prefill.url, c.decode.url):
        assert_only_the_cas_clients_get_in(endpoint, c.certs)


@pytest.mark.parametrize("tls_cluster", ["ipc"], indirect=True)  # one worker pair is enough: no handoff here
def test_a_tls_gateway_refuses_a_plaintext_worker_at_once(tls_cluster: TlsCluster, smollm2_gguf: str) -> None:
    c = tls_cluster
    assert c.prefill.url is not None
    plaintext = _worker("decode_worker", smollm2_gguf, c.tmp)
    try:
        endpoint = plaintext.wait_ready(300)
        # A gateway that only waited would wait --worker-wait-timeout (600 s) and be killed at 120 s here.
        gateway = subprocess.run(_gateway_argv(c.prefill.url, endpoint, c.certs, "--worker-wait-timeout", "600"),
                                 cwd=REPO_ROOT, env={**os.environ, "SPLITSERVE_CLUSTER_SECRET": SECRET},
                                 capture_output=True, text=True, timeout=120, check=False)
    finally:
        plaintext.close()
    assert gateway.returncode == 1, gateway.stderr
    assert (f"splitserve: error: the worker at {endpoint} serves plaintext gRPC, and this gateway's links are "
            "mutual TLS (--grpc-tls-cert/--grpc-tls-key/--grpc-tls-ca)") in gateway.stderr, gateway.stderr[-2000:]
