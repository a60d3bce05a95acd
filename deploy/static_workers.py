"""A fixed list of worker processes, without Ray: what `splitserve gateway --prefill HOST:PORT --decode HOST:PORT`
(SGLang's router PD mode) or `--colocated HOST:PORT` routes to. The workers are plain processes
(`python -m prefill_worker`, `python -m decode_worker [--role colocated]`: worker/main.py).

    flags ──▶ WorkerList (roles and endpoints, validated, no I/O)
          ──▶ StaticWorkers.discover(): `Health` on every endpoint until each answers ok (bounded:
              --worker-wait-timeout; a GPU worker loads for a while; refused at once: a worker that refuses the
              cluster secret, or serves plaintext to a gateway with --grpc-tls-*)
          ──▶ check_workers() (pure): each worker's own id and incarnation; refused: a worker whose role is not
              its flag's, workers that run different engines (model, load format, block size, context length, KV
              cache dtype), two with one id
          ──▶ ServedEngine: the model, load format, block size, context length and mode the gateway serves, all
              taken from the workers (no gateway flag for them), so that it always matches them

As the router's worker provider (every refresh, from a thread) it asks every endpoint's `Health` again, at once,
with a short deadline: a worker restarted at the same address answers with its new incarnation (and, if its id
was not fixed, its new id), which replaces its entry. A worker that does not answer stays listed as it was; the
registry's load poll marks it unhealthy and routing skips it until it answers again, as it does for a Ray-managed
worker between its death and its restart (here no one restarts it: that is up to whoever runs the process).
A restarted worker whose role or engine changed is not taken (an error is logged; its old entry stays).

The pools' sizes are fixed: the admin API lists the workers (GET /admin/pools) but its scale answers 503 saying
so. No `ray` import anywhere on this path (tests/deploy/test_static_gateway.py checks it).
"""

from __future__ import annotations

import argparse
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from engine.request.sampling_params import DEFAULT_MAX_LOGPROBS
from protos import serving_pb2, serving_pb2_grpc
from protos.cluster_auth import ClusterAuth, sync_channel
from protos.worker_info import WorkerInfo
from router.config import ServedEngine

if TYPE_CHECKING:
    from router.admin import PoolWorker

logger = logging.getLogger(__name__)

FLAG_OF_ROLE = {"prefill": "--prefill", "decode": "--decode", "colocated": "--colocated"}
DEFAULT_WORKER_WAIT_TIMEOUT_S = 300.0
_ENDPOINT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")  # host:port, [v6]:port


@dataclass(frozen=True, kw_only=True)
class WorkerList:
    """The endpoints (host:port of each worker's gRPC server) the flags name, by role: prefill + decode, or
    colocated."""

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("--colocated workers run both phases: give either --colocated or --prefill and --decode, "
                             "not both")
        if not self.colocated and not (self.prefill and self.decode):
            given, missing = ("--prefill", "--decode") if self.prefill else ("--decode", "--prefill")
            if not self.prefill and not self.decode:
                raise ValueError("a fixed worker list needs --prefill HOST:PORT and --decode HOST:PORT, or "
                                 "--colocated HOST:PORT")
            raise ValueError(f"{given} needs {missing} too: a disaggregated gateway routes each request to a prefill "
                             "and a decode worker (or give --colocated workers)")
        seen: set[str] = set()
        for role, endpoint in self.endpoints():
            if not _ENDPOINT.match(endpoint) or not 0 < int(endpoint.rpartition(":")[2]) <= 65535:
                raise ValueError(f"{FLAG_OF_ROLE[role]} {endpoint!r}: expected HOST:PORT, the worker's gRPC endpoint "
                                 "(the ENDPOINT line it prints)")
            if endpoint in seen:
                raise ValueError(f"{endpoint} is given twice: each worker once, under its own role's flag")
            seen.add(endpoint)

    @property
    def mode(self) -> str:
        return "colocated" if self.colocated else "disaggregated"

    def endpoints(self) -> list[tuple[str, str]]:
        """(role, endpoint) of every worker, in flag order."""
        return [(role, endpoint) for role in FLAG_OF_ROLE for endpoint in getattr(self, role)]


