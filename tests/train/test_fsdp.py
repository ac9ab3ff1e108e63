"""Two processes over gloo (torchrun, FSDP2) train like one process on the same global batch, and
write the same checkpoint, log and plot (rank 0 only): DeepSeek-V3.2 and DeepSeek-V4."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flashdsa.cli import main
from flashdsa.train.architecture import load_trainable

STEPS = 3
TOLERANCE = 1e-4  # relative: the two runs differ only in the order of fp32 reductions
V4_TOLERANCE = 1e-3  # V4's indexer KL over few compressed entries moves more with that rounding


def finetune_args(model_dir, corpus, output, seq_len: int) -> list[str]:
    return ["finetune", "--model", str(model_dir), "--data", str(corpus), "--stage", "sparse", "--steps", str(STEPS),
            "--seq-len", str(seq_len), "--batch-tokens", str(4 * seq_len), "--eval-every", "2",
            "--eval-tokens", str(2 * seq_len), "--lr", "3e-3", "--device", "cpu", "--output", str(output)]


def on_two_ranks(args: list[str]) -> subprocess.CompletedProcess:
    """``flashdsa *args`` under torchrun, 2 processes on this machine (gloo on CPU)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "-m", "flashdsa",
               *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def losses(output) -> list[dict[str, float]]:
    keys = ("lm_loss", "indexer_kl", "grad_norm", "eval_loss")
    records = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in keys if k in r} for r in records]


@pytest.mark.parametrize("checkpoint, seq_len, tolerance", [("tiny_model_dir", 32, TOLERANCE),
                                                             ("tiny_v4_dir", 132, V4_TOLERANCE)])
def test_two_ranks_match_one_process(checkpoint, seq_len, tolerance, corpus, tmp_path, request):
    model_dir = request.getfixturevalue(checkpoint)
    assert main(finetune_args(model_dir, corpus, tmp_path / "one", seq_len)) == 0
    run = on_two_ranks(finetune_args(model_dir, corpus, tmp_path / "two", seq_len))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "(2 ranks)" in run.stdout
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(two) == STEPS and [r.keys() for r in one] == [r.keys() for r in two]
    for a, b in zip(one, two):
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=tolerance), key
    single, sharded = (load_trainable(tmp_path / run_dir, "cpu").state_dict() for run_dir in ("one", "two"))
    assert single.keys() == sharded.keys()
    for name, tensor in single.items():
        assert (sharded[name].float() - tensor.float()).abs().max() <= 1e-2 * tensor.float().abs().max() + 1e-6, name
    assert (tmp_path / "two" / "loss.png").is_file()
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == [f"step-{STEPS:06d}"]


@pytest.mark.parametrize("checkpoint, seq_len, extra, tolerance", [
    ("tiny_model_dir", 32, ["--add-mtp-layer"], TOLERANCE),  # V3.2 without an MTP layer: a fresh one
    ("tiny_v4_dir", 132, [], V4_TOLERANCE),  # V4 with its own MTP layer, saved and resumed in the official layout
])
def test_two_ranks_resume_like_one_process(checkpoint, seq_len, extra, tolerance, corpus, tmp_path, request):
    """A 2-rank run that stops after its first step (time limit) and resumes from its checkpoint
    (each rank loading its shards of it) follows the one-process run, its MTP layer trained."""
    model_dir = request.getfixturevalue(checkpoint)
    assert main([*finetune_args(model_dir, corpus, tmp_path / "one", seq_len), *extra]) == 0
    two = [*finetune_args(model_dir, corpus, tmp_path / "two", seq_len), *extra]
    for stop in (["--time-limit", "1e-6"], ["--resume"]):
        run = on_two_ranks([*two, *stop])
        assert run.returncode == 0, run.stderr[-3000:]
    assert "resumed from" in run.stdout and "step-000001" in run.stdout
    one, resumed = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(resumed) == STEPS and "mtp_loss" in json.loads((tmp_path / "two" / "log.jsonl").read_text().splitlines()[-1])
    for a, b in zip(one, resumed):
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=tolerance), key
