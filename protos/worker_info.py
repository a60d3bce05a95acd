"""What the cluster knows of a running worker: its roles and `WorkerInfo`, the record the controller publishes, the
gateway routes by and a fixed-list gateway builds from each worker's Health. Frozen, no I/O, no torch, no gRPC: the
router, the controller and the workers all import it."""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("prefill", "decode", "colocated")


def check_role(role: str) -> None:
    """Raise ValueError unless `role` is one of ROLES."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """A running worker as the controller publishes it and the router reaches it."""

    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    endpoint: str  # "host:port" of its gRPC `Worker` service
    incarnation: int = 0  # changes on every restart: index entries and channels of an older one are stale
    pid: int = 0  # the process hosting it (for operators and tests; 0: not known)
    rank_pids: tuple[int, ...] = ()  # at tensor_parallel_size N: its ranks 1..N-1's processes (rank 0 is `pid`)
    node_id: str = ""  # the Ray node it runs on ("": not on Ray)
    # Chosen for removal by a scale-down: still listed (so in-flight calls, Aborts and load polls reach it) but
    # routed no new request; it refuses new ones itself too (UNAVAILABLE "draining").
    draining: bool = False

    def __post_init__(self) -> None:
        check_role(self.role)
        if not self.worker_id or not self.endpoint:
            raise ValueError(f"worker_id and endpoint must be non-empty, got {self.worker_id!r}, {self.endpoint!r}")
