"""V4 indexer over compressed keys: the whole reference path (compressor pooling, then scores with
causality in compressed units, then top-k) against transformers' ``DeepseekV4Indexer`` itself."""

from __future__ import annotations

import os

import pytest
import torch

from flashdsa.runtime.compressor import compress_sequence
from flashdsa.runtime.indexer import hadamard_transform, indexer_fused_topk, quantize_indexer
from flashdsa.runtime.indexer.compressed import compressed_indexer_topk, compressed_ranges

modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
configuration = pytest.importorskip("transformers.models.deepseek_v4.configuration_deepseek_v4")

SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
RATIO, HEADS, DIM = 4, 3, 16


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv("FLASHDSA_BACKEND", "reference")


@pytest.mark.parametrize("seq_len, topk", [(3, 4), (17, 2), (40, 5), (40, 64)])
def test_selection_matches_transformers_indexer(seq_len, topk):
    torch.manual_seed(SEED + seq_len * 10 + topk)
    config = configuration.DeepseekV4Config(
        hidden_size=32, head_dim=16, qk_rope_head_dim=4, num_attention_heads=2, q_lora_rank=16, index_head_dim=DIM,
        index_n_heads=HEADS, index_topk=topk, vocab_size=50, num_hidden_layers=2,
        compress_rates={"compressed_sparse_attention": RATIO, "heavily_compressed_attention": 8})
    indexer = modeling.DeepseekV4Indexer(config).double()
    for p in indexer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    hidden = torch.randn(1, seq_len, 32, dtype=torch.float64)
    q_residual = torch.randn(1, seq_len, 16, dtype=torch.float64)
    positions = torch.arange(seq_len)
    with torch.no_grad():
        want = indexer(hidden, q_residual, positions[None], None, 0)[0]  # [S, min(topk, N)]
        entries = compress_sequence(indexer.kv_proj(hidden[0]).float(), indexer.gate_proj(hidden[0]).float(),
                                    indexer.position_bias.float(), True)[0]
        entries = indexer.kv_norm(entries.double())[None]
        cos, sin = indexer.rotary_emb(entries, position_ids=(torch.arange(entries.shape[1]) * RATIO)[None],
                                      layer_type="compress")
        keys = modeling.apply_rotary_pos_emb(entries.unsqueeze(1), cos, sin)[0, 0]
        cos, sin = indexer.rotary_emb(hidden, position_ids=positions[None], layer_type="compress")
        q = indexer.q_b_proj(q_residual).view(1, seq_len, HEADS, DIM).transpose(1, 2)
        q = modeling.apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)[0]
        weights = indexer.scorer.weights_proj(hidden[0]) * HEADS**-0.5 * DIM**-0.5
        got = compressed_indexer_topk(q.float().contiguous(), weights.float(), keys.float().contiguous(), positions,
                                      RATIO, topk)
        scores = indexer.scorer(q[None], keys[None], hidden)[0]  # transformers' [S, N] scores
    assert got.shape == (seq_len, topk) and got.dtype == torch.int32
    for t in range(seq_len):  # ReLU makes exact-zero ties common: the selected scores must agree, ties to lower ids
        picked = [i for i in got[t].tolist() if i >= 0]
        expected = [i for i in want[t].tolist() if i >= 0]
        assert len(picked) == len(expected) and all(i < (t + 1) // RATIO for i in picked), f"seed {SEED}, query {t}"
        torch.testing.assert_close(scores[t, picked].sort().values, scores[t, expected].sort().values,
                                   msg=f"seed {SEED}, query {t}")


def test_ranges_are_windows_closed_by_each_position():
    starts, ends = compressed_ranges(torch.tensor([0, 2, 3, 4, 7, 8, 100]), 4, num_entries=2)
    assert starts.tolist() == [0] * 7 and ends.tolist() == [0, 0, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="ratio"):
        compressed_ranges(torch.tensor([1]), 0, 3)


def test_no_entries_yet_gives_all_minus_one():
    q, weights = torch.randn(3, HEADS, DIM), torch.rand(3, HEADS)
    got = compressed_indexer_topk(q, weights, torch.randn(0, DIM), torch.arange(3), RATIO, 8)
    assert (got == -1).all() and got.shape == (3, 8)


def test_fp8_path_with_compressed_ranges_stays_causal_and_recalls_the_reference_selection():
    """Production path: FP8 q and keys (Hadamard-rotated, power-of-two scales) through the fused
    score + top-k with the compressed ranges."""
    g = torch.Generator().manual_seed(SEED)
    num_q, heads, entries, topk = 64, 8, 50, 16
    q, keys = torch.randn(num_q, heads, 128, generator=g), torch.randn(entries, 128, generator=g)
    weights = torch.rand(num_q, heads, generator=g)
    positions = torch.randint(0, 4 * entries + 8, (num_q,), generator=g)
    want = compressed_indexer_topk(q, weights, keys, positions, RATIO, topk)
    q_fp8, q_scale = quantize_indexer(hadamard_transform(q))
    k_fp8, k_scale = quantize_indexer(hadamard_transform(keys))
    starts, ends = compressed_ranges(positions, RATIO, entries)
    got = indexer_fused_topk(q_fp8, weights * q_scale, k_fp8, k_scale, starts, ends, topk)
    hits = total = 0
    for t in range(num_q):
        picked, expected = set(got[t].tolist()) - {-1}, set(want[t].tolist()) - {-1}
        assert len(picked) == len(expected) == min(topk, int(ends[t])) and all(i < ends[t] for i in picked)
        hits, total = hits + len(picked & expected), total + len(expected)
    assert hits >= 0.9 * total, f"seed {SEED}: recall {hits / total:.2f}"
