"""`python -m services up`: starts every service, reports ready, stops them all on a signal.

The fast tests run the launcher with stand-in services (fake_service.py, through --python);
the slow one runs the real three services on a tiny random model.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

import psutil
import pytest
import yaml
from grpc_health.v1 import health, health_pb2_grpc

from services.launch.healthcheck import health_status
from services.__main__ import DEFAULT_STOP_TIMEOUT_S, default_worker_threads
from services.launch.deployment import Deployment, free_ports, routes, service_commands
from services.launch.supervisor import Launcher, RestartPolicy

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

    def events(self, name: str | None = None) -> list[dict]:
        """The launcher's own log lines (JSON, after a "launcher  | " prefix without --log-dir), `name`d ones only."""
        lines = [line.removeprefix("launcher  | ") for line in list(self.err)]
        found = [record for record in map(json.loads, filter(lambda line: line.startswith("{"), lines))
                 if record.get("service") == "launcher"]
        return [e for e in found if name is None or e["event"] == name]

    def pids(self) -> dict[str, int]:
        """Each service's latest pid."""
        return {e["service_name"]: e["pid"] for e in self.events("service_started")}

    def wait_event(self, name: str, timeout: float, **fields) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.events(name) if all(e.get(k) == v for k, v in fields.items())]
            if found:
                return found[-1]
            assert self.proc.poll() is None, f"launcher exited {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"no {name} {fields} in {timeout}s:\n{self.log()}"
            time.sleep(0.1)

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
        """SIGKILL the launcher and every service it started that still runs (checked by command line,
        so a reused pid is left alone)."""
        started = [(self.proc.pid, self.proc.args), *((e["pid"], e["argv"]) for e in self.events("service_started"))]
        for pid, argv in started:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).cmdline()[-len(argv) + 1:] == argv[1:]:  # argv[0]: maybe a script
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


def started_argvs(argv_dir: Path) -> dict[int, list[str]]:
    """pid -> the argv each fake service ran with."""
    return {int(f.name.split(".")[0]): json.loads(f.read_text()) for f in argv_dir.glob("*.json")
            if not f.name.endswith(".stop.json")}


def assert_all_stopped(up: Up, ports: tuple[int, ...], pids: dict[str, int], within: float) -> None:
    deadline = time.monotonic() + within
    while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [name for name, pid in pids.items() if alive(pid)], up.log()
    assert [p for p in ports if not port_free(p)] == [], up.log()


def assert_orphans_stop(up: Up, ports: tuple[int, ...], within: float) -> None:
    """SIGKILL the launcher (as the OOM killer would): every service it started stops by itself
    (orphan.py) within `within` seconds and frees its ports. A zombie nobody reaps counts as stopped."""
    pids = up.pids()
    os.kill(up.proc.pid, signal.SIGKILL)
    up.proc.wait(10)

    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + within
    while any(map(running, pids.values())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [name for name, pid in pids.items() if running(pid)] == [], up.log()
    assert [p for p in ports if not port_free(p)] == [], up.log()


def test_services_stop_when_the_launcher_is_killed(launch, fake_python, fake_model):
    ports = free_ports(3)
    up = launch(up_args(fake_model, ports) + ["--python", fake_python])
    up.wait_ready(timeout=30)
    assert_orphans_stop(up, ports + up.worker_ports(), within=10)


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
        worker_ports=up.worker_ports(), python=fake_python, drain_timeout_s=10.0,  # 2/3 of the 15 s grace
        engine_flags=(("--block-size", "32"), ("--dtype", "float32"), ("--enable-prefix-caching", False),
                      ("--num-threads", str(default_worker_threads(2))))))  # the cores, shared
    ran = started_argvs(argv_dir)
    assert {name: ran[pid] for name, pid in pids.items()} == {name: argv[1:] for name, argv in expected.items()}

    up.proc.send_signal(sig)
    assert up.finish(timeout=10) == 0, up.log()
    assert_all_stopped(up, ports + up.worker_ports(), pids, within=1)


def test_a_worker_that_dies_is_restarted_and_the_deployment_keeps_serving(launch, fake_python, fake_model):
    ports = free_ports(3)
    up = launch(up_args(fake_model, ports) + ["--python", fake_python])
    up.wait_ready(timeout=30)
    before = up.pids()
    os.kill(before["worker-0"], signal.SIGKILL)
    exited = up.wait_event("service_exited", timeout=10, service_name="worker-0")
    assert exited["pid"] == before["worker-0"] and exited["exit_code"] == -signal.SIGKILL
    assert exited["restart_in_s"] == 0.5 and exited["level"] == "warning"
    ready = up.wait_event("service_ready", timeout=20, service_name="worker-0")
    assert ready["pid"] != before["worker-0"] and alive(ready["pid"])
    assert up.proc.poll() is None  # still up: nothing else was touched
    assert {name: pid for name, pid in up.pids().items() if name != "worker-0"} == \
        {name: pid for name, pid in before.items() if name != "worker-0"}
    assert health_status(f"127.0.0.1:{ports[0]}") == "SERVING"
    assert health_status(f"127.0.0.1:{up.worker_ports()[0]}") == "SERVING"  # the new one, on the same port

    os.kill(ready["pid"], signal.SIGKILL)  # it ran under a minute: the next backoff is longer
    assert up.wait_event("service_exited", timeout=10, pid=ready["pid"])["restart_in_s"] == 1.0
    up.stop()
    assert up.proc.returncode == 0, up.log()


