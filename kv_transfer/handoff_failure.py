"""Why a disaggregated request got no KV: one word of a closed set, carried from where the failure is seen to the
gateway's metrics. No torch: the router imports this.

    prefill worker  its sender raised ──reason_of(exc)──▶ PrefillResponse.error_reason
    decode worker   that, or why its own Prefill call failed ──▶ the ABORTED status's trailing metadata (REASON_KEY)
    gateway         retries; when every attempt failed: 503, request_failure_total{reason}

    kv_transfer_timeout   the handoff's deadline (--kv-transfer-timeout) passed before the receiver confirmed it
    kv_transfer_refused   the receiver refused it before any byte (unknown transfer, wrong source, block count,
                          layout)
    kv_transfer_checksum  a block arrived corrupt
    kv_transfer_failed    anything else: the receiver unreachable, the stream cut, the sender's blocks gone
    prefill_unavailable   the decode worker could not reach the prefill worker
    prefill_timeout       the Prefill call's deadline passed (the prefill worker's queue, its prefill, the handoff)
    prefill_failed        the Prefill call failed otherwise

A peer that names no reason (an older worker) is counted as the gateway always counted it: kv_transfer.
"""

from __future__ import annotations

from collections.abc import Iterable

from kv_transfer.layout import KVChecksumError, KVLayoutMismatch, KVRefused, KVTransferTimeout

REASONS = (
    "kv_transfer_timeout", "kv_transfer_refused", "kv_transfer_checksum", "kv_transfer_failed",
    "prefill_unavailable", "prefill_timeout", "prefill_failed",
)
UNNAMED = "kv_transfer"  # a failed handoff whose worker named no reason
REASON_KEY = "splitserve-handoff-failure"  # the trailing-metadata key of the decode worker's ABORTED status


def reason_of(exc: BaseException) -> str:
    """The reason of a sender's exception (any exception a failed `send` raised)."""
    if isinstance(exc, KVTransferTimeout):
        return "kv_transfer_timeout"
    if isinstance(exc, KVChecksumError):
        return "kv_transfer_checksum"
    if isinstance(exc, (KVRefused, KVLayoutMismatch)):
        return "kv_transfer_refused"
    return "kv_transfer_failed"


def reason_in(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The reason named in a status's trailing metadata; None when none is, or one outside REASONS (a metrics label
    takes only known values)."""
    for key, value in metadata or ():
        if key == REASON_KEY:
            text = value.decode() if isinstance(value, bytes) else value
            return text if text in REASONS else None
    return None
