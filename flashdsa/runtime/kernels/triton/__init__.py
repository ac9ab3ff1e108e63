"""Triton kernels for sparse MLA attention (Hopper and Blackwell; run under TRITON_INTERPRET=1 on CPU).

Modules are imported lazily by the dispatcher: ``sparse_fwd.sparse_mla_fwd`` and
``sparse_bwd.sparse_mla_bwd``; ``_gather`` holds what both share.
"""
