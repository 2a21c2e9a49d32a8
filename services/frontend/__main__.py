"""`python -m services.frontend`: the public gRPC and OpenAI HTTP APIs in front of the scheduler.

The flags are those of FrontendConfig, GrammarLimits and LogConfig (services/cli.py); every flag
also reads PAGEDSERVE_<FLAG> from the environment.
"""
from __future__ import annotations

from services.core.model_path import resolve_model_path, resolve_tokenizer_path
from services.frontend.config import CLI_CONFIGS, FrontendConfig
from services.frontend.server import FrontendServer
from services.launch.service_main import ServiceMain, stop_requested

MAIN = ServiceMain("frontend", __doc__, CLI_CONFIGS)
PROG, parse_args, build_config = MAIN.prog, MAIN.parse_args, MAIN.build_configs


async def serve(config: FrontendConfig) -> None:
    model = resolve_model_path(config.model)
    server = FrontendServer(config, resolve_tokenizer_path(config.tokenizer, model), model)
    await server.start()
    await stop_requested().wait()
    await server.drain()


def main(argv: list[str] | None = None) -> None:
    MAIN.run(serve, argv)


if __name__ == "__main__":
    main()
