"""Reference DeepSeek-V4 sparse attention against transformers' own equation, plus its contract.

The oracle is ``transformers.models.deepseek_v4.modeling_deepseek_v4.eager_attention_forward``
(dense attention with an additive mask and per-head sinks, K = V): the two index sets become a
dense mask over the concatenated tables, so the reference's union, lengths, invalid-index masking
and sink handling are all checked against the model's code, on small shapes and fresh inputs.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from flashdsa.runtime.cache import write_v4_cache
from flashdsa.runtime.cache.layout_v4 import gather_v4
from flashdsa.runtime.cache.pool import v4_pool
from flashdsa.runtime.kernels import sparse_attention_v4_decode, sparse_attention_v4_prefill
from flashdsa.testing import random_indices

modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
SCALE = 512**-0.5


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv("FLASHDSA_BACKEND", "reference")


def allowed(indices: torch.Tensor, lengths, num_rows: int, offset: int, width: int) -> torch.Tensor:
    """[n, width] bool: which table rows (shifted by ``offset``) a query's valid indices name."""
    idx = indices.long()
    valid = (idx >= 0) & (idx < num_rows)
    if lengths is not None:
        valid &= torch.arange(idx.shape[-1]) < lengths.long()[:, None]
    mask = torch.zeros(idx.shape[0], width + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(valid, idx + offset, width), True)
    return mask[:, :width]


def transformers_attention(q, keys, mask, sinks):
    """transformers' V4 eager attention: q [n, h, d], keys [N, d] (K = V), mask [n, N] bool."""
    module = SimpleNamespace(num_key_value_groups=q.shape[1], sinks=sinks, training=False)
    bias = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    out, _ = modeling.eager_attention_forward(module, q.double().transpose(0, 1)[None], keys.double()[None, None],
                                              keys.double()[None, None], bias[None, None], SCALE)
    return out[0]  # [n, h, d]


def random_case(s_q, h_q, s_kv, topk, s_extra, extra_topk, g):
    q = torch.randn(s_q, h_q, 512, generator=g, dtype=torch.float64)
    kv = torch.randn(s_kv, 1, 512, generator=g, dtype=torch.float64)
    extra_kv = torch.randn(s_extra, 1, 512, generator=g, dtype=torch.float64)
    idx = random_indices((s_q, 1, topk), s_kv, invalid=0.1, out_of_range=0.05, generator=g)
    extra_idx = random_indices((s_q, 1, extra_topk), s_extra, invalid=0.1, generator=g)
    lengths = torch.randint(0, topk + 3, (s_q,), generator=g, dtype=torch.int32)
    extra_lengths = torch.randint(0, extra_topk + 1, (s_q,), generator=g, dtype=torch.int32)
    sinks = torch.randn(h_q, generator=g, dtype=torch.float64) * 2
    return q, kv, extra_kv, idx, extra_idx, lengths, extra_lengths, sinks


@pytest.mark.parametrize("s_q, h_q, s_kv, topk, s_extra, extra_topk",
                         [(1, 4, 30, 16, 20, 8), (7, 3, 50, 40, 128, 128), (5, 2, 3, 8, 6, 12), (4, 2, 0, 4, 9, 9),
                          (600, 2, 64, 16, 128, 128)])  # topk > s_kv; empty table; many queries
def test_reference_prefill_matches_transformers_dense_attention_with_sinks(s_q, h_q, s_kv, topk, s_extra, extra_topk):
    g = torch.Generator().manual_seed(SEED + s_q * 100 + topk)
    q, kv, extra_kv, idx, extra_idx, lengths, extra_lengths, sinks = random_case(
        s_q, h_q, s_kv, topk, s_extra, extra_topk, g)
    out, lse = sparse_attention_v4_prefill(q, kv, idx, SCALE, topk_length=lengths, attn_sink=sinks.float(),
                                           extra_kv=extra_kv, extra_indices=extra_idx, extra_topk_length=extra_lengths)
    width = s_kv + s_extra
    mask = allowed(idx[:, 0], lengths, s_kv, 0, width) | allowed(extra_idx[:, 0], extra_lengths, s_extra, s_kv, width)
    keys = torch.cat([kv[:, 0], extra_kv[:, 0]])
    want = transformers_attention(q, keys, mask, sinks.float().double())
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6, msg=f"seed {SEED}")  # lse and the sink factor are fp32
    scores = torch.einsum("nhd,kd->nhk", q, keys) * SCALE
    want_lse = torch.logsumexp(scores.masked_fill(~mask[:, None], float("-inf")), -1)
    want_lse = want_lse.masked_fill(want_lse == float("-inf"), float("inf")).float()
    torch.testing.assert_close(lse, want_lse, msg=f"seed {SEED}")


