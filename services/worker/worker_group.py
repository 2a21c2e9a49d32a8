"""A worker group: the ranks of one tensor x pipeline parallel model copy, seen as one worker.

Like vLLM's executor: the server and the in-process engine hold a `WorkerGroup` where they would hold
a `Worker`, with the same calls (step, forget_all, run_async_step, close, info). It owns what is the
group's, not a rank's: spawning the follower ranks (when one process starts the whole group) and
watching them start, broadcasting each step to them before rank 0 runs it, the followers' loop
(`follow`), the ranks' timers (bench/parallel.py), and stopping them. Each rank is a plain `Worker`
(services/worker/worker.py); their collectives are GroupComm's (services/worker/group.py).
"""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import multiprocessing.connection
import os
import time

import structlog

from services.core.config import CacheConfig, WorkerConfig
from services.core.errors import InvalidArgument, Unavailable, UnknownSequence
from services.core.step import StepDelta, StepResult
from services.rpc.internal_codec import delta_from_bytes, delta_to_bytes
from services.worker.group import FORGET, LORA, STEP, STOP, TIMEOUT_S, TIMERS, free_address
from services.core.model_path import resolve_model_path
from services.worker.model_config import ModelArchConfig
from services.worker.worker import Worker, checked_layout, pick_device

log = structlog.get_logger("worker.group")


class GroupBroken(Unavailable):
    """A rank of this worker's group failed or is gone: the group cannot step any more (its process
    exits, the scheduler recomputes its sequences elsewhere, the launcher restarts the group)."""


def start_worker(config: WorkerConfig, cache: CacheConfig) -> Worker | WorkerGroup:
    """What the scheduler talks to: a plain Worker, or, for rank 0 of a group, the WorkerGroup around it."""
    if config.tensor_parallel_size * config.pipeline_parallel_size == 1:
        return Worker(config, cache)
    if config.group_rank != 0:
        raise ValueError("group_rank: only rank 0 of a worker group serves; the others run `follow`")
    return WorkerGroup.start(config, cache)


class WorkerGroup:
    """Rank 0 (`leader`, the rank whose results count) and, when this process started the group, the
    follower processes it spawned (none when each rank was launched on its own, e.g. across hosts)."""

    def __init__(self, leader: Worker, followers: list | None = None):
        self.leader = leader
        self.followers = list(followers or [])
        self.broken = False  # a rank failed: the group steps no more

    @classmethod
    def start(cls, config: WorkerConfig, cache: CacheConfig) -> WorkerGroup:
        """Rank 0 of a group. Without a group_address this process starts the whole group on this machine:
        a free local port, the other ranks spawned, the machine's threads shared out equally."""
        if config.group_address:
            return cls(Worker(config, cache))
        model_path = resolve_model_path(config.model)  # a layout the model cannot take: refused before any spawn
        checked_layout(config, model_path, ModelArchConfig.from_model(model_path), pick_device(config.device).type)
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        address = free_address()
        threads = max(1, (config.num_threads or os.cpu_count() or 1) // world)
        config = dataclasses.replace(config, group_address=address, num_threads=threads)
        context = multiprocessing.get_context("spawn")
        followers, started = [], []
        for rank in range(1, world):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=follow, args=(dataclasses.replace(config, group_rank=rank), cache, sender),
                                      daemon=True, name=f"pagedserve-rank-{rank}")
            process.start()
            sender.close()  # the follower holds the only sending end: its exit closes the pipe
            followers.append(process)
            started.append(receiver)
        try:
            wait_started(list(zip(started, followers)), world, TIMEOUT_S)
            return cls(Worker(config, cache), followers)
        except BaseException:
            stop_processes(followers)
            raise

    # what the engine and the LLM read of the worker they hold: rank 0's
    @property
    def info(self):
        return self.leader.info

    @property
    def runner(self):
        return self.leader.runner

    @property
    def model_path(self):
        return self.leader.model_path

    @property
    def tokenizer_path(self):
        return self.leader.tokenizer_path

    @property
    def comm(self):
        """Rank 0's collectives (its timers: bench/parallel.py)."""
        return self.leader.comm

    # LoRA: every rank holds its part of each adapter (services/worker/lora.py) and the same ones, so a load or
    # an unload reaches the followers first, as a step does; every rank checks the adapter, and they all
    # refuse a bad one alike (rank 0's refusal is the answer)
    def load_lora(self, name: str, path: str):
        self.comm.broadcast(LORA, json.dumps({"name": name, "path": str(path)}).encode())
        return self.leader.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.comm.broadcast(LORA, json.dumps({"name": name}).encode())
        self.leader.unload_lora(name)

    def lora_names(self) -> list[str]:
        return self.leader.lora_names()

    def step(self, delta: StepDelta) -> StepResult:
        if self.broken:
            raise GroupBroken("this worker group lost a rank; it is restarting")
        delta = dataclasses.replace(delta, async_next_step=False)  # the followers cannot run ahead
        try:
            self.comm.broadcast(STEP, delta_to_bytes(delta))
            return self.leader.step(delta)
        except (InvalidArgument, UnknownSequence):  # every rank refused the same delta: the group is whole
            raise
        except Exception as error:
            self.broken = True
            log.error("worker_group_broken", rank=0, error=f"{type(error).__name__}: {error}")
            raise GroupBroken(f"this worker group lost a rank: {type(error).__name__}: {error}") from error

    def forget_all(self) -> None:
        """The scheduler dropped this worker: no sequence it holds will be named again."""
        self.comm.broadcast(FORGET)
        self.leader.forget_all()

    def run_async_step(self) -> None:
        """A group runs no step ahead: its followers see only the deltas."""

    def group_timers(self) -> list[dict[str, float]]:
        """Each rank's time computing and in its pipelined passes so far (bench/parallel.py)."""
        self.comm.broadcast(TIMERS)
        return self.comm.gather_timers()

    def close(self) -> None:
        """Tell the followers to stop, wait for those this process spawned, leave the group."""
        try:
            self.comm.broadcast(STOP)
        except Exception:  # noqa: BLE001 - a follower already gone: the group is over anyway
            pass
        for process in self.followers:
            process.join(timeout=10)
        stop_processes(self.followers)
        self.leader.close()


