"""The Docker side of tests/e2e/test_docker.py: an engine (started when none runs), the image
(built once per hash of its inputs), and the compose stack on the host network.

The client is the engine package's own `docker` (Debian's docker.io puts dockerd in /usr/sbin
and its CLI in /usr/bin): a `docker` earlier on PATH (here /usr/local/bin/docker, a 28.x CLI with
no engine and no compose plugin) is not the one the engine was released with. Compose is v2
(`docker compose`) where that plugin answers, else v1 (`docker-compose`, Debian's 1.29.2).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = (ROOT / "docker-compose.yml", ROOT / "docker-compose.hostnet.yml")
BASE_IMAGE = "pagedserve-base:bookworm"  # docker/make-base-image.sh's; no registry is reachable here
IMAGE_REPO = "pagedserve"
CACHE = Path.home() / ".cache" / "pagedserve-docker"  # the wheelhouse, kept across clones
DOCKERD_LOG = CACHE / "dockerd.log"
IMAGE_INPUTS = ("Dockerfile", ".dockerignore", "requirements.txt", "protos", "pagedserve", "kernels", "services")


class Unavailable(RuntimeError):
    """No engine can run here (the only reason the Docker tests skip)."""


def run(argv: list[str], timeout: float = 120, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout[-4000:]}{result.stderr[-4000:]}")
    return result


def docker_client() -> str | None:
    return shutil.which("docker", path="/usr/bin:/bin") or shutil.which("docker")


class Engine:
    """A running dockerd: the one already there, or one started here (and stopped by `close`)."""

    def __init__(self):
        self.docker = docker_client()
        self.process: subprocess.Popen | None = None
        if self.docker is None:
            raise Unavailable("no docker client installed (apt-get install docker.io)")
        if not self.running():
            self._start()

    def running(self) -> bool:
        return run([self.docker, "info", "--format", "{{.ServerVersion}}"], timeout=30, check=False).returncode == 0

    def _start(self) -> None:
        dockerd = shutil.which("dockerd", path="/usr/sbin:/usr/bin:/sbin:/bin")
        if dockerd is None:
            raise Unavailable("no dockerd installed (apt-get install docker.io)")
        if os.geteuid() != 0:
            raise Unavailable("dockerd is not running and only root can start it")
        CACHE.mkdir(parents=True, exist_ok=True)
        # No bridge and no iptables: the engine needs neither on the host network, and the
        # machines this runs on allow neither.
        with open(DOCKERD_LOG, "a") as log:
            self.process = subprocess.Popen([dockerd, "--bridge=none", "--iptables=false"], stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None or self.running():
                break
            time.sleep(0.5)
        if not self.running():
            tail = DOCKERD_LOG.read_text(errors="replace").splitlines()[-15:]
            self.close()
            raise Unavailable("dockerd could not start:\n" + "\n".join(tail))

    def versions(self) -> str:
        return run([self.docker, "version", "--format", "client {{.Client.Version}}, engine {{.Server.Version}}"]).stdout.strip()

    def image_id(self, name: str) -> str | None:
        result = run([self.docker, "image", "inspect", "--format", "{{.Id}}", name], check=False)
        return result.stdout.strip() if result.returncode == 0 else None

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            stop_process(self.process)
        self.process = None


def stop_process(process: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds: a daemon's orderly stop, or its end."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def chat(http: str, question: str) -> str:
    """The default model's greedy answer (32 tokens) over the frontend at `http` ("http://host:port")."""
    body = json.dumps({"model": "default", "messages": [{"role": "user", "content": question}],
                       "max_tokens": 32, "temperature": 0}).encode()
    request = urllib.request.Request(f"{http}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]["message"]["content"]


def compose_command(docker: str) -> list[str] | None:
    if run([docker, "compose", "version"], check=False).returncode == 0:
        return [docker, "compose"]
    v1 = shutil.which("docker-compose")
    return [v1] if v1 else None


# ---- the image ----------------------------------------------------------------------------

def ensure_base_image(engine: Engine) -> str:
    if engine.image_id(BASE_IMAGE) is None:
        if shutil.which("debootstrap", path="/usr/sbin:/usr/bin:/sbin:/bin") is None:
            raise RuntimeError(f"no {BASE_IMAGE} and no debootstrap to make it (apt-get install debootstrap)")
        run([str(ROOT / "docker" / "make-base-image.sh"), BASE_IMAGE], timeout=1800,
            env={**os.environ, "DOCKER": engine.docker})
    return BASE_IMAGE


def ensure_wheelhouse() -> Path:
    """Every pinned wheel, downloaded once into the cache (by this Python's pip and its
    configuration), hard-linked into docker/extra/wheels so the build needs no index."""
    cache = CACHE / "wheels"
    stamp = CACHE / "wheels.sha"
    want = hashlib.sha256((ROOT / "requirements.txt").read_bytes()).hexdigest()
    if not stamp.exists() or stamp.read_text() != want:
        shutil.rmtree(cache, ignore_errors=True)
        run([str(ROOT / "docker" / "wheelhouse.sh"), sys.executable, str(cache)], timeout=1800)
        stamp.write_text(want)
    context = ROOT / "docker" / "extra" / "wheels"
    context.mkdir(parents=True, exist_ok=True)
    wanted = {p.name for p in cache.glob("*.whl")}
    for stale in context.iterdir():
        if stale.name not in wanted:
            stale.unlink()
    for name in wanted - {p.name for p in context.iterdir()}:
        try:
            os.link(cache / name, context / name)  # same inode and mtime: the build cache still hits
        except OSError:
            shutil.copy2(cache / name, context / name)
    return context


def inputs_digest(base_id: str, wheels: Path) -> str:
    """The image's inputs: its files (as the context holds them), the wheel names, the base image."""
    digest = hashlib.sha256(base_id.encode())
    for top in IMAGE_INPUTS:
        path = ROOT / top
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()
                                                     and "__pycache__" not in p.parts and p.suffix != ".pyc")
        for f in files:
            digest.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    for wheel in sorted(p.name for p in wheels.glob("*.whl")):
        digest.update(wheel.encode())
    return digest.hexdigest()[:16]


