"""The training loop: it learns, it resumes bit for bit, and `flashdsa finetune` writes a usable model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from flashdsa.cli import main
from flashdsa.models.loader import load_model
from flashdsa.train import checkpoint as ckpt
from flashdsa.train import loop
from flashdsa.train.data import read_documents, split_stream, token_stream
from flashdsa.train.loop import TrainConfig, Trainer, evaluate

SEQ_LEN, BATCH_TOKENS = 32, 128


def make_trainer(model_dir, corpus, output, stage: str, steps: int, **overrides) -> Trainer:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train, held_out = split_stream(token_stream(read_documents(corpus, tokenizer), tokenizer), 0.1, SEQ_LEN)
    settings = dict(lr=3e-3, seq_len=SEQ_LEN, batch_tokens=BATCH_TOKENS, eval_every=1000, eval_tokens=4 * SEQ_LEN)
    cfg = TrainConfig(stage=stage, steps=steps, **{**settings, **overrides})
    source = ckpt.latest_checkpoint(output) or model_dir
    trainer = Trainer(load_model(source, mode="reference"), train, held_out, cfg, output, model_dir, "cpu")
    if source != model_dir:
        trainer.load_state_dict(ckpt.load_training_state(source))
    return trainer


def test_thirty_sparse_steps_lower_the_held_out_loss(tiny_model_dir, corpus, tmp_path):
    trainer = make_trainer(tiny_model_dir, corpus, tmp_path, "sparse", 30)
    before = evaluate(trainer.model, trainer.eval_set, trainer.cfg, "cpu")
    after = trainer.train()
    assert after["eval_lm_loss"] < before["eval_lm_loss"] - 0.5
    assert after["eval_indexer_kl"] < before["eval_indexer_kl"]


def test_resume_continues_bit_for_bit(tiny_model_dir, corpus, tmp_path):
    straight = make_trainer(tiny_model_dir, corpus, tmp_path / "straight", "sparse", 6, save_every=3)
    straight.train()
    shutil.copytree(ckpt.checkpoint_dir(tmp_path / "straight", 3), ckpt.checkpoint_dir(tmp_path / "resumed", 3))
    resumed = make_trainer(tiny_model_dir, corpus, tmp_path / "resumed", "sparse", 6)
    assert resumed.step == 3
    resumed.train()
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed.batches.state_dict() == straight.batches.state_dict()


def test_finetune_command_writes_a_loadable_checkpoint_log_and_plot(tiny_model_dir, corpus, tmp_path):
    out = tmp_path / "out"
    args = ["finetune", "--model", str(tiny_model_dir), "--data", str(corpus), "--stage", "warmup",
            "--seq-len", str(SEQ_LEN), "--batch-tokens", str(BATCH_TOKENS), "--output", str(out),
            "--eval-every", "1", "--eval-tokens", str(2 * SEQ_LEN), "--device", "cpu", "--max-shard-mb", "0"]
    assert main(args + ["--steps", "2"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())  # --max-shard-mb 0: a shard a tensor
    with safe_open(out / index["weight_map"]["lm_head.weight"], framework="pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    load_model(out, mode="reference")
    assert AutoTokenizer.from_pretrained(out).eos_token_id == 1
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all("eval_indexer_kl" in r for r in records)
    assert (out / "loss.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert main(args + ["--steps", "3", "--resume"]) == 0
    assert [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_resume_refuses_another_stage(tiny_model_dir, corpus, tmp_path):
    make_trainer(tiny_model_dir, corpus, tmp_path, "warmup", 1).train()
    with pytest.raises(ValueError, match="cannot resume a 'warmup' run as stage 'sparse'"):
        make_trainer(tiny_model_dir, corpus, tmp_path, "sparse", 2)


@pytest.mark.parametrize("keep_best_by,scores", [("loss", [3.0, 1.0, 2.0]), ("mtp_agreement", [0.2, 0.5, 0.3])])
def test_keep_best_ends_on_the_best_evaluated_weights(tiny_model_dir, corpus, tmp_path, monkeypatch, keep_best_by,
                                                     scores):
    scripted = iter(scores)  # held-out scores of steps 1, 2, 3: step 2 is the best (lowest loss, highest agreement)
    key = "eval_loss" if keep_best_by == "loss" else "eval_mtp_agreement"
    monkeypatch.setattr(loop, "evaluate", lambda *args: {"eval_loss": 9.0, key: next(scripted)})
    trainer = make_trainer(tiny_model_dir, corpus, tmp_path, "sparse", 3, keep_best=True, eval_every=1, save_every=1,
                           keep_best_by=keep_best_by)
    assert trainer.train()[f"best_eval_{keep_best_by}"] == scores[1]
    step2 = load_model(ckpt.checkpoint_dir(tmp_path, 2), mode="reference").state_dict()
    assert all(torch.equal(step2[name], t) for name, t in trainer.model.state_dict().items())
    last = load_model(ckpt.checkpoint_dir(tmp_path, 3), mode="reference").state_dict()
    assert not all(torch.equal(last[name], t) for name, t in trainer.model.state_dict().items())


def test_time_limit_stops_with_a_resumable_checkpoint(tiny_model_dir, corpus, tmp_path):
    stopped = make_trainer(tiny_model_dir, corpus, tmp_path / "timed", "sparse", 50, time_limit_s=0.0)
    stopped.train()
    assert stopped.step == 1 and ckpt.latest_checkpoint(tmp_path / "timed").name == "step-000001"
