"""The launcher's failure paths over gloo: a worker that dies ends rank 0 with an error naming it
(no hang), and Ctrl-C on rank 0 ends every rank, both within a bounded time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from flashdsa.models.tiny import make_tiny_checkpoint
from flashdsa.runtime.parallel.launcher import WORKER_DIED_EXIT

# Rank 0 starts a TP 2 model, prints the worker's pid, then waits (as a server would between requests).
RANK0 = """
import multiprocessing, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a runner started with bash's `&` ignores SIGINT, and so would we
from flashdsa.runtime.llm import LLM
llm = LLM(sys.argv[1], mode="reference", max_num_seqs=2, tensor_parallel_size=2)
print(*[p.pid for p in multiprocessing.active_children()], flush=True)
time.sleep(120)
"""
BOUND_S = 30  # after the event, every rank must be gone within this


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3)


def start_rank0(checkpoint) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0, str(checkpoint)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    line = rank0.stdout.readline()
    assert line.strip(), rank0.communicate(timeout=BOUND_S)[1][-2000:]
    return rank0, int(line.split()[0])


def gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_a_dead_worker_ends_rank0_with_an_error_naming_it(checkpoint):
    rank0, worker = start_rank0(checkpoint)
    os.kill(worker, signal.SIGKILL)
    _, stderr = rank0.communicate(timeout=BOUND_S)
    assert rank0.returncode == WORKER_DIED_EXIT, stderr[-2000:]
    assert "worker rank 1 (exit code" in stderr and "died" in stderr, stderr[-2000:]


def test_ctrl_c_on_rank0_ends_every_rank(checkpoint):
    rank0, worker = start_rank0(checkpoint)
    rank0.send_signal(signal.SIGINT)
    rank0.communicate(timeout=BOUND_S)
    assert rank0.returncode != 0
    assert gone(worker, BOUND_S)
