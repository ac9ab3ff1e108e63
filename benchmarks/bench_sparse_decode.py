"""Sparse MLA decode over the FP8 cache, backend by backend: triton, cuda (native SM90) and FlashMLA.

Issue 13's decode shapes: h_q 128 at b=128 s_q=2, b=128 s_q=1, b=64 s_q=1 and b=4 s_q=1 (split over
the top-k), and h_q 64 at b=128 s_q=2 and b=4 s_q=1; topk 2048 over 32K tokens per request, slot
ids uniform over each request's context. Each call runs back to back from a CUDA graph (as a decode
step replays it), cycling through input sets. FLOPs 2*h_q*topk*(576+512) per query row. Each
row's note gives the ratio to FlashMLA (when ``flash_mla`` builds from ``.device/flashmla``, see
``common.load_flashmla``) and the largest |out| difference to FlashMLA and to triton.

    python3 -m benchmarks.bench_sparse_decode [--output BENCHMARKS.md] [--no-flashmla]
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
from tqdm import tqdm

from benchmarks.bench_decode_indexer import decode_inputs
from benchmarks.common import Row, graph_ms, input_sets_for, parse_with_flashmla, report, side_by_side_rows
from flashdsa.runtime.kernels import sparse_mla_decode

log = logging.getLogger("bench_sparse_decode")
SHAPES = [(128, 2, 128), (128, 1, 128), (64, 1, 128), (4, 1, 128), (128, 2, 64), (4, 1, 64)]  # (b, s_q, h_q)
TOPK, S_KV = 2048, 32768
SM_SCALE = 576**-0.5
FLASHMLA_TFLOPS = 400.0  # the rate to match: FlashMLA's 406-409 TFLOPS at b=128 on an H200 (issue 13)
BACKENDS = ("triton", "cuda")

Call = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def flashmla_call(fm, pool: torch.Tensor) -> Call:
    meta = fm.get_mla_metadata()[0]
    return lambda q, slots: fm.flash_mla_with_kvcache(q, pool, None, None, 512, meta, softmax_scale=SM_SCALE,
                                                      is_fp8_kvcache=True, indices=slots)


def backend_call(backend: str, pool: torch.Tensor) -> Call:
    return lambda q, slots: sparse_mla_decode(q, pool, slots, SM_SCALE, backend=backend)


def bench_shape(device, b: int, s_q: int, h_q: int, fm) -> list[Row]:
    per_set = b * s_q * TOPK * 656
    pool, sets = decode_inputs(device, b, s_q, h_q, TOPK, S_KV, sets=input_sets_for(per_set, at_most=6))
    flops = b * s_q * 2 * h_q * TOPK * (576 + 512)
    shape = f"b={b} s_q={s_q} h_q={h_q} topk={TOPK} s_kv={S_KV // 1024}K"
    calls = {name: backend_call(name, pool) for name in BACKENDS}
    if fm is not None:
        calls["FlashMLA"] = flashmla_call(fm, pool)
    times, outs = {}, {}
    for name, call in calls.items():
        try:
            times[name] = graph_ms([lambda s=s, call=call: call(*s) for s in sets])
            outs[name] = call(*sets[0])[0].float()
        except Exception as e:  # one failing backend must not hide the others
            log.warning("%s at %s failed: %s", name, shape, str(e).splitlines()[0][:300])

    def differences(name: str) -> list[str]:
        return [f"max |out - {other}| {(outs[name] - outs[other]).abs().max().item():.1e}"
                for other in ("FlashMLA", "triton") if other in outs and other != name]

    return side_by_side_rows("sparse_mla_decode", shape, times, differences, flops, FLASHMLA_TFLOPS)


def main(argv: Optional[list[str]] = None) -> None:
    args, fm = parse_with_flashmla(__doc__, argv)
    device = torch.device("cuda")
    rows = []
    for b, s_q, h_q in tqdm(SHAPES, desc="sparse decode"):
        rows += bench_shape(device, b, s_q, h_q, fm)
        torch.cuda.empty_cache()
    report("Sparse MLA decode over the FP8 cache: triton, cuda, FlashMLA", rows, args.output)


if __name__ == "__main__":
    main()
