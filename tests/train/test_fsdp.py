"""Two processes over gloo (torchrun, FSDP2) train like one process on the same global batch, and
write the same HF-layout checkpoint, log and plot (rank 0 only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flashdsa.cli import main
from flashdsa.models.loader import load_model

STEPS = 3
TOLERANCE = 1e-4  # relative: the two runs differ only in the order of fp32 reductions


def finetune_args(model_dir, corpus, output) -> list[str]:
    return ["finetune", "--model", str(model_dir), "--data", str(corpus), "--stage", "sparse", "--steps", str(STEPS),
            "--seq-len", "32", "--batch-tokens", "128", "--eval-every", "2", "--eval-tokens", "64", "--lr", "3e-3",
            "--device", "cpu", "--output", str(output)]


def losses(output) -> list[dict[str, float]]:
    keys = ("lm_loss", "indexer_kl", "grad_norm", "eval_loss")
    records = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in keys if k in r} for r in records]


def test_two_ranks_match_one_process(tiny_model_dir, corpus, tmp_path):
    assert main(finetune_args(tiny_model_dir, corpus, tmp_path / "one")) == 0
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               "-m", "flashdsa", *finetune_args(tiny_model_dir, corpus, tmp_path / "two")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "(2 ranks)" in run.stdout
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(two) == STEPS and [r.keys() for r in one] == [r.keys() for r in two]
    for a, b in zip(one, two):
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=TOLERANCE), key
    single, sharded = (load_model(tmp_path / run_dir, mode="reference").state_dict() for run_dir in ("one", "two"))
    assert single.keys() == sharded.keys()
    for name, tensor in single.items():
        assert (sharded[name].float() - tensor.float()).abs().max() <= 1e-2 * tensor.float().abs().max() + 1e-6, name
    assert (tmp_path / "two" / "loss.png").is_file()
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == [f"step-{STEPS:06d}"]
