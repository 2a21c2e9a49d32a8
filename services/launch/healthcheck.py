"""Ask a service's grpc.health.v1 endpoint whether it is SERVING (the compose health checks).

    python -m services.launch.healthcheck HOST:PORT [--service NAME] [--timeout SECONDS]

Exit status 0 when the answer is SERVING, 1 otherwise (NOT_SERVING, unreachable, timeout),
with the reason on stderr.
"""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

UNREACHABLE = "UNREACHABLE"


def health_status(address: str, service: str = "", timeout: float = 2.0) -> str:
    """The health status name (SERVING, NOT_SERVING, ...), or UNREACHABLE with the gRPC reason."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return f"{UNREACHABLE} ({exc.code().name}: {exc.details()})"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def is_serving(address: str, service: str = "", timeout: float = 2.0) -> bool:
    return health_status(address, service, timeout) == "SERVING"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.launch.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="HOST:PORT of a gRPC server")
    parser.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    status = health_status(args.address, args.service, args.timeout)
    if status != "SERVING":
        print(f"{args.address}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
