"""A chaos run: a real 2 + 2 cluster under a steady load, a fault every `--interval` seconds, every answer checked.

    python bench/chaos.py [--duration 600] [--interval 30] [--seed 0] [--out chaos.json] [--transport grpc|torch]
                          [--hosts auto|netns|loopback]

1. A real cluster of SmolLM2 (real Ray, real workers, real gRPC / torch KV handoffs) with 2 prefill and 2 decode
   workers, the admin API, short health checks, and the prefix index in a real Redis (bench/chaos_clusters.py):
   `--hosts netns`, the Helm chart's pods on hosts that are network namespaces (a head host, a Redis host, a host
   per pool worker, a spare pool host for scale-ups), or `--hosts loopback`, one `splitserve serve` with every
   process on this host; `auto` (the default) takes netns where namespaces can be made (root), and the JSON says
   which ran and why.
2. The undisturbed answers: each of `PROMPTS` (greedy, `ignore_eos`, `max_tokens`) once, as many at a time as
   the load has clients, on the cluster before any fault.
3. A steady load of `--clients` streaming clients (tests/cluster/load.py's SteadyLoad, each request greedy on a
   seeded choice of `PROMPTS`), and a fault every `--interval` seconds from a seeded schedule (every kind once per
   round, in a seeded order; each victim chosen by the same generator), each injected once the cluster is whole
   again (every worker serving and healthy). The fault kinds are bench/chaos_faults.py's: each a small class with
   a `name` and an `inject(cluster, rng)` that returns what it did. A fault the cluster cannot take (a host
   partition on loopback) is not scheduled, and the JSON says so (`faults_unavailable`).
4. Every response is checked: a completed stream must carry the undisturbed text and its token count; the others must
   be clean errors (429/503 with Retry-After, or an SSE error event); a request not ended within its deadline
   (`--request-timeout` + 30 s) is hung. After the run: a final drain, then every worker's KV blocks (GetLoad over
   the cluster's gRPC) must be free, and the prefix index must hold exactly the pools' current incarnations.

Printed and written (`--out`) as JSON: the hosts it ran on, requests sent, completed correct / wrong, clean errors
by status, unclean errors, hung, migrations, restarts, faults injected (and those unavailable), leaked blocks per
worker, index consistency. Issue 36's
target: >= 99% correct over 10 minutes with a fault every 30 s, 0 wrong, 0 hung, 0 leaked.

Why not AIPerf / GuideLLM (the project's load generators): the point here is per-request correctness under faults,
which they do not check; the load is tests/cluster/load.py's, with the prompt and text of each request recorded.
tests/cluster/test_chaos.py runs this module's `run` shorter, with fewer faults, and asserts the same invariants.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.chaos_clusters import choose_hosts  # noqa: E402
from bench.chaos_clusters import start as start_cluster  # noqa: E402
from bench.chaos_faults import PARTITION_S, Cluster, Fault, make_faults, schedule  # noqa: E402
from tests.cluster.load import Outcome, SteadyLoad, _one  # noqa: E402

# Every prompt three full 16-token blocks or more (SmolLM2's tokenizer), no two sharing a first block, and more of
# them than a worker's KV cache (32 MiB: 45 blocks) holds at once: the decode workers keep missing their prefix
# caches, so KV handoffs carry several blocks (one can be cut half-way) and index entries come and go all along.
_TOPICS = ("lighthouses", "volcanoes", "bread", "rainbows", "trains", "rivers", "bees", "glaciers", "comets",
           "violins", "deserts", "coral reefs", "windmills", "owls", "tides", "mushrooms", "bridges", "thunder",
           "penguins", "clocks", "maple trees", "submarines", "chess", "silk")
_TAIL = ("Answer in plain words for a curious reader who knows nothing about it yet: say what it is, how it works "
         "or how it came to be, one thing that most people get wrong about it, and why it matters today.")
PROMPTS = tuple(f"Question {i + 1} is about {topic}. {_TAIL}" for i, topic in enumerate(_TOPICS))


@dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    duration_s: float = 600.0  # of the load; faults start after one interval
    interval_s: float = 30.0
    seed: int = 0
    hosts: str = "auto"  # "netns": the chart's pods on network namespaces; "loopback": one `splitserve serve`
    transport: str = "grpc"
    faults: tuple[str, ...] = ()  # fault names (make_faults); empty: all
    num_clients: int = 3
    max_tokens: int = 16
    stop_s: float = 20.0  # how long a SIGSTOPped worker stays stopped
    partition_s: float = PARTITION_S  # how long a partitioned host stays cut off
    request_timeout_s: float = 60.0  # serve's --request-timeout; a request past it + 30 s is hung
    kv_transfer_timeout_s: float = 10.0
    step_sleep_s: float = 0.02  # every engine step paced, so that streams are long enough to be cut mid-way
    whole_timeout_s: float = 180.0  # a fault waits at most this long for the cluster to be whole again


@dataclass
class Injected:
    name: str
    at_s: float  # since the load started
    waited_whole_s: float
    took_s: float
    what: str


@dataclass
class ChaosReport:
    config: dict
    hosts: str = ""  # the cluster it ran on: "netns" or "loopback"
    hosts_reason: str = ""  # why (--hosts auto: whether namespaces can be made here)
    requests_sent: int = 0
    completed_correct: int = 0
    completed_wrong: int = 0
    clean_errors: dict[str, int] = field(default_factory=dict)  # "429", "503", "sse_error"
    unclean_errors: dict[str, int] = field(default_factory=dict)  # anything else, by status ("0": no response)
    hung: int = 0
    correct_fraction: float = 0.0
    migrations: float = 0.0
    retries: dict[str, float] = field(default_factory=dict)  # dispatches retried before any token, by reason
    restarts: dict[str, float] = field(default_factory=dict)  # "role/reason" -> count
    kv_transfer_failures: float = 0.0  # failed handoffs: the most the workers' counters showed (/metrics, per
    # incarnation), read after a cut_kv_transfer fault and at the end (a worker restarted later takes its count along)
    node_restarts: dict[str, int] = field(default_factory=dict)  # netns: pod -> restarts (its Ray node had exited)
    faults: list[Injected] = field(default_factory=list)
    fault_errors: list[str] = field(default_factory=list)  # faults that could not be injected; a cluster not whole
    faults_skipped: list[str] = field(default_factory=list)  # scheduled past the end (earlier ones ran late)
    faults_unavailable: dict[str, str] = field(default_factory=dict)  # asked for, not scheduled: why (loopback hosts)
    leaked_blocks: dict[str, int] = field(default_factory=dict)  # worker id -> KV blocks still used after the drain
    index_consistent: bool = False
    index_problems: list[str] = field(default_factory=list)
    wrong_examples: list[dict] = field(default_factory=list)
    error_examples: list[dict] = field(default_factory=list)

    def ok(self) -> bool:
        return (self.completed_wrong == 0 and self.hung == 0 and not any(self.leaked_blocks.values())
                and self.index_consistent and not self.unclean_errors and not self.fault_errors)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def classify(outcomes: list[Outcome], expected: dict[str, str], max_tokens: int, report: ChaosReport) -> None:
    """Count each outcome: correct, wrong, clean error, unclean error, hung."""
    clean: Counter[str] = Counter()
    unclean: Counter[str] = Counter()
    for o in outcomes:
        report.requests_sent += 1
        if o.hung:
            report.hung += 1
            report.error_examples.append({"hung": True, "prompt": o.prompt[:40], "error": o.error})
        elif o.completed:
            if o.text == expected[o.prompt] and o.num_tokens == max_tokens:
                report.completed_correct += 1
            else:
                report.completed_wrong += 1
                report.wrong_examples.append({"prompt": o.prompt, "expected": expected[o.prompt], "got": o.text,
                                              "num_tokens": o.num_tokens})
        elif o.status == 200 and o.error:
            clean["sse_error"] += 1
            report.error_examples.append({"status": 200, "error": o.error})
        elif o.status in (429, 503) and o.retry_after:
            clean[str(o.status)] += 1
        else:
            unclean[str(o.status)] += 1
            report.error_examples.append({"status": o.status, "error": o.error, "retry_after": o.retry_after})
    report.clean_errors, report.unclean_errors = dict(clean), dict(unclean)
    report.correct_fraction = report.completed_correct / report.requests_sent if report.requests_sent else 0.0
    del report.error_examples[20:], report.wrong_examples[10:]


def leaked_blocks(cluster: Cluster, timeout_s: float = 30.0) -> dict[str, int]:
    """worker id -> KV blocks still in use, once every worker's are free or `timeout_s` passed (GetLoad)."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = {w["worker_id"]: cluster.load(w["endpoint"]).kv_blocks_used for w in cluster.pools()}
        if not any(used.values()) or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


