"""Public indexer_topk per backend (cuda, triton) against torch.topk: top-2048 of 128 rows x 128K
(decode-like, floor 3x torch.topk, ~0.30 ms on an H200) and of 4096 rows x 64K (prefill-like,
floor 3x, ~3.3 ms). Normal random scores, input sets rotated past the L2; sorted output, plus the
unsorted variant and a CUDA-graph replay (device time without Python launch overhead); each eager
row's note gives the host time of one call (what the eager figure pays before the kernel starts).

    python3 -m benchmarks.bench_topk [--output BENCHMARKS.md]
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from benchmarks.common import Row, input_sets_for, kernel_split, median_ms, output_parser, report
from flashdsa.runtime.indexer import indexer_topk

log = logging.getLogger("bench_topk")
TOPK = 2048
SHAPES = [(128, 131072), (4096, 65536)]  # (rows, row length)
BACKENDS = ("cuda", "triton")
FLOOR = 3.0  # x torch.topk


def host_us(call, iters: int = 50) -> float:
    """Median host time of one call in us (from the call to its return: checks, dispatch, allocation
    and launch, not the kernel), each call after the GPU went idle: what an eager caller pays first."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def bench_shape(rows: int, length: int, device: torch.device) -> list[Row]:
    sets = [torch.randn(rows, length, device=device) for _ in range(input_sets_for(rows * length * 4, at_most=4))]
    ms_torch = median_ms([lambda x=x: torch.topk(x, TOPK, dim=-1) for x in sets], iters=20)
    host_torch = host_us(lambda: torch.topk(sets[0], TOPK, dim=-1))
    shape = f"{rows} rows x {length // 1024}K, topk={TOPK}"
    out = []
    for backend in BACKENDS:
        for sorted_ in (True, False):
            try:
                ms = median_ms([lambda x=x: indexer_topk(x, TOPK, sorted=sorted_, backend=backend) for x in sets],
                               iters=20)
            except Exception as e:  # one backend failing must not hide the other's figure
                log.warning("%s top-k failed: %s", backend, str(e).splitlines()[0][:300])
                break
            host = host_us(lambda: indexer_topk(sets[0], TOPK, sorted=sorted_, backend=backend))
            note = (f"torch.topk {ms_torch:.3f} ms (host {host_torch:.0f} us); {'sorted' if sorted_ else 'unsorted'}; "
                    f"host {host:.0f} us a call")
            out.append(Row(f"indexer_topk {backend}", shape, ms, ms_torch / ms, "x torch.topk", FLOOR, note))
            log.info("%s", out[-1])
        else:
            graph = torch.cuda.CUDAGraph()  # the whole public call replayed
            with torch.cuda.graph(graph):
                indexer_topk(sets[0], TOPK, backend=backend)
            ms = median_ms([graph.replay], iters=20)
            out.append(Row(f"indexer_topk {backend}, CUDA graph", shape, ms, ms_torch / ms, "x torch.topk", FLOOR,
                           f"kernels: {kernel_split(graph.replay)}"))
    del sets
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    args = output_parser(__doc__).parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    device = torch.device("cuda")
    rows = [row for rows, length in SHAPES for row in bench_shape(rows, length, device)]
    report("Indexer top-k per backend (cuda native, triton) vs torch.topk", rows, args.output)


if __name__ == "__main__":
    main()
