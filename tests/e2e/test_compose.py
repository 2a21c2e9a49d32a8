"""docker-compose.yml (+ the GPU and host-network overlays) validate, publish only the frontend,
run the launcher's commands (services.launch.deployment.service_commands) and stop in the launcher's
order; the health-check command works.

These need no Docker engine: the files are checked against the compose spec's JSON schema
and, where Compose is installed (v1.29 `docker-compose`, v2 `docker compose`), by its own
`config`; their commands are compared with the launcher's for the same settings. The stack
itself runs in tests/e2e/test_docker.py.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.launch.deployment import Deployment, free_ports, health_addresses, service_commands
from services.tools.default_model import default_model_path

ROOT = Path(__file__).resolve().parents[2]
BASE, GPU, HOSTNET = ROOT / "docker-compose.yml", ROOT / "docker-compose.gpu.yml", ROOT / "docker-compose.hostnet.yml"
SERVICES = ("scheduler", "worker", "frontend")
CONTAINER_HOSTNAME = "3f2a9c1b7d4e"  # what Docker puts in $HOSTNAME


def load(*files: Path) -> dict:
    """The files merged as compose merges them: mappings key by key, lists and scalars replaced."""
    def merge(base, extra):
        if isinstance(base, dict) and isinstance(extra, dict):
            return {**base, **{k: merge(base[k], v) if k in base else v for k, v in extra.items()}}
        return extra
    merged: dict = {}
    for f in files:
        merged = merge(merged, yaml.safe_load(f.read_text()))
    return merged


def compose_deployment(**changes) -> Deployment:
    """The launcher's settings that the compose file stands for: one worker per container."""
    settings = dict(model=str(default_model_path("/models")), served_model_name="default", num_workers=1,
                    host="0.0.0.0", internal_host="0.0.0.0",
                    scheduler_address="scheduler:50052", worker_ports=(50053,), advertise_host=CONTAINER_HOSTNAME)
    return Deployment(**{**settings, **changes})


def container_argv(service: dict) -> list[str]:
    """What the container executes: the entrypoint (a shell, given $HOSTNAME) run on the command."""
    entrypoint = [part.replace("$$", "$") for part in service.get("entrypoint", [])]
    command = [interpolate(part) for part in service["command"]]
    if not entrypoint:
        return command
    shown = subprocess.run(entrypoint + ["printf", r"%s\n"] + command, capture_output=True, text=True,
                           env={"HOSTNAME": CONTAINER_HOSTNAME, "PATH": "/usr/bin:/bin"}, check=True)
    return shown.stdout.splitlines()


def interpolate(value: str) -> str:
    """Compose's ${NAME:-default}, with no variable set."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def stop_order(services: dict) -> list[str]:
    """The order compose stops the long-running services in: every service before those it depends on."""
    order: list[str] = []
    def visit(name):
        if name not in order:
            for dependent, s in services.items():
                if name in s.get("depends_on", {}):
                    visit(dependent)
            order.append(name)
    for name in services:
        visit(name)
    return [name for name in order if "restart" in services[name]]


def compose_commands() -> list[list[str]]:
    """Each installed Compose: v2 (the docker CLI plugin) and v1 (docker-compose)."""
    found = []
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        found.append([docker, "compose"])
    if shutil.which("docker-compose"):
        found.append([shutil.which("docker-compose")])
    return found


@pytest.mark.parametrize("files", [[BASE], [GPU], [BASE, GPU], [BASE, HOSTNET]], ids=["base", "gpu", "both", "hostnet"])
def test_compose_files_validate_against_the_compose_spec(files):
    check = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent)) or "check-jsonschema"
    result = subprocess.run([check, "--builtin-schema", "vendor.compose-spec", *map(str, files)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("files", [[BASE], [BASE, GPU]], ids=["base", "gpu"])
def test_only_the_frontend_publishes_ports(files):
    services = load(*files)["services"]
    assert {name for name, s in services.items() if "ports" in s or "expose" in s} == {"frontend"}
    assert services["frontend"]["ports"] == ["50051:50051", "8000:8000"]
    assert not any("network_mode" in s for s in services.values())


def test_compose_commands_are_the_launchers_commands():
    services = load(BASE)["services"]
    expected = service_commands(compose_deployment())
    assert container_argv(services["scheduler"]) == expected["scheduler"]
    assert container_argv(services["worker"]) == expected["worker-0"]
    assert container_argv(services["frontend"]) == expected["frontend"]


def test_gpu_override_runs_cuda_workers_with_the_launchers_command():
    worker = load(BASE, GPU)["services"]["worker"]
    expected = service_commands(compose_deployment(engine_flags=(("--device", "cuda"),)))
    assert container_argv(worker) == expected["worker-0"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


def test_model_init_fills_the_volume_the_services_read():
    services = load(BASE)["services"]
    init = services["model-init"]["command"]
    assert init[:3] == ["python", "-m", "services.tools.default_model"]
    assert compose_deployment().model == str(default_model_path(init[init.index("--cache-dir") + 1]))
    assert services["model-init"]["volumes"] == ["models:/models"]
    for name in ("worker", "frontend"):
        assert "models:/models:ro" in services[name]["volumes"]
        assert services[name]["depends_on"]["model-init"] == {"condition": "service_completed_successfully"}
    assert services["frontend"]["depends_on"]["scheduler"] == {"condition": "service_healthy"}


def test_kernels_compile_into_a_writable_volume_not_the_model_volume():
    worker = load(BASE)["services"]["worker"]
    assert worker["volumes"] == ["models:/models:ro", "kernels:/home/pagedserve/.cache/pagedserve-kernels"]
    assert "kernels" in load(BASE)["volumes"]


@pytest.mark.parametrize("files", [[BASE], [BASE, HOSTNET]], ids=["base", "hostnet"])
def test_compose_stops_the_frontend_then_the_scheduler_then_the_workers(files):
    """The launcher's stop order: the frontend drains its streams while the scheduler and workers still run."""
    services = {name: s for name, s in load(*files)["services"].items() if "published-ports" not in s.get("profiles", [])}
    assert stop_order(services) in (["frontend", "scheduler", "worker"], ["frontend-host", "scheduler", "worker"])
    assert {s["stop_grace_period"] for name, s in services.items() if "restart" in s} == {"15s"}