def test_reference_decode_equals_prefill_over_the_dequantized_pools():
    g = torch.Generator().manual_seed(SEED)
    pool, extra_pool = v4_pool(3, "cpu", block_size=16), v4_pool(2, "cpu", block_size=64)
    write_v4_cache(torch.randn(48, 512, generator=g), pool, torch.randperm(48, generator=g))
    write_v4_cache(torch.randn(128, 512, generator=g), extra_pool, torch.arange(128))
    b, s_q, h_q = 3, 2, 4
    q = torch.randn(b, s_q, h_q, 512, generator=g)
    slots = random_indices((b, s_q, 20), 48, invalid=0.2, out_of_range=0.1, generator=g)
    extra = random_indices((b, s_q, 16), 128, invalid=0.2, generator=g)
    lengths, extra_lengths = torch.tensor([20, 5, 0], dtype=torch.int32), torch.tensor([3, 16, 0], dtype=torch.int32)
    sinks = torch.randn(h_q, generator=g)
    out, lse = sparse_attention_v4_decode(q, pool, slots, SCALE, topk_length=lengths, attn_sink=sinks,
                                          extra_kv_cache=extra_pool, extra_indices=extra,
                                          extra_topk_length=extra_lengths)
    table, extra_table = gather_v4(pool, torch.arange(48))[:, None], gather_v4(extra_pool, torch.arange(128))[:, None]
    for i in range(b):
        want, want_lse = sparse_attention_v4_prefill(
            q[i], table, slots[i][:, None], SCALE, topk_length=lengths[i].repeat(s_q), attn_sink=sinks,
            extra_kv=extra_table, extra_indices=extra[i][:, None], extra_topk_length=extra_lengths[i].repeat(s_q))
        torch.testing.assert_close(out[i], want)
        torch.testing.assert_close(lse[i], want_lse.T)
    assert (out[2] == 0).all() and (lse[2] == float("inf")).all()  # lengths 0 and 0: nothing to attend


def test_sink_joins_the_denominator_only():
    g = torch.Generator().manual_seed(SEED)
    q, kv = torch.randn(2, 3, 512, generator=g), torch.randn(10, 1, 512, generator=g)
    idx = torch.arange(10, dtype=torch.int32).repeat(2, 1, 1)
    plain, lse = sparse_attention_v4_prefill(q, kv, idx, SCALE)
    sinks = torch.tensor([float("-inf"), 0.5, float("inf")])
    out, sink_lse = sparse_attention_v4_prefill(q, kv, idx, SCALE, attn_sink=sinks)
    assert torch.equal(lse, sink_lse)
    torch.testing.assert_close(out[:, 0], plain[:, 0])
    torch.testing.assert_close(out[:, 1], plain[:, 1] * torch.sigmoid(lse[:, 1] - 0.5)[:, None])
    assert (out[:, 2] == 0).all()


def test_bad_inputs_raise_value_errors_naming_the_argument():
    q, kv = torch.randn(2, 4, 512).bfloat16(), torch.randn(5, 1, 512).bfloat16()
    idx = torch.zeros(2, 1, 8, dtype=torch.int32)
    cases = [
        (dict(q=q[..., :448]), "q must be"),
        (dict(kv=kv.float()), "kv must be"),
        (dict(indices=idx.long()), "indices must be"),
        (dict(sm_scale=-1.0), "sm_scale"),
        (dict(topk_length=torch.zeros(3, dtype=torch.int32)), "topk_length must be"),
        (dict(attn_sink=torch.zeros(4).bfloat16()), "attn_sink must be"),
        (dict(extra_kv=kv), "extra_indices and the extra kv"),
        (dict(extra_kv=kv, extra_indices=idx[:1]), "extra_indices must be"),
    ]
    for change, message in cases:
        args = dict(q=q, kv=kv, indices=idx, sm_scale=SCALE) | change
        with pytest.raises(ValueError, match=message):
            sparse_attention_v4_prefill(**args)
    pool = v4_pool(1, "cpu")
    with pytest.raises(ValueError, match="kv_cache must be"):
        sparse_attention_v4_decode(q[None], torch.zeros(1, 64, 1, 656, dtype=torch.uint8), idx.view(1, 2, 8), SCALE)
    with pytest.raises(ValueError, match="topk_length must be"):
        sparse_attention_v4_decode(q[None], pool, idx.view(1, 2, 8), SCALE,
                                   topk_length=torch.zeros(2, dtype=torch.int32))