@pytest.mark.slow
def test_a_frontend_that_keeps_dying_stops_the_deployment_after_three_restarts(launch, fake_python, fake_model,
                                                                                tmp_path):
    ports, logs = free_ports(3), tmp_path / "logs"
    up = launch(up_args(fake_model, ports) + ["--python", fake_python, "--log-dir", str(logs)],
                {"FAKE_EXIT_AFTER": "services.frontend"})
    assert up.finish(timeout=60) == 1, up.log()
    exits = [e for e in up.events("service_exited") if e["service_name"] == "frontend"]
    assert [(e["exit_code"], e["restart_in_s"]) for e in exits] == [(3, 0.5), (3, 1.0), (3, 2.0)]
    failed = up.events("deployment_failed")[-1]
    assert failed["reason"] == "frontend exited with code 3 after 3 restarts in a row; giving up"
    assert "fake services.frontend failing on purpose" in failed["last_lines"]  # its last lines are shown
    assert "fake services.frontend failing on purpose" in (logs / "frontend.log").read_text()
    assert "fake services.worker serving" in (logs / "worker-1.log").read_text()
    pids = up.pids()
    assert sorted(pids) == ["frontend", "scheduler", "worker-0", "worker-1"]
    assert_all_stopped(up, ports, pids, within=1)


def test_a_service_that_exits_with_status_2_is_not_restarted(launch, fake_python, fake_model):
    """Status 2: its flags are wrong or the scheduler refused it; a restart would only repeat that."""
    ports = free_ports(3)
    up = launch(up_args(fake_model, ports) + ["--python", fake_python],
                {"FAKE_EXIT_AFTER": "services.worker", "FAKE_EXIT_CODE": "2"})
    assert up.finish(timeout=30) == 1, up.log()
    assert not up.events("service_exited")
    assert "exited with code 2 (a setting it refuses; not restarted)" in up.events("deployment_failed")[-1]["reason"]


def test_up_is_not_ready_when_another_server_holds_the_schedulers_port(launch, fake_python, fake_model):
    """Another deployment's scheduler answers SERVING on the port; ours failed to bind it and exits."""
    ports = free_ports(3)
    squatter = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, squatter)
    squatter.add_insecure_port(f"127.0.0.1:{ports[2]}")
    squatter.start()
    try:
        assert health_status(f"127.0.0.1:{ports[2]}") == "SERVING"
        up = launch(up_args(fake_model, ports, workers=1) + ["--python", fake_python])
        assert up.finish(timeout=30) == 1, up.log()
        assert not any(line.startswith("ready:") for line in up.out)
        failed = up.events("deployment_failed")[-1]
        assert failed["reason"] == "scheduler exited with code 1 before it was serving"
        assert any(f"127.0.0.1:{ports[2]}" in line and "bind" in line for line in failed["last_lines"])
        assert sorted(up.pids()) == ["scheduler"]
    finally:
        squatter.stop(0)


def value_flags() -> dict[str, tuple[str, ...]]:
    return {flag: route.services for flag, route in routes().items() if not route.flag.is_switch}


def switch_flags() -> dict[str, tuple[str, ...]]:
    return {flag: route.services for flag, route in routes().items() if route.flag.is_switch}


def test_every_flag_up_lists_reaches_the_services_it_names(launch, fake_python, fake_model):
    VALUE_FLAGS, SWITCH_FLAGS = value_flags(), switch_flags()
    values = {flag: f"{7 + i}" for i, flag in enumerate(VALUE_FLAGS)}
    values["--log-level"] = "debug"
    switches = {flag: ("--" if i % 2 else "--no-") + flag[2:] for i, flag in enumerate(SWITCH_FLAGS)}
    switches["--reflection"] = "--reflection"
    args = [part for flag, value in values.items() for part in (flag, value)] + list(switches.values())
    up = launch(up_args(fake_model, free_ports(3)) + ["--python", fake_python, *args])
    up.wait_ready(timeout=30)
    for name, pid in up.pids().items():
        service = name.partition("-")[0]
        argv = psutil.Process(pid).cmdline()  # /proc/PID/cmdline
        assert f"services.{service}" in argv
        for flag, value in values.items():
            takes = service in VALUE_FLAGS[flag]
            assert (flag in argv) == takes, (name, flag, argv)
            if takes:
                assert argv[argv.index(flag) + 1] == value, (name, flag, argv)
        for flag, given in switches.items():
            assert (given in argv) == (service in SWITCH_FLAGS[flag]), (name, flag, argv)
    up.stop()


