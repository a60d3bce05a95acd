"""A short chaos run (bench/chaos.py's `run`, not a copy of it): a real 2 + 2 cluster of SmolLM2 (real Ray, real gRPC
KV handoffs, the prefix index in a real Redis) under a steady load of streaming clients, and five faults, one of
each kind, in a seeded order: a decode worker SIGKILLed mid-stream, a worker SIGSTOPped for 8 s, a KV handoff cut
half-way, Redis restarted empty, and a prefill or decode host cut off for 15 s. Every response is checked against
the undisturbed greedy answer of its prompt.

The cluster is the Helm chart's pods on network namespaces (bench/chaos_clusters.py, tests/multihost/) where they
can be made (root, as in CI), so that the partition is a real one; elsewhere one `splitserve serve` on loopback,
where the partition is reported unavailable (not scheduled) and the four other faults run.

- no completed response differs from its prompt's undisturbed answer; no request hangs past its deadline; every
  request that did not complete ended cleanly (429/503 with Retry-After, or an SSE error event);
- each fault took effect: the killed stream migrated, the cut handoff failed and was counted;
- after a final drain every worker's KV blocks are free, and the prefix index holds exactly the pools' current
  incarnations (none of a restarted worker's old entries; every serving worker's entries back after Redis).
"""

from __future__ import annotations

import pytest

from bench import chaos
from bench.chaos_clusters import choose_hosts

pytestmark = [pytest.mark.slow, pytest.mark.ray]

FAULTS = ("kill_decode_mid_stream", "sigstop_worker", "cut_kv_transfer", "restart_redis", "partition_host")


def test_five_faults_under_load_lose_nothing_and_answer_nothing_wrong(smollm2_gguf: str, tmp_path) -> None:
    hosts, _ = choose_hosts("auto")
    config = chaos.ChaosConfig(duration_s=96, interval_s=16, seed=36, faults=FAULTS, num_clients=3, stop_s=8,
                               hosts=hosts)
    report = chaos.run(smollm2_gguf, config, tmp_path)
    summary = report.to_json()
    assert report.hosts == hosts, summary
    if hosts == "netns":
        assert not report.faults_unavailable, summary
        injected = FAULTS
    else:  # said so, not dropped silently
        assert list(report.faults_unavailable) == ["partition_host"], summary
        injected = FAULTS[:-1]
    assert sorted(f.name for f in report.faults) == sorted(injected), summary
    assert not report.fault_errors, summary
    assert report.completed_wrong == 0, summary
    assert report.hung == 0, summary
    assert not report.unclean_errors, summary
    assert report.completed_correct > 0 and report.requests_sent == report.completed_correct + sum(
        report.clean_errors.values()), summary
    assert report.migrations >= 1, summary  # the decode worker's stream went on elsewhere
    assert report.kv_transfer_failures >= 1, summary  # the cut handoff
    assert report.leaked_blocks and not any(report.leaked_blocks.values()), summary
    assert report.index_consistent, summary
