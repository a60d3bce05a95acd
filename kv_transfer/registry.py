"""Transports by name, imported lazily so that choosing gRPC never imports torch.distributed and vice versa.

    make_sender("grpc" | "torch" | "ipc" | "inproc", worker_id=..., device=...)
    make_receiver("grpc" | "torch" | "ipc" | "inproc", sink)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from protos.cluster_auth import OPEN, ClusterAuth

if TYPE_CHECKING:
    import torch

    from kv_transfer.base import KVReceiver, KVSender, KVSink

TRANSPORTS = ("grpc", "torch", "ipc", "inproc")
_MODULES = {
    "grpc": "kv_transfer.grpc_transport",
    "torch": "kv_transfer.torch_transport",
    "ipc": "kv_transfer.ipc_transport",
    "inproc": "kv_transfer.inproc_transport",
}


def _module(name: str):
    if name not in _MODULES:
        raise ValueError(f"unknown KV transport {name!r}; choose one of {', '.join(TRANSPORTS)}")
    return importlib.import_module(_MODULES[name])


def make_sender(name: str, *, worker_id: str, device: torch.device, auth: ClusterAuth = OPEN) -> KVSender:
    """`auth`: the cluster secret (and TLS) its control calls to receivers carry."""
    return _module(name).Sender(worker_id=worker_id, device=device, auth=auth)


def make_receiver(name: str, sink: KVSink) -> KVReceiver:
    return _module(name).Receiver(sink)
