"""The tiny model config of the training tests, importable by name from each test module
(``conftest`` is not: tests/models has a conftest too, and only one can own that module name)."""

from __future__ import annotations

from flashdsa.models.config import DeepseekV32Config


def tiny_config(vocab_size: int, index_topk: int = 8) -> DeepseekV32Config:
    """Two layers (one dense MLP, one MoE), every width small; topk below the test sequence length."""
    return DeepseekV32Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=32, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, index_n_heads=4, index_head_dim=16, index_topk=index_topk,
        max_position_embeddings=256, eos_token_id=1,
    )
