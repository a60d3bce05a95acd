"""One end of a 2-rank torch.distributed process group between a KV sender and a KV receiver, made on demand
without a world group (no init_process_group): both ends construct the backend directly over
`PrefixStore(pair_key, TCPStore)`, the sender as rank 0 and the receiver as rank 1, as torch's own
`distributed_c10d._new_process_group_helper` and `_dist2.new_group` do. gloo on CPU, NCCL on CUDA.

Lifecycle: built once (both ends rendezvous, bounded by the handoff's deadline), used for one transfer at a time
under `lock`, dropped for good after any failure (`broken`); a new pair key makes the next one. Also the small
address helpers the torch transport needs to tell gloo which interface to bind.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
import urllib.parse

import torch
import torch.distributed as dist

from kv_transfer.layout import KVHandoff, KVTransferError, KVTransferTimeout

NCCL_WATCHDOG_S = 600.0  # NCCL's own op timeout; our deadlines are enforced by polling and abort, well before it
NCCL_POLL_S = 0.0005
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def split_host_port(address: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` → (host, port), brackets stripped."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def local_host_towards(peer_host: str) -> str:
    """The local address the kernel would use to reach `peer_host`: the one the gloo device must bind so that
    the peer can connect back to it (the machine's hostname may resolve to some other interface)."""
    family = socket.AF_INET6 if ":" in peer_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((peer_host, 9))  # UDP connect sends nothing; it only picks the route
        return probe.getsockname()[0]


def grpc_peer_host(peer: str) -> str:
    """The host of a gRPC `context.peer()` string: `ipv4:1.2.3.4:5`, `ipv6:%5B::1%5D:5` → `1.2.3.4`, `::1`."""
    kind, _, address = urllib.parse.unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        return "127.0.0.1"
    host, _ = split_host_port(address)
    return host.removeprefix("::ffff:")


def remaining_s(deadline_s: float) -> float:
    return deadline_s - time.monotonic()


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def _teardown(group: dist.ProcessGroupGloo | dist.ProcessGroupNCCL, backend: str) -> None:
    # gloo's sockets close when the last reference goes; NCCL communicators must be aborted explicitly.
    if backend == "nccl":
        group.abort()


class PairGroup:
    """One end of a 2-rank process group with one peer, and the lock that keeps it to one transfer at a time."""

    def __init__(self, key: str, backend: str) -> None:
        self.key = key
        self.backend = backend
        self.lock = threading.Lock()
        self.group: dist.ProcessGroupGloo | dist.ProcessGroupNCCL | None = None  # a backend, no ProcessGroup
        self._store: dist.Store | None = None  # the group's store client, kept alive with it
        self.broken = False
        self.last_used_s = time.monotonic()
        self._staging: torch.Tensor | None = None  # receiver: bytes reused by each handoff (grown on demand)
        self._build_lock = threading.Lock()  # orders a late rendezvous against drop()

    def staging_for(self, handoff: KVHandoff, device: torch.device) -> torch.Tensor:
        """[blocks that travel, *wire_shape] of the layout's wire dtype over the pair's reused staging bytes. Reuse
        matters: a fresh multi-MB tensor per handoff costs a page fault per 4 KiB, as much as the copy itself."""
        layout = handoff.wire_layout
        if self._staging is None or self._staging.numel() < handoff.num_bytes:
            self._staging = torch.empty(handoff.num_bytes, dtype=torch.uint8, device=device)
        flat = self._staging[: handoff.num_bytes].view(getattr(torch, layout.wire_dtype))
        return flat.view(len(handoff.wire_indices), *layout.wire_shape)

    def build(self, *, store_host: str, store_port: int, rank: int, local_host: str, device: torch.device,
              deadline_s: float) -> None:
        """Rendezvous with the peer under this pair's key; raises KVTransferError by the deadline if it never comes.

        Each group gets its own store client: TCPStore serializes a client's blocking waits, so sharing one would
        let a pair whose peer never shows up stall every other pair's rendezvous.

        The rendezvous runs on a helper thread that we wait for only until the deadline: a peer that is frozen
        (SIGSTOPped, swapped out) still has its kernel accept our connection, and TCPStore's connect handshake
        then blocks in recv without honouring its own timeout. If we give up, the pair is dropped; a rendezvous
        that completes later finds it dropped and tears its group down itself."""
        timeout = _timedelta(remaining_s(deadline_s))

        def rendezvous() -> None:
            store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timeout)
            prefix = dist.PrefixStore(self.key, store)
            group: dist.ProcessGroupGloo | dist.ProcessGroupNCCL
            if self.backend == "gloo":
                options = dist.ProcessGroupGloo._Options()
                options._timeout = timeout
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
                group = dist.ProcessGroupGloo(prefix, rank, 2, options)
            else:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = datetime.timedelta(seconds=NCCL_WATCHDOG_S)
                group = dist.ProcessGroupNCCL(prefix, rank, 2, options)
                group.eager_connect_single_device(device)  # rendezvous now, so a missing peer fails here
            with self._build_lock:
                if not self.broken:
                    self.group, self._store = group, store
                    return
            _teardown(group, self.backend)  # given up on (dropped) while we waited for the peer

        outcome: list[BaseException | None] = []
        finished = threading.Event()

        def run() -> None:
            try:
                rendezvous()
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                outcome.append(exc)
            finally:
                finished.set()

        threading.Thread(target=run, name=f"kv-pair-rendezvous-{self.key}", daemon=True).start()
        if not finished.wait(max(remaining_s(deadline_s), 0)):
            self.drop()
            raise KVTransferTimeout(f"pair group {self.key or '(new)'}: the peer did not complete the rendezvous "
                                    "before the deadline (dead or frozen)")
        if outcome[0] is not None:
            raise outcome[0]
        if self.group is None:
            raise KVTransferError(f"pair group {self.key}: dropped during its rendezvous")

    def drop(self) -> None:
        """Tear the group down (gloo closes its sockets, so a peer waiting on it fails at once); never reused."""
        with self._build_lock:
            self.broken = True
            group, self.group, self._store, self._staging = self.group, None, None, None
        if group is not None:
            _teardown(group, self.backend)

    def wait(self, work: dist.Work, deadline_s: float, what: str) -> None:
        """Wait for one send/recv until the deadline; raise KVTransferError when it fails or the deadline passes."""
        try:
            if self.backend == "gloo":
                work.wait(_timedelta(remaining_s(deadline_s)))
                return
            # NCCL's wait only orders streams; poll for completion on the host so the deadline holds.
            while not work.is_completed():
                if remaining_s(deadline_s) <= 0:
                    raise KVTransferTimeout(f"{what}: timed out")
                time.sleep(NCCL_POLL_S)
            work.wait()
        except KVTransferError:
            raise
        except RuntimeError as exc:  # gloo's own timeout (the deadline) among others
            error = KVTransferTimeout if remaining_s(deadline_s) <= 0 else KVTransferError
            raise error(f"{what}: {exc}") from None
