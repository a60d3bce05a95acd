"""Hosts as Linux network namespaces on one bridge: each its own network stack and IP, all on one subnet, the test
process (the root namespace) on the bridge too, so it reaches every host as a client on another machine would.

    net = HostNetwork(["head", "prefill-0", "decode-0"], tag="a1")   # 10.<tag>.0.1, .2, ...; the bridge .254
    net.create()
    subprocess.Popen([*net.exec_prefix("head"), "splitserve", "head", ...])
    net.cut("decode-0"); net.heal("decode-0")                          # its link down / up: a partition
    net.close()                                                        # every process in them killed, all gone

Names are short (interface names have 15 bytes) and carry the tag, so that runs side by side, or one that died
before its teardown, never collide: `remove_stale` deletes what a run of the same tag left behind. Creating
namespaces needs root (CAP_NET_ADMIN) and the `ip` tool; `unavailable()` says why not, for a skip.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import zlib


class NetworkError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can): tried, not guessed."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    probe = f"ss-probe-{os.getpid()}"
    try:
        made = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "the `ip` tool (iproute2) is not installed"
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class HostNetwork:
    def __init__(self, hosts: list[str], *, tag: str) -> None:
        if len(hosts) > 250:
            raise ValueError("one /24 subnet")
        self.hosts = list(hosts)
        self.tag = tag
        octet = 16 + zlib.crc32(tag.encode()) % 200  # 10.<16..215>.<tag>.x: away from common local networks
        self.subnet = f"10.{octet}.{zlib.crc32(tag.encode()[::-1]) % 250}"
        self.bridge = f"ssbr{tag}"[:15]
        self.gateway_ip = f"{self.subnet}.254"  # the root namespace's address on the bridge

    def namespace(self, host: str) -> str:
        return f"ss{self.tag}-{host}"

    def ip(self, host: str) -> str:
        return f"{self.subnet}.{self.hosts.index(host) + 1}"

    def _veth(self, host: str) -> str:
        return f"ssv{self.tag}{self.hosts.index(host)}"[:15]

    def exec_prefix(self, host: str) -> list[str]:
        """A command line's prefix that runs it on `host` (in its namespace; the environment passes through)."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def create(self) -> None:
        self.remove_stale()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for host in self.hosts:
                ns, veth = self.namespace(host), self._veth(host)
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.ip(host)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                # A default route makes the host's own address the one a process finds for itself (Ray's node IP,
                # a worker's advertised endpoint): the address a UDP socket "connected" outwards binds to.
                _ip("-n", ns, "route", "add", "default", "via", self.gateway_ip)
        except BaseException:
            self.close()
            raise

    def cut(self, host: str) -> None:
        """Partition `host` from every other (its link to the bridge down); what it has in flight stalls."""
        _ip("link", "set", self._veth(host), "down")

    def heal(self, host: str) -> None:
        _ip("link", "set", self._veth(host), "up")

    def pids(self, host: str) -> list[int]:
        listed = _ip("netns", "pids", self.namespace(host), check=False)
        return [int(p) for p in listed.stdout.split()] if listed.returncode == 0 else []

    def close(self) -> None:
        """Kill every process left in the hosts, then remove the namespaces and the bridge. Idempotent."""
        for _ in range(3):
            left = [pid for host in self.hosts for pid in self.pids(host)]
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.5)
        self.remove_stale()

    def remove_stale(self) -> None:
        for host in self.hosts:
            _ip("netns", "del", self.namespace(host), check=False)
            _ip("link", "del", self._veth(host), check=False)
        _ip("link", "del", self.bridge, check=False)
