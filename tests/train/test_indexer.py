"""Training-side indexer: chunked top-k selection and selected-key scores equal the full score matrix."""

from __future__ import annotations

import torch

from flashdsa.models.deepseek_v32 import DeepseekV32ForCausalLM
from flashdsa.train import indexer as train_indexer
from flashdsa.runtime.indexer import indexer_topk
from flashdsa.train.indexer import causal_scores, indexer_inputs, select_topk, selected_scores
from flashdsa.train.init import initialize

from train_configs import tiny_config


def inputs_of_a_tiny_model(batch: int = 2, length: int = 13):
    model = initialize(DeepseekV32ForCausalLM(tiny_config(50), mode="reference"), seed=2, std=0.3).double()
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch * length, 32, generator=g, dtype=torch.float64)
    q_resid = torch.randn(batch * length, 16, generator=g, dtype=torch.float64)
    rope = model.rotary.at(torch.arange(length).repeat(batch))
    return attn.indexer, indexer_inputs(attn.indexer, x, q_resid, rope, batch)


def test_chunked_selection_equals_top_k_of_the_full_causal_scores(monkeypatch):
    _, inputs = inputs_of_a_tiny_model()
    scores = causal_scores(inputs).float()  # [B, L, L], -inf above the diagonal: never selected
    full = indexer_topk(scores.flatten(0, 1), 6).view(*scores.shape[:2], 6).long()
    monkeypatch.setattr(train_indexer, "SELECT_CHUNK", 4)  # 13 queries in chunks of 4, 4, 4, 1
    chunked = select_topk(inputs, 6)
    assert torch.equal(chunked, full)
    assert (chunked[:, 2, 3:] == -1).all() and (chunked[:, 2, :3] >= 0).all()  # query 2 sees 3 keys


def test_selected_scores_and_their_gradients_equal_the_gathered_full_scores():
    indexer, inputs = inputs_of_a_tiny_model()
    positions = select_topk(inputs, 6)
    valid = positions >= 0
    weights = torch.randn(positions.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = []
    for scores in (selected_scores(inputs, positions), causal_scores(inputs).gather(2, positions.clamp_min(0))):
        loss = (scores * weights).masked_fill(~valid, 0).sum()
        grads.append(torch.autograd.grad(loss, list(indexer.parameters()), retain_graph=True))
        assert torch.isfinite(scores[valid]).all()
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # the indexer scores in fp32
    assert any(g.abs().sum() > 0 for g in grads[0])
