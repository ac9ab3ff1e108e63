"""Reference sparse_mla_decode over the paged FP8 cache: equals the forward on the dequantized
pool (slot ids are flat pool rows) and the dense oracle on each sequence's own tokens."""

import pytest
import torch

from flashdsa.runtime.cache.layout import BLOCK_SIZE, D_QK, MLA_TOKEN_BYTES, dequantize_mla
from flashdsa.runtime.kernels import reference, sparse_mla_decode, sparse_mla_fwd
from flashdsa.testing import (
    assert_flashmla_close,
    assert_lse_close,
    dense_sparse_mla,
    random_block_table,
    random_indices,
    random_mla_cache,
    slots_from_positions,
)

SM_SCALE = D_QK**-0.5


def decode_case(b, s_q, h_q, topk, blocks_per_seq, num_blocks, dtype, seed, **options):
    """q, pool, block table, positions [b, s_q, topk] and their slot ids (blocks scattered)."""
    g = torch.Generator().manual_seed(seed)
    pool = random_mla_cache(num_blocks, generator=g)
    table = random_block_table(b, blocks_per_seq, num_blocks, generator=g)
    positions = random_indices((b, s_q, topk), blocks_per_seq * BLOCK_SIZE, generator=g, **options)
    q = torch.randn(b, s_q, h_q, D_QK, generator=g).to(dtype)
    return q, pool, table, positions, slots_from_positions(positions, table)


@pytest.mark.parametrize("s_q", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_equals_fwd_on_dequantized_pool(s_q, dtype):
    q, pool, _, _, slots = decode_case(3, s_q, 16, 128, 2, 9, dtype, seed=s_q, invalid=0.2)
    slots[0, 0, :5] = torch.tensor([-7, 9 * BLOCK_SIZE, 2**31 - 1, -1, 9 * BLOCK_SIZE - 1])  # bad ids + last slot
    out, lse = sparse_mla_decode(q, pool, slots, SM_SCALE, backend="reference")
    assert out.shape == (3, s_q, 16, 512) and out.dtype == dtype and lse.shape == (3, 16, s_q)
    flat_kv = dequantize_mla(pool.view(-1, MLA_TOKEN_BYTES)).unsqueeze(1)  # fp32, as decode reads it
    for i in range(3):
        ref_out, _, ref_lse = sparse_mla_fwd(q[i].float(), flat_kv, slots[i].unsqueeze(1), SM_SCALE,
                                             backend="reference")
        assert_flashmla_close("out", out[i], ref_out)
        assert_lse_close(lse[i], ref_lse.T)


def test_decode_matches_dense_oracle_on_each_sequences_tokens():
    h_q = 128
    q, pool, table, positions, slots = decode_case(2, 2, h_q, 256, 3, 10, torch.float32, seed=9, out_of_range=0.2,
                                                   duplicates=True)
    out, lse = sparse_mla_decode(q, pool, slots, SM_SCALE, backend="reference")
    for i in range(2):
        seq_kv = dequantize_mla(pool[table[i].long()].view(-1, MLA_TOKEN_BYTES)).unsqueeze(1)  # position order
        ref_out, _, ref_lse = dense_sparse_mla(q[i], seq_kv, positions[i].unsqueeze(1), SM_SCALE, 512)
        assert_flashmla_close("out", out[i], ref_out)
        assert_lse_close(lse[i], ref_lse.T)


def test_decode_rows_without_valid_slot_give_zero_out_and_inf_lse():
    q, pool, _, _, slots = decode_case(2, 3, 8, 64, 1, 2, torch.bfloat16, seed=2)
    slots[1, 2] = -1
    slots[0, 0] = 2 * BLOCK_SIZE  # one past the pool
    out, lse = sparse_mla_decode(q, pool, slots, SM_SCALE, backend="reference")
    for i, j in ((1, 2), (0, 0)):
        assert torch.equal(out[i, j], torch.zeros_like(out[i, j])) and torch.isposinf(lse[i, :, j]).all()
    assert torch.isfinite(lse[0, :, 1:]).all() and torch.isfinite(lse[1, :, :2]).all()


def test_decode_on_an_empty_pool_gives_zero_out_and_inf_lse():
    q = torch.randn(1, 2, 4, D_QK)
    pool = torch.empty(0, BLOCK_SIZE, 1, MLA_TOKEN_BYTES, dtype=torch.uint8)
    indices = torch.tensor([[[0, -1, 5]] * 2], dtype=torch.int32)
    out, lse = sparse_mla_decode(q, pool, indices, SM_SCALE, backend="reference")
    assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()


def test_empty_query_batches_give_empty_outputs():
    q = torch.randn(0, 4, 48)
    out, max_logits, lse = sparse_mla_fwd(q, torch.randn(5, 1, 48), torch.zeros(0, 1, 8, dtype=torch.int32), 0.1, 32,
                                          backend="reference")
    assert out.shape == (0, 4, 32) and max_logits.shape == lse.shape == (0, 4)
    pool = random_mla_cache(1)
    out, lse = sparse_mla_decode(torch.randn(2, 0, 4, D_QK), pool, torch.zeros(2, 0, 8, dtype=torch.int32), SM_SCALE,
                                 backend="reference")
    assert out.shape == (2, 0, 4, 512) and lse.shape == (2, 4, 0)


def test_decode_chunking_gives_the_same_result():
    q, pool, _, _, slots = decode_case(2, 3, 8, 64, 2, 5, torch.float32, seed=4, invalid=0.3)
    whole = reference.sparse_mla_decode(q, pool, slots, SM_SCALE, 512, chunk=6)
    for a, b in zip(reference.sparse_mla_decode(q, pool, slots, SM_SCALE, 512, chunk=4), whole):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_slots_from_positions_follows_the_block_table():
    table = torch.tensor([[4, 1], [0, 3]], dtype=torch.int32)
    positions = torch.tensor([[[0, 63, 64, 127, 128, -1]], [[1, 65, 200, -3, 70, 5]]], dtype=torch.int32)
    want = torch.tensor([[[256, 319, 64, 127, -1, -1]], [[1, 193, -1, -1, 198, 5]]], dtype=torch.int32)
    assert torch.equal(slots_from_positions(positions, table), want)
