"""A stand-in for one service in the launcher tests: grpc.health.v1 where the real one listens.

Run as the launcher runs a service, with this file in place of the interpreter's `-m`:
`python fake_service.py -m services.<name> <the service's flags>`. The environment steers it:

    FAKE_ARGV_DIR      write this process's argv (from "-m" on) to DIR/<pid>.json, and when it
                       got SIGTERM and when it exited (time.time()) to DIR/<pid>.stop.json
    FAKE_NOT_SERVING   a module name that answers NOT_SERVING forever
    FAKE_EXIT_AFTER    a module name that exits with code FAKE_EXIT_CODE (3) after a second of serving
    FAKE_DRAIN_S       seconds the frontend takes to exit after SIGTERM (as it drains open streams)

Like the real services it binds without SO_REUSEPORT, so a port another server holds fails it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from services.launch import orphan  # noqa: E402  (as the real services: stop when the launcher is gone)

EXIT_CODE = int(os.environ.get("FAKE_EXIT_CODE", "3"))


def parse(argv: list[str]) -> tuple[str, argparse.Namespace]:
    assert argv[0] == "-m", argv
    parser = argparse.ArgumentParser()
    for flag in ("--host", "--port", "--grpc-port", "--http-port"):
        parser.add_argument(flag)
    known, _ = parser.parse_known_args(argv[2:])
    return argv[1], known


def serve(module: str, args: argparse.Namespace) -> grpc.Server:
    status = health_pb2.HealthCheckResponse.NOT_SERVING if os.environ.get("FAKE_NOT_SERVING") == module \
        else health_pb2.HealthCheckResponse.SERVING
    servicer = health.HealthServicer()
    servicer.set("", status)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = args.grpc_port if module == "services.frontend" else args.port
    if server.add_insecure_port(f"{args.host}:{port}") == 0:
        raise OSError(f"cannot listen on {args.host}:{port}")
    server.start()
    print(f"fake {module} serving on {args.host}:{port}", flush=True)
    return server


def main() -> int:
    module, args = parse(sys.argv[1:])
    if os.environ.get("FAKE_ARGV_DIR"):
        Path(os.environ["FAKE_ARGV_DIR"], f"{os.getpid()}.json").write_text(json.dumps(sys.argv[1:]))
    stop, signalled = threading.Event(), []
    signal.signal(signal.SIGTERM, lambda *_: (signalled.append(time.time()), stop.set()))
    orphan.stop_with_launcher(os.environ.get(orphan.LAUNCHER_PID_ENV))
    server = serve(module, args)
    http = None
    if args.http_port:
        http = socket.create_server((args.host, int(args.http_port)))
    if os.environ.get("FAKE_EXIT_AFTER") == module and not stop.wait(1.0):
        print(f"fake {module} failing on purpose", flush=True)
        return EXIT_CODE
    stop.wait()
    if module == "services.frontend":
        time.sleep(float(os.environ.get("FAKE_DRAIN_S", "0")))
    server.stop(0).wait()
    if http:
        http.close()
    print(f"fake {module} stopped", flush=True)
    if os.environ.get("FAKE_ARGV_DIR"):
        Path(os.environ["FAKE_ARGV_DIR"], f"{os.getpid()}.stop.json").write_text(
            json.dumps({"module": module, "signalled": signalled[0], "exited": time.time()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
