"""/metrics: prefix-cache hits by tier and the KV offload tier's bytes, from the workers' LoadStats."""

from __future__ import annotations

from tests.router.conftest import Cluster
from tests.router.test_metrics_and_status import scrape, value


def test_prefix_cache_hits_by_tier_and_offload_bytes(cluster: Cluster) -> None:
    cluster.prefill.load.prefix_cache_hits = 64
    cluster.prefill.load.prefix_cache_hits_by_tier.update(device=64, disk=2000)
    cluster.prefill.load.kv_offload_bytes.update(write=737_280 * 3, read=737_280 * 125)

    samples = scrape(cluster.client)

    assert value(samples, "splitserve:prefix_cache_hits_total", worker="prefill-0", tier="device") == 64
    assert value(samples, "splitserve:prefix_cache_hits_total", worker="prefill-0", tier="disk") == 2000
    assert value(samples, "splitserve:kv_offload_bytes_total", worker="prefill-0", direction="write") == 737_280 * 3
    assert value(samples, "splitserve:kv_offload_bytes_total", worker="prefill-0", direction="read") == 737_280 * 125
    # A worker without a tier: its device hits only, no offload bytes.
    assert [labels["tier"] for labels, _, _ in samples["splitserve:prefix_cache_hits_total"]
            if labels["worker"] == "decode-0"] == ["device"]
    assert not [s for s in samples.get("splitserve:kv_offload_bytes_total", []) if s[0]["worker"] == "decode-0"]
