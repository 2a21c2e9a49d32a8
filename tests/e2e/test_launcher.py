"""`python -m services up`: starts every service, reports ready, stops them all on a signal.

The fast tests run the launcher with stand-in services (fake_service.py, through --python);
the slow one runs the real three services on a tiny random model.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.healthcheck import health_status
from services.__main__ import default_worker_threads
from services.launcher import Deployment, free_ports, service_commands

ROOT = Path(__file__).resolve().parents[2]
FAKE_SERVICE = Path(__file__).with_name("fake_service.py")
REAL_SERVICES = all((ROOT / "services" / name / "__main__.py").is_file() for name in ("scheduler", "worker", "frontend"))


class Up:
    """`python -m services up ...` as a subprocess, its output collected by threads."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "services", "up", *args], cwd=ROOT, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, l=lines: l.extend(s), daemon=True).start()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(line.startswith("ready:") for line in self.out):
            assert self.proc.poll() is None, f"launcher exited {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"no ready line in {timeout}s:\n{self.log()}"
            time.sleep(0.1)
        time.sleep(0.1)  # the rest of the ready block

    def pids(self) -> dict[str, int]:
        return {m[1]: int(m[2]) for m in re.finditer(r"started (\S+) \(pid (\d+)\)", "".join(self.err))}

    def worker_ports(self) -> tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"^  worker-\d+\s+\S+:(\d+) ", "".join(self.out), re.M))

    def finish(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def log(self) -> str:
        return "".join(self.out) + "".join(self.err)

    def stop(self, timeout: float = 30) -> None:
        """SIGINT, as Ctrl-C would; whatever is still alive afterwards is killed."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.finish(timeout)
        finally:
            self.kill_all()

    def kill_all(self) -> None:
        for pid in [self.proc.pid, *self.pids().values()]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def fake_python(tmp_path) -> str:
    """An 'interpreter' that runs fake_service.py in place of `-m services.<name>`."""
    script = tmp_path / "python"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_SERVICE}" "$@"\n')
    script.chmod(0o755)
    return str(script)


@pytest.fixture
def fake_model(tmp_path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


@pytest.fixture
def launch():
    started: list[Up] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> Up:
        started.append(Up(args, env))
        return started[-1]

    yield start
    for up in started:
        up.kill_all()


def up_args(model: Path, ports: tuple[int, int, int], workers: int = 2) -> list[str]:
    grpc_port, http_port, scheduler_port = ports
    return ["--model", str(model), "--workers", str(workers), "--grpc-port", str(grpc_port),
            "--http-port", str(http_port), "--scheduler-port", str(scheduler_port)]


def assert_all_stopped(up: Up, ports: tuple[int, ...], pids: dict[str, int], within: float) -> None:
    deadline = time.monotonic() + within
    while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [name for name, pid in pids.items() if alive(pid)], up.log()
    assert [p for p in ports if not port_free(p)] == [], up.log()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_up_runs_the_service_commands_and_stops_them_on_a_signal(launch, fake_python, fake_model, tmp_path, sig):
    ports, argv_dir = free_ports(3), tmp_path / "argv"
    argv_dir.mkdir()
    up = launch(up_args(fake_model, ports) + ["--python", fake_python, "--block-size", "32", "--dtype", "float32",
                                             "--no-enable-prefix-caching"], {"FAKE_ARGV_DIR": str(argv_dir)})
    up.wait_ready(timeout=30)
    assert health_status(f"127.0.0.1:{ports[0]}") == "SERVING"
    pids = up.pids()
    assert sorted(pids) == ["frontend", "scheduler", "worker-0", "worker-1"]

    expected = service_commands(Deployment(
        model=str(fake_model), served_model_name=str(fake_model), num_workers=2, grpc_port=ports[0], http_port=ports[1], scheduler_port=ports[2],
        worker_ports=up.worker_ports(), python=fake_python,
        engine_flags=(("--block-size", "32"), ("--dtype", "float32"), ("--enable-prefix-caching", False),
                      ("--num-threads", str(default_worker_threads(2))))))  # the cores, shared
    ran = {int(f.stem): json.loads(f.read_text()) for f in argv_dir.iterdir()}
    assert {name: ran[pid] for name, pid in pids.items()} == {name: argv[1:] for name, argv in expected.items()}

    up.proc.send_signal(sig)
    assert up.finish(timeout=10) == 0, up.log()
    assert_all_stopped(up, ports + up.worker_ports(), pids, within=1)


def test_up_stops_everything_and_fails_when_a_service_dies(launch, fake_python, fake_model, tmp_path):
    ports, logs = free_ports(3), tmp_path / "logs"
    up = launch(up_args(fake_model, ports) + ["--python", fake_python, "--log-dir", str(logs)],
                {"FAKE_EXIT_AFTER": "services.frontend"})
    assert up.finish(timeout=30) == 1, up.log()
    assert "frontend exited with code 3" in up.log()
    assert "fake services.frontend failing on purpose" in up.log()  # its last lines are shown
    assert "fake services.frontend failing on purpose" in (logs / "frontend.log").read_text()
    assert "fake services.worker serving" in (logs / "worker-1.log").read_text()
    pids = up.pids()
    assert sorted(pids) == ["frontend", "scheduler", "worker-0", "worker-1"]
    assert_all_stopped(up, ports, pids, within=1)


def test_up_names_the_service_that_does_not_come_up(launch, fake_python, fake_model):
    ports = free_ports(3)
    up = launch(up_args(fake_model, ports, workers=1) + ["--python", fake_python, "--startup-timeout", "2"],
                {"FAKE_NOT_SERVING": "services.worker"})
    assert up.finish(timeout=30) == 1, up.log()
    assert re.search(r"worker-0 was not SERVING at 127\.0\.0\.1:\d+ in time \(last: NOT_SERVING\)", up.log())
    assert "fake services.worker serving on" in up.log()
    assert "started frontend" not in up.log()
    assert port_free(ports[2]), up.log()


def test_ctrl_c_during_startup_stops_what_started_and_starts_nothing_more(launch, fake_python, fake_model):
    ports = free_ports(3)
    up = launch(up_args(fake_model, ports, workers=1) + ["--python", fake_python],
                {"FAKE_NOT_SERVING": "services.worker"})
    deadline = time.monotonic() + 30
    while "fake services.worker serving" not in up.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    up.proc.send_signal(signal.SIGINT)
    assert up.finish(timeout=10) == 0, up.log()
    assert sorted(up.pids()) == ["scheduler", "worker-0"]
    assert_all_stopped(up, ports, up.pids(), within=1)


def test_up_refuses_a_model_that_is_not_there(launch, tmp_path):
    up = launch(["--model", str(tmp_path / "nothing")])
    assert up.finish(timeout=30) == 2
    assert "neither a folder nor a hub id" in up.log()


@pytest.mark.slow
@pytest.mark.skipif(not REAL_SERVICES, reason="the three services' __main__ modules are not there yet")
def test_up_serves_a_tiny_model_with_the_real_services(launch, tiny_llama):
    ports = free_ports(3)
    up = launch(up_args(tiny_llama, ports) + ["--dtype", "float32", "--num-gpu-blocks", "64", "--startup-timeout", "240"])
    up.wait_ready(timeout=300)
    assert health_status(f"127.0.0.1:{ports[0]}") == "SERVING"
    pids = up.pids()
    assert len(pids) == 4
    up.proc.send_signal(signal.SIGINT)
    assert up.finish(timeout=30) == 0, up.log()
    assert_all_stopped(up, ports + up.worker_ports(), pids, within=1)