def add_worker_list_args(p: argparse.ArgumentParser) -> None:
    """`gateway`'s fixed worker list: instead of --ray-address."""
    group = p.add_argument_group("a fixed worker list, without Ray (instead of --ray-address)")
    for role, flag in FLAG_OF_ROLE.items():
        group.add_argument(flag, action="append", default=None, metavar="HOST:PORT", dest=f"{role}_endpoints",
                           help=f"a {role} worker process' gRPC endpoint; repeatable")
    group.add_argument("--worker-wait-timeout", type=float, default=DEFAULT_WORKER_WAIT_TIMEOUT_S,
                       help="seconds to wait at start for every listed worker to answer (a GPU worker loads a while)")
    group.add_argument("--redis-url", default=None,
                       help="the prefix index's Redis the workers publish to (their --redis-url); none: route by load")


def worker_list_from_args(args: argparse.Namespace) -> WorkerList | None:
    """The fixed worker list the flags give, validated (ValueError naming the flag); None: the workers come from
    the head's controller (--ray-address). Exactly one of the two must be given."""
    prefill, decode, colocated = (tuple(getattr(args, f"{role}_endpoints") or ()) for role in FLAG_OF_ROLE)
    if not (prefill or decode or colocated):
        if args.ray_address is None:
            raise ValueError("give the workers: --ray-address HOST:PORT (the head's controller), or a fixed list: "
                             "--prefill HOST:PORT --decode HOST:PORT, or --colocated HOST:PORT")
        if args.redis_url is not None:
            raise ValueError("--redis-url goes with a fixed worker list; with --ray-address the index is the "
                             "controller's")
        return None
    if args.ray_address is not None:
        raise ValueError("--ray-address finds the workers through the head's controller; --prefill/--decode/"
                         "--colocated name them: give one or the other")
    if args.start_ray is not None:
        raise ValueError("--start-ray is for --ray-address: a fixed worker list needs no Ray")
    if not args.worker_wait_timeout > 0:
        raise ValueError(f"--worker-wait-timeout must be positive, got {args.worker_wait_timeout}")
    return WorkerList(prefill=prefill, decode=decode, colocated=colocated)


def _engine_of(answer: serving_pb2.HealthResponse) -> tuple[str, str, int, int, str, str, int]:
    return (answer.engine_model, answer.load_format, answer.block_size, answer.max_model_len, answer.kv_cache_dtype,
            answer.scheduling_policy or "fcfs", _max_logprobs(answer))


def _max_logprobs(answer: serving_pb2.HealthResponse) -> int:
    return answer.max_logprobs if answer.HasField("max_logprobs") else DEFAULT_MAX_LOGPROBS


_ENGINE_FIELDS = ("model", "load format", "block size", "max model len", "KV cache dtype", "scheduling policy",
                  "max logprobs")


def check_workers(workers: WorkerList,
                  answers: dict[str, serving_pb2.HealthResponse]) -> tuple[list[WorkerInfo], ServedEngine]:
    """Every listed worker as the router knows it, and the engine they all run, from their `Health` answers
    (endpoint -> answer, one for each). ValueError when a worker's role is not its flag's, when two run
    different engines, or when two share an id."""
    infos: list[WorkerInfo] = []
    first: tuple[str, serving_pb2.HealthResponse] | None = None
    for role, endpoint in workers.endpoints():
        answer = answers[endpoint]
        if answer.role != role:
            raise ValueError(f"{FLAG_OF_ROLE[role]} {endpoint}: that worker ({answer.worker_id}) is a "
                             f"{answer.role or 'role-less'} worker; give it as {FLAG_OF_ROLE.get(answer.role, '?')}")
        if not answer.engine_model or not answer.block_size or not answer.max_model_len:
            raise ValueError(f"{endpoint}: the worker ({answer.worker_id}) does not report its engine (model, block "
                             "size, context length): it predates this gateway; run the same splitserve version")
        if first is None:
            first = (endpoint, answer)
        elif _engine_of(answer) != _engine_of(first[1]):
            differ = [f"{name} {a!r} vs {b!r}" for name, a, b in
                      zip(_ENGINE_FIELDS, _engine_of(first[1]), _engine_of(answer), strict=True) if a != b]
            raise ValueError(f"the workers run different engines: {first[0]} ({first[1].worker_id}) and {endpoint} "
                             f"({answer.worker_id}) differ in {', '.join(differ)}; start every worker with the "
                             "same --model, --load-format, --block-size, --max-model-len, --kv-cache-dtype, "
                             "--scheduling-policy and --max-logprobs")
        infos.append(WorkerInfo(worker_id=answer.worker_id, role=role, endpoint=endpoint,
                                incarnation=answer.incarnation))
    ids = [info.worker_id for info in infos]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise ValueError(f"worker id(s) {', '.join(twice)} answer at more than one endpoint: give each worker its "
                         "own --worker-id")
    assert first is not None  # a WorkerList is never empty
    answer = first[1]
    served = ServedEngine(model=answer.engine_model, load_format=answer.load_format, block_size=answer.block_size,
                          max_model_len=answer.max_model_len, mode=workers.mode,
                          scheduling_policy=answer.scheduling_policy or "fcfs", max_logprobs=_max_logprobs(answer))
    return infos, served


