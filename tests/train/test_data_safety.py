"""Training files survive a kill: checkpoints appear whole or not at all, ``--resume`` skips a
cut-off or damaged checkpoint and a torn log line with a warning, and picks up from the newest
checkpoint that loads."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from flashdsa.cli import main
from flashdsa.train import checkpoint as ckpt
from flashdsa.train.distributed import World
from flashdsa.train.loop import LOG_FILE
from flashdsa.train.safe_io import atomic_path, read_records

SEQ_LEN, BATCH_TOKENS = 32, 64


def finetune(model_dir, corpus, output, steps: int, *extra) -> list[str]:
    return ["finetune", "--model", str(model_dir), "--data", str(corpus), "--stage", "sparse", "--steps", str(steps),
            "--seq-len", str(SEQ_LEN), "--batch-tokens", str(BATCH_TOKENS), "--output", str(output),
            "--eval-every", "1000", "--eval-tokens", str(2 * SEQ_LEN), "--device", "cpu", "--save-every", "1", *extra]


def test_atomic_path_keeps_the_old_file_when_the_write_fails(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as temporary:
            temporary.write_text("half")
            raise RuntimeError("killed")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_resume_skips_a_checkpoint_whose_save_was_cut_off(tiny_model_dir, corpus, tmp_path, monkeypatch, caplog):
    out = tmp_path / "out"
    assert main(finetune(tiny_model_dir, corpus, out, 2)) == 0
    real_save = World.save_optimizer

    def killed_after_the_weights(*args, **kwargs):
        raise KeyboardInterrupt  # the kill lands while checkpoint 3 is being written

    monkeypatch.setattr(World, "save_optimizer", killed_after_the_weights)
    assert main(finetune(tiny_model_dir, corpus, out, 4, "--resume")) == 130
    assert (out / ckpt.CHECKPOINTS / ".partial-step-000003" / "model.safetensors").is_file()
    assert ckpt.latest_checkpoint(out).name == "step-000002"
    monkeypatch.setattr(World, "save_optimizer", real_save)
    with caplog.at_level(logging.WARNING):
        assert main(finetune(tiny_model_dir, corpus, out, 4, "--resume")) == 0
    assert any("incomplete checkpoint" in r.getMessage() and "step-000003" in r.getMessage() for r in caplog.records)
    assert [r["step"] for r in read_records(out / LOG_FILE)] == [1, 2, 3, 4]
    assert sorted(p.name for p in (out / ckpt.CHECKPOINTS).iterdir()) == ["step-000003", "step-000004"]


@pytest.mark.parametrize("damaged_file", ["model.safetensors", ckpt.TRAINER_STATE])
def test_resume_skips_a_truncated_checkpoint_and_a_torn_log_line(tiny_model_dir, corpus, tmp_path, caplog,
                                                                 damaged_file):
    out = tmp_path / "out"
    assert main(finetune(tiny_model_dir, corpus, out, 3)) == 0
    newest = ckpt.checkpoint_dir(out, 3) / damaged_file
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 3])
    with (out / LOG_FILE).open("a") as log:
        log.write('{"step": 4, "stage": "spa')  # a kill while the line was written
    with caplog.at_level(logging.WARNING):
        assert main(finetune(tiny_model_dir, corpus, out, 4, "--resume")) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step-000003" in w and "does not load" in w for w in warnings), warnings
    assert any("torn log line" in w for w in warnings), warnings
    lines = (out / LOG_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]  # resumed at 2: 3 and 4 written again


def test_a_run_killed_at_any_moment_resumes(tiny_model_dir, corpus, tmp_path):
    """SIGKILL a real run at whatever it is doing (a step or a save) once it has two checkpoints."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "flashdsa.cli", *finetune(tiny_model_dir, corpus, out, 500)]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while ckpt.latest_checkpoint(out) is None or ckpt.latest_checkpoint(out).name < "step-000002":
            assert process.poll() is None and time.monotonic() < deadline, "the run made no checkpoint"
            time.sleep(0.01)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    step = int(ckpt.latest_checkpoint(out).name.removeprefix("step-"))
    assert main(finetune(tiny_model_dir, corpus, out, step + 1, "--resume")) == 0
    assert ckpt.latest_checkpoint(out).name == f"step-{step + 1:06d}"
    assert [r["step"] for r in read_records(out / LOG_FILE)] == list(range(1, step + 2))
