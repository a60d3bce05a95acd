"""The Helm chart without a Kubernetes API server: `helm lint`, `helm template` with several value sets, every
manifest validated against the Kubernetes 1.37 schemas in strict mode (kubernetes-validate), and assertions on the
rendered objects. The RayCluster (KubeRay) and ServiceMonitor (Prometheus operator) are custom resources that
kubernetes-validate has no schema for: their kinds are skipped by name (CUSTOM_KINDS), nothing else is."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import pytest

from tests.helm.chart import CHART, RELEASE, containers, find, of_kind, render
from tests.helm.pods import expand

helm = pytest.importorskip("helm_python", reason="the `test` extra installs helm-python-sdk")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the `test` extra installs kubernetes-validate")

REPO_ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_VERSION = "1.37.0"
CUSTOM_KINDS = {"RayCluster", "ServiceMonitor"}  # CRDs: no schema in kubernetes-validate

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "3-prefill-5-decode": {"prefill": {"replicas": 3}, "decode": {"replicas": 5}},
    "external-redis": {"redis": {"enabled": False, "url": "redis://redis.example.internal:6379/2"}},
    "gpu": {"prefill": {"gpus": 1, "image": {"tag": "0.1.0-cuda"}, "nodeSelector": {"gpu": "h100"},
                        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
            "decode": {"gpus": 2, "image": {"tag": "0.1.0-cuda"}}, "kvTransport": "torch"},
    "tensor-parallel": {"prefill": {"tensorParallelSize": 2, "gpus": 2, "image": {"tag": "0.1.0-cuda"}},
                        "decode": {"workersPerNode": 2, "gpus": 2, "image": {"tag": "0.1.0-cuda"}},
                        "kvTransport": "torch"},
    "kuberay": {"rayCluster": {"kuberay": True}, "prefill": {"replicas": 2}, "decode": {"replicas": 3}},
    "everything-on": {"gateway": {"autoscaling": {"enabled": True}, "service": {"type": "LoadBalancer"},
                                  "servedModelName": ["smol", "gpt-4o-mini"], "chatTemplate": "{{ messages }}",
                                  "ingress": {"enabled": True, "className": "nginx", "host": "llm.example.com",
                                              "tls": {"secretName": "llm-example-com-tls"}}},
                      "prefill": {"autoscaling": {"enabled": True}}, "decode": {"autoscaling": {"enabled": True}},
                      "serviceMonitor": {"enabled": True}, "modelCache": {"enabled": True},
                      "redis": {"persistence": {"enabled": True}}, "engine": ["--max-num-seqs", "64"]},
}


@pytest.fixture(scope="module", autouse=True)
def _schemas_read_once() -> Any:
    """kubernetes-validate reads its schema files (the definitions are megabytes) on every call: read each once."""
    import functools

    from kubernetes_validate import utils

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(utils, "schema_contents", functools.lru_cache(maxsize=None)(utils.schema_contents))
        yield


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(values) for name, values in VALUE_SETS.items()}


def test_helm_lint_is_clean() -> None:
    for values in VALUE_SETS.values():
        report = helm.lint(str(CHART), values, strict=True)
        assert report["errors"] == [] and not [m for m in report["messages"] if m["severity"] >= 2], report


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_manifest_is_valid_kubernetes_in_strict_mode(name: str, rendered: dict[str, list[dict]]) -> None:
    checked = 0
    for obj in rendered[name]:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)  # raises ValidationError
        checked += 1
    assert checked >= 8


def test_strict_validation_catches_a_misspelt_field(rendered: dict[str, list[dict]]) -> None:
    """The validation above is not vacuous: an unknown field in a container fails it."""
    deployment = find(rendered["defaults"], "Deployment", "gateway")
    containers(deployment)[0]["livenesProbe"] = containers(deployment)[0]["livenessProbe"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def _pool_workers(head: dict, role: str) -> int:
    args = containers(head)[0]["args"]
    return int(next(a for a in args if a.startswith(f"--{role}-workers=")).split("=")[1])


def test_replicas_per_pool_and_the_head_starts_that_many_workers(rendered: dict[str, list[dict]]) -> None:
    for name, (num_prefill, num_decode) in {"defaults": (1, 1), "3-prefill-5-decode": (3, 5)}.items():
        objects = rendered[name]
        assert find(objects, "Deployment", "prefill")["spec"]["replicas"] == num_prefill
        assert find(objects, "Deployment", "decode")["spec"]["replicas"] == num_decode
        assert find(objects, "Deployment", "gateway")["spec"]["replicas"] == 2
        head = find(objects, "Deployment", "head")
        assert head["spec"]["replicas"] == 1
        assert (_pool_workers(head, "prefill"), _pool_workers(head, "decode")) == (num_prefill, num_decode)


def test_each_pool_node_advertises_its_pools_resource(rendered: dict[str, list[dict]]) -> None:
    for role in ("prefill", "decode"):
        (node,) = containers(find(rendered["defaults"], "Deployment", role))
        assert node["command"] == ["ray", "start"]
        assert f'--resources={{"splitserve_{role}": 1}}' in node["args"] and "--block" in node["args"]
        assert f"--address={RELEASE}-splitserve-head:6379" in node["args"]


def test_resources_gpus_node_selectors_and_tolerations_per_pool(rendered: dict[str, list[dict]]) -> None:
    objects = rendered["gpu"]
    prefill, decode = find(objects, "Deployment", "prefill"), find(objects, "Deployment", "decode")
    (p,), (d,) = containers(prefill), containers(decode)
    assert p["resources"]["limits"]["nvidia.com/gpu"] == 1 and d["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert p["resources"]["requests"] == {"cpu": "4", "memory": "8Gi"}
    assert "--num-gpus=1" in p["args"] and "--num-gpus=2" in d["args"]
    assert p["image"].endswith(":0.1.0-cuda") and d["image"].endswith(":0.1.0-cuda")
    assert prefill["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert prefill["spec"]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "nodeSelector" not in decode["spec"]["template"]["spec"]
    for name in ("defaults", "3-prefill-5-decode"):  # no GPU asked, none requested
        for role in ("prefill", "decode"):
            (c,) = containers(find(rendered[name], "Deployment", role))
            assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
            assert not any(a.startswith("--num-gpus") for a in c["args"])


def test_a_pools_tensor_parallel_size_reaches_the_head_and_needs_a_gpu_per_rank(
        rendered: dict[str, list[dict]]) -> None:
    head_args = containers(find(rendered["tensor-parallel"], "Deployment", "head"))[0]["args"]
    assert "--prefill-tensor-parallel-size=2" in head_args
    assert not any(a.startswith("--decode-tensor-parallel-size") for a in head_args)  # 1: the default
    assert not any("tensor-parallel" in a for a in containers(find(rendered["defaults"], "Deployment", "head"))[0]["args"])
    with pytest.raises(Exception, match=re.escape("decode.gpus is 2: a pod of 1 workers of tensorParallelSize 4 needs "
                                                  "4 GPUs (one per rank)")):
        render({"decode": {"tensorParallelSize": 4, "gpus": 2}})


def test_selectors_match_their_pods_labels(rendered: dict[str, list[dict]]) -> None:
    for name in ("defaults", "everything-on"):
        objects = rendered[name]
        pods = {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"]
                for o in objects if o["kind"] in ("Deployment", "StatefulSet")}
        for o in objects:
            if o["kind"] in ("Deployment", "StatefulSet", "PodDisruptionBudget"):
                selector = o["spec"]["selector"]["matchLabels"]
            elif o["kind"] == "Service":
                selector = o["spec"]["selector"]
            else:
                continue
            matching = [n for n, labels in pods.items() if selector.items() <= labels.items()]
            assert len(matching) == 1, (o["kind"], o["metadata"]["name"], matching)
        for hpa in of_kind(objects, "HorizontalPodAutoscaler"):  # and every HPA targets a Deployment of the chart
            assert hpa["spec"]["scaleTargetRef"]["name"] in pods
        components = {labels["app.kubernetes.io/component"] for labels in pods.values()}
        assert components == {"gateway", "head", "prefill-pool", "decode-pool", "redis"}


def test_every_container_has_liveness_apart_from_readiness(rendered: dict[str, list[dict]]) -> None:
    for name in ("defaults", "kuberay"):
        objects = rendered[name]
        templates = [o["spec"]["template"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
        for cluster in of_kind(objects, "RayCluster"):
            templates += [cluster["spec"]["headGroupSpec"]["template"]]
            templates += [g["template"] for g in cluster["spec"]["workerGroupSpecs"]]
        assert templates
        for template in templates:
            for c in template["spec"]["containers"]:
                assert "livenessProbe" in c and "readinessProbe" in c, c["name"]
                assert c["livenessProbe"] != c["readinessProbe"], c["name"]
    (gateway,) = containers(find(rendered["defaults"], "Deployment", "gateway"))
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/live"
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"


def test_only_the_gateway_service_is_exposed(rendered: dict[str, list[dict]]) -> None:
    for name, objects in rendered.items():
        services = {o["metadata"]["name"]: o for o in of_kind(objects, "Service")}
        gateway = services.pop(f"{RELEASE}-splitserve-gateway")
        assert gateway["spec"]["ports"][0]["targetPort"] == "http"
        for other in services.values():  # head (GCS), redis: cluster-internal
            assert other["spec"]["type"] == "ClusterIP", other["metadata"]["name"]
    assert find(rendered["everything-on"], "Service", "gateway")["spec"]["type"] == "LoadBalancer"


def test_an_ingress_to_the_gateway_terminates_tls_only_when_asked(rendered: dict[str, list[dict]]) -> None:
    assert of_kind(rendered["defaults"], "Ingress") == []
    (ingress,) = of_kind(rendered["everything-on"], "Ingress")
    spec = ingress["spec"]
    assert spec["ingressClassName"] == "nginx"
    assert spec["tls"] == [{"secretName": "llm-example-com-tls", "hosts": ["llm.example.com"]}]
    (rule,) = spec["rules"]
    assert rule["host"] == "llm.example.com"
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": f"{RELEASE}-splitserve-gateway", "port": {"name": "http"}}


def test_the_network_policy_admits_outsiders_to_the_gateway_only(rendered: dict[str, list[dict]]) -> None:
    policies = {o["metadata"]["name"]: o["spec"] for o in of_kind(rendered["defaults"], "NetworkPolicy")}
    internal, gateway = policies[f"{RELEASE}-splitserve-internal"], policies[f"{RELEASE}-splitserve-gateway"]
    release = {"app.kubernetes.io/instance": RELEASE}
    assert internal["podSelector"]["matchLabels"] == release  # every pod of the release ...
    assert internal["ingress"] == [{"from": [{"podSelector": {"matchLabels": release}}]}]  # ... only from the release
    assert gateway["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    assert gateway["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}]  # any source, the HTTP port only
    assert not of_kind(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy")


def test_the_secret_is_referenced_by_every_ray_container_and_the_gateway(rendered: dict[str, list[dict]]) -> None:
    objects = rendered["defaults"]
    (secret,) = of_kind(objects, "Secret")
    keys = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(keys) == {"admin-token", "api-key", "cluster-secret", "redis-password"}
    assert all(len(v) >= 40 for v in keys.values())
    refs: dict[str, set[str]] = {}
    for o in objects:
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in containers(o):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == secret["metadata"]["name"]
                    refs.setdefault(o["metadata"]["name"].rsplit("-", 1)[1], set()).add(f"{env['name']}={ref['key']}")
    for component in ("head", "prefill", "decode", "gateway"):
        assert "RAY_AUTH_TOKEN=cluster-secret" in refs[component]
    assert "SPLITSERVE_ADMIN_TOKEN=admin-token" in refs["gateway"]
    assert {"REDIS_PASSWORD=redis-password", "REDISCLI_AUTH=redis-password"} == refs["redis"]
    assert "REDIS_PASSWORD=redis-password" in refs["head"]
    given = render({"secrets": {"adminToken": "admin-t0ken", "clusterSecret": "s3cret", "redisPassword": "r3dis"}})
    data = of_kind(given, "Secret")[0]["data"]
    assert base64.b64decode(data["admin-token"]) == b"admin-t0ken" and base64.b64decode(data["cluster-secret"]) == b"s3cret"
    assert base64.b64decode(data["redis-password"]) == b"r3dis"
    assert not of_kind(render({"secrets": {"existingSecret": "mine"}}), "Secret")


def _env(container: dict[str, Any], secret: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: `$(NAME)` expanded from the entries before it."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = expand(entry["value"], env, strict=True)
        else:
            env[entry["name"]] = secret[entry["valueFrom"]["secretKeyRef"]["key"]]
    return env


def _secret(objects: list[dict[str, Any]]) -> dict[str, str]:
    (secret,) = of_kind(objects, "Secret")
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def test_redis_in_the_release_takes_the_secrets_password(rendered: dict[str, list[dict]]) -> None:
    """The release's Redis runs with the Secret's password as its requirepass, and the head's prefix index URL
    (which the controller hands to the workers and the gateways) carries it; neither is on a command line.
    tests/helm/test_pods_as_processes.py runs these containers."""
    for name in ("defaults", "kuberay"):
        objects = rendered[name]
        password = _secret(objects)["redis-password"]
        if name == "kuberay":
            (cluster,) = of_kind(objects, "RayCluster")
            head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
        else:
            (head,) = containers(find(objects, "Deployment", "head"))
        assert _env(head, _secret(objects))["SPLITSERVE_REDIS_URL"] == \
            f"redis://:{password}@{RELEASE}-splitserve-redis:6379/0", name
        assert not [a for a in head["args"] if "redis" in a or password in a], name
    (redis,) = containers(find(rendered["defaults"], "StatefulSet", "redis"))
    assert redis["command"] == ["sh", "-c"]
    script, *redis_args = redis["args"]
    assert "--protected-mode" not in redis_args  # with a password, Redis's protected mode has nothing to refuse
    # the script: redis-server with its arguments, and the config on stdin naming the password from the Secret
    assert re.search(r'^exec redis-server - "\$@" <<EOF\nrequirepass \$REDIS_PASSWORD\nEOF\n$', script)
    assert _env(redis, _secret(rendered["defaults"]))["REDIS_PASSWORD"] == _secret(rendered["defaults"])["redis-password"]
    assert redis["readinessProbe"]["exec"]["command"][:2] == ["redis-cli", "-e"]  # an error reply (NOAUTH) fails it


def test_both_kinds_of_head_take_the_secrets_cluster_secret(rendered: dict[str, list[dict]]) -> None:
    """The head gives the cluster secret to every worker and the gateway reads it from the controller: a head
    without it would make up its own, and the Secret's `cluster-secret` would guard nothing but Ray."""
    for name in ("defaults", "kuberay"):
        objects = rendered[name]
        if name == "kuberay":
            (cluster,) = of_kind(objects, "RayCluster")
            head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
        else:
            (head,) = containers(find(objects, "Deployment", "head"))
        assert _env(head, _secret(objects))["SPLITSERVE_CLUSTER_SECRET"] == _secret(objects)["cluster-secret"], name
        assert not [a for a in head["args"] if _secret(objects)["cluster-secret"] in a], name