def ensure_image(engine: Engine) -> tuple[str, float | None]:
    """(tag, seconds the build took, or None when the image for these inputs was there). One build at a
    time on this machine (a file lock): a module that needs the image while the suite's background
    pre-build (tests/prebuild.py) makes it waits for that build and reuses it."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "image.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _ensure_image(engine)


def _ensure_image(engine: Engine) -> tuple[str, float | None]:
    base = ensure_base_image(engine)
    wheels = ensure_wheelhouse()
    tag = f"{IMAGE_REPO}:test-{inputs_digest(engine.image_id(base), wheels)}"
    if engine.image_id(tag) is not None:
        return tag, None
    start = time.monotonic()
    run([engine.docker, "build", "--network", "host", "--build-arg", f"BASE_IMAGE={base}",
         "--build-arg", "PIP_OFFLINE=1", "-t", tag, str(ROOT)], timeout=3000)
    seconds = time.monotonic() - start
    # Older test images: only their tags go (their layers are shared or pruned by the engine).
    listed = run([engine.docker, "images", IMAGE_REPO, "--format", "{{.Repository}}:{{.Tag}}"]).stdout.split()
    old = [t for t in listed if t.startswith(f"{IMAGE_REPO}:test-") and t != tag]
    if old:
        run([engine.docker, "rmi", *old], check=False)
    return tag, seconds


# ---- the stack -----------------------------------------------------------------------------

class Stack:
    """One compose project on the host network: `compose(...)` runs a compose command on it."""

    def __init__(self, engine: Engine, compose: list[str], image: str, ports: tuple[int, int, int]):
        self.engine, self.image = engine, image
        self.project = f"pstest{os.getpid()}"
        self.grpc_port, self.http_port, self.scheduler_port = ports
        self.env = {**os.environ, "PAGEDSERVE_HOSTNET_IMAGE": image,
                    "PAGEDSERVE_HOSTNET_GRPC_PORT": str(self.grpc_port),
                    "PAGEDSERVE_HOSTNET_HTTP_PORT": str(self.http_port),
                    "PAGEDSERVE_HOSTNET_SCHEDULER_PORT": str(self.scheduler_port)}
        self.base = compose + ["-p", self.project] + [a for f in COMPOSE_FILES for a in ("-f", str(f))]

    @property
    def frontend(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def scheduler(self) -> str:
        return f"127.0.0.1:{self.scheduler_port}"

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return run(self.base + list(args), timeout=timeout, check=check, cwd=ROOT, env=self.env)

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).stdout.split()

    def inspect(self, container: str, template: str) -> str:
        return run([self.engine.docker, "inspect", "--format", template, container]).stdout.strip()

    def logs(self, service: str = "", tail: int = 40) -> str:
        return self.compose("logs", "--no-color", "--tail", str(tail), *([service] if service else []),
                            check=False).stdout

    def down(self) -> None:
        """Containers (with their anonymous volumes, the image's VOLUME /models where nothing is
        mounted) and the model volume go; the kernel volume stays (compiled once per CPU)."""
        self.compose("rm", "--stop", "--force", "-v", check=False)
        self.compose("down", "--timeout", "5", check=False)
        run([self.engine.docker, "volume", "rm", f"{self.project}_models"], check=False)


def listening_ports(pid: int) -> set[int]:
    """TCP ports process `pid` listens on (its socket inodes matched in its network namespace's table)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


# ---- streams through a deployed frontend -----------------------------------------------------

PROMPTS = ("Once upon a time", "The three primary colors are", "def fibonacci(n):", "Paris is a city")
REFERENCE_TOKENS = 256  # the longest stream a test sizes from the reference (length_for caps at it)


def params(i: int, max_tokens: int) -> dict:
    """Greedy and seeded sampling alike; no early EOS, so every stream runs its full length (a
    shorter run's tokens are a prefix of a longer one's: draws are keyed by position)."""
    sampling = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.8, top_p=0.9, seed=500 + i)
    return dict(max_tokens=max_tokens, ignore_eos=True, **sampling)


