"""python -m services.scheduler: the scheduler service (queues, block tables, step loop).

    python -m services.scheduler --host 0.0.0.0 --port 50052 --block-size 16 --max-num-seqs 64 \\
        --max-num-batched-tokens 2048 --max-model-len 0 --scheduling-policy fcfs \\
        --preemption-mode recompute --enable-prefix-caching --enable-chunked-prefill \\
        --max-waiting-requests 4096 --heartbeat-timeout-s 10 --step-timeout-s 300 --worker-probe-timeout-s 3 \\
        --async-scheduling [--reflection] --log-level info

The flags are those of SchedulerServiceConfig, SchedulerConfig and LogConfig (services/cli.py);
every flag also reads PAGEDSERVE_<FLAG> from the environment. SIGTERM/SIGINT: health turns
NOT_SERVING, new Submits get UNAVAILABLE, running requests finish, then the process exits.
"""
from __future__ import annotations

from services.launch.service_main import ServiceMain, stop_requested
from services.scheduler.config import CLI_CONFIGS, SchedulerServiceConfig
from services.scheduler.server import SchedulerServer

MAIN = ServiceMain("scheduler", __doc__, CLI_CONFIGS)
PROG, parse_args, build_config = MAIN.prog, MAIN.parse_args, MAIN.build_configs


async def serve(config: SchedulerServiceConfig) -> None:
    server = SchedulerServer(config)
    await server.start()
    await stop_requested().wait()
    await server.shutdown()


def main(argv: list[str] | None = None) -> None:
    MAIN.run(serve, argv)


if __name__ == "__main__":
    main()
