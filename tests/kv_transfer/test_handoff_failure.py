"""Why a request got no KV: a sender's exception named by one word of a closed set, read back from a status's
trailing metadata only when it is one of them."""

from __future__ import annotations

import pytest

from kv_transfer.handoff_failure import REASON_KEY, REASONS, reason_in, reason_of
from kv_transfer.layout import KVChecksumError, KVLayoutMismatch, KVRefused, KVTransferError, KVTransferTimeout


@pytest.mark.parametrize(("exc", "reason"), [
    (KVTransferTimeout("no answer by the deadline"), "kv_transfer_timeout"),
    (KVChecksumError("block 3"), "kv_transfer_checksum"),
    (KVRefused("who are you", reason="unknown_transfer"), "kv_transfer_refused"),
    (KVLayoutMismatch("16 vs 32 tokens a block"), "kv_transfer_refused"),
    (KVTransferError("cut half-way"), "kv_transfer_failed"),
    (KeyError("aborted meanwhile"), "kv_transfer_failed"),
])
def test_a_senders_exception_is_named_by_its_kind(exc: BaseException, reason: str) -> None:
    assert reason_of(exc) == reason
    assert reason in REASONS


def test_a_status_names_a_reason_only_from_the_set() -> None:
    assert reason_in([("x-other", "kv_transfer_timeout"), (REASON_KEY, "kv_transfer_timeout")]) == "kv_transfer_timeout"
    assert reason_in([(REASON_KEY, b"prefill_unavailable")]) == "prefill_unavailable"
    assert reason_in([(REASON_KEY, "anything else")]) is None  # a label takes known values only
    assert reason_in([]) is None and reason_in(None) is None