def serves_plaintext(endpoint: str, *, timeout_s: float) -> bool:
    """Whether the gRPC server at `endpoint` answers a plaintext call: what a TLS gateway asks of a worker its TLS
    handshake failed with. The probe carries no secret (a worker that has one answers UNAUTHENTICATED, which
    still says it speaks plaintext); an unreachable or TLS-only endpoint fails it with UNAVAILABLE."""
    with grpc.insecure_channel(endpoint) as channel:
        try:
            serving_pb2_grpc.WorkerStub(channel).Health(serving_pb2.HealthRequest(), timeout=timeout_s)
        except grpc.RpcError as error:
            return error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    return True


class StaticWorkers:
    """The router's worker provider over a fixed list (see the module docstring), and the admin API's view of it.

    `discover()` once, before the app is built; then the registry calls it (`__call__`) from a thread."""

    def __init__(self, workers: WorkerList, *, auth: ClusterAuth, health_timeout_s: float = 2.0) -> None:
        self._workers = workers
        self._auth = auth
        self._health_timeout_s = health_timeout_s
        self._channels = {endpoint: sync_channel(endpoint, auth) for _, endpoint in workers.endpoints()}
        self._stubs = {e: serving_pb2_grpc.WorkerStub(c) for e, c in self._channels.items()}
        self._infos: list[WorkerInfo] = []
        self._served: ServedEngine | None = None
        self._engine: tuple[str, str, int, int, str] | None = None  # what every worker runs (`_engine_of`)
        self._refused: set[tuple[str, int]] = set()  # (endpoint, incarnation) already logged as not taken

    def discover(self, *, timeout_s: float, stop: threading.Event | None = None) -> ServedEngine | None:
        """Wait until every listed worker answers `Health` ok, check them (`check_workers`), and return the engine
        they run; None when `stop` was set meanwhile. TimeoutError naming those that did not answer in
        `timeout_s`; RuntimeError when one refuses the cluster secret, or serves plaintext to a TLS gateway (at
        once: it would never answer); ValueError from `check_workers`."""
        deadline = time.monotonic() + timeout_s
        answers: dict[str, serving_pb2.HealthResponse] = {}
        errors: dict[str, str] = {}
        while True:
            waiting = [e for e in self._stubs if e not in answers]
            for endpoint, outcome in self._ask(waiting, min(self._health_timeout_s, timeout_s)).items():
                if isinstance(outcome, serving_pb2.HealthResponse):
                    if outcome.ok:
                        answers[endpoint] = outcome
                    else:
                        errors[endpoint] = "answers Health not ok (its engine is stuck or stopped)"
                    continue
                if outcome.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise RuntimeError(f"the worker at {endpoint} refused this gateway's cluster secret: give the "
                                       "workers' --cluster-secret (or $SPLITSERVE_CLUSTER_SECRET)")
                if (self._auth.tls and outcome.code() == grpc.StatusCode.UNAVAILABLE
                        and serves_plaintext(endpoint, timeout_s=min(self._health_timeout_s, timeout_s))):
                    raise RuntimeError(f"the worker at {endpoint} serves plaintext gRPC, and this gateway's links "
                                       "are mutual TLS (--grpc-tls-cert/--grpc-tls-key/--grpc-tls-ca): start the "
                                       "worker with the same three flags")
                errors[endpoint] = f"{outcome.code().name} {outcome.details() or ''}".strip()
            if len(answers) == len(self._stubs):
                break
            if time.monotonic() >= deadline:
                left = ", ".join(f"{e} ({errors.get(e, 'no answer')})" for e in self._stubs if e not in answers)
                raise TimeoutError(f"workers did not answer within {timeout_s:g} s (--worker-wait-timeout): {left}")
            if stop is None:
                time.sleep(0.5)
            elif stop.wait(0.5):
                return None
        self._infos, self._served = check_workers(self._workers, answers)
        self._engine = _engine_of(answers[self._infos[0].endpoint])
        return self._served

    def __call__(self) -> list[WorkerInfo]:
        """The workers, each as it last answered `Health` (see the module docstring)."""
        if self._served is None:
            return list(self._infos)
        by_endpoint = {info.endpoint: info for info in self._infos}
        outcomes = self._ask(list(by_endpoint), self._health_timeout_s)
        infos = []
        for endpoint, info in by_endpoint.items():
            answer = outcomes.get(endpoint)
            if isinstance(answer, serving_pb2.HealthResponse) and answer.ok and (
                    answer.worker_id, answer.incarnation) != (info.worker_id, info.incarnation):
                info = self._restarted(info, answer)
            infos.append(info)
        self._infos = infos
        return list(infos)

    def _restarted(self, info: WorkerInfo, answer: serving_pb2.HealthResponse) -> WorkerInfo:
        """`info`'s successor when the worker that answers at its endpoint now may take its place, else `info`."""
        others = [i for i in self._infos if i.endpoint != info.endpoint]
        if (answer.role != info.role or _engine_of(answer) != self._engine
                or any(i.worker_id == answer.worker_id for i in others)):
            if (info.endpoint, answer.incarnation) not in self._refused:
                self._refused.add((info.endpoint, answer.incarnation))
                logger.error("the worker now at %s (%s, %s) does not match the one listed there (%s, %s); not taken",
                             info.endpoint, answer.worker_id, answer.role, info.worker_id, info.role)
            return info
        logger.info("worker at %s restarted: %s incarnation %d -> %s incarnation %d", info.endpoint, info.worker_id,
                    info.incarnation, answer.worker_id, answer.incarnation)
        return WorkerInfo(worker_id=answer.worker_id, role=info.role, endpoint=info.endpoint,
                          incarnation=answer.incarnation)

    def _ask(self, endpoints: list[str], timeout_s: float) -> dict[str, serving_pb2.HealthResponse | grpc.RpcError]:
        """`Health` on each endpoint at once: its answer, or the call's error."""
        futures = {e: self._stubs[e].Health.future(serving_pb2.HealthRequest(), timeout=timeout_s) for e in endpoints}
        out: dict[str, serving_pb2.HealthResponse | grpc.RpcError] = {}
        for endpoint, future in futures.items():
            try:
                out[endpoint] = future.result()
            except grpc.RpcError as error:
                out[endpoint] = error
        return out

    def restart_counts(self) -> list[tuple[str, str, int]]:
        """None: nothing here restarts a worker (splitserve:worker_restarts_total stays 0)."""
        return []

    def scale(self, role: str, num_workers: int) -> None:
        raise RuntimeError("this gateway routes to a fixed worker list (--prefill/--decode/--colocated): start or "
                           "stop worker processes and restart the gateway with the new list")

    def pool_workers(self) -> list[PoolWorker]:
        """Every listed worker, "serving" (GET /admin/pools; its load there says whether it answers)."""
        from router.admin import PoolWorker

        return [PoolWorker(worker_id=i.worker_id, role=i.role, state="serving", endpoint=i.endpoint,
                           incarnation=i.incarnation) for i in self._infos]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
