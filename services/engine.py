"""The in-process engine: the scheduler and its workers in one process, no gRPC.

The same Scheduler and Worker classes the services wrap; also the baseline that measures
what the gRPC split costs.
"""
from __future__ import annotations

from services.core.config import EngineArgs
from services.core.scheduler import Scheduler
from services.core.sequence import SeqUpdate
from services.scheduler.kv_publisher import KVEventPublisher
from services.worker.worker_group import start_worker


class Engine:
    def __init__(self, args: EngineArgs, num_workers: int = 1):
        self.args = args
        self.workers = {f"worker-{i}": start_worker(args.worker_config(), args.cache_config()) for i in range(num_workers)}
        first = next(iter(self.workers.values()))
        self.model_path = first.model_path
        self.tokenizer_path = first.tokenizer_path
        self.info = first.info
        self.scheduler = Scheduler(args.scheduler_config(first.info.max_model_len))
        for worker_id, worker in self.workers.items():
            self.scheduler.add_worker(worker_id, worker.info)
        events = self.scheduler.config.kv_events_config  # published as the scheduler service does
        self.kv_events = KVEventPublisher(events) if self.scheduler.kv_events is not None else None

    def load_lora(self, name: str, path: str, lora_id: int | None = None) -> None:
        """Serve adapter `name`: checked and held by every worker (a no-op where held from that path), which
        load it again on demand once it is dropped for others (max_cpu_loras); lora_id: its id on KV events."""
        for worker_id, worker in self.workers.items():
            worker.load_lora(name, path)
            self.scheduler.set_worker_loras(worker_id, worker.lora_names())
        self.scheduler.register_lora(name, path, lora_id)

    def unload_lora(self, name: str) -> None:
        for worker_id in self.scheduler.retire_lora(name):
            worker = self.workers[worker_id]
            worker.unload_lora(name)
            self.scheduler.set_worker_loras(worker_id, worker.lora_names())

    def close(self) -> None:
        """Stop the follower ranks of tensor/pipeline parallel workers and leave their groups."""
        for worker in self.workers.values():
            worker.close()
        if self.kv_events is not None:
            self.kv_events.close()

    def step(self) -> list[SeqUpdate]:
        """One scheduling round: every worker runs its delta; returns what changed."""
        updates = []
        for worker_id, delta in self.scheduler.schedule().items():
            result = self.workers[worker_id].step(delta)
            updates += self.scheduler.update(worker_id, result)
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.drain_kv_events())
        return updates