def test_no_healthcheck_uses_what_compose_1_29_refuses():
    for files in ([BASE], [BASE, GPU], [BASE, HOSTNET]):
        for name, service in load(*files)["services"].items():
            assert "start_interval" not in service.get("healthcheck", {}), name


@pytest.mark.parametrize("files", [[BASE], [BASE, GPU], [BASE, HOSTNET]], ids=["base", "gpu", "hostnet"])
def test_installed_compose_accepts_the_files(files):
    """`config` of each installed Compose (v1.29 and/or v2): the files parse, merge and validate there."""
    commands = compose_commands()
    if not commands:
        pytest.skip("no Compose installed (docker-compose or the docker compose plugin)")
    for compose in commands:
        args = [arg for f in files for arg in ("-f", str(f))]
        result = subprocess.run(compose + args + ["config", "-q"], cwd=ROOT, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, f"{' '.join(compose)}: {result.stdout}{result.stderr}"


def test_hostnet_overlay_runs_the_launchers_commands_on_loopback():
    """Every service on the host network, bound to 127.0.0.1; workers on port 0, advertising 127.0.0.1."""
    services = load(BASE, HOSTNET)["services"]
    assert {name: s.get("network_mode") for name, s in services.items()} == {
        "model-init": "host", "scheduler": "host", "worker": "host", "frontend": None, "frontend-host": "host"}
    assert services["frontend"]["profiles"] == ["published-ports"]  # parked: its ports cannot go on the host network
    expected = service_commands(compose_deployment(
        host="127.0.0.1", internal_host="127.0.0.1", grpc_port=58051, http_port=58000, scheduler_port=58052,
        scheduler_address="127.0.0.1:58052", worker_ports=(0,), advertise_host="127.0.0.1"))
    assert container_argv(services["scheduler"]) == expected["scheduler"]
    assert container_argv(services["frontend-host"]) == expected["frontend"]
    worker = container_argv(services["worker"])
    assert worker[:-2] == expected["worker-0"] and worker[-2] == "--worker-id"
    assert worker[-1] != container_argv(services["worker"])[-1]  # a replica's own id: same hostname, same pid 1


def test_health_checks_ask_each_service_on_its_own_port():
    services = load(BASE)["services"]
    addresses = health_addresses(compose_deployment())
    for name, key in (("scheduler", "scheduler"), ("worker", "worker-0"), ("frontend", "frontend")):
        assert services[name]["healthcheck"]["test"] == ["CMD", "python", "-m", "services.launch.healthcheck", addresses[key]]


def run_healthcheck(address: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.launch.healthcheck", address, "--timeout", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)


def test_healthcheck_fails_for_a_dead_address():
    result = run_healthcheck(f"127.0.0.1:{free_ports(1)[0]}")
    assert result.returncode == 1
    assert "UNREACHABLE" in result.stderr


@pytest.mark.parametrize("status, code", [("SERVING", 0), ("NOT_SERVING", 1)])
def test_healthcheck_reports_the_servers_status(status, code):
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.ServingStatus.Value(status))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        result = run_healthcheck(f"127.0.0.1:{port}")
    finally:
        server.stop(0)
    assert result.returncode == code, result.stderr
    assert (status in result.stderr) == (code != 0)