@pytest.mark.parametrize("service", ["scheduler", "worker", "frontend"])
def test_each_service_knows_every_flag_up_passes_it(service):
    """The routes name no flag a service's own parser would refuse or read differently."""
    VALUE_FLAGS, SWITCH_FLAGS = value_flags(), switch_flags()
    parse_args = importlib.import_module(f"services.{service}.__main__").parse_args
    values = {flag: "7" for flag, services in VALUE_FLAGS.items() if service in services}
    values["--log-level"] = "debug"
    argv = [part for flag, value in values.items() for part in (flag, value)]
    switches = [flag for flag, services in SWITCH_FLAGS.items() if service in services]
    args = parse_args(argv + switches)
    for flag, value in values.items():
        assert str(getattr(args, flag[2:].replace("-", "_"))) in (value, f"{value}.0"), flag
    assert all(getattr(args, flag[2:].replace("-", "_")) is True for flag in switches)
    negated = parse_args(["--no-" + flag[2:] for flag in switches])
    assert [flag for flag in switches if getattr(negated, flag[2:].replace("-", "_")) is not False] == []


def test_sigterm_stops_the_frontend_first_then_the_scheduler_then_the_workers(launch, fake_python, fake_model,
                                                                             tmp_path):
    argv_dir = tmp_path / "argv"
    argv_dir.mkdir()
    up = launch(up_args(fake_model, free_ports(3)) + ["--python", fake_python, "--stop-timeout", "6"],
                {"FAKE_ARGV_DIR": str(argv_dir), "FAKE_DRAIN_S": "1.5"})
    up.wait_ready(timeout=30)
    pids = up.pids()
    up.proc.send_signal(signal.SIGTERM)
    assert up.finish(timeout=10) == 0, up.log()
    stops = {name: json.loads((argv_dir / f"{pid}.stop.json").read_text()) for name, pid in pids.items()}
    assert stops["frontend"]["exited"] - stops["frontend"]["signalled"] >= 1.5  # it was let drain
    assert stops["frontend"]["exited"] <= stops["scheduler"]["signalled"]
    assert stops["scheduler"]["exited"] <= min(stops[w]["signalled"] for w in ("worker-0", "worker-1"))
    assert started_argvs(argv_dir)[pids["frontend"]][-len(["--drain-timeout-s", "4"]):] == ["--drain-timeout-s", "4"]


@pytest.mark.slow
def test_a_frontend_that_does_not_drain_in_the_grace_period_is_killed(launch, fake_python, fake_model):
    up = launch(up_args(fake_model, free_ports(3), workers=1) + ["--python", fake_python, "--stop-timeout", "3"],
                {"FAKE_DRAIN_S": "60"})
    up.wait_ready(timeout=30)
    pids = up.pids()
    started = time.monotonic()
    up.proc.send_signal(signal.SIGTERM)
    assert up.finish(timeout=10) == 0, up.log()
    assert time.monotonic() - started < 3 + 1.5  # the whole grace period, and a little to spare
    assert up.wait_event("stop_timeout", timeout=1, service_name="frontend")["pid"] == pids["frontend"]
    assert_all_stopped(up, (), pids, within=1)


def test_the_compose_files_grace_period_is_the_launchers():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert {name: services[name].get("stop_grace_period") for name in ("scheduler", "worker", "frontend")} == \
        dict.fromkeys(("scheduler", "worker", "frontend"), f"{DEFAULT_STOP_TIMEOUT_S:g}s")


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
    assert "neither a folder, a GGUF file nor a hub id" in up.log()


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


@pytest.mark.slow
@pytest.mark.skipif(not REAL_SERVICES, reason="the three services' __main__ modules are not there yet")
def test_the_real_services_stop_when_the_launcher_is_killed(launch, tiny_llama):
    ports = free_ports(3)
    up = launch(up_args(tiny_llama, ports, workers=1) + ["--dtype", "float32", "--num-gpu-blocks", "64",
                                                         "--startup-timeout", "240"])
    up.wait_ready(timeout=300)
    assert_orphans_stop(up, ports + up.worker_ports(), within=30)


def test_the_backoff_doubles_to_its_cap_and_starts_over_after_a_minute_of_running(fake_model):
    """The restart bookkeeping alone: no process is started."""
    launcher = Launcher(Deployment(model=str(fake_model), worker_ports=(1,)), err=io.StringIO())
    worker = launcher.children[1]
    worker.proc = subprocess.Popen(["true"])
    worker.proc.wait()
    delays = []
    for _ in range(8):  # each run lasted a second
        worker.started_at, worker.restart_at = 100.0, None
        launcher._exited(worker, 1, now=101.0)
        delays.append(worker.restart_at - 101.0)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    worker.started_at = 100.0
    launcher._exited(worker, 1, now=100.0 + RestartPolicy().reset_after_s)  # it ran a minute
    assert worker.restart_at - (100.0 + RestartPolicy().reset_after_s) == 0.5 and worker.restarts == 1
