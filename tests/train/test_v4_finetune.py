"""Fine-tuning DeepSeek-V4 end to end: export read by flashdsa and transformers, exact resume,
the `flashdsa finetune` command, and its refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from flashdsa.cli import main
from flashdsa.models.deepseek_v4_loader import load_v4_model
from flashdsa.train import checkpoint as ckpt
from flashdsa.train.architecture import load_trainable
from flashdsa.train.data import read_documents, split_stream, token_stream
from flashdsa.train.forward_v4 import training_forward_v4
from flashdsa.train.loop import TrainConfig, Trainer

SEQ_LEN = 132  # crosses the 128-token window, 33 CSA entries, one HCA entry


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_export_loads_in_flashdsa_and_transformers_with_the_trained_logits(tiny_v4_dir, tmp_path, dtype):
    from transformers import AutoModelForCausalLM

    model = load_v4_model(tiny_v4_dir, mtp=True)
    with torch.no_grad():  # weights no longer the checkpoint's, and not bf16-exact
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    ckpt.save_model(model, tmp_path, tiny_v4_dir, dtype=dtype)
    if dtype is not None:  # what the saved weights hold: the model rounded to bf16 but its fp32 parts
        model = load_v4_model(tmp_path, mtp=True)
        assert model.model.layers[0].self_attn.q_a_proj.weight.eq(
            model.model.layers[0].self_attn.q_a_proj.weight.bfloat16().float()).all()
    ids = torch.randint(4, 500, (2, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    trained = training_forward_v4(model, ids[:, :-1], "sparse", next_ids=ids[:, 1:])
    loaded = training_forward_v4(load_v4_model(tmp_path, mtp=True), ids[:, :-1], "sparse", next_ids=ids[:, 1:])
    torch.testing.assert_close(loaded.logits, trained.logits, rtol=0, atol=0)
    torch.testing.assert_close(loaded.mtp_logits, trained.mtp_logits, rtol=0, atol=0)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids[:, :-1]).logits, trained.logits, rtol=1e-4, atol=1e-4)
    assert AutoTokenizer.from_pretrained(tmp_path).eos_token_id == 1


def make_trainer(model_dir, corpus, output, steps: int, **overrides) -> Trainer:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train, held_out = split_stream(token_stream(read_documents(corpus, tokenizer), tokenizer), 0.1, SEQ_LEN)
    settings = dict(lr=3e-3, seq_len=SEQ_LEN, batch_tokens=2 * SEQ_LEN, eval_every=1000, eval_tokens=2 * SEQ_LEN)
    cfg = TrainConfig(stage="sparse", steps=steps, **{**settings, **overrides})
    source = ckpt.latest_checkpoint(output) or model_dir
    trainer = Trainer(load_trainable(source, "cpu"), train, held_out, cfg, output, model_dir, "cpu")
    if source != model_dir:
        trainer.load_state_dict(ckpt.load_training_state(source))
    return trainer


def test_resume_continues_bit_for_bit(tiny_v4_dir, corpus, tmp_path):
    straight = make_trainer(tiny_v4_dir, corpus, tmp_path / "straight", 4, save_every=2, batch_tokens=SEQ_LEN)
    straight.train()
    shutil.copytree(ckpt.checkpoint_dir(tmp_path / "straight", 2), ckpt.checkpoint_dir(tmp_path / "resumed", 2))
    resumed = make_trainer(tiny_v4_dir, corpus, tmp_path / "resumed", 4, batch_tokens=SEQ_LEN)
    assert resumed.step == 2 and resumed.model.has_mtp
    resumed.train()
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed.batches.state_dict() == straight.batches.state_dict()


def finetune_argv(model_dir, corpus, output, stage: str = "warmup") -> list[str]:
    return ["finetune", "--model", str(model_dir), "--data", str(corpus), "--stage", stage, "--steps", "2",
            "--seq-len", str(SEQ_LEN), "--batch-tokens", str(SEQ_LEN), "--eval-every", "1",
            "--eval-tokens", str(SEQ_LEN), "--device", "cpu", "--output", str(output)]


def test_finetune_command_trains_and_saves_a_v4_checkpoint(tiny_v4_dir, corpus, tmp_path):
    out = tmp_path / "out"
    assert main(finetune_argv(tiny_v4_dir, corpus, out)) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4" and config["num_nextn_predict_layers"] == 1
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all("eval_indexer_kl" in r for r in records)
    assert (out / "loss.png").is_file()
    trained, start = load_v4_model(out, mtp=True).state_dict(), load_v4_model(tiny_v4_dir, mtp=True).state_dict()
    changed = {n for n in trained if not torch.equal(trained[n], start[n])}
    assert changed and all(".indexer." in n for n in changed)  # warm-up: the CSA indexers alone
    argv = finetune_argv(tiny_v4_dir, corpus, out)
    assert main([*argv[: argv.index("--steps") + 1], "3", *argv[argv.index("--steps") + 2 :], "--resume"]) == 0
    assert [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_keep_best_ends_on_the_best_evaluated_weights(tiny_v4_dir, corpus, tmp_path, monkeypatch):
    from flashdsa.train import loop

    scripted = iter([3.0, 1.0, 2.0])  # held-out losses of steps 1, 2, 3: step 2 is the best
    monkeypatch.setattr(loop, "evaluate", lambda *args: {"eval_loss": next(scripted)})
    trainer = make_trainer(tiny_v4_dir, corpus, tmp_path, 3, keep_best=True, eval_every=1, save_every=1)
    assert trainer.train()["best_eval_loss"] == 1.0
    step2 = load_trainable(ckpt.checkpoint_dir(tmp_path, 2), "cpu").state_dict()
    assert all(torch.equal(step2[name], t) for name, t in trainer.model.state_dict().items())


def test_add_mtp_layer_gives_a_v4_checkpoint_without_one_a_trained_layer(tiny_v4_dir, corpus, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(tiny_v4_dir, bare)
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    argv = finetune_argv(bare, corpus, tmp_path / "out", "dense")
    assert main([*argv[: argv.index("--steps") + 1], "1", *argv[argv.index("--steps") + 2 :], "--add-mtp-layer"]) == 0
    assert load_v4_model(tmp_path / "out", mtp=True).has_mtp
    assert "mtp_loss" in json.loads((tmp_path / "out" / "log.jsonl").read_text().splitlines()[0])


def test_an_fp8_checkpoint_trains_and_is_saved_unquantized(corpus, tmp_path):
    from safetensors import safe_open

    from flashdsa.models.deepseek_v4_tiny import make_tiny_v4_checkpoint

    fp8 = make_tiny_v4_checkpoint(tmp_path / "fp8", seed=3, fp8=True, small=True)
    argv = finetune_argv(fp8, corpus, tmp_path / "out", "dense")
    assert main(argv) == 0
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as f:
        assert f.get_tensor("layers.0.attn.wq_a.weight").dtype == torch.bfloat16
        assert not any(name.endswith(".scale") for name in f.keys())
    load_v4_model(tmp_path / "out", mtp=True)


@pytest.fixture
def user_error(capsys):
    """Run ``flashdsa argv``; it must exit 2 with one error line (progress bars aside), no traceback."""
    def run(argv) -> str:
        capsys.readouterr()
        assert main([str(a) for a in argv]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if "error" in line.lower()]
        assert len(lines) == 1 and "Traceback" not in err, err
        return lines[0]
    return run


@pytest.mark.parametrize("damage, says", [
    ("config", "o_groups (3) must divide num_attention_heads"),
    ("tensor", "does not match the DeepSeek-V4 model: missing"),
    ("tokenizer", "has no tokenizer"),
])
def test_a_broken_v4_checkpoint_is_refused_naming_the_model(user_error, tiny_v4_dir, corpus, tmp_path, damage, says):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_v4_dir, broken)
    if damage == "config":
        config = json.loads((broken / "config.json").read_text())
        (broken / "config.json").write_text(json.dumps({**config, "o_groups": 3}))
    elif damage == "tensor":
        weights = load_file(broken / "model.safetensors")
        del weights["layers.1.attn.indexer.wq_b.weight"]
        save_file(weights, broken / "model.safetensors")
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (broken / name).unlink(missing_ok=True)
    line = user_error(finetune_argv(broken, corpus, tmp_path / "out"))
    assert "argument --model:" in line and says in line, line


@pytest.mark.parametrize("flag, value, says", [
    ("--backend", "triton", "no triton V4 attention backward"),
    ("--add-mtp-layer", None, "already has a multi-token-prediction layer"),
    ("--seq-len", "5000", "at most the model's 4096 positions"),
])
def test_unsupported_settings_are_refused_naming_the_flag(user_error, tiny_v4_dir, corpus, tmp_path, flag, value, says):
    argv = finetune_argv(tiny_v4_dir, corpus, tmp_path / "out")
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag] if value is None else [flag, value]
    line = user_error(argv)
    assert f"argument {flag}:" in line and says in line, line
