"""`python -m services.frontend`: the public gRPC and OpenAI HTTP APIs in front of the scheduler."""
from __future__ import annotations

import argparse
import asyncio
import signal

import uvloop

from services.cli import add_flag, add_switch
from services.core.errors import InvalidArgument
from services.core.model_path import resolve_model_path
from services.core.structured import GrammarLimits
from services.frontend.config import FrontendConfig
from services.frontend.server import FrontendServer
from services.launch.logs import configure_logging


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.frontend", description=__doc__.splitlines()[0])
    add_flag(parser, "--model", "default", help="model folder (the workers' path), 'default' or a hub id")
    add_flag(parser, "--served-model-name", "", help="the model's id for clients (default: the --model value)")
    add_flag(parser, "--scheduler-address", "127.0.0.1:50052", help="the scheduler's HOST:PORT")
    add_flag(parser, "--host", "0.0.0.0", help="address to listen on")
    add_flag(parser, "--grpc-port", 50051, type=int, help="public gRPC port (0: any free port)")
    add_flag(parser, "--http-port", 0, type=int, help="OpenAI HTTP API, /health and /metrics port (0: off)")
    add_flag(parser, "--api-key", "", help="HTTP clients must send 'Authorization: Bearer KEY' (empty: no key)")
    add_flag(parser, "--max-body-bytes", 2 * 1024 * 1024, type=int, help="larger HTTP request bodies get 413")
    add_flag(parser, "--max-message-bytes", 4 * 1024 * 1024, type=int,
             help="larger gRPC request messages get RESOURCE_EXHAUSTED")
    add_flag(parser, "--max-pending", 0, type=int, help="requests in flight before RESOURCE_EXHAUSTED (0: no limit)")
    add_flag(parser, "--drain-timeout-s", 60.0, type=float,
             help="on SIGTERM, seconds the open requests get to finish before the process exits")
    add_switch(parser, "--reflection", True, help="serve gRPC reflection of the public API (--no-reflection: off)")
    add_flag(parser, "--max-grammar-bytes", GrammarLimits.max_bytes, type=int,
             help="structured outputs: larger constraints are refused (400)")
    add_flag(parser, "--grammar-compile-timeout-s", GrammarLimits.compile_timeout_s, type=float,
             help="structured outputs: constraints that take longer to compile are refused (400)")
    add_flag(parser, "--grammar-cache-size", GrammarLimits.max_entries, type=int,
             help="structured outputs: compiled grammars kept in memory")
    add_flag(parser, "--log-level", "info", help="debug, info, warning or error")
    return parser.parse_args(argv)


async def serve(config: FrontendConfig) -> None:
    server = FrontendServer(config, resolve_model_path(config.model))
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    await server.drain()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging("frontend", args.log_level)
    try:
        config = FrontendConfig(model=args.model, served_model_name=args.served_model_name,
                                scheduler_address=args.scheduler_address, host=args.host,
                                grpc_port=args.grpc_port, http_port=args.http_port, api_key=args.api_key,
                                max_body_bytes=args.max_body_bytes, max_message_bytes=args.max_message_bytes,
                                max_pending=args.max_pending,
                                reflection=args.reflection, drain_timeout_s=args.drain_timeout_s,
                                grammar=GrammarLimits(max_bytes=args.max_grammar_bytes,
                                                      max_entries=args.grammar_cache_size,
                                                      compile_timeout_s=args.grammar_compile_timeout_s))
    except InvalidArgument as error:
        raise SystemExit(f"python -m services.frontend: --{error.field.replace('_', '-')}: {error.message}")
    uvloop.run(serve(config))


if __name__ == "__main__":
    main()
