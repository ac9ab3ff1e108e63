"""Triton kernels for sparse MLA attention (Hopper and Blackwell; run under TRITON_INTERPRET=1 on CPU).

Modules are imported lazily by the dispatcher: ``sparse_fwd.sparse_mla_fwd`` and
``sparse_bwd.sparse_mla_bwd`` (bf16 kv; ``_gather`` holds what they share) and
``sparse_decode.sparse_mla_decode`` (FP8 paged cache).
"""
