"""Each DSA stage trains what it should, and the training forward equals the inference model."""

from __future__ import annotations

import pytest
import torch

from flashdsa.models.deepseek_v32 import DeepseekV32ForCausalLM
from flashdsa.runtime.metadata import BatchMetadata
from flashdsa.train.forward import training_forward
from flashdsa.train.init import initialize
from flashdsa.train.loop import TrainConfig, compute_losses, make_optimizer, set_trainable

from train_configs import tiny_config

VOCAB, LENGTH = 60, 16


def tiny_model(index_topk: int = 6) -> DeepseekV32ForCausalLM:
    return initialize(DeepseekV32ForCausalLM(tiny_config(VOCAB, index_topk), mode="reference"), seed=1, std=0.3)


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, LENGTH + 1), generator=torch.Generator().manual_seed(seed))


def is_indexer(name: str) -> bool:
    return ".indexer." in name


@pytest.mark.parametrize("index_topk", [64, 6])  # >= L: the indexer keeps every key; < L: really sparse
def test_training_forward_equals_inference_forward(index_topk):
    model = tiny_model(index_topk)
    ids = batch()[:, :LENGTH]
    out = training_forward(model, ids, "sparse" if index_topk < LENGTH else "dense")
    caches = model.allocate_caches(1)
    for b in range(ids.shape[0]):
        meta = BatchMetadata.for_step([0], [LENGTH], torch.tensor([[0]], dtype=torch.int32), torch.arange(LENGTH))
        torch.testing.assert_close(out.logits[b], model(ids[b], meta, caches), rtol=1e-5, atol=1e-5)


def run_steps(model, stage: str, steps: int = 2) -> None:
    cfg = TrainConfig(stage=stage, steps=steps, lr=1e-2, seq_len=LENGTH, batch_tokens=2 * LENGTH, warmup_steps=0)
    optimizer, _ = make_optimizer(set_trainable(model, stage), cfg)
    for step in range(steps):
        compute_losses(model, batch(step), cfg)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("stage,trains_indexer,trains_main", [("warmup", True, False), ("dense", False, True),
                                                             ("sparse", True, True)])
def test_stage_changes_exactly_its_parameters(stage, trains_indexer, trains_main):
    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    run_steps(model, stage)
    for name, p in model.named_parameters():
        changed = not torch.equal(before[name], p.detach())
        should = trains_indexer if is_indexer(name) else trains_main
        if name.endswith("k_norm.bias") or ".experts." in name:  # may see no gradient in two steps
            assert changed <= should, name
        else:
            assert changed == should, name


def test_sparse_stage_keeps_main_model_and_indexer_in_separate_graphs():
    model = tiny_model()
    cfg = TrainConfig(stage="sparse", steps=1, seq_len=LENGTH, batch_tokens=2 * LENGTH)
    set_trainable(model, "sparse")
    losses = compute_losses(model, batch(), cfg)
    main = [p for n, p in model.named_parameters() if not is_indexer(n)]
    indexer = [p for n, p in model.named_parameters() if is_indexer(n)]
    kl_to_main = torch.autograd.grad(losses["indexer_kl"], main, retain_graph=True, allow_unused=True)
    lm_to_indexer = torch.autograd.grad(losses["lm_loss"], indexer, retain_graph=True, allow_unused=True)
    assert all(g is None for g in kl_to_main)
    assert all(g is None for g in lm_to_indexer)
    kl_to_indexer = torch.autograd.grad(losses["indexer_kl"], indexer, retain_graph=True, allow_unused=True)
    lm_to_main = torch.autograd.grad(losses["lm_loss"], main, allow_unused=True)
    assert sum(g.abs().sum() for g in kl_to_indexer if g is not None) > 0
    assert sum(g.abs().sum() for g in lm_to_main if g is not None) > 0


def test_gradient_checkpointing_gives_the_same_gradients():
    grads = []
    for checkpointing in (False, True):
        model = tiny_model()
        out = training_forward(model, batch()[:, :LENGTH], "sparse", indexer_loss=True, checkpointing=checkpointing)
        (out.logits.logsumexp(-1).mean() + out.indexer_kl).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)


def test_saved_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from flashdsa.train.checkpoint import save_model

    model = tiny_model(index_topk=64)  # every key kept: HF breaks top-k ties (zero scores) its own way
    save_model(model, tmp_path, dtype=None)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = batch()[:, :LENGTH]
    torch.testing.assert_close(hf(ids).logits, training_forward(model, ids, "dense").logits, rtol=1e-4, atol=1e-4)
