"""``flashdsa demo``: the DSA data path on random data, every available backend against the reference.

Runs the sparse prefill forward, the FP8 paged decode and the fused indexer top-k on one device
and prints, per op and backend, the error against the reference backend and the time taken.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from flashdsa.runtime import dispatch, indexer, kernels
from flashdsa.runtime.cache.layout import D_QK, KV_LORA_RANK
from flashdsa.testing import cosine_distance, random_block_table, random_indices, random_mla_cache, slots_from_positions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--s-q", type=int, default=64, help="query tokens (default 64)")
    parser.add_argument("--s-kv", type=int, default=4096, help="context length (default 4096)")
    parser.add_argument("--heads", type=int, default=16, help="query heads (default 16)")
    parser.add_argument("--topk", type=int, default=256, help="selected tokens per query (default 256)")
    parser.add_argument("--seed", type=int, default=0)


def _timed(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    fn()  # warm-up (compiles Triton kernels)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, (time.perf_counter() - start) * 1e3


def _cases(args: argparse.Namespace, device: torch.device) -> dict[str, Callable[[str], torch.Tensor]]:
    """op name -> run(backend) returning the tensor compared across backends."""
    s_q, s_kv, h, topk = args.s_q, args.s_kv, args.heads, args.topk
    scale = D_QK ** -0.5
    q = torch.randn(s_q, h, D_QK, device=device).bfloat16()
    kv = torch.randn(s_kv, 1, D_QK, device=device).bfloat16()
    idx = random_indices((s_q, 1, topk), s_kv, invalid=0.1, device=device)
    blocks = -(-s_kv // 64)
    cache = random_mla_cache(2 * blocks, device=device)
    table = random_block_table(1, blocks, 2 * blocks, device=device)
    slot_idx = slots_from_positions(idx.view(1, s_q, topk), table)
    q_idx, q_scale = indexer.quantize_indexer(torch.randn(s_q, 8, 128, device=device))
    k_idx, k_scale = indexer.quantize_indexer(torch.randn(s_kv, 128, device=device))
    weights = torch.randn(s_q, 8, device=device) * q_scale
    ends = torch.arange(s_kv - s_q + 1, s_kv + 1, device=device, dtype=torch.int32)
    starts = torch.zeros_like(ends)
    return {
        "sparse_mla_fwd": lambda b: kernels.sparse_mla_fwd(q, kv, idx, scale, KV_LORA_RANK, backend=b)[0],
        "sparse_mla_decode": lambda b: kernels.sparse_mla_decode(
            q.unsqueeze(0), cache, slot_idx, scale, KV_LORA_RANK, backend=b)[0],
        "indexer_fused_topk": lambda b: indexer.indexer_fused_topk(
            q_idx, weights, k_idx, k_scale, starts, ends, topk, backend=b),
    }


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    print(f"{'op':<20} {'backend':<10} {'ms':>9}  agreement with reference")
    for op, fn in _cases(args, device).items():
        ref, _ = _timed(lambda: fn("reference"), device)
        for backend in dispatch.available(op):
            try:
                got, ms = _timed(lambda: fn(backend), device)
            except ValueError as e:  # backend cannot serve this device or shape
                print(f"{op:<20} {backend:<10} {'-':>9}  unavailable: {e}")
                continue
            if got.dtype == torch.int32:  # top-k: set recall
                hits = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(got, ref))
                agreement = f"top-k recall {hits / max(ref.numel(), 1):.4f}"
            else:
                agreement = f"cosine distance {cosine_distance(got, ref):.2e}"
            print(f"{op:<20} {backend:<10} {ms:9.3f}  {agreement}")
    return 0