def test_the_redis_password_must_be_safe_in_a_url_and_a_config_line() -> None:
    given = render({"secrets": {"redisPassword": "Az09-._~"}})
    assert base64.b64decode(of_kind(given, "Secret")[0]["data"]["redis-password"]) == b"Az09-._~"
    for bad in ("p@ss", "pass word", "a/b", 'quo"te'):
        with pytest.raises(helm.HelmValuesError, match="/secrets/redisPassword"):
            render({"secrets": {"redisPassword": bad}})


def test_redis_external(rendered: dict[str, list[dict]]) -> None:
    external = rendered["external-redis"]
    assert not of_kind(external, "StatefulSet") and not [s for s in of_kind(external, "Service") if "redis" in s["metadata"]["name"]]
    (head,) = containers(find(external, "Deployment", "head"))
    assert _env(head, _secret(external))["SPLITSERVE_REDIS_URL"] == "redis://redis.example.internal:6379/2"
    assert "REDIS_PASSWORD" not in _env(head, _secret(external))
    assert "--no-prefix-index" not in head["args"]


def test_kuberay_mode_is_a_raycluster_with_a_prefill_and_a_decode_group(rendered: dict[str, list[dict]]) -> None:
    objects = rendered["kuberay"]
    (cluster,) = of_kind(objects, "RayCluster")
    deployments = {o["metadata"]["name"].rsplit("-", 1)[1] for o in of_kind(objects, "Deployment")}
    assert deployments == {"gateway"}  # the head and the pools are the operator's now
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    assert groups["prefill"]["replicas"] == 2 and groups["decode"]["replicas"] == 3
    assert groups["prefill"]["rayStartParams"]["resources"] == '"{\\"splitserve_prefill\\": 1}"'
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    (command,) = head["template"]["spec"]["containers"][0]["args"]
    assert 'splitserve head --start-ray="$KUBERAY_GEN_RAY_START_CMD"' in command
    assert "'--prefill-workers=2'" in command and "'--decode-workers=3'" in command
    gateway_args = containers(find(objects, "Deployment", "gateway"))[0]["args"]
    assert f"--ray-address={RELEASE}-splitserve-head-svc:6379" in gateway_args  # KubeRay's head Service
    pdbs = {p["metadata"]["name"]: p["spec"]["selector"]["matchLabels"] for p in of_kind(objects, "PodDisruptionBudget")}
    assert pdbs[f"{RELEASE}-splitserve-decode"] == {"ray.io/cluster": f"{RELEASE}-splitserve", "ray.io/group": "decode"}


