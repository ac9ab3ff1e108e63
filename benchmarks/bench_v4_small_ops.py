"""DeepSeek-V4 decode's small ops, torch against fused Triton: one mHC site and one compressor step.

mHC site (``runtime.hyper``): ``hc_pre`` then ``hc_post`` at V4-Flash widths (hidden 4096,
hc_mult 4, 20 Sinkhorn iterations, bf16 streams), T = 1, 32, 128 tokens; the block between them
is left out (its output ``y`` is an input). Compressor decode step (``runtime.compressor``) on the
engine's state pool (state_slots, as the model calls it): CSA (ratio 4, 2 x 512 channels) and HCA
(ratio 128, 512 channels) at batch 1 and 32, one token per sequence at positions that close no
window (the common step; the fused kernel then writes one row, the torch path rewrites the whole
state). Graph-timed (``graph_ms``: back-to-back replays, no launch cost, weights rotated out of
L2). The rate is the bytes each op must move (weights, streams in and out; the compressor's token
rows) over the time; the target the measured device copy bandwidth.

    python3 benchmarks/bench_v4_small_ops.py [--output BENCHMARKS.md]
"""

from __future__ import annotations

import functools

import torch

from benchmarks.bench_decode_indexer import copy_bandwidth
from benchmarks.common import Row, graph_ms, input_sets_for, output_parser, report
from flashdsa.runtime.compressor import compress_decode_step, new_state
from flashdsa.runtime.hyper import hc_post, hc_pre

HIDDEN, HC_MULT, ITERS, EPS = 4096, 4, 20, 1e-6
TOKENS = (1, 32, 128)
COMPRESSORS = (("CSA", True, 4, 1024), ("HCA", False, 128, 512))  # name, overlap, ratio, channels
BATCHES = (1, 32)
SLOTS = 64  # the pool's state slots (the batch takes every other)


def mhc_site(tokens: int, backend: str, device) -> tuple[list, int]:
    """Calls of one mHC site (pre + post) over rotated input sets, and the bytes one call must move."""
    width = (2 + HC_MULT) * HC_MULT
    stream_bytes = tokens * HC_MULT * HIDDEN * 2
    weight_bytes = width * HC_MULT * HIDDEN * 4
    sets = input_sets_for(stream_bytes + weight_bytes)
    calls = []
    for _ in range(sets):
        h = torch.randn(tokens, HC_MULT, HIDDEN, device=device).bfloat16()
        fn = torch.randn(width, HC_MULT * HIDDEN, device=device) * (HC_MULT * HIDDEN) ** -0.5
        base, scale = torch.randn(width, device=device), torch.ones(3, device=device)
        y = torch.randn(tokens, HIDDEN, device=device).bfloat16()

        def call(h=h, fn=fn, base=base, scale=scale, y=y):
            _, post, comb = hc_pre(h, fn, base, scale, ITERS, EPS, EPS, backend=backend)
            return hc_post(y, h, post, comb, backend=backend)

        calls.append(call)
    # weights, h read by pre and post, x written, y read, new streams written
    moved = weight_bytes + 3 * stream_bytes + 2 * tokens * HIDDEN * 2
    return calls, moved


def compressor_step(overlap: bool, ratio: int, channels: int, batch: int, backend: str, device) -> tuple[list, int]:
    """Calls of one compressor decode step over rotated state pools, and the bytes it must move."""
    state_bytes = 2 * SLOTS * (2 * ratio if overlap else ratio) * channels * 4
    calls = []
    for _ in range(input_sets_for(state_bytes)):
        state = new_state(SLOTS, ratio, channels, overlap, device)
        kv = torch.randn(batch, channels, device=device).bfloat16()
        bias = torch.randn(ratio, channels, device=device)
        positions = torch.arange(batch, device=device) * ratio + ratio // 2  # no window closes
        slots = torch.arange(batch, device=device) * 2
        calls.append(functools.partial(compress_decode_step, kv, kv, positions, bias, overlap, *state,
                                       state_slots=slots, fresh=torch.zeros(batch, dtype=torch.bool, device=device),
                                       backend=backend))
    return calls, batch * channels * (2 * 2 + 2 * 4)  # kv and gate rows in, the token's state rows out


def main() -> None:
    args = output_parser(__doc__).parse_args()
    device = torch.device("cuda")
    copy = copy_bandwidth(device)
    rows = []
    cases = [(f"mHC site T={t}", functools.partial(mhc_site, t)) for t in TOKENS]
    cases += [(f"{name} compressor step B={b}", functools.partial(compressor_step, overlap, ratio, channels, b))
              for name, overlap, ratio, channels in COMPRESSORS for b in BATCHES]
    for shape, build in cases:
        times = {}
        for backend in ("reference", "triton"):
            calls, moved = build(backend, device)
            times[backend] = graph_ms(calls)
            rows.append(Row(f"{backend}", shape, times[backend], moved / times[backend] / 1e6, "GB/s", copy))
        rows[-1].note = f"{times['reference'] / times['triton']:.1f}x torch"
    report("DeepSeek-V4 decode small ops: torch vs fused (mHC site, compressor step)", rows, args.output)


if __name__ == "__main__":
    main()
