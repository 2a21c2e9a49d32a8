"""The services' command lines, generated from their config dataclasses, and `up`'s routing of
each flag to the services whose dataclasses hold it."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
from pathlib import Path

import pytest

from services import cli
from services.launch.deployment import SERVICE_CONFIGS, Deployment, routes, service_commands

SERVICES = ("scheduler", "worker", "frontend")


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(cli.ENV_PREFIX):
            monkeypatch.delenv(name)


def main_of(service: str):
    return importlib.import_module(f"services.{service}.__main__")


def build(service: str, argv: list[str]) -> tuple:
    main = main_of(service)
    builder = main.build_configs if service == "worker" else main.build_config
    return builder(main.parse_args(argv))


def settings(service: str):
    """(dataclass, field) of every setting the service's flags come from, nested ones too."""
    flags = cli.flags_of(*SERVICE_CONFIGS[service])
    return [(flag, next(f for f in dataclasses.fields(flag.owner) if f.name == flag.field)) for flag in flags]


@pytest.mark.parametrize("service", SERVICES)
def test_every_setting_is_a_flag_with_its_default_and_help(service, capsys):
    main = main_of(service)
    with pytest.raises(SystemExit):
        main.parse_args(["--help"])
    usage = " ".join(capsys.readouterr().out.split())
    defaults = main.parse_args([])
    for flag, field in settings(service):
        assert flag.name in usage, flag.name
        assert " ".join(field.metadata["help"].split()) in usage, flag.name
        if field.default is not dataclasses.MISSING:
            assert getattr(defaults, flag.dest) == field.default, flag.name


@pytest.mark.parametrize("service", SERVICES)
def test_no_flags_give_the_dataclasses_defaults(service):
    built = build(service, [])
    expected = tuple(cls() for cls in SERVICE_CONFIGS[service])
    if service == "worker":  # a per-process default
        expected = tuple(dataclasses.replace(c, worker_id=b.worker_id) if hasattr(c, "worker_id") else c
                         for c, b in zip(expected, built))
    assert built == expected


def test_flags_and_environment_reach_the_nested_configs(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_MAX_NUM_SEQS", "8")
    service, _ = build("scheduler", ["--block-size", "32", "--max-model-len", "0", "--no-enable-prefix-caching"])
    assert (service.scheduler.max_num_seqs, service.scheduler.block_size) == (8, 32)
    assert service.scheduler.max_model_len is None and not service.scheduler.enable_prefix_caching
    frontend, log = build("frontend", ["--max-grammar-bytes", "100", "--log-level", "debug"])
    assert frontend.grammar.max_bytes == 100 and log.log_level == "debug"


def test_the_old_name_of_async_scheduling_still_works(monkeypatch, capsys):
    assert build("scheduler", [])[0].scheduler.async_scheduling
    assert not build("scheduler", ["--no-overlap-steps"])[0].scheduler.async_scheduling
    assert "--no-overlap-steps is an old name of --async-scheduling" in capsys.readouterr().err
    assert not build("scheduler", ["--no-async-scheduling"])[0].scheduler.async_scheduling
    monkeypatch.setenv("PAGEDSERVE_OVERLAP_STEPS", "0")
    assert not build("scheduler", [])[0].scheduler.async_scheduling


def test_the_model_cache_comes_from_main_and_its_old_variable_still_works(monkeypatch):
    """--model-cache-dir (no longer read by a service: "default" is the package's GGUF file) is still taken from
    main, with its old variable, so the command lines of older deployments start; the converting tool's folder
    is named by it."""
    from services.tools.default_model import MODEL_NAME, default_model_path

    monkeypatch.setenv("PAGEDSERVE_CACHE", "/old/name")
    assert build("worker", [])[0].model_cache_dir == "/old/name"
    assert build("frontend", ["--model-cache-dir", "/new"])[0].model_cache_dir == "/new"
    assert "--model-cache-dir" not in routes()
    assert default_model_path("/new") == Path("/new") / MODEL_NAME


@pytest.mark.parametrize("service, argv, flag", [
    ("scheduler", ["--block-size", "12"], "--block-size"),
    ("scheduler", ["--scheduling-policy", "random"], "--scheduling-policy"),
    ("worker", ["--cpu-isa", "neon"], "--cpu-isa"),
    ("frontend", ["--grammar-compile-timeout-s", "0"], "--grammar-compile-timeout-s"),
    ("frontend", ["--log-level", "loud"], "--log-level"),
    ("scheduler", ["--speculative-config", '{"method": "eagle"}'], "--speculative-config"),
    ("scheduler", ["--speculative-config", "{nope"], "--speculative-config"),
    ("scheduler", ["--kv-events-config", '{"enable_kv_cache_events": true, "hwm": 0}'], "--kv-events-config"),
])
def test_a_refused_setting_exits_2_naming_its_flag(service, argv, flag, capsys):
    with pytest.raises(SystemExit) as exit:
        build(service, argv)
    assert exit.value.code == 2  # the launcher does not restart a service that exits 2
    assert f"error: {flag}:" in capsys.readouterr().err


def test_up_routes_each_flag_to_the_services_whose_dataclasses_hold_it():
    held = {service: {f.name for f in cli.flags_of(*SERVICE_CONFIGS[service])} for service in SERVICES}
    for flag, route in routes().items():
        assert route.services == tuple(s for s in SERVICES if flag in held[s]), flag
    assert routes()["--block-size"].services == ("scheduler", "worker")
    assert routes()["--max-num-seqs"].services == ("scheduler",)
    assert routes()["--api-key"].services == ("frontend",)
    assert routes()["--log-level"].services == SERVICES
    for own in ("--worker-id", "--host", "--port", "--model", "--drain-timeout-s", "--scheduler-address"):
        assert own not in routes()  # the launcher sets these itself, per process


def up_argvs(argv: list[str]) -> dict[str, list[str]]:
    from services.__main__ import add_up_parser, engine_flags
    parser = argparse.ArgumentParser()
    add_up_parser(parser.add_subparsers())
    args = parser.parse_args(["up", "--workers", "1", *argv])
    deployment = Deployment(model="m", worker_ports=(1,), engine_flags=engine_flags(args))
    return service_commands(deployment)


def test_speculative_config_is_json_on_the_scheduler_and_up_passes_it_through(monkeypatch):
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2}'
    config = build("scheduler", ["--speculative-config", text])[0].scheduler.speculative_config
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == ("ngram", 3, 5)
    assert build("scheduler", [])[0].scheduler.speculative_config is None
    monkeypatch.setenv("PAGEDSERVE_SPECULATIVE_CONFIG", '{"method": "suffix"}')
    assert build("scheduler", [])[0].scheduler.speculative_config.method == "suffix"
    scheduler = up_argvs(["--speculative-config", text])["scheduler"]
    assert scheduler[scheduler.index("--speculative-config") + 1] == text
    assert routes()["--speculative-config"].services == ("scheduler",)