def test_a_pdb_per_pool_and_hpas_when_asked(rendered: dict[str, list[dict]]) -> None:
    names = {p["metadata"]["name"] for p in of_kind(rendered["defaults"], "PodDisruptionBudget")}
    assert {f"{RELEASE}-splitserve-{c}" for c in ("prefill", "decode", "gateway")} <= names
    assert not of_kind(rendered["defaults"], "HorizontalPodAutoscaler")
    hpas = {h["spec"]["scaleTargetRef"]["name"].rsplit("-", 1)[1] for h in of_kind(rendered["everything-on"], "HorizontalPodAutoscaler")}
    assert hpas == {"gateway", "prefill", "decode"}
    for role in ("prefill", "decode", "gateway"):  # the HPA owns the replica count then
        assert "replicas" not in find(rendered["everything-on"], "Deployment", role)["spec"]


def test_servicemonitor_and_dashboard(rendered: dict[str, list[dict]]) -> None:
    import json

    assert not of_kind(rendered["defaults"], "ServiceMonitor")
    (monitor,) = of_kind(rendered["everything-on"], "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    (dashboard,) = of_kind(rendered["defaults"], "ConfigMap")
    panels = json.loads(dashboard["data"]["splitserve.json"])["panels"]
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for metric in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                   "ttft_stage_seconds", "pool_kv_cache_usage_perc", "prefix_cache_hits_total",
                   "admission_queue_requests", "pool_num_requests_waiting"):
        assert f"splitserve:{metric}" in exprs, metric
    source = "".join((REPO_ROOT / "router" / name).read_text() for name in ("metrics.py", "pool_signals.py"))
    for metric in set(re.findall(r"splitserve:([a-z0-9_]+)", exprs)):  # every metric it names is the gateway's
        base = re.sub(r"_(bucket|total)$", "", metric)
        assert re.search(rf'{{_?PREFIX}}{base}"|"{base}"', source) or (
            base.startswith("pool_") and f'"{base.removeprefix("pool_")}"' in source), metric


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"prefill": {"replicas": -1}}, "/prefill/replicas"),
        ({"decode": {"replicas": 0}}, "/decode/replicas"),
        ({"gateway": {"replicas": "two"}}, "/gateway/replicas"),
        ({"kvTransport": "carrier-pigeon"}, "/kvTransport"),
        ({"redis": {"enabled": False}}, "url"),
        ({"redis": {"enabled": False, "url": "http://not-redis"}}, "/redis/url"),
        ({"prefill": {"gpus": -1}}, "/prefill/gpus"),
        ({"gateway": {"service": {"type": "Ingress"}}}, "/gateway/service/type"),
        ({"modle": "typo"}, "modle"),
        ({"gateway": {"servedModelName": "smol"}}, "/gateway/servedModelName"),
        ({"gateway": {"servedModelName": ["smol", "smol"]}}, "/gateway/servedModelName"),
        ({"gateway": {"servedModelName": [" "]}}, "/gateway/servedModelName/0"),
    ],
)
def test_the_schema_rejects_bad_values(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
        render(values)


def test_the_gateway_serves_its_names_and_the_chat_template_it_mounts(rendered: dict[str, list[dict]]) -> None:
    """gateway.servedModelName and gateway.chatTemplate become the gateway's own flags, as its parser reads them:
    the template from a ConfigMap mounted where the flag points, its digest on the pod so that a change rolls it."""
    from deploy.cli import build_parser
    from deploy.serve_args import gateway_config_from_args

    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    objects = render({"gateway": {"servedModelName": ["smol", "gpt-4o-mini"], "chatTemplate": template,
                                  "args": ["--queue-timeout", "5"]}})
    deployment = find(objects, "Deployment", "gateway")
    container = containers(deployment)[0]
    config = gateway_config_from_args(build_parser().parse_args(["gateway", *container["args"]]))
    assert config.served_model_names == ("smol", "gpt-4o-mini") and config.queue_timeout_s == 5
    path = Path(config.chat_template)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "chat-template")
    assert str(path.parent) == mount["mountPath"] and mount["readOnly"]
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "chat-template")
    config_map = find(objects, "ConfigMap", "chat-template")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert config_map["data"] == {path.name: template}
    digest = deployment["spec"]["template"]["metadata"]["annotations"]["checksum/chat-template"]
    other = find(render({"gateway": {"chatTemplate": template + " "}}), "Deployment", "gateway")
    assert other["spec"]["template"]["metadata"]["annotations"]["checksum/chat-template"] != digest
    # Neither set: no flag, no ConfigMap, no mount.
    default = find(rendered["defaults"], "Deployment", "gateway")
    assert not [a for a in containers(default)[0]["args"] if "chat-template" in a or "served-model-name" in a]
    assert not [o for o in of_kind(rendered["defaults"], "ConfigMap") if "chat-template" in o["metadata"]["name"]]


