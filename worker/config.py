"""A worker's configuration. Frozen, no I/O, no torch: the controller builds one per worker it starts, the worker
process from its flags (what the rest of the cluster knows of a running worker is protos/worker_info.py's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from protos.cluster_auth import OPEN, ClusterAuth
from protos.worker_info import check_role


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    worker_id: str
    role: str  # "prefill" | "decode" | "colocated" (runs both phases itself)
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"  # the address its gRPC server binds ("0.0.0.0": every interface)
    port: int = 0  # 0: any free port; the bound address is the worker's endpoint
    advertise_host: str = ""  # the host of its endpoint, for peers on other machines; "": `host`
    kv_transport: str = "grpc"  # "grpc" | "torch" | "ipc" | "inproc"
    kv_transfer_timeout_s: float = 30.0  # a handoff not confirmed by then fails and its blocks are freed
    incarnation: int = 0  # bumped by the controller on every restart
    # Liveness: an engine step running longer than this means the engine is stuck, and Health says so (a long
    # prefill chunk on a busy CPU takes seconds; nothing legitimate takes minutes).
    stall_timeout_s: float = 120.0
    redis_url: str | None = field(default=None, repr=False)  # the prefix index it publishes to (may hold a password)
    # The cluster secret and TLS of every gRPC link: its server requires them, its channels present them.
    auth: ClusterAuth = OPEN

    def __post_init__(self) -> None:
        check_role(self.role)
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError(f"kv_transfer_timeout_s must be positive, got {self.kv_transfer_timeout_s}")