def test_kv_events_config_is_vllms_json_on_the_scheduler_and_up_passes_it_through():
    text = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5600", "replay_endpoint": "tcp://*:5601"}'
    config = build("scheduler", ["--kv-events-config", text])[0].scheduler.kv_events_config
    assert (config.publisher, config.endpoint, config.replay_endpoint, config.buffer_steps) == \
        ("zmq", "tcp://*:5600", "tcp://*:5601", 10_000)
    scheduler = up_argvs(["--kv-events-config", text])["scheduler"]
    assert scheduler[scheduler.index("--kv-events-config") + 1] == text
    assert routes()["--kv-events-config"].services == ("scheduler",)


def test_up_passes_a_flag_only_to_its_services_and_the_old_name_by_the_new():
    argvs = up_argvs(["--max-num-seqs", "5", "--block-size", "32", "--no-overlap-steps", "--api-key", "k"])
    scheduler, worker, frontend = argvs["scheduler"], argvs["worker-0"], argvs["frontend"]
    assert scheduler[scheduler.index("--max-num-seqs") + 1] == "5" and "--max-num-seqs" not in worker
    assert scheduler[scheduler.index("--block-size") + 1] == worker[worker.index("--block-size") + 1] == "32"
    assert "--no-async-scheduling" in scheduler and "--no-overlap-steps" not in scheduler
    assert frontend[frontend.index("--api-key") + 1] == "k" and "--api-key" not in scheduler + worker
    assert "--block-size" not in frontend


def test_up_never_gives_a_worker_a_port_the_user_gave_another_service(monkeypatch):
    """`pagedserve up` chooses its workers' ports before the scheduler, started first, has bound the port the user
    gave it, and the system may offer that very port (a clean-clone CI run: worker-1 on the scheduler's port, which
    failed to bind). Here the system offers the scheduler's port first."""
    from services.launch import deployment

    offered = iter([7001, 7002, 7003, 7004])

    class Offered:
        def bind(self, address):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            pass

    monkeypatch.setattr(deployment.socket, "socket", Offered)
    assert deployment.free_ports(2, avoid=(9000, None, 7001)) == (7002, 7003)
