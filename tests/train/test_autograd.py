"""The sparse attention op under autograd equals a dense attention masked to the same selection."""

from __future__ import annotations

import pytest
import torch

from flashdsa.models.deepseek_v32 import DeepseekV32ForCausalLM
from flashdsa.train import forward as training
from flashdsa.train.autograd import sparse_mla_attention
from flashdsa.train.init import initialize

from train_configs import tiny_config


def dense_masked_attention(q, kv, indices, sm_scale, d_v=512, backend=None):
    """Plain softmax attention over all kv rows, masked to the valid, selected ones (autograd by torch)."""
    s_kv = kv.shape[0]
    idx = indices[:, 0].long()
    valid = (idx >= 0) & (idx < s_kv)
    mask = torch.zeros(q.shape[0], s_kv + 1, dtype=torch.bool).scatter_(1, torch.where(valid, idx, s_kv), True)
    mask = mask[:, :s_kv]  # column s_kv collected the invalid indices
    scores = torch.einsum("thc,sc->ths", q, kv[:, 0]) * sm_scale
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("ths,sc->thc", torch.softmax(scores, dim=-1), kv[:, 0, :d_v])
    return out, lse.float()


def random_selection(s_q: int, s_kv: int, topk: int, generator) -> torch.Tensor:
    """[s_q, 1, topk] int32: distinct rows per query, some -1 and some >= s_kv (invalid)."""
    rows = torch.stack([torch.randperm(s_kv, generator=generator)[:topk] for _ in range(s_q)])
    drop = torch.rand(s_q, topk, generator=generator) < 0.25
    drop[:, 0] = False  # at least one valid index per row
    rows = torch.where(drop, torch.where(torch.rand(s_q, topk, generator=generator) < 0.5, -1, s_kv + 3), rows)
    return rows[:, None].to(torch.int32)


@pytest.mark.parametrize("s_q,s_kv,h_q,d_qk,d_v,topk",
                         [(9, 13, 3, 20, 16, 6), (4, 7, 1, 12, 12, 7), (1, 5, 2, 8, 4, 3)])
def test_sparse_gradients_equal_dense_masked_attention(s_q, s_kv, h_q, d_qk, d_v, topk):
    g = torch.Generator().manual_seed(s_q * 100 + topk)
    q = torch.randn(s_q, h_q, d_qk, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(s_kv, 1, d_qk, generator=g, dtype=torch.float64, requires_grad=True)
    indices = random_selection(s_q, s_kv, topk, g)
    dout = torch.randn(s_q, h_q, d_v, generator=g, dtype=torch.float64)
    results = []
    for attend in (sparse_mla_attention, dense_masked_attention):
        out, lse = attend(q, kv, indices, 0.3, d_v)
        dq, dkv = torch.autograd.grad((out * dout).sum(), (q, kv))
        results.append((out, lse, dq, dkv))
    for got, want in zip(*results):  # the contract's lse is fp32, which bounds the backward at ~1e-7
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert results[0][3].abs().sum() > 0  # kv rows really received gradient


def test_sparse_attention_passes_gradcheck():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, 2, 6, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(8, 1, 6, generator=g, dtype=torch.float64, requires_grad=True)
    indices = random_selection(5, 8, 4, g)
    assert torch.autograd.gradcheck(lambda a, b: sparse_mla_attention(a, b, indices, 0.5, 4)[0], (q, kv))


def test_model_gradients_through_sparse_path_equal_dense_masked(monkeypatch):
    """Whole-model float64 gradients: sparse kernels vs dense masked attention on the same top-k."""
    model = initialize(DeepseekV32ForCausalLM(tiny_config(50, index_topk=5), mode="reference"), seed=3, std=0.3)
    model = model.double()
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    grads = []
    for attend in (sparse_mla_attention, dense_masked_attention):
        monkeypatch.setattr(training, "sparse_mla_attention", attend)
        model.zero_grad()
        out = training.training_forward(model, ids, "sparse", indexer_loss=True)
        (out.logits.logsumexp(-1).sum() + out.indexer_kl).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(model.parameters()))
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-6, msg=name)