class Streams:
    """`prompts` streamed at once through the frontend at `address`, each in a thread; the
    `params(i, max_tokens)` sampling for the i-th. `wait_started` returns once every one has a token."""

    def __init__(self, address: str, max_tokens: int, prompts: tuple[str, ...] = PROMPTS):
        self.address, self.max_tokens, self.prompts = address, max_tokens, prompts
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.finish: list[str | None] = [None] * len(prompts)
        self.errors: list[Exception] = []
        self._first = [threading.Event() for _ in prompts]
        self.first_at: list[float | None] = [None] * len(prompts)  # monotonic time of each stream's first token
        self.ended_at: list[float | None] = [None] * len(prompts)  # and of its last
        self._threads = [threading.Thread(target=self._one, args=(i,), daemon=True) for i in range(len(prompts))]
        for thread in self._threads:
            thread.start()

    def _one(self, i: int) -> None:
        from pagedserve import Client

        try:
            with Client(self.address) as client:
                for delta in client.stream(self.prompts[i], **params(i, self.max_tokens)):
                    self.tokens[i] += delta.token_ids
                    self.finish[i] = delta.finish_reason or self.finish[i]
                    self.ended_at[i] = time.monotonic()
                    if not self._first[i].is_set():
                        self.first_at[i] = self.ended_at[i]
                    self._first[i].set()
        except Exception as error:  # noqa: BLE001 - reported by the test
            self.errors.append(error)
            self._first[i].set()

    def wait_started(self, timeout: float = 300) -> None:
        for event in self._first:
            assert event.wait(timeout), "a stream got no token"

    def join(self, timeout: float = 600) -> tuple[list[list[int]], list[str | None]]:
        for thread in self._threads:
            thread.join(timeout)
        assert not self.errors, self.errors
        return self.tokens, self.finish


class Reference:
    """The prompts' tokens streamed at once from the undisturbed deployment, and how long a step
    took: the later tests size their streams in seconds, as fast or slow as the machine is."""

    def __init__(self, address: str, prompts: tuple[str, ...] = PROMPTS):
        self.address, self.prompts = address, prompts
        streams = Streams(address, REFERENCE_TOKENS, prompts)
        self.tokens, finish = streams.join()
        assert finish == ["length"] * len(prompts)
        # a decode step: first token to last, without the connection and the (cold) prefill, which
        # made the estimate long and the later tests' streams too short to be open when they act
        steps = [(end - first) / (REFERENCE_TOKENS - 1) for first, end in zip(streams.first_at, streams.ended_at)]
        self.step_s = sum(steps) / len(steps)

    def length_for(self, seconds: float, least: int) -> int:
        return max(least, min(REFERENCE_TOKENS, round(seconds / self.step_s)))

    def prefix(self, length: int) -> list[list[int]]:
        return [tokens[:length] for tokens in self.tokens]
