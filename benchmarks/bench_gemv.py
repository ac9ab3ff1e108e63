"""Native FP8 decode GEMV (``gemm/cuda/gemv.cu``) against the Triton ``fp8_linear`` at decode sizes.

For each FP8 linear of DeepSeek-V4-Flash (the grouped output projection included) and V3.2 and
M in {1, 2, 4} tokens: device time of one call replayed from a CUDA graph (as decode runs it),
bf16 activations, power-of-two activation scales, the weights rotated through sets that together
exceed the L2 three times and all replayed in one graph, so every call reads its weight from
memory. Rate: GB/s (weights + scales + activations read, output written); target: 80% of the
device copy bandwidth measured in the same run. The note gives the share of the copy bandwidth,
the Triton path's time (``runtime.gemm.fp8_linear(backend="triton")``: quantize + GEMM (+ split
sum), or the one-launch kernel; the grouped shape in one launch) and the speedup, and the largest
difference between the two outputs.

    python3 -m benchmarks.bench_gemv [--shapes "v4 q_a,v3.2 wk"] [--m 1,2,4] [--output BENCHMARKS.md]
"""

from __future__ import annotations

import logging

import torch
from tqdm import tqdm

from benchmarks.bench_decode_indexer import copy_bandwidth, fp8_bytes
from benchmarks.common import L2_BYTES, Row, graph_ms, output_parser, report
from flashdsa.runtime.gemm import GROUP, fp8_linear

SHAPES = {  # name: (N, K, groups) of the FP8 linears at decode
    "v4 q_a": (1024, 4096, 1), "v4 q_b": (32768, 1024, 1), "v4 kv": (512, 4096, 1),
    "v4 index_q_b": (8192, 1024, 1), "v4 o_a": (1024, 4096, 8), "v4 o_b": (4096, 8192, 1),
    "v4 shared_gate_up": (4096, 4096, 1), "v4 shared_down": (4096, 2048, 1),
    "v3.2 q_a": (1536, 7168, 1), "v3.2 q_b": (24576, 1536, 1), "v3.2 kv_a": (576, 7168, 1),
    "v3.2 o_proj": (7168, 16384, 1), "v3.2 wk": (128, 7168, 1),
}
MS = (1, 2, 4)
COPY_SHARE = 0.8
MAX_SETS = 256

log = logging.getLogger("bench_gemv")


def blocks(n: int) -> int:
    return -(-n // GROUP)


def make_sets(m: int, n: int, k: int, groups: int, device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(x bf16 [m, groups*k], w e4m3 [groups*n, k], w_scale) sets whose weights together exceed the
    L2 three times."""
    rows = groups * n
    count = max(2, min(MAX_SETS, -(-3 * L2_BYTES // (rows * k))))
    return [(torch.randn(m, groups * k, device=device, dtype=torch.bfloat16),
             fp8_bytes((rows, k), device).view(torch.float8_e4m3fn),
             torch.rand(blocks(rows), k // GROUP, device=device) * 1e-2 + 1e-3) for _ in range(count)]


def bytes_moved(m: int, n: int, k: int, groups: int) -> int:
    rows = groups * n
    return rows * k + 4 * blocks(rows) * (k // GROUP) + 2 * m * groups * k + 2 * m * rows


def bench(name: str, m: int, device, copy_gbs: float) -> Row:
    from flashdsa.runtime.gemm.cuda.gemv import fp8_gemv

    n, k, groups = SHAPES[name]
    sets = make_sets(m, n, k, groups, device)
    native = [lambda s=s: fp8_gemv(*s, groups, True) for s in sets]
    triton = [lambda s=s: fp8_linear(*s, groups=groups, pow2_scales=True, backend="triton") for s in sets]
    ours, theirs = native[0]().float(), triton[0]().float()
    diff = ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30)).item()
    native_ms = graph_ms(native, per_graph=max(16, len(sets)))
    triton_ms = graph_ms(triton, per_graph=max(16, len(sets)))
    gbs = bytes_moved(m, n, k, groups) / native_ms / 1e6
    triton_gbs = bytes_moved(m, n, k, groups) / triton_ms / 1e6
    note = (f"{100 * gbs / copy_gbs:.0f}% of copy; {native_ms * 1e3:.1f} us vs triton fp8_linear "
            f"{triton_ms * 1e3:.1f} us ({triton_gbs:.0f} GB/s, {100 * triton_gbs / copy_gbs:.0f}% of copy): "
            f"{triton_ms / native_ms:.2f}x; max |diff| {diff:.1e} of max |y|")
    shape = f"{name} N={n} K={k}" + (f" groups={groups}" if groups > 1 else "") + f" M={m}"
    return Row("fp8_gemv cuda", shape, native_ms, gbs, "GB/s", COPY_SHARE * copy_gbs, note)


def main(argv: list[str] | None = None) -> None:
    parser = output_parser(__doc__)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shape names")
    parser.add_argument("--m", default=",".join(map(str, MS)), help="comma-separated token counts (1..4)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    device = torch.device("cuda")
    copy_gbs = copy_bandwidth(device)
    rows = [Row("device copy", "2 GiB", 0.0, copy_gbs, "GB/s", copy_gbs, "read + write")]
    for name in tqdm(args.shapes.split(","), desc="shapes"):
        for m in map(int, args.m.split(",")):
            try:
                rows.append(bench(name, m, device, copy_gbs))
                print(rows[-1])
            except Exception as e:  # one failing shape must not hide the other figures
                log.exception("%s M=%d failed: %s", name, m, e)
        torch.cuda.empty_cache()
    report("Native FP8 decode GEMV vs Triton fp8_linear (rate: GB/s; target: 80% of copy)", rows, args.output)


if __name__ == "__main__":
    main()
