"""Training the MTP layer: the training forward equals the inference MTP path, its loss trains
it in the dense and sparse stages, and a fresh layer can be added to a checkpoint without one."""

from __future__ import annotations

import pytest
import torch

from flashdsa.models.deepseek_v32 import DeepseekV32ForCausalLM
from flashdsa.models.mtp import add_mtp_layer
from flashdsa.runtime.metadata import BatchMetadata
from flashdsa.train.forward import training_forward
from flashdsa.train.init import initialize
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