def index_problems(cluster: Cluster, timeout_s: float = 30.0) -> list[str]:
    """What keeps the prefix index from equalling the pools (empty: it does): an entry of a worker or incarnation
    not in the pools, or a worker that has cached prefixes (it served) with no entry. Retried for `timeout_s`
    (a Redis just restarted is resynchronised from the workers' snapshots)."""
    deadline = time.monotonic() + timeout_s
    while True:
        problems: list[str] = []
        body = httpx.get(f"{cluster.url}/v1/prefix_index", headers=cluster.api_headers, timeout=30).json()
        if not body.get("up"):
            problems.append(f"the index is down: {body}")
        else:
            pools = {w["worker_id"]: w for w in cluster.pools()}
            indexed = {e["worker_id"]: e for e in body["workers"]}
            for e in body["workers"]:
                worker = pools.get(e["worker_id"])
                if worker is None or worker["incarnation"] != e["incarnation"] or not e["live"]:
                    problems.append(f"stale entry {e}")
            for worker_id, w in pools.items():
                served = cluster.load(w["endpoint"]).prefix_cache_queries > 0
                if served and not indexed.get(worker_id, {}).get("num_blocks"):
                    problems.append(f"{worker_id} (incarnation {w['incarnation']}) served but has no index entry")
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(0.5)