def test_gateway_env_reaches_the_gateway_pods_beside_the_secrets() -> None:
    env = [{"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "true"}]
    container = containers(find(render({"gateway": {"env": env}}), "Deployment", "gateway"))[0]
    assert env[0] in container["env"] and "SPLITSERVE_API_KEY" in [e["name"] for e in container["env"]]
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError):
        render({"gateway": {"env": [{"name": "X"}]}})  # a value is required


def test_values_yaml_has_the_keys_the_issue_lists() -> None:
    import yaml

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in ("image.repository", "image.tag", "model", "gateway.replicas", "prefill.replicas", "decode.replicas",
                 "prefill.resources", "decode.resources", "redis.enabled", "redis.url", "kvTransport", "engine"):
        node = values
        for key in path.split("."):
            assert key in node, path
            node = node[key]


def test_notes_say_how_to_reach_the_gateway_and_scale_each_pool() -> None:
    notes = render({}, notes=True)
    assert f"port-forward svc/{RELEASE}-splitserve-gateway" in notes
    assert f"scale deployment/{RELEASE}-splitserve-prefill" in notes and f"scale deployment/{RELEASE}-splitserve-decode" in notes
    assert "splitserve scale --url" in notes
    # the gateway takes the Secret's API key (SPLITSERVE_API_KEY): the example request carries it
    assert f"get secret {RELEASE}-splitserve-secrets -o jsonpath='{{.data.api-key}}'" in notes
    assert '-H "Authorization: Bearer $KEY"' in notes


def test_the_images_install_with_the_readmes_script() -> None:
    """The Dockerfiles' install steps are the README's: both run deploy/setup.sh, and nothing else installs
    Python packages in the images (so the two cannot drift apart)."""
    readme = (REPO_ROOT / "README.md").read_text()
    assert "`deploy/setup.sh` creates `.venv`" in readme
    for name in ("Dockerfile", "Dockerfile.cuda"):
        text = (REPO_ROOT / "deploy" / "docker" / name).read_text()
        runs = [line for line in text.replace("\\\n", " ").splitlines() if line.startswith("RUN ")]
        assert [r for r in runs if "bash deploy/setup.sh" in r], name
        assert not [r for r in runs if re.search(r"\bpip\b", r)], f"{name} installs packages itself"
        assert re.search(r"^USER (?!root)\w+", text, re.M) and 'ENTRYPOINT ["splitserve"]' in text, name
