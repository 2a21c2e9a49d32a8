"""The Swarm side of tests/e2e/test_swarm.py: a Docker daemon per namespace host (tests/netns.py), the
two joined into a swarm, the project image loaded into each.

Each daemon runs in its host's network namespace through `nsenter --net` (`ip netns exec` would
remount /sys, and dockerd then fails on the devices cgroup), with its own data root, exec root and
socket. Its data root is kept across runs under ~/.cache/pagedserve-docker/swarm/NODE, so the image
(moved in with `docker save | docker load`, once per hash of the image's inputs) and the compiled CPU
kernels (a named volume) survive; the swarm state does not (removed before each start, left at the
end). This kernel has no IPVS: the stack uses dnsrr endpoints and host-mode ports (deploy/swarm).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from tests.e2e.docker_stack import CACHE, run, stop_process
from tests.netns import Host

SWARM_CACHE = CACHE / "swarm"


class Node:
    """A dockerd in `host`; `docker(...)` runs the CLI against it."""

    def __init__(self, host: Host, docker: str):
        self.host, self.cli = host, docker
        self.data_root = SWARM_CACHE / host.name
        self.exec_root = Path("/run") / host.netns  # short: containerd's socket paths live under it
        self.socket = f"unix:///run/{host.netns}.sock"
        self.log = SWARM_CACHE / f"{host.name}.log"
        self.process: subprocess.Popen | None = None

    def docker(self, *args: str, timeout: float = 120, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        return run([self.cli, "-H", self.socket, *args], timeout=timeout, check=check, **kwargs)

    def running(self) -> bool:
        return self.docker("info", "--format", "{{.ServerVersion}}", timeout=30, check=False).returncode == 0

    def start(self) -> None:
        dockerd = shutil.which("dockerd", path="/usr/sbin:/usr/bin:/sbin:/bin")
        shutil.rmtree(self.data_root / "swarm", ignore_errors=True)  # a fresh swarm every run
        pidfile = Path(f"{self.exec_root}.pid")  # a killed run's, whose dockerd is gone, stops this one starting
        try:
            os.kill(int(pidfile.read_text().strip()), 0)
        except (FileNotFoundError, ValueError, ProcessLookupError):
            pidfile.unlink(missing_ok=True)
        self.data_root.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as log:
            self.process = self.host.popen([dockerd, "--data-root", str(self.data_root), "--exec-root", str(self.exec_root),
                                            "--pidfile", str(pidfile), "-H", self.socket],
                                           stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and self.process.poll() is None and not self.running():
            time.sleep(0.5)
        if not self.running():
            raise RuntimeError(f"dockerd in {self.host.netns} did not start:\n{self.log_tail()}")
        # containers a killed run left (their swarm is gone): a clean slate
        stale = self.docker("ps", "-aq").stdout.split()
        if stale:
            self.docker("rm", "-f", *stale, timeout=300, check=False)

    def node_id(self) -> str:
        return self.docker("info", "--format", "{{.Swarm.NodeID}}").stdout.strip()

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""

    def has_image(self, image: str) -> bool:
        return self.docker("image", "inspect", image, check=False).returncode == 0

    def stop(self) -> None:
        if self.process is None:
            return
        self.docker("swarm", "leave", "--force", timeout=60, check=False)
        stop_process(self.process)  # SIGTERM stops its containers (no live-restore)
        self.process = None


def load_image(nodes: list[Node], source_docker: str, image: str, repository: str) -> list[Node]:
    """`image` from the engine that built it into the nodes that lack it, one `docker save` fed to
    every `docker load` at once; the nodes' older `repository:test-*` tags go. The nodes it loaded."""
    need = [node for node in nodes if not node.has_image(image)]
    if need:
        save = subprocess.Popen([source_docker, "save", image], stdout=subprocess.PIPE)
        loads = [subprocess.Popen([node.cli, "-H", node.socket, "load"], stdin=subprocess.PIPE,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for node in need]
        while chunk := save.stdout.read(1 << 20):
            for load in loads:
                load.stdin.write(chunk)
        for load in loads:
            load.stdin.close()
        assert save.wait(60) == 0, f"docker save {image} failed"
        for node, load in zip(need, loads):
            assert load.wait(600) == 0, f"docker load into {node.host.netns} failed: {load.stderr.read()}"
    for node in nodes:
        listed = node.docker("images", repository, "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
        old = [tag for tag in listed if tag.startswith(f"{repository}:test-") and tag != image]
        if old:
            node.docker("rmi", *old, check=False)
    return need


def form_swarm(manager: Node, workers: list[Node], address_pool: str) -> None:
    """`manager` inits the swarm on its host's address, the others join it as workers. Overlay
    subnets come from `address_pool` (inside the namespaces only)."""
    address = manager.host.address
    manager.docker("swarm", "init", "--advertise-addr", address, "--listen-addr", f"{address}:2377",
                   "--default-addr-pool", address_pool, "--default-addr-pool-mask-length", "26")
    token = manager.docker("swarm", "join-token", "-q", "worker").stdout.strip()
    for node in workers:
        node.docker("swarm", "join", "--token", token, "--advertise-addr", node.host.address,
                    "--listen-addr", f"{node.host.address}:2377", f"{address}:2377", timeout=120)
