"""A fault-injection KV source for the tests: a sender that stalls half-way through a handoff while a file exists,
so that a test can kill its worker mid-transfer (prefill_worker's SPLITSERVE_FAULT_KV_STALL_FILE, a peer fetch's
SPLITSERVE_FAULT_PEER_FETCH_STALL_FILE)."""

from __future__ import annotations

import os
import time

import torch

from kv_transfer.base import KVBlockSource
from kv_transfer.layout import KVHandoff


class StallHalfWay:
    """A KVBlockSource that stops before the second half of its blocks while the file `path` exists: it writes
    "stalled <transfer id>" into the file, then waits until the file is removed (the test kills the worker
    meanwhile, or lets the handoff go on)."""

    def __init__(self, source: KVBlockSource, handoff: KVHandoff, path: str) -> None:
        self.source = source
        self.layout = handoff.wire_layout
        self.stall_at = handoff.first_wire_block + len(handoff.wire_indices) // 2
        self.transfer_id = handoff.transfer_id
        self.path = path

    def read_block(self, index: int) -> torch.Tensor:
        if index == self.stall_at:
            try:  # never creates the file: a test that removed it already must not find it back
                marker = os.open(self.path, os.O_WRONLY | os.O_TRUNC)
                os.write(marker, f"stalled {self.transfer_id}\n".encode())
                os.close(marker)
            except FileNotFoundError:
                pass
            while os.path.exists(self.path):
                time.sleep(0.05)
        return self.source.read_block(index)
