"""A worker's configuration. Frozen, no I/O: entry points build it from flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    worker_id: str
    role: str  # "prefill" | "decode" | "colocated" (runs both phases itself)
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port; the bound address is the worker's endpoint
    kv_transport: str = "grpc"  # "grpc" | "torch" | "inproc"
    kv_transfer_timeout_s: float = 30.0  # a handoff not confirmed by then fails and its blocks are freed
    incarnation: int = 0  # bumped by the controller on every restart
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError(f"kv_transfer_timeout_s must be positive, got {self.kv_transfer_timeout_s}")
