"""DeepSeek-V4 training forward: equal to the reference model, and each stage trains what it should."""

from __future__ import annotations

import pytest
import torch

from flashdsa.models.deepseek_v4_loader import load_v4_model
from flashdsa.train import attention_v4
from flashdsa.train.forward_v4 import training_forward_v4
from flashdsa.train.loop import TrainConfig, compute_losses, make_optimizer, set_trainable

WINDOW = 128  # the tiny model's sliding window; its CSA ratio is 4, its HCA ratio 128


@pytest.fixture(scope="module")
def v4(tiny_v4_dir):
    return load_v4_model(tiny_v4_dir, mtp=True)


def fresh(tiny_v4_dir):
    return load_v4_model(tiny_v4_dir, mtp=True)


def token_batch(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 500, (batch, length), generator=torch.Generator().manual_seed(seed))


def is_indexer(name: str) -> bool:
    return ".indexer." in name


@pytest.mark.parametrize("length", [5, WINDOW + 2, 300])  # no entry yet; across the window; 75 CSA entries, 2 HCA
def test_sparse_training_forward_equals_the_reference_forward(v4, length, monkeypatch):
    monkeypatch.setattr(attention_v4, "SELECT_CHUNK", 128)  # the top-k selection in several query blocks
    ids = token_batch(2, length + 1, seed=length)
    out = training_forward_v4(v4, ids[:, :-1], "sparse", indexer_loss=True, next_ids=ids[:, 1:])
    for b in range(2):
        cache = v4.new_cache()
        ref = v4.forward_sequence(ids[b, :-1], cache)
        torch.testing.assert_close(out.logits[b], ref.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.mtp_logits[b], v4.mtp_forward(ids[b, 1:], ref.streams, cache), rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out.indexer_kl) and (out.indexer_kl > 0) == (length >= 4 * 2)


def test_dense_attention_is_the_reference_when_the_indexer_keeps_every_entry(tiny_v4_dir):
    model = fresh(tiny_v4_dir)
    ids = token_batch(2, 300, seed=1)
    sparse_logits = training_forward_v4(model, ids, "sparse").logits
    dense_logits = training_forward_v4(model, ids, "dense").logits
    assert not torch.allclose(sparse_logits, dense_logits, atol=1e-3)  # top-8 of 75 entries is a real selection
    for layer in model.model.layers:
        if hasattr(getattr(layer.self_attn, "compressor", None), "indexer"):
            layer.self_attn.compressor.indexer.topk = 1000
    for b in range(2):
        torch.testing.assert_close(dense_logits[b], model.forward_sequence(ids[b]).logits, rtol=1e-5, atol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_v4_dir):
    grads = []
    for checkpointing in (False, True):
        model = fresh(tiny_v4_dir)
        ids = token_batch(2, WINDOW + 9)
        out = training_forward_v4(model, ids[:, :-1], "sparse", indexer_loss=True, checkpointing=checkpointing,
                                  next_ids=ids[:, 1:])
        (out.logits.logsumexp(-1).mean() + out.mtp_logits.logsumexp(-1).mean() + out.indexer_kl).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)


def stage_losses(model, stage: str, steps: int = 4) -> list[float]:
    """``steps`` optimizer steps of ``stage`` on one repeated text; the stage's loss before each."""
    text = torch.arange(4, 24).repeat(7)[: WINDOW + 9][None]  # a short phrase repeated past the window
    cfg = TrainConfig(stage=stage, steps=steps, lr=1e-2, seq_len=WINDOW + 8, batch_tokens=WINDOW + 8, warmup_steps=0)
    optimizer, _ = make_optimizer(set_trainable(model, stage), cfg)
    losses = []
    for _ in range(steps):
        loss = compute_losses(model, text, cfg)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("stage,trains_indexer,trains_main", [("warmup", True, False), ("dense", False, True),
                                                             ("sparse", True, True)])
def test_each_stage_lowers_its_loss_and_changes_exactly_its_parameters(tiny_v4_dir, stage, trains_indexer, trains_main):
    model = fresh(tiny_v4_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = stage_losses(model, stage)
    assert losses[-1] < losses[0], losses
    for name, p in model.named_parameters():
        changed = not torch.equal(before[name], p.detach())
        should = trains_indexer if is_indexer(name) else trains_main
        if ".experts." in name:  # a routed expert may see no token
            assert changed <= should, name
        else:
            assert changed == should, name


def test_sparse_stage_keeps_the_main_model_and_the_indexers_in_separate_graphs(tiny_v4_dir):
    model = fresh(tiny_v4_dir)
    cfg = TrainConfig(stage="sparse", steps=1, seq_len=WINDOW + 8, batch_tokens=WINDOW + 8)
    set_trainable(model, "sparse")
    losses = compute_losses(model, token_batch(1, WINDOW + 9), cfg)
    main = [p for n, p in model.named_parameters() if not is_indexer(n)]
    indexer = [p for n, p in model.named_parameters() if is_indexer(n)]
    grad = lambda loss, params: torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)  # noqa: E731
    assert all(g is None for g in grad(losses["indexer_kl"], main))
    assert all(g is None for g in grad(losses["lm_loss"], indexer))
    assert sum(g.abs().sum() for g in grad(losses["indexer_kl"], indexer) if g is not None) > 0


def test_hyper_connection_mixing_stays_fp32_under_the_training_autocast(v4):
    """The loop trains under bf16 autocast on CUDA; the mHC mixing weights (fp32 in DeepSeek-V4)
    must not be rounded by it. CPU autocast takes the same path."""
    layer, head = v4.model.layers[0].attn_hc, v4.model.hc_head
    h = torch.randn(16, v4.config.hc_mult, v4.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = [*layer(h), head(h)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = [*layer(h), head(h)]
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)
