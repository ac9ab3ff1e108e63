"""Triton sparse decode over the FP8 cache, FP8 indexer (decode and prefill), top-k, cache writes.

- decode: b=128, s_q=2, h_q=128, topk=2048, s_kv=32K per request, slot ids uniform over each
  request's context; FLOPs 2*h_q*topk*(d_qk+d_v) per query token; floor 200 TFLOPS. A sweep of
  (keys per step, warps, stages) with each variant's registers, spills and shared memory.
- indexer decode: b=64, context 128K, H=64: paged logits (a sweep of the Triton kernel's launch
  and the native kernel's blocks per CTA) + top-2048 of the fastest (the public top-k: native on
  SM90), GB/s of indexer cache read (132 B/token) vs 50% of the copy bandwidth measured in the
  same run (bytes read + written) for the logits alone, 80% for both; the top-k and the pair are
  timed from a CUDA graph, as a decode step replays them (no host launch gaps).
- indexer prefill: 4096 queries over 64K keys (causal ranges): logits (FP8 TFLOPS over the
  in-range pairs) and the fused score + top-2048.
- top-k 2048 of 128K per row, 128 rows, vs torch.topk (floor 3x).
- cache writes: 16K tokens; and the prefill's read of 256 whole blocks (16K tokens) of the FP8
  MLA cache as bf16 rows (``cache.dequantize_mla_blocks``), GB/s of bytes read + written.

    python3 benchmarks/bench_decode_indexer.py [--output BENCHMARKS.md]
"""

from __future__ import annotations

import logging

import torch
from tqdm import tqdm

from benchmarks.common import Row, cache_keys, compiled_stats, graph_ms, kernel_split, median_ms, output_parser, report
from flashdsa.runtime import dispatch, native
from flashdsa.runtime.cache import dequantize_mla_blocks
from flashdsa.runtime.cache.triton import writes
from flashdsa.runtime.checks import trusted_values
from flashdsa.runtime.indexer import indexer_fused_topk, indexer_topk
from flashdsa.runtime.indexer.triton import logits, topk
from flashdsa.runtime.kernels.triton import sparse_decode

log = logging.getLogger("bench_decode_indexer")
BS = 64  # cache block size
DECODE = dict(b=128, s_q=2, h_q=128, topk=2048, s_kv=32768)
DECODE_FLOOR = 200.0
DECODE_CONFIGS = [  # (keys per step, warps, stages, q reloaded each step, d_v split over two launches,
    #                   keys prescaled to bf16, slot ids prefetched a step ahead); the first is the default
    (64, 8, 3, False, False, True, True), (64, 8, 2, False, False, True, True), (64, 8, 3, False, False, True, False),
    (32, 8, 4, False, False, True, True), (64, 8, 2, False, False, False, False), (64, 8, 2, False, True, False, False),
]
SMALL_BATCH_CONFIGS = [  # split over the top-k with a combine
    (64, 8, 3, False, False, True, True), (64, 8, 2, False, False, True, True), (64, 8, 2, False, False, True, False),
    (64, 8, 1, False, False, True, False), (64, 8, 2, False, False, False, False),
]
INDEXER_B, INDEXER_CTX, INDEXER_H, TOPK = 64, 131072, 64, 2048
PAGED_CONFIGS = [  # (tokens per step, steps per program, warps, stages, heads on the dot's N); None: the default
    (None, None, 4, 3, True), (64, 16, 4, 3, False), (128, 8, 4, 3, False), (64, 16, 4, 3, True), (128, 8, 4, 3, True),
    (128, 8, 8, 3, True), (256, 4, 8, 2, True),
]
CUDA_BLOCKS_PER_CTA = (4, 8, 16, 32)  # the native paged logits' launch sweep
PREFILL_Q, PREFILL_KEYS = 4096, 65536
TOPK_CONFIGS = [  # (columns per program of the histogram/collect passes, None: ~16 programs per SM; warps; block)
    (None, 8, 2048), (None, 4, 1024), (2048, 4, 1024), (4096, 8, 2048), (16384, 8, 2048),
]


