"""deploy/kubernetes: every overlay renders (kubectl kustomize), every built-in object validates
against the Kubernetes 1.34 schemas in strict mode (kubernetes-validate), checkov passes with each
skipped check named with its reason, and every container runs a command its service's own argument
parser takes: the launcher's command (services.launch.deployment.service_commands), so a renamed
flag fails here. The autoscalers' metric names are checked against a running frontend's /metrics
in tests/frontend/test_http_cluster.py. Nothing here runs a cluster: none can run on these machines.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services import cli
from services.frontend import __main__ as frontend_main
from services.launch.deployment import Deployment, service_commands
from services.rpc.grpc_server import LIVENESS
from services.scheduler import __main__ as scheduler_main
from services.tools import default_model
from services.worker import __main__ as worker_main

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.34"
MIN_KUBECTL_MINOR = 27  # kustomize components and `labels:` (kustomize v5 in kubectl 1.27)
# What each overlay is made of: (resources, components), relative to deploy/kubernetes.
OVERLAYS = {
    "base": ("base", ()),
    "gpu": ("overlays/gpu", ()),
    "base+keda+servicemonitor": ("base", ("components/keda", "components/servicemonitor")),
    "gpu+keda+servicemonitor": ("overlays/gpu", ("components/keda", "components/servicemonitor")),
}
CUSTOM_RESOURCES = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "ServiceMonitor")}
POD_IP = "10.42.0.7"  # what the downward API gives a worker's POD_IP

# checkov's checks these manifests fail on purpose, and why. The test also fails when one of them
# passes again, so the list stays the list of what is skipped.
CHECKOV_SKIPPED = {
    "CKV_K8S_14": "the image tag is the user's: `docker build -t pagedserve .` makes pagedserve:latest, and "
                  "`kustomize edit set image` points the manifests at the user's registry and tag",
    "CKV_K8S_43": "a digest exists only once the user pushed the image to a registry (kustomize edit set image "
                  "pagedserve=REGISTRY/pagedserve@sha256:...)",
    "CKV_K8S_15": "imagePullPolicy IfNotPresent, so an image loaded onto the nodes (kind load, air-gapped "
                  "clusters) is used as it is; with a fixed tag or a digest Always adds nothing",
    "CKV_K8S_40": "the image's user is uid 1000 (Dockerfile: useradd --uid 1000), whose home holds the kernel "
                  "cache path; another uid would have no home",
}


def kubectl() -> str:
    """kubectl with kustomize components, or skip saying why."""
    found = shutil.which("kubectl")
    if not found:
        pytest.skip("kubectl is not installed (.ci/run installs it where apt has it)")
    version = json.loads(subprocess.run([found, "version", "--client", "-o", "json"], capture_output=True,
                                        text=True, check=True).stdout)["clientVersion"]
    minor = int(re.match(r"\d+", version["minor"]).group())
    if (int(version["major"]), minor) < (1, MIN_KUBECTL_MINOR):
        pytest.skip(f"kubectl {version['gitVersion']} is older than 1.{MIN_KUBECTL_MINOR} (kustomize components)")
    return found


def render(name: str, out: Path) -> list[dict]:
    """The overlay's objects, as `kubectl kustomize` makes them (components through a throwaway overlay)."""
    resource, components = OVERLAYS[name]
    root = out / name
    root.mkdir(parents=True, exist_ok=True)
    relative = lambda p: os.path.relpath(KUBE / p, root)  # kustomize takes no absolute roots
    (root / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [relative(resource)], "components": [relative(c) for c in components]}))
    result = subprocess.run([kubectl(), "kustomize", str(root)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("kustomize")
    return {name: render(name, out) for name in OVERLAYS}


def objects(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def containers(docs: list[dict]):
    """(deployment, container, is_init) for every container of every Deployment."""
    for name, deployment in objects(docs, "Deployment").items():
        spec = deployment["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []):
            yield name, c, True
        for c in spec["containers"]:
            yield name, c, False


# ---- rendering and schemas ----------------------------------------------------------------------
@pytest.mark.parametrize("name", OVERLAYS)
def test_every_overlay_renders_the_three_services(rendered, name):
    docs = rendered[name]
    deployments = objects(docs, "Deployment")
    assert set(deployments) == {"scheduler", "worker", "frontend"}
    assert deployments["scheduler"]["spec"]["replicas"] == 1
    assert deployments["scheduler"]["spec"]["strategy"] == {"type": "Recreate"}
    assert deployments["frontend"]["spec"]["replicas"] >= 2
    assert set(objects(docs, "Service")) == {"scheduler", "frontend"}  # workers are dialled at their pod IPs
    assert {p["port"] for p in objects(docs, "Service")["frontend"]["spec"]["ports"]} == {50051, 8000}
    assert set(objects(docs, "PodDisruptionBudget")) == {"worker", "frontend"}
    keda = "keda" in name
    assert set(objects(docs, "HorizontalPodAutoscaler")) == (set() if keda else {"worker"})
    assert set(objects(docs, "ScaledObject")) == ({"worker"} if keda else set())
    assert all(doc["metadata"].get("namespace") == "pagedserve" for doc in docs if doc["kind"] != "Namespace")


@pytest.mark.parametrize("name", OVERLAYS)
def test_builtin_objects_validate_against_the_kubernetes_schemas_strictly(rendered, name):
    import kubernetes_validate

    for doc in rendered[name]:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_RESOURCES:
            continue  # custom resources: no schema in Kubernetes
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_strict_validation_refuses_a_misspelt_field(rendered):
    import kubernetes_validate

    worker = json.loads(json.dumps(objects(rendered["base"], "Deployment")["worker"]))
    worker["spec"]["template"]["spec"]["terminationGracePeriod"] = 15
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, KUBERNETES_VERSION, strict=True)


def checkov() -> str:
    """checkov lives in a venv of its own (.ci/run makes .venv-checkov: its pins clash with ours)."""
    for candidate in (ROOT / ".venv-checkov" / "bin" / "checkov", shutil.which("checkov")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.skip("checkov is not installed (.ci/run installs it into .venv-checkov)")


@pytest.mark.slow
def test_checkov_passes_but_for_the_named_skips(rendered, tmp_path):
    for name, docs in rendered.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(docs))
    result = subprocess.run([checkov(), "-d", str(tmp_path), "--framework", "kubernetes", "--skip-download",
                             "--output", "json", "--quiet"], capture_output=True, text=True, timeout=300)
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = {(c["check_id"], c["resource"]) for r in reports for c in r["results"]["failed_checks"]}
    assert {check for check, _ in failed} == set(CHECKOV_SKIPPED), sorted(failed)


# ---- the commands -----------------------------------------------------------------------------
PARSERS = {"services.scheduler": (scheduler_main.parse_args, scheduler_main.CLI_CONFIGS, scheduler_main.PROG),
           "services.worker": (worker_main.parse_args, worker_main.CLI_CONFIGS, worker_main.PROG),
           "services.frontend": (frontend_main.parse_args, frontend_main.CLI_CONFIGS, frontend_main.PROG)}


def container_env(container: dict) -> dict[str, str]:
    """The container's environment as Kubernetes would set it (downward API values made up)."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            env[var["name"]] = POD_IP
        else:
            ref = var["valueFrom"]["resourceFieldRef"]
            assert ref["containerName"] == container["name"] and ref["resource"] == "limits.cpu"
            env[var["name"]] = str(container["resources"]["limits"]["cpu"])  # whole cores
    return env


def argv(container: dict, env: dict[str, str]) -> list[str]:
    """command + args with $(VAR) expanded from the container's env, as the kubelet does."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], part)
            for part in container["command"] + container.get("args", [])]


def expected_commands(gpu: bool) -> dict[str, list[str]]:
    """The launcher's commands for what the manifests stand for: one service per container."""
    commands = service_commands(Deployment(
        model="/models/SmolLM2-135M-Instruct", served_model_name="default", host="0.0.0.0", internal_host="0.0.0.0",
        scheduler_address="scheduler:50052", worker_ports=(50053,), advertise_host=POD_IP, drain_timeout_s=10,
        engine_flags=(("--device", "cuda"),) if gpu else ()))
    return {"scheduler": commands["scheduler"], "worker": commands["worker-0"], "frontend": commands["frontend"]}


@pytest.mark.parametrize("name", ["base", "gpu"])
def test_every_container_runs_the_launchers_command_and_its_parser_takes_it(rendered, name, monkeypatch):
    expected = expected_commands(gpu=name == "gpu")
    seen = set()
    for deployment, container, is_init in containers(rendered[name]):
        env = container_env(container)
        command = argv(container, env)
        assert command[:2] == ["python", "-m"]
        if is_init:
            assert command[2:] == ["services.tools.default_model", "--cache-dir", "/models"]
            default_model.parse_args(command[3:])
            continue
        assert command == expected[deployment]
        parse, configs, prog = PARSERS[command[2]]
        engine = {k: v for k, v in env.items() if k.startswith(cli.ENV_PREFIX)}
        known = {cli.env_name(name) for flag in cli.flags_of(*configs) for name in (flag.name, *flag.aliases)}
        assert set(engine) <= known, f"{deployment}: no such flag for {sorted(set(engine) - known)}"
        for key in [k for k in os.environ if k.startswith(cli.ENV_PREFIX)]:
            monkeypatch.delenv(key)
        for key, value in engine.items():
            monkeypatch.setenv(key, value)
        cli.build_configs(parse(command[3:]), *configs, prog=prog)  # SystemExit(2) on an unknown or bad flag
        seen.add(deployment)
    assert seen == {"scheduler", "worker", "frontend"}


def test_a_renamed_flag_is_refused_by_the_parser(rendered):
    worker = next(c for d, c, init in containers(rendered["base"]) if d == "worker" and not init)
    command = [part.replace("--scheduler-address", "--scheduler-host") for part in argv(worker, container_env(worker))]
    with pytest.raises(SystemExit):
        worker_main.parse_args(command[3:])


# ---- probes, drain, security ------------------------------------------------------------------
def test_probes_ask_grpc_health_and_grace_periods_cover_the_drains(rendered):
    deployments = objects(rendered["base"], "Deployment")
    by_name = {d: c for d, c, init in containers(rendered["base"]) if not init}
    for name, container in by_name.items():
        port = container["ports"][0]["containerPort"]
        assert container["livenessProbe"]["grpc"] == {"port": port, "service": LIVENESS}, name
        assert container["readinessProbe"]["grpc"] == {"port": port}, name  # "": ready to serve
    assert by_name["worker"]["startupProbe"]["grpc"]["service"] == by_name["frontend"]["startupProbe"]["grpc"][
        "service"] == LIVENESS
    grace = {name: d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] for name, d in deployments.items()}
    assert grace["worker"] >= worker_main.STOP_GRACE_S + 5
    frontend = by_name["frontend"]
    command = frontend["command"]
    drain = float(command[command.index("--drain-timeout-s") + 1])
    assert grace["frontend"] >= frontend["lifecycle"]["preStop"]["sleep"]["seconds"] + drain + 5


def test_the_worker_advertises_its_pod_ip(rendered):
    worker = next(c for d, c, init in containers(rendered["base"]) if d == "worker" and not init)
    assert worker["command"][-2:] == ["--advertise-host", "$(POD_IP)"]
    [pod_ip] = [v for v in worker["env"] if v["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


@pytest.mark.parametrize("name", ["base", "gpu"])
def test_every_container_is_unprivileged_with_requests_and_limits(rendered, name):
    for deployment in objects(rendered[name], "Deployment").values():
        assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    for deployment, container, _ in containers(rendered[name]):
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
        assert security["capabilities"]["drop"] == ["ALL"]
        resources = container["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(resources["limits"])
    gpu_worker = next(c for d, c, init in containers(rendered[name]) if d == "worker" and not init)
    assert ("nvidia.com/gpu" in gpu_worker["resources"]["limits"]) == (name == "gpu")


def test_network_policies_open_only_the_frontend(rendered):
    policies = objects(rendered["base"], "NetworkPolicy")
    assert policies["default-deny-ingress"]["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}

    def sources(name):
        [rule] = policies[name]["spec"]["ingress"]
        return {peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in rule.get("from", [])}

    assert sources("frontend") == set()  # no `from`: anyone
    assert sources("scheduler") == {"frontend", "worker"}
    assert sources("worker") == {"scheduler"}


def test_liveness_is_serving_while_the_service_is_not_ready():
    """What the liveness probes ask: a worker waiting for its scheduler is alive, just not ready."""
    import asyncio

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.rpc.grpc_server import GrpcServer

    async def statuses() -> list[str]:
        server = GrpcServer(lambda s: None, "pagedserve.internal.v1.Worker", reflection_on=False)
        port = await server.start("127.0.0.1", 0)
        await server.set_serving(False)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            names = []
            for service in ("", LIVENESS):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                names.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
        await server.stop(None)
        return names

    assert asyncio.run(statuses()) == ["NOT_SERVING", "SERVING"]
