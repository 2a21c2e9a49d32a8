"""Several "hosts" on one machine: network namespaces on a bridge, each with its own address.

    with Hosts(["sched", "w1", "w2"], prefix="ps25-", subnet="10.225.0.0/26") as hosts:
        worker = hosts["w1"].popen(["python", "-m", "services.worker", "--host", hosts["w1"].address, ...])
        hosts["w1"].kill_all()          # the host loses power: every process in its namespace, SIGKILL
        hosts["w1"].run(["ip", "-br", "addr"])

The bridge (PREFIX + "br", or `bridge=`) lives in this machine's namespace with the subnet's first
address, so the test process itself reaches every host (a client "outside" them); the hosts get the
next addresses, in order, on a veth whose inside end is `eth0`. A host has loopback and that one
interface, no default route: traffic stays on the bridge. Files, processes and mounts are shared with
this machine; only the network is the host's own.

Processes enter a namespace with `nsenter --net=/run/netns/NAME`, not `ip netns exec`, which also
remounts /sys (dockerd then fails on the devices cgroup). `close` (also on an exception in the
`with`) kills every process in each namespace and deletes the namespaces, veths and bridge; names
left by a run that died are removed before they are made again. Every name starts with the prefix,
so developers sharing a machine keep apart by prefix and subnet. Needs root and iproute2: `why_not()`
says why these hosts cannot be made here (for a skip).
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

NETNS_DIR = Path("/run/netns")
IFNAME_MAX = 15  # the kernel's limit on an interface name


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
    return result


def why_not() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"no `{tool}` (apt-get install iproute2 util-linux)"
    probe = f"psprobe{os.getpid()}"[:IFNAME_MAX]
    made = ip("netns", "add", probe, check=False)
    ip("netns", "del", probe, check=False)
    return None if made.returncode == 0 else f"cannot make a network namespace: {made.stderr.strip()}"


def namespace_pids(path: Path) -> list[int]:
    """Every process whose network namespace is the one bound at `path`, and their descendants
    (a container a daemon in the namespace started has a namespace of its own, but runs on that host)."""
    want = path.stat().st_ino
    inside, children = set(), {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(proc.name))
            if os.stat(proc / "ns" / "net").st_ino == want:
                inside.add(int(proc.name))
        except (OSError, IndexError, ValueError):
            pass  # gone, or a kernel thread
    found, todo = set(), list(inside)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return sorted(found)


class Host:
    """One namespace: its name, its address on the bridge, and how to run things in it."""

    def __init__(self, name: str, netns: str, address: str, veth: str):
        self.name, self.netns, self.address, self.veth = name, netns, address, veth
        self.path = NETNS_DIR / netns

    def argv(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's network namespace."""
        return ["nsenter", f"--net={self.path}", "--", *argv]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` in the host, in its own session (so a signal to the test's group misses it)."""
        kwargs.setdefault("start_new_session", True)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(self.argv(argv), **kwargs)

    def run(self, argv: list[str], timeout: float = 60, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        result = subprocess.run(self.argv(argv), capture_output=True, text=True, timeout=timeout, **kwargs)
        if check and result.returncode != 0:
            raise RuntimeError(f"{argv} in {self.netns} exited {result.returncode}:\n{result.stdout[-3000:]}"
                               f"{result.stderr[-3000:]}")
        return result

    def pids(self) -> list[int]:
        return namespace_pids(self.path) if self.path.exists() else []

    def kill_all(self, sig: int = signal.SIGKILL, timeout: float = 10) -> list[int]:
        """Signal every process on the host (a power cut, with SIGKILL) and wait until they are gone."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        return pids

    def link(self, up: bool) -> None:
        """Plug the host's cable in or pull it out (its bridge-side veth up or down)."""
        ip("link", "set", self.veth, "up" if up else "down")

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address})"


class Hosts:
    """`names` as hosts on one bridge; a context manager that always tears them down."""

    def __init__(self, names: list[str], prefix: str, subnet: str, bridge: str = "br"):
        network = ipaddress.ip_network(subnet)
        addresses = list(network.hosts())
        if len(names) + 1 > len(addresses):
            raise ValueError(f"{subnet} has room for {len(addresses) - 1} hosts, not {len(names)}")
        self.prefix = prefix
        self.bridge = prefix + bridge
        self.gateway = str(addresses[0])
        self.prefixlen = network.prefixlen
        self.hosts = {name: Host(name, prefix + name, str(address), prefix + name)
                      for name, address in zip(names, addresses[1:])}
        for name in [self.bridge] + [h.veth for h in self.hosts.values()]:
            if len(name) > IFNAME_MAX:
                raise ValueError(f"interface name {name!r} is longer than {IFNAME_MAX}")
        self._made = False

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __iter__(self):
        return iter(self.hosts.values())

    def __enter__(self) -> Hosts:
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def create(self) -> None:
        self.close()  # what a run that died left behind
        self._made = True
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/{self.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for host in self:
            ip("netns", "add", host.netns)
            ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            ip("link", "set", host.veth, "master", self.bridge, "up")
            ip("-n", host.netns, "addr", "add", f"{host.address}/{self.prefixlen}", "dev", "eth0")
            ip("-n", host.netns, "link", "set", "eth0", "up")
            ip("-n", host.netns, "link", "set", "lo", "up")

    def close(self) -> None:
        """Kill what runs in the hosts, delete them and the bridge (safe to call twice)."""
        for host in self:
            host.kill_all()
            ip("netns", "del", host.netns, check=False)
            ip("link", "del", host.veth, check=False)  # gone with its peer's namespace, normally
        ip("link", "del", self.bridge, check=False)
        self._made = False