def copy_bandwidth(device) -> float:
    """GB/s of a 2 GiB device-to-device copy, bytes read plus bytes written."""
    src = torch.empty(1 << 29, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = median_ms([lambda: dst.copy_(src)], iters=20)
    return 2 * src.numel() * 4 / ms / 1e6


def fp8_bytes(shape, device) -> torch.Tensor:
    """Random e4m3 bytes without NaN codes (0x7F / 0xFF)."""
    b = torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
    return torch.where((b & 0x7F) == 0x7F, b ^ 1, b)


def block_table(batch: int, blocks: int, device) -> torch.Tensor:
    return torch.randperm(batch * blocks, device=device).view(batch, blocks).to(torch.int32)


def decode_inputs(device, b, s_q, h_q, topk, s_kv, sets=2) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """An FP8 pool of ``b`` contexts of ``s_kv`` random tokens and ``sets`` input sets (q [b, s_q, h_q, 576]
    bf16 N(0, 1/100), slot ids [b, s_q, topk] uniform over each request's context)."""
    blocks = s_kv // BS
    pool = fp8_bytes((b * blocks, BS, 1, 656), device)
    pool.view(torch.float32)[..., 128:132].uniform_(1e-3, 1e-2)  # tile scales
    pool.view(torch.bfloat16)[..., 264:].normal_()  # k_pe
    inputs = []
    for _ in range(sets):
        table = block_table(b, blocks, device)
        pos = torch.randint(0, s_kv, (b, s_q, topk), device=device)
        slots = (table.long().gather(1, (pos // BS).view(b, -1)).view(b, s_q, topk) * BS + pos % BS).to(torch.int32)
        inputs.append((torch.randn(b, s_q, h_q, 576, device=device, dtype=torch.bfloat16) / 10, slots))
    return pool, inputs


def bench_decode(device, b, s_q, h_q, topk, s_kv, configs=DECODE_CONFIGS) -> list[Row]:
    pool, sets = decode_inputs(device, b, s_q, h_q, topk, s_kv)
    flops = b * s_q * 2 * h_q * topk * (576 + 512)
    shape = f"b={b} s_q={s_q} h_q={h_q} topk={topk} s_kv={s_kv // 1024}K"
    rows = []
    for block_n, warps, stages, q_in_loop, split_dv, prescaled, prefetch in tqdm(configs, desc=f"decode {shape}"):
        config = sparse_decode.DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages, q_in_loop=q_in_loop,
                                            split_dv=split_dv, prescaled_keys=prescaled, prefetch_slots=prefetch)
        before = cache_keys(sparse_decode._decode_partial_kernel)
        calls = [lambda s=s: sparse_decode.sparse_mla_decode(s[0], pool, s[1], 576**-0.5, 512, config=config)
                 for s in sets]
        try:
            ms = median_ms(calls, iters=20)
        except Exception as e:  # e.g. out of shared memory: report and go on
            log.warning("decode %s failed: %s", config, str(e).splitlines()[0][:200])
            continue
        note = (f"N={block_n} w={warps} st={stages} q_in_loop={q_in_loop} split_dv={split_dv} "
                f"prescaled={prescaled} prefetch={prefetch}: "
                f"{compiled_stats(sparse_decode._decode_partial_kernel, before)}")
        rows.append(Row("sparse_mla_decode triton", shape, ms, flops / ms / 1e9, "TFLOPS", DECODE_FLOOR, note))
        print(rows[-1])
    return rows


def bench_indexer_decode(device, copy_gbs) -> list[Row]:
    blocks = INDEXER_CTX // BS
    pool = fp8_bytes((INDEXER_B * blocks, BS, 1, 132), device)
    scales = pool.view(INDEXER_B * blocks, -1)[:, BS * 128:].view(torch.float32)
    scales.copy_(torch.exp2(torch.randint(-10, -4, scales.shape, device=device).float()))
    table = block_table(INDEXER_B, blocks, device)
    lens = torch.full((INDEXER_B,), INDEXER_CTX, dtype=torch.int32, device=device)
    q = fp8_bytes((INDEXER_B, 1, INDEXER_H, 128), device).view(torch.float8_e4m3fn)
    w = torch.randn(INDEXER_B, INDEXER_H, device=device)
    read = INDEXER_B * INDEXER_CTX * 132
    target = 0.5 * copy_gbs
    shape = f"b={INDEXER_B} ctx={INDEXER_CTX // 1024}K H={INDEXER_H}"
    variants = {}  # label -> the call of one logits launch
    for tokens, steps, warps, stages, heads_on_n in PAGED_CONFIGS:
        knobs = dict(tokens_per_step=tokens, steps=steps, num_warps=warps, num_stages=stages, heads_on_n=heads_on_n)
        variants[f"triton tokens={tokens} steps={steps} w={warps} st={stages} heads_on_n={heads_on_n}"] = (
            lambda knobs=knobs: logits.indexer_logits_paged(q, w, pool, lens, table, INDEXER_CTX, **knobs))
    if "cuda" in dispatch.available("indexer_logits_paged") and native.unavailable() is None:
        from flashdsa.runtime.indexer.cuda import paged_logits

        for per_cta in CUDA_BLOCKS_PER_CTA:
            variants[f"cuda blocks_per_cta={per_cta}"] = (
                lambda per_cta=per_cta: paged_logits.indexer_logits_paged(q, w, pool, lens, table, INDEXER_CTX,
                                                                          blocks_per_cta=per_cta))
    rows, times = [], {}
    for label, call in variants.items():
        times[label] = median_ms([call])
        rows.append(Row("indexer logits paged", shape, times[label], read / times[label] / 1e6, "GB/s", target, label))
        print(rows[-1])
    best = min(times, key=times.get)
    scores = variants[best]()
    starts = torch.zeros(INDEXER_B, dtype=torch.int32, device=device)
    ends = torch.full_like(starts, INDEXER_CTX)
    backend = dispatch.choose("indexer_topk", device, topk=TOPK)
    with trusted_values():  # as in the engine: the ranges are not read back
        ms_topk = graph_ms([lambda: indexer_topk(scores, TOPK, starts, ends, sorted=False)])
        rows.append(Row("indexer top-k (decode rows)", shape + f" topk={TOPK}", ms_topk, read / ms_topk / 1e6, "GB/s",
                        target, f"top-k alone ({backend}, unsorted, CUDA graph), rate in cache bytes"))

        def both():
            return indexer_topk(variants[best](), TOPK, starts, ends, sorted=False)

        ms = graph_ms([both])
    rows.append(Row("indexer logits + top-k decode", shape + f" topk={TOPK}", ms, read / ms / 1e6, "GB/s",
                    0.8 * copy_gbs, f"{100 * read / ms / 1e6 / copy_gbs:.0f}% of copy {copy_gbs:.0f} GB/s (target "
                    f"80%); in a CUDA graph as decode runs it; top-k {backend}; logits {best}"))
    print(rows[-1])
    return rows


def bench_indexer_prefill(device) -> list[Row]:
    q = fp8_bytes((PREFILL_Q, INDEXER_H, 128), device).view(torch.float8_e4m3fn)
    w = torch.randn(PREFILL_Q, INDEXER_H, device=device)
    k = fp8_bytes((PREFILL_KEYS, 128), device).view(torch.float8_e4m3fn)
    k_scale = torch.rand(PREFILL_KEYS, device=device)
    starts = torch.zeros(PREFILL_Q, dtype=torch.int32, device=device)
    ends = torch.arange(PREFILL_KEYS - PREFILL_Q + 1, PREFILL_KEYS + 1, dtype=torch.int32, device=device)
    pairs = ends.double().sum().item()
    flops = 2 * INDEXER_H * 128 * pairs
    shape = f"s_q={PREFILL_Q} keys={PREFILL_KEYS // 1024}K H={INDEXER_H} causal"
    ms = median_ms([lambda: logits.indexer_logits(q, w, k, k_scale, starts, ends)], iters=10)
    rows = [Row("indexer logits prefill", shape, ms, flops / ms / 1e9, "TFLOPS", 1.0, "report only (fp8 dots)")]
    ms = median_ms([lambda: topk.indexer_fused_topk(q, w, k, k_scale, starts, ends, TOPK, 4096)], warmup=1, iters=5)
    rows.append(Row("indexer fused score+top-k prefill", shape + f" topk={TOPK}", ms, flops / ms / 1e9, "TFLOPS",
                    1.0, "report only; triton, chunk 4096"))
    if "cuda" in dispatch.available("indexer_fused_topk") and native.unavailable() is None:
        with trusted_values():
            ms = median_ms([lambda: indexer_fused_topk(q, w, k, k_scale, starts, ends, TOPK, backend="cuda")],
                           warmup=1, iters=5)
        rows.append(Row("indexer fused score+top-k prefill", shape + f" topk={TOPK}", ms, flops / ms / 1e9,
                        "TFLOPS", 1.0, "report only; whole rows + native top-k"))
    for r in rows:
        print(r)
    return rows


def bench_topk(device) -> list[Row]:
    sets = [torch.randn(128, 131072, device=device) for _ in range(4)]
    starts = torch.zeros(128, dtype=torch.int32, device=device)
    ends = torch.full_like(starts, 131072)
    ms_torch = median_ms([lambda x=x: torch.topk(x, TOPK, dim=-1) for x in sets])
    rows = []
    for split, warps, block in TOPK_CONFIGS:
        knobs = dict(split=split, num_warps=warps, block=block)
        ms = median_ms([lambda x=x: topk.indexer_topk(x, TOPK, starts, ends, **knobs) for x in sets])
        rows.append(Row("indexer_topk triton", f"128 rows x 128K, topk={TOPK}", ms, ms_torch / ms, "x torch.topk", 3.0,
                        f"torch.topk {ms_torch:.3f} ms; split={split or 'auto'} w={warps} block={block}"))
        print(rows[-1])
    graph = torch.cuda.CUDAGraph()  # the same launches replayed: device time without Python launch overhead
    with torch.cuda.graph(graph):
        topk.indexer_topk(sets[0], TOPK, starts, ends)
    ms = median_ms([graph.replay])
    rows.append(Row("indexer_topk triton, CUDA graph", f"128 rows x 128K, topk={TOPK}", ms, ms_torch / ms,
                    "x torch.topk", 3.0, f"torch.topk {ms_torch:.3f} ms; replayed: {kernel_split(graph.replay, 6)}"))
    print(rows[-1])
    return rows


def bench_writes(device) -> list[Row]:
    tokens, blocks = 16384, 1024
    x = torch.randn(tokens, 576, device=device, dtype=torch.bfloat16)
    slots = torch.randperm(blocks * BS, device=device)[:tokens]
    mla = torch.zeros(blocks, BS, 1, 656, dtype=torch.uint8, device=device)
    idx = torch.zeros(blocks, BS, 1, 132, dtype=torch.uint8, device=device)
    block_ids = torch.randperm(blocks, device=device)[: tokens // BS].int()
    rows = []
    for name, call, moved in (
        ("write_mla_cache triton", lambda: writes.write_mla_cache(x[:, :512], x[:, 512:], mla, slots), 576 * 2 + 656),
        ("write_indexer_cache triton", lambda: writes.write_indexer_cache(x[:, :128], idx, slots), 128 * 2 + 132),
        ("dequantize_mla_blocks", lambda: dequantize_mla_blocks(mla, block_ids), 656 + 576 * 2),
    ):
        try:
            ms = median_ms([call])
        except Exception as e:  # report the others
            log.warning("%s failed: %s", name, str(e).splitlines()[0][:200])
            continue
        rows.append(Row(name, f"T={tokens}", ms, tokens * moved / ms / 1e6, "GB/s", 1.0, "report only"))
    return rows


def main(argv: list[str] | None = None) -> None:
    args = output_parser(__doc__).parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    device = torch.device("cuda")
    copy_gbs = copy_bandwidth(device)
    rows = [Row("device copy", "2 GiB", 0.0, copy_gbs, "GB/s", copy_gbs, "read + write")]
    steps = [lambda: bench_decode(device, **DECODE),
             lambda: bench_decode(device, 4, 1, 128, 2048, 32768, SMALL_BATCH_CONFIGS),
             lambda: bench_indexer_decode(device, copy_gbs), lambda: bench_topk(device),
             lambda: bench_indexer_prefill(device), lambda: bench_writes(device)]
    for step in tqdm(steps, desc="benchmarks"):
        try:
            rows += step()
        except Exception as e:  # one failing kernel must not hide the other figures
            log.exception("benchmark step failed: %s", e)
        torch.cuda.empty_cache()
    report("Sparse decode, FP8 indexer, top-k, cache writes (Triton)", rows, args.output)


if __name__ == "__main__":
    main()
