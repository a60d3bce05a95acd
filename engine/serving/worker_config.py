"""A worker's configuration, and what the rest of the cluster knows of a running worker. Frozen, no I/O, no torch:
the controller, the router and the workers all import it."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from protos.cluster_auth import OPEN, ClusterAuth

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """A running worker as the controller publishes it and the router reaches it."""

    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    endpoint: str  # "host:port" of its gRPC `Worker` service
    incarnation: int = 0  # changes on every restart: index entries and channels of an older one are stale
    pid: int = 0  # the process hosting it (for operators and tests; 0: not known)
    node_id: str = ""  # the Ray node it runs on ("": not on Ray)
    # Chosen for removal by a scale-down: still listed (so in-flight calls, Aborts and load polls reach it) but
    # routed no new request; it refuses new ones itself too (UNAVAILABLE "draining").
    draining: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.worker_id or not self.endpoint:
            raise ValueError(f"worker_id and endpoint must be non-empty, got {self.worker_id!r}, {self.endpoint!r}")


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
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError(f"kv_transfer_timeout_s must be positive, got {self.kv_transfer_timeout_s}")
