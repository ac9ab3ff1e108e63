"""DeepSeek-V4 sparse attention (Triton) at V4 shapes, with FlashMLA's MODEL1 kernels side by side.

Decode: b = 1..128 requests, s_q = 1 (and 2 for MTP), h_q = 64 (V4-Flash) and 128 (V4-Pro), each
query attending to topk = 512 CSA entries (distinct slots, uniform over a 64K-token context = 16K
compressed entries in the 584 B/token FP8 MODEL1 cache) plus its 128-token sliding window (an
extra cache), with per-head sinks and per-request top-k lengths (all full). Prefill: s_q = 4096
bf16 queries over 16K bf16 compressed entries, topk 512 (FlashMLA's sparse prefill takes no extra
set, so the window is left out on both sides there). FLOPs per query token:
2 * h_q * keys * (512 + 512). When ``flash_mla`` can be built (``../shared/anchors/flashmla``, see
its README), each row also times FlashMLA on the same inputs and reports the ratio and the largest
output difference.

    python3 benchmarks/bench_v4_attention.py [--output BENCHMARKS.md] [--no-flashmla]
"""

from __future__ import annotations

from typing import Optional

import torch
from tqdm import tqdm

from benchmarks.common import Row, graph_ms, input_sets_for, median_ms, parse_with_flashmla, report
from flashdsa.runtime.cache.layout_v4 import V4_TOKEN_BYTES
from flashdsa.runtime.kernels import sparse_attention_v4_decode, sparse_attention_v4_prefill

D, TOPK, WINDOW, BLOCK = 512, 512, 128, 64
ENTRIES = 16384  # CSA entries of a 64K-token context
PREFILL_S_Q = 4096
DECODE_FLOOR = 200.0  # TFLOPS: no V4 target is set yet; the V3.2 decode kernel's measured rate
PREFILL_FLOOR = 250.0