def wait_started(started: list, world_size: int, timeout_s: float) -> None:
    """Wait until every spawned follower (receiver, process) has started (re-imported the main module and
    reached `follow`). A follower that exits first would leave rank 0 waiting at the rendezvous for the
    group's whole timeout: raise at once instead, with the usual cause and its fix."""
    pending = dict(started)
    deadline = time.monotonic() + timeout_s
    try:
        while pending:
            ready = multiprocessing.connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return  # slow to start, not gone: the rendezvous's own timeout takes over
            for receiver in ready:
                process = pending.pop(receiver)
                try:
                    receiver.recv()
                except EOFError:  # it exited before it could say so
                    process.join(timeout=5)
                    raise RuntimeError(
                        f"tensor_parallel_size x pipeline_parallel_size = {world_size}: the group's rank "
                        f"process {process.name} exited with status {process.exitcode} while starting. Its ranks "
                        "are started with multiprocessing's spawn, which runs the main script again in each new "
                        "process: a script that creates an LLM with tensor_parallel_size or "
                        "pipeline_parallel_size > 1 must do so under `if __name__ == \"__main__\":` (its error, "
                        "printed above, says the same). Otherwise see that process's error above.") from None
                finally:
                    receiver.close()
    finally:
        for receiver in pending:
            receiver.close()


def stop_processes(processes: list) -> None:
    """Kill those still alive and reap them all."""
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(timeout=10)
    processes.clear()


def follow(config: WorkerConfig, cache: CacheConfig, started=None) -> None:
    """A follower rank's process: load the shard, join the group, run rank 0's steps until told to stop.
    A broken group (rank 0 or another rank gone) ends it with an error: the launcher restarts the group.
    `started` (the sending end of a pipe, from the rank 0 that spawned it) is told first thing that this
    process got through its start-up (wait_started)."""
    if started is not None:
        started.send(True)
        started.close()
    worker = Worker(config, cache)
    try:
        follow_steps(worker)
    finally:
        worker.close()


def follow_steps(worker: Worker) -> None:
    """Run each message rank 0 broadcasts on this rank, until it says stop (a failed collective raises)."""
    while True:
        kind, payload = worker.comm.receive()
        if kind == FORGET:
            worker.forget_all()
        elif kind == TIMERS:
            worker.comm.gather_timers()
        elif kind == STEP:
            try:
                worker.step(delta_from_bytes(payload))
            except (ValueError, LookupError) as error:  # the same refusal rank 0 answers with
                log.info("follower_step_refused", rank=worker.shard.rank, error=str(error))
        elif kind == LORA:
            follow_lora(worker, json.loads(payload))
        else:
            return


def follow_lora(worker: Worker, message: dict) -> None:
    """Rank 0's load (name and path) or unload (name) of an adapter, on this rank."""
    try:
        if "path" in message:
            worker.load_lora(message["name"], message["path"])
        else:
            worker.unload_lora(message["name"])
    except ValueError as error:  # a bad adapter: rank 0 refuses it alike
        log.info("follower_lora_refused", rank=worker.shard.rank, error=str(error))
