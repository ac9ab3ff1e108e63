"""One process per rank: start the workers, join the process group, load each rank's shard.

On one node, :func:`load_parallel` (behind ``--tensor-parallel-size N`` and ``LLM(...,
tensor_parallel_size=N)``) spawns ranks 1..N-1 itself; the calling process is rank 0 and gets the
model back. Across nodes the same entry point runs under ``torchrun`` (RANK, WORLD_SIZE, ...
in the environment): every rank calls it, rank 0 returns and the others serve rank 0's steps
until it stops, then exit. GPUs use NCCL (one per rank), CPUs gloo; rank 0's step inputs always
travel over a gloo group. A worker that dies ends rank 0 with an error naming it (a collective
would otherwise wait forever); Ctrl-C stops every rank (workers ignore SIGINT and are stopped
by rank 0).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashdsa.runtime.cache.layout import BLOCK_SIZE
from flashdsa.runtime.parallel import steps
from flashdsa.runtime.parallel.shard import ParallelConfig, Shard

logger = logging.getLogger(__name__)

WORKER_DIED_EXIT = 3  # rank 0's exit status when a worker died
STOP_TIMEOUT_S = 10


def check_parallel(path: str | Path, parallel: ParallelConfig, device: str, mode: str = "production",
                   quantization: Optional[str] = None) -> None:
    """ValueError naming the cause if the checkpoint cannot run split this way on ``device``: sizes
    that do not divide, FP8 splits off the block grid, more ranks than GPUs. Reads no weight."""
    from flashdsa.models.config import DeepseekV32Config
    from flashdsa.models.deepseek_v32 import DeepseekV32ForCausalLM
    from flashdsa.models.loader import checkpoint_is_fp8

    size = parallel.tensor_parallel_size
    if torch.device(device).type == "cuda" and "WORLD_SIZE" not in os.environ and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs, {torch.cuda.device_count()} visible")
    config = DeepseekV32Config.from_json(path)
    if quantization is None and checkpoint_is_fp8(Path(path)):
        quantization = "fp8"
    with torch.device("meta"):  # every split the model makes, checked on every rank's shapes
        DeepseekV32ForCausalLM(config, mode, quantization, Shard.planned(parallel, size - 1))
    if torch.device(device).type == "cuda":
        _check_memory(config, parallel, mode, quantization)


def _check_memory(config, parallel: ParallelConfig, mode: str, quantization: Optional[str]) -> None:
    """Log the memory plan of a rank; ValueError with its numbers if the weights cannot fit."""
    from flashdsa.runtime.parallel.plan import format_plan, memory_plan, plan_problem

    plans = memory_plan(config, parallel, torch.cuda.get_device_properties(0).total_memory, mode, quantization)
    logger.info("memory plan per rank:\n%s", format_plan(plans[:1]))
    problem = plan_problem(plans, BLOCK_SIZE)
    if problem:
        raise ValueError(f"the model does not fit: {problem}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(rank: int, size: int, parallel: ParallelConfig, device_type: str,
               init_method: Optional[str] = None) -> tuple[Shard, torch.device]:
    """Join the process group as ``rank`` of ``size``: this rank's Shard and device (RuntimeError
    naming the backend if it cannot start)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=size,
                                timeout=timedelta(minutes=30), device_id=device if device_type == "cuda" else None)
        cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else None
    except Exception as exc:
        raise RuntimeError(f"rank {rank}: {backend.upper()} failed to initialize: {exc}") from exc
    return Shard(rank, size, parallel.enable_expert_parallel, cpu_group=cpu_group), device


def _load(path, shard: Shard, device: torch.device, mode: str, quantization: Optional[str], mtp: bool = False):
    from flashdsa.models.loader import load_model

    return load_model(path, device, mode, quantization, shard, mtp)


