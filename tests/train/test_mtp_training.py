"""Training the MTP layer: the training forward equals the inference MTP path, its loss trains
it in the dense and sparse stages, a fresh layer can be added to a checkpoint without one, and
distillation toward the main model (alone, the main model frozen) raises their top-1 agreement."""

from __future__ import annotations

import math

import pytest
import torch

from flashdsa.models.deepseek_v32 import DeepseekV32ForCausalLM
from flashdsa.models.mtp import add_mtp_layer
from flashdsa.runtime.metadata import BatchMetadata
from flashdsa.train.forward import training_forward
from flashdsa.train.init import initialize
from flashdsa.train.losses import distill_kl, top1_agreement
from flashdsa.train.loop import TrainConfig, compute_losses, make_optimizer, set_trainable

from train_configs import tiny_config

VOCAB, LENGTH = 60, 16


def mtp_model(index_topk: int = 6) -> DeepseekV32ForCausalLM:
    model = initialize(DeepseekV32ForCausalLM(tiny_config(VOCAB, index_topk), mode="reference"), seed=1, std=0.3)
    initialize(add_mtp_layer(model), seed=2, std=0.3, depth=2)
    return model


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, LENGTH + 1), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("index_topk", [64, 6])
def test_training_mtp_logits_equal_the_inference_mtp_forward(index_topk):
    model = mtp_model(index_topk)
    ids = batch()
    out = training_forward(model, ids[:, :-1], "sparse" if index_topk < LENGTH else "dense", next_ids=ids[:, 1:])
    caches = model.allocate_caches(1)
    for b in range(ids.shape[0]):
        meta = BatchMetadata.for_step([0], [LENGTH], torch.tensor([[0]], dtype=torch.int32), torch.arange(LENGTH))
        _, hidden = model(ids[b, :-1], meta, caches, return_hidden=True)
        torch.testing.assert_close(out.mtp_logits[b], model.mtp_forward(ids[b, 1:], hidden, meta, caches),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stage", ["dense", "warmup", "sparse"])
def test_mtp_loss_trains_the_mtp_layer_in_its_stages(stage):
    model = mtp_model()
    cfg = TrainConfig(stage=stage, steps=2, lr=1e-2, seq_len=LENGTH, batch_tokens=2 * LENGTH, warmup_steps=0,
                      mtp_loss_weight=0.3)
    losses = compute_losses(model, batch(), cfg)
    assert ("mtp_loss" in losses) == (stage != "warmup")
    expected = losses.get("lm_loss", 0) + 0.3 * losses.get("mtp_loss", 0) + losses.get("indexer_kl", 0)
    torch.testing.assert_close(losses["loss"], torch.as_tensor(expected))
    optimizer, _ = make_optimizer(set_trainable(model, stage), cfg)
    before = {n: p.detach().clone() for n, p in model.model.mtp.named_parameters()}
    losses["loss"].backward()
    optimizer.step()
    changed = {n for n, p in model.model.mtp.named_parameters() if not torch.equal(before[n], p.detach())}
    assert ("eh_proj.weight" in changed) == (stage != "warmup")
    assert ("self_attn.indexer.wk.weight" in changed) == (stage != "dense")


def test_a_zero_weight_leaves_the_mtp_layer_out():
    model = mtp_model()
    cfg = TrainConfig(stage="sparse", steps=1, seq_len=LENGTH, batch_tokens=2 * LENGTH, mtp_loss_weight=0.0)
    assert "mtp_loss" not in compute_losses(model, batch(), cfg)
    with pytest.raises(ValueError, match="mtp_loss_weight"):
        TrainConfig(stage="sparse", steps=1, mtp_loss_weight=-1)


def test_finetune_adds_trains_and_saves_an_mtp_layer(tiny_model_dir, corpus, tmp_path, capsys):
    import json

    from flashdsa.cli import main
    from flashdsa.models.loader import load_model

    out = tmp_path / "out"
    args = ["finetune", "--model", str(tiny_model_dir), "--data", str(corpus), "--stage", "dense", "--steps", "2",
            "--seq-len", "32", "--batch-tokens", "128", "--eval-every", "1", "--eval-tokens", "64", "--device", "cpu",
            "--output", str(out), "--add-mtp-layer", "--mtp-loss-weight", "0.3"]
    assert main(args) == 0
    model = load_model(out, mode="reference", mtp=True)
    assert model.has_mtp and model.config.num_nextn_predict_layers == 1
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert all("mtp_loss" in r and "eval_mtp_loss" in r for r in records)
    again = args[: args.index("--output")] + ["--output", str(tmp_path / "again"), "--add-mtp-layer"]
    again[again.index(str(tiny_model_dir))] = str(out)
    capsys.readouterr()
    assert main(again) == 2  # one line naming the flag
    assert "--add-mtp-layer" in capsys.readouterr().err
    assert main(again[:-1]) == 0  # without the flag: the layer loads and keeps training


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_distill_kl_equals_a_hand_computation(temperature):
    g = torch.Generator().manual_seed(3)
    student, teacher = torch.randn(2, 3, 7, generator=g) * 3, torch.randn(2, 3, 7, generator=g) * 3
    expected = 0.0
    for s_row, t_row in zip(student.double().flatten(0, 1).tolist(), teacher.double().flatten(0, 1).tolist()):
        p = [math.exp(t / temperature) for t in t_row]
        q = [math.exp(s / temperature) for s in s_row]
        p, q = [x / sum(p) for x in p], [x / sum(q) for x in q]
        expected += sum(pv * math.log(pv / qv) for pv, qv in zip(p, q)) / 6
    student.requires_grad_(), teacher.requires_grad_()
    got = distill_kl(student, teacher, temperature)
    assert got.item() == pytest.approx(expected * temperature**2, rel=1e-5)
    assert torch.autograd.grad(got, teacher, allow_unused=True)[0] is None  # the target is detached
    assert distill_kl(teacher, teacher).item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        distill_kl(student, teacher, 0.0)


def test_top1_agreement_counts_equal_argmaxes():
    teacher = torch.eye(4)[[0, 1, 2, 3]][None]  # argmaxes 0 1 2 3
    student = torch.eye(4)[[0, 2, 2, 1]][None]
    assert top1_agreement(student, teacher).item() == 0.5


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_distillation_aligns_mtp_row_i_with_main_row_i_plus_1(stage):
    model = mtp_model()
    ids = batch()
    cfg = TrainConfig(stage=stage, steps=1, seq_len=LENGTH, batch_tokens=2 * LENGTH, mtp_loss_weight=0.2,
                      mtp_distill_weight=0.7, mtp_distill_temperature=2.0)
    losses = compute_losses(model, ids, cfg)
    out = training_forward(model, ids[:, :-1], cfg.attention, indexer_loss=True, next_ids=ids[:, 1:])
    main, draft = torch.log_softmax(out.logits.double() / 2, -1), torch.log_softmax(out.mtp_logits.double() / 2, -1)
    kl = [(main[b, i + 1].exp() * (main[b, i + 1] - draft[b, i])).sum() for b in range(2) for i in range(LENGTH - 1)]
    torch.testing.assert_close(losses["mtp_distill"].double(), 4 * torch.stack(kl).mean(), rtol=1e-5, atol=1e-6)
    agree = out.mtp_logits[:, :-1].argmax(-1) == out.logits[:, 1:].argmax(-1)
    assert losses["mtp_agreement"].item() == agree.float().mean().item()
    expected = (losses["lm_loss"] + 0.2 * losses["mtp_loss"] + 0.7 * losses["mtp_distill"]
                + losses.get("indexer_kl", 0))
    torch.testing.assert_close(losses["loss"], expected)


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_mtp_only_leaves_the_main_model_bit_identical(stage):
    model = mtp_model()
    cfg = TrainConfig(stage=stage, steps=3, lr=1e-2, seq_len=LENGTH, batch_tokens=2 * LENGTH, warmup_steps=0,
                      mtp_loss_weight=0.0, mtp_distill_weight=1.0, mtp_only=True)
    params = set_trainable(model, stage, mtp_only=True)
    mtp_ids = {id(p) for p in model.model.mtp.parameters()}
    assert params and all(id(p) in mtp_ids for p in params)
    optimizer, _ = make_optimizer(params, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(cfg.steps):
        compute_losses(model, batch(step), cfg)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed and all(n.startswith("model.mtp.") for n in changed)
    assert {"model.mtp.eh_proj.weight", "model.mtp.self_attn.q_a_proj.weight"} <= changed
    assert ("model.mtp.self_attn.indexer.wk.weight" in changed) == (stage == "sparse")


def test_mtp_only_refuses_a_model_without_an_mtp_layer():
    model = initialize(DeepseekV32ForCausalLM(tiny_config(VOCAB), mode="reference"), seed=1)
    with pytest.raises(ValueError, match="mtp_only"):
        set_trainable(model, "dense", mtp_only=True)


def agreement(model, cfg: TrainConfig, seeds: range) -> float:
    with torch.no_grad():
        return sum(compute_losses(model, batch(s), cfg)["mtp_agreement"].item() for s in seeds) / len(seeds)


def test_distillation_raises_top1_agreement_more_than_the_data_loss():
    """Forty MTP-only steps on random tokens. The main model's layers write a tenth of their init
    into the residual stream, so its choice at i + 1 follows token i + 1 mostly (a bigram teacher one
    MTP layer can learn this fast): distillation raises the held-out agreement far; the data loss
    (the random token after next) does not."""
    held_out = range(100, 104)
    results = {}
    for name, weights in (("distill", dict(mtp_loss_weight=0.0, mtp_distill_weight=1.0)),
                          ("data", dict(mtp_loss_weight=1.0, mtp_distill_weight=0.0))):
        torch.manual_seed(0)
        model = mtp_model()
        with torch.no_grad():
            for param_name, p in model.model.layers.named_parameters():
                if "o_proj" in param_name or "down_proj" in param_name:
                    p.mul_(0.1)
        cfg = TrainConfig(stage="dense", steps=40, lr=1e-2, seq_len=LENGTH, batch_tokens=4 * LENGTH, warmup_steps=0,
                          mtp_only=True, **weights)
        before = agreement(model, cfg, held_out)
        optimizer, _ = make_optimizer(set_trainable(model, "dense", mtp_only=True), cfg)
        for step in range(cfg.steps):
            compute_losses(model, torch.cat([batch(2 * step), batch(2 * step + 1)]), cfg)["loss"].backward()
            optimizer.step()
            optimizer.zero_grad()
        results[name] = (before, agreement(model, cfg, held_out))
    assert results["distill"][0] == results["data"][0]  # the same start
    assert results["distill"][1] > results["distill"][0] + 0.25, results
    assert results["distill"][1] > results["data"][1] + 0.2, results


def finetune_args(model_dir, corpus, output) -> list[str]:
    return ["finetune", "--model", str(model_dir), "--data", str(corpus), "--stage", "dense", "--steps", "2",
            "--seq-len", "32", "--batch-tokens", "128", "--eval-every", "1", "--eval-tokens", "64", "--device", "cpu",
            "--output", str(output)]


@pytest.mark.parametrize("extra,flag,says", [
    (["--mtp-distill-weight", "-1"], "--mtp-distill-weight", "must be a number >= 0"),
    (["--mtp-distill-temperature", "0"], "--mtp-distill-temperature", "must be a number > 0"),
    (["--mtp-distill-weight", "1"], "--mtp-distill-weight", "no multi-token-prediction layer"),
    (["--mtp-only"], "--mtp-only", "no multi-token-prediction layer"),
    (["--add-mtp-layer", "--mtp-only", "--mtp-loss-weight", "0"], "--mtp-only", "nothing would train"),
    (["--add-mtp-layer", "--keep-best-by", "mtp_agreement"], "--keep-best-by", "pass --keep-best"),
    (["--add-mtp-layer", "--keep-best", "--keep-best-by", "mtp_agreement", "--mtp-loss-weight", "0"],
     "--keep-best-by", "needs the MTP layer's predictions"),
    (["--add-mtp-layer", "--stage", "warmup", "--mtp-distill-weight", "1"], "--mtp-distill-weight", "warmup"),
])
def test_finetune_refuses_bad_mtp_options_naming_the_flag(tiny_model_dir, corpus, tmp_path, capsys, extra, flag, says):
    from flashdsa.cli import main

    try:
        code = main(finetune_args(tiny_model_dir, corpus, tmp_path / "out") + extra)
    except SystemExit as exc:  # argparse refuses a value at parse time
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert f"argument {flag}:" in err and says in err, err
    assert not (tmp_path / "out" / "log.jsonl").exists()


def test_finetune_mtp_only_distillation_keeps_the_main_weights(tiny_model_dir, corpus, tmp_path):
    import json

    from flashdsa.cli import main
    from flashdsa.models.loader import load_model

    out = tmp_path / "out"
    args = finetune_args(tiny_model_dir, corpus, out) + [
        "--add-mtp-layer", "--mtp-only", "--mtp-loss-weight", "0", "--mtp-distill-weight", "1",
        "--mtp-distill-temperature", "2", "--keep-best", "--keep-best-by", "mtp_agreement", "--save-dtype", "float32"]
    assert main(args) == 0
    trained, source = load_model(out, mode="reference", mtp=True), load_model(tiny_model_dir, mode="reference")
    assert trained.has_mtp
    for name, t in source.state_dict().items():
        assert torch.equal(trained.state_dict()[name], t), name
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert all(0 <= r["eval_mtp_agreement"] <= 1 and r["eval_mtp_distill"] >= 0 for r in records)