def _expected_answers(url: str, model: str, max_tokens: int, num_clients: int,
                      headers: dict[str, str]) -> dict[str, str]:
    """Each prompt's undisturbed greedy text, `num_clients` requests at a time (as the load runs them), on the
    cluster before any fault."""
    import asyncio

    async def answers() -> dict[str, str]:
        limit = asyncio.Semaphore(num_clients)
        async with httpx.AsyncClient(base_url=url, timeout=120, headers=headers) as client:
            async def one(prompt: str) -> Outcome:
                async with limit:
                    return await _one(client, model, prompt, max_tokens)

            found = {}
            for prompt, o in zip(PROMPTS, await asyncio.gather(*(one(p) for p in PROMPTS)), strict=True):
                assert o.completed and o.num_tokens == max_tokens, f"undisturbed run failed: {o}"
                found[prompt] = o.text
            return found

    return asyncio.run(answers())


def _prompt(seed: int) -> Callable[[int, int], str]:
    """The load's prompt choice: client `c`'s `n`-th request, the same for every run of one seed."""
    return lambda c, n: random.Random(f"{seed}-{c}-{n}").choice(PROMPTS)


def run(model: str, config: ChaosConfig, work_dir: Path, *, log=print) -> ChaosReport:  # type: ignore[no-untyped-def]
    """The whole chaos run (see the module docstring) against `model` (a path or name serve takes) on the cluster
    `config.hosts` chooses; logs and the KV-cut trigger go under `work_dir`. Everything it started is stopped when
    it returns or raises."""
    faults: dict[str, Fault] = make_faults(stop_s=config.stop_s, partition_s=config.partition_s)
    names = list(config.faults) or list(faults)
    unknown = set(names) - set(faults)
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}; known: {sorted(faults)}")
    hosts, why = choose_hosts(config.hosts)
    rng = random.Random(config.seed)
    report = ChaosReport(config=asdict(config), hosts=hosts, hosts_reason=why)
    with start_cluster(hosts, model, config, work_dir, log) as cluster:
        cluster.wait_whole(config.whole_timeout_s)
        # a fault this cluster cannot take is said so, not dropped silently; the schedule is of the others
        report.faults_unavailable = {n: r for n in names if (r := faults[n].unavailable(cluster)) is not None}
        names = [n for n in names if n not in report.faults_unavailable]
        url = cluster.url
        model_id = httpx.get(f"{url}/v1/models", headers=cluster.api_headers, timeout=30).json()["data"][0]["id"]
        expected = _expected_answers(url, model_id, config.max_tokens, config.num_clients, cluster.api_headers)
        log(f"chaos: serving on {url} ({hosts}: {why}); undisturbed answers of {len(expected)} prompts known")
        deadline_s = config.request_timeout_s + 30
        load = SteadyLoad(url, model_id, num_clients=config.num_clients, max_tokens=config.max_tokens,
                          prompt=_prompt(config.seed), timeout_s=deadline_s + 30, deadline_s=deadline_s,
                          headers=cluster.api_headers).start()
        started = time.monotonic()
        num_faults = int((config.duration_s - 1e-6) // config.interval_s) if names else 0
        try:
            for k, name in enumerate(schedule(names, num_faults, rng), start=1):
                time.sleep(max(0.0, started + k * config.interval_s - time.monotonic()))
                if time.monotonic() - started >= config.duration_s:  # earlier faults ran late: the run is over
                    report.faults_skipped.append(name)
                    continue
                try:
                    waited = cluster.wait_whole(config.whole_timeout_s)
                    failures_before = _kv_transfer_failures(cluster)
                    at = time.monotonic()
                    what = faults[name].inject(cluster, rng)
                except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is a finding too
                    report.fault_errors.append(f"{name}: {type(exc).__name__}: {exc}"[:500])
                    log(f"chaos: {name} failed: {exc}")
                    continue
                report.faults.append(Injected(name=name, at_s=round(at - started, 1), waited_whole_s=round(waited, 1),
                                              took_s=round(time.monotonic() - at, 1), what=what))
                log(f"chaos: t={at - started:.0f}s {name}: {what} ({len(load.outcomes)} requests done)")
                if name == "cut_kv_transfer":  # read the failure before a later fault restarts the worker counting it
                    until = min(time.monotonic() + 12.0, started + (k + 1) * config.interval_s - 1.0)
                    try:
                        report.kv_transfer_failures = max(report.kv_transfer_failures, _await_more(
                            lambda: _kv_transfer_failures(cluster), failures_before, until))
                    except Exception as exc:  # noqa: BLE001 - the end's reading still counts; say why this one failed
                        log(f"chaos: reading kv_transfer_failures after the cut failed: {exc}")
            time.sleep(max(0.0, started + config.duration_s - time.monotonic()))
        finally:
            outcomes = load.stop()
        log(f"chaos: load stopped after {time.monotonic() - started:.0f} s, {len(outcomes)} requests")
        classify(outcomes, expected, config.max_tokens, report)
        try:
            cluster.wait_whole(config.whole_timeout_s)
        except TimeoutError as exc:
            report.fault_errors.append(f"final: {exc}"[:500])
        report.leaked_blocks = leaked_blocks(cluster)
        report.index_problems = index_problems(cluster)
        report.index_consistent = not report.index_problems
        report.migrations = sum(cluster.metric("splitserve:request_migrations_total").values())
        report.retries = {dict(k).get("reason", ""): v
                          for k, v in cluster.metric("splitserve:request_retries_total").items() if v}
        report.restarts = {f"{dict(k)['role']}/{dict(k)['reason']}": v
                           for k, v in cluster.metric("splitserve:worker_restarts_total").items() if v}
        report.kv_transfer_failures = max(report.kv_transfer_failures, _kv_transfer_failures(cluster))
        report.node_restarts = cluster.node_restarts()
        return report


def _kv_transfer_failures(cluster: Cluster) -> float:
    """The failed KV handoffs the current workers count (/metrics; a worker's count restarts with its incarnation)."""
    return sum(cluster.metric("splitserve:kv_transfer_failures_total").values())


def _await_more(read: Callable[[], float], before: float, until_s: float, *, period_s: float = 0.5) -> float:
    """`read()` until it exceeds `before` or time.monotonic() passes `until_s`; the last value read."""
    value = read()
    while value <= before and time.monotonic() < until_s:
        time.sleep(period_s)
        value = read()
    return value


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--interval", type=float, default=30.0, help="seconds between faults")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="chaos.json", help="where the JSON report goes")
    p.add_argument("--hosts", choices=("auto", "netns", "loopback"), default="auto",
                   help="the cluster: the Helm chart's pods on network namespaces (netns: needs root and iproute2), "
                        "one `splitserve serve` on loopback, or netns where it can run (auto)")
    p.add_argument("--transport", choices=("grpc", "torch"), default="grpc", help="the cluster's --kv-transport")
    p.add_argument("--faults", default="", help="comma-separated fault names (default: all): "
                   + ", ".join(make_faults(stop_s=0)))
    p.add_argument("--clients", type=int, default=3, help="concurrent streaming clients")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--work-dir", default="", help="where the processes' logs go, kept (default: a temporary "
                   "directory, removed)")
    args = p.parse_args(argv)
    config = ChaosConfig(duration_s=args.duration, interval_s=args.interval, seed=args.seed, hosts=args.hosts,
                         transport=args.transport,
                         faults=tuple(f for f in args.faults.split(",") if f), num_clients=args.clients)
    from engine.loader.model_registry import resolve_model

    with tempfile.TemporaryDirectory(prefix="splitserve-chaos-") as tmp:
        work_dir = Path(args.work_dir or tmp)
        work_dir.mkdir(parents=True, exist_ok=True)
        report = run(str(resolve_model(args.model)), config, work_dir, log=lambda line: print(line, flush=True))
    print(report.to_json())
    Path(args.out).write_text(report.to_json() + "\n")
    sys.exit(0 if report.ok() else 1)


if __name__ == "__main__":
    main()