def _worker(rank: int, size: int, parallel: ParallelConfig, device_type: str, init_method: Optional[str],
            path: str, mode: str, quantization: Optional[str], log_level: int) -> None:
    """A worker rank: load its shard, then run rank 0's steps until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    logging.basicConfig(level=log_level, format=f"%(levelname)s rank{rank} %(name)s: %(message)s")
    try:
        shard, device = join_group(rank, size, parallel, device_type, init_method)
        steps.follow(_load(path, shard, device, mode, quantization))
    except Exception as exc:  # one line for the user; rank 0's watchdog reports the exit
        logger.error("rank %d failed: %s", rank, exc)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _Workers:
    """Rank 0's handle on the ranks it spawned: a watchdog thread and the stop at exit."""

    def __init__(self, processes: list, shard: Optional[Shard] = None):
        self.processes, self.shard, self.stopping = processes, shard, False
        if processes:
            threading.Thread(target=self._watch, daemon=True, name="flashdsa-watchdog").start()
        atexit.register(self.stop)

    def _watch(self) -> None:
        ready = multiprocessing.connection.wait([p.sentinel for p in self.processes])
        if self.stopping:
            return
        for p in self.processes:  # a sentinel is ready a moment before the exit status can be read
            if p.sentinel in ready:
                p.join(STOP_TIMEOUT_S)
        dead = [f"rank {i + 1} (exit code {p.exitcode})" for i, p in enumerate(self.processes) if not p.is_alive()]
        logger.critical("worker %s died; stopping every rank", ", ".join(dead))
        print(f"flashdsa: worker {', '.join(dead)} died; stopping", file=sys.stderr, flush=True)
        os._exit(WORKER_DIED_EXIT)

    def stop(self) -> None:
        """Tell the workers to stop (or terminate them if they do not listen), wait for them and
        leave the process group (a later model may start another)."""
        if self.stopping:
            return
        self.stopping = True
        if self.shard is not None:
            sender = threading.Thread(target=steps.send, args=(self.shard, None), daemon=True)
            sender.start()
            sender.join(STOP_TIMEOUT_S)
        for p in self.processes:
            p.join(STOP_TIMEOUT_S)
            if p.is_alive():
                p.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()


def load_parallel(path: str | Path, parallel: ParallelConfig, device: str = "cuda", mode: str = "production",
                  quantization: Optional[str] = None):
    """Rank 0's model of the checkpoint ``path`` split over ``parallel.tensor_parallel_size`` ranks.

    Checks the split first (ValueError, no weight read), then starts the other ranks (or, under
    torchrun, joins them: there ranks other than 0 serve rank 0's steps and exit in here)."""
    check_parallel(path, parallel, device, mode, quantization)
    device_type = torch.device(device).type
    if "WORLD_SIZE" in os.environ:  # torchrun: every rank runs this same code
        size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if size != parallel.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size {parallel.tensor_parallel_size} != torchrun's WORLD_SIZE {size}")
        shard, dev = join_group(rank, size, parallel, device_type)
        model = _load(path, shard, dev, mode, quantization)
        if rank != 0:
            steps.follow(model)
            dist.destroy_process_group()
            sys.exit(0)
        model.workers = _Workers([], shard)
        return model
    size = parallel.tensor_parallel_size
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = mp.get_context("spawn")
    processes = [context.Process(target=_worker, daemon=True, name=f"flashdsa-rank{rank}",
                                 args=(rank, size, parallel, device_type, init_method, str(path), mode, quantization,
                                       logging.getLogger().level))
                 for rank in range(1, size)]
    for p in processes:
        p.start()
    workers = _Workers(processes)
    shard, dev = join_group(0, size, parallel, device_type, init_method)
    workers.shard = shard
    model = _load(path, shard, dev, mode, quantization)
    model.workers = workers  # model.workers.stop() ends the other ranks (also at exit)
    return model


def load(path: str | Path, parallel: ParallelConfig = ParallelConfig(), device: str = "cuda", mode: str = "production",
         quantization: Optional[str] = None, mtp: bool = False):
    """The model of checkpoint ``path``: in this process alone, or rank 0's part of a parallel one;
    ``mtp`` also loads its multi-token-prediction layer (speculative decoding: one process only)."""
    if parallel.tensor_parallel_size == 1 and "WORLD_SIZE" not in os.environ:
        check_parallel(path, parallel, device, mode, quantization)
        return _load(path, Shard(), torch.device(device), mode, quantization, mtp)
    if mtp:
        raise ValueError("speculative decoding runs on one GPU: use tensor_parallel_size 1")
    return load_parallel(path, parallel, device, mode, quantization)