def random_pool(num_tokens: int, device) -> torch.Tensor:
    """A MODEL1 pool of random uint8 tokens with sane scales (exponent bytes 120..127)."""
    blocks = -(-num_tokens // BLOCK)
    pool = torch.randint(0, 256, (blocks, BLOCK, 1, V4_TOKEN_BYTES), dtype=torch.uint8, device=device)
    flat = pool.view(blocks, BLOCK * V4_TOKEN_BYTES)
    data = flat[:, : BLOCK * 576].view(blocks, BLOCK, 576)
    data[..., :448] &= 0xBF  # e4m3 magnitudes < 2 (no NaN bytes)
    data[..., 448:].view(torch.bfloat16).normal_(0, 0.1)
    flat[:, BLOCK * 576 :] = torch.randint(120, 128, (blocks, BLOCK * 8), dtype=torch.uint8, device=device)
    return pool


def distinct(rows: int, topk: int, n: int, device) -> torch.Tensor:
    return torch.rand(rows, n, device=device).topk(topk, dim=-1).indices.to(torch.int32)


def decode_inputs(b: int, s_q: int, h_q: int, device) -> dict:
    window_pool = random_pool(b * WINDOW, device)
    window = torch.arange(b * WINDOW, device=device, dtype=torch.int32).view(b, 1, WINDOW).expand(b, s_q, WINDOW)
    return dict(
        q=torch.randn(b, s_q, h_q, D, device=device, dtype=torch.bfloat16) / 10, kv_cache=random_pool(ENTRIES, device),
        indices=distinct(b * s_q, TOPK, ENTRIES, device).view(b, s_q, TOPK), sm_scale=D**-0.5,
        topk_length=torch.full((b,), TOPK, dtype=torch.int32, device=device),
        attn_sink=torch.randn(h_q, device=device), extra_kv_cache=window_pool, extra_indices=window.contiguous(),
        extra_topk_length=torch.full((b,), WINDOW, dtype=torch.int32, device=device))


def flashmla_decode(fm, inputs: dict):
    meta = fm.get_mla_metadata()[0]
    return lambda: fm.flash_mla_with_kvcache(
        inputs["q"], inputs["kv_cache"], None, None, D, meta, softmax_scale=inputs["sm_scale"], is_fp8_kvcache=True,
        indices=inputs["indices"], attn_sink=inputs["attn_sink"], extra_k_cache=inputs["extra_kv_cache"],
        extra_indices_in_kvcache=inputs["extra_indices"], topk_length=inputs["topk_length"],
        extra_topk_length=inputs["extra_topk_length"])


def prefill_inputs(h_q: int, device) -> dict:
    return dict(q=torch.randn(PREFILL_S_Q, h_q, D, device=device, dtype=torch.bfloat16) / 10,
                kv=torch.randn(ENTRIES, 1, D, device=device, dtype=torch.bfloat16) / 10,
                indices=distinct(PREFILL_S_Q, TOPK, ENTRIES, device).view(PREFILL_S_Q, 1, TOPK), sm_scale=D**-0.5,
                attn_sink=torch.randn(h_q, device=device))


def flashmla_prefill(fm, inputs: dict):
    return lambda: fm.flash_mla_sparse_fwd(inputs["q"], inputs["kv"], inputs["indices"], inputs["sm_scale"], D,
                                           attn_sink=inputs["attn_sink"])


def measure(name: str, shape: str, sets: list[dict], ours, theirs, fm, flops: float, floor: float,
            timer=median_ms) -> Row:
    """Time ``ours(**set)`` (and FlashMLA's ``theirs(fm, set)``) over the rotated sets with ``timer``
    (decode: ``graph_ms``, back to back from a CUDA graph as a decode step runs them, since an eager
    call of a few microseconds of work measures Python's launch cost)."""
    ms = timer([lambda s=s: ours(**s) for s in sets])
    note = ""
    if fm is not None:
        calls = [theirs(fm, s) for s in sets]
        their_ms = timer(calls)
        diff = (ours(**sets[0])[0].float() - calls[0]()[0].float()).abs().max().item()
        note = (f"FlashMLA {their_ms:.3f} ms ({flops / their_ms / 1e9:.0f} TFLOPS), ratio {their_ms / ms:.2f}x, "
                f"max |out diff| {diff:.1e}")
    return Row(name, shape, ms, flops / ms / 1e9, "TFLOPS", floor, note)


def main(argv: Optional[list[str]] = None) -> None:
    args, fm = parse_with_flashmla(__doc__, argv)
    device = torch.device("cuda")
    rows = []
    cases = [(b, s_q, h_q) for h_q in (64, 128) for b in (1, 4, 16, 64, 128) for s_q in (1, 2)]
    for b, s_q, h_q in tqdm(cases, desc="decode"):
        per_set = b * s_q * TOPK * 4 + ENTRIES * V4_TOKEN_BYTES
        sets = [decode_inputs(b, s_q, h_q, device) for _ in range(input_sets_for(per_set, at_most=4))]
        flops = 2 * h_q * (TOPK + WINDOW) * 2 * D * b * s_q
        shape = f"b={b} s_q={s_q} h_q={h_q} topk={TOPK}+{WINDOW}"
        rows.append(measure("v4 decode (FP8 MODEL1 + window + sinks)", shape, sets, sparse_attention_v4_decode,
                            flashmla_decode, fm, flops, DECODE_FLOOR, timer=graph_ms))
    for h_q in tqdm((64, 128), desc="prefill"):
        sets = [prefill_inputs(h_q, device) for _ in range(2)]
        flops = 2 * h_q * TOPK * 2 * D * PREFILL_S_Q
        rows.append(measure("v4 prefill (bf16 + sinks)", f"s_q={PREFILL_S_Q} h_q={h_q} s_kv={ENTRIES} topk={TOPK}",
                            sets, sparse_attention_v4_prefill, flashmla_prefill, fm, flops, PREFILL_FLOOR))
    report("DeepSeek-V4 sparse attention", rows, args.output)


if __name__ == "__main__":
    main()
