"""The router never imports torch or ray: it must start on any machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
HEAVY = "print(sorted(name for name in ('torch', 'ray', 'transformers') if name in sys.modules))\n"


def _run(code: str) -> list[str]:
    """`code` in a fresh interpreter from the repository root; its stdout lines."""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                            check=False, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()


def test_router_imports_neither_torch_nor_ray() -> None:
    lines = _run(
        "import sys\n"
        "import router, router.app, router.server, router.metrics, router.worker_registry, router.routing\n"
        "from router.server import build_router_app, load_tokenizer\n" + HEAVY
    )
    assert lines[-1] == "[]"


def test_a_dummy_shapes_gateway_loads_the_workers_tokenizer_without_torch() -> None:
    """`serve --load-format dummy --model llama-3.2-1b`: the gateway takes the shape's stand-in tokenizer (the one
    its workers use) and context length, and still never imports torch."""
    models, imported = _run(
        "import sys\n"
        "from fastapi.testclient import TestClient\n"
        "from router.config import GatewayConfig, ServedEngine\n"
        "from router.server import build_router_app\n"
        "app = build_router_app(GatewayConfig(), ServedEngine(model='llama-3.2-1b', load_format='dummy'), lambda: [])\n"
        "models = TestClient(app).get('/v1/models').json()\n"
        "print([m['id'] for m in models['data']], [m.get('max_model_len') for m in models['data']])\n" + HEAVY
    )[-2:]
    assert models == "['llama-3.2-1b'] [131072]"
    assert imported == "[]"


def test_the_fixed_list_gateway_imports_neither_torch_nor_ray() -> None:
    """`splitserve gateway --prefill/--decode/--colocated` (deploy/static_workers.py): everything it imports and
    builds, with any import of ray failing (tests/deploy/test_static_gateway.py runs it over real workers)."""
    models, imported = _run(
        "import sys\n"
        "sys.modules['ray'] = None  # `import ray` raises ImportError\n"
        "from fastapi.testclient import TestClient\n"
        "from deploy import cli, gateway_command\n"
        "from deploy.gateway_app import GatewayConfig, ServedEngine, build_gateway_app\n"
        "from deploy.lifecycle import ShutdownSignals, describe_pools\n"
        "from deploy.redis_server import check_redis\n"
        "from deploy.static_workers import StaticWorkers, worker_list_from_args\n"
        "from protos.cluster_auth import cluster_auth_from_args\n"
        "from router.server import RouterServer\n"
        "args = cli.build_parser().parse_args(['gateway', '--colocated', '127.0.0.1:9'])\n"
        "workers = StaticWorkers(worker_list_from_args(args), auth=cluster_auth_from_args(args, {}))\n"
        "served = ServedEngine(model='llama-3.2-1b', load_format='dummy', max_model_len=2048, mode='colocated')\n"
        "app, _ = build_gateway_app(GatewayConfig(), served, workers, auth=cluster_auth_from_args(args, {}),\n"
        "                           redis_url=None)\n"
        "with TestClient(app) as client:\n"
        "    print([m.get('max_model_len') for m in client.get('/v1/models').json()['data']])\n"
        "workers.close()\n"
        "sys.modules.pop('ray')\n" + HEAVY
    )[-2:]
    assert models == "[2048]"
    assert imported == "[]"
