"""Public indexer_topk per backend (cuda, triton) against torch.topk: top-2048 of 128 rows x 128K
(decode-like, floor 3x torch.topk) and of 4096 rows x 64K (prefill-like, floor 3x). Normal random
scores, input sets rotated past the L2. The ratio is to torch.topk's eager time (its host cost is
negligible at these sizes; its graph time is in the note). Device time from CUDA graphs (calls back to back, as a
decode step replays them), sorted and unsorted; one eager row per backend shows the host cost. The
cuda backend's streaming kernel (one CTA per row, the design before the cluster kernel) is timed
beside it, from the same build.

    python3 -m benchmarks.bench_topk [--output BENCHMARKS.md]
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from benchmarks.common import Row, graph_ms, input_sets_for, kernel_split, median_ms, output_parser, report
from flashdsa.runtime.indexer import indexer_topk

log = logging.getLogger("bench_topk")
TOPK = 2048
SHAPES = [(128, 131072), (4096, 65536)]  # (rows, row length)
FLOOR = 3.0  # x torch.topk


def variants(rows: int, length: int, device: torch.device) -> dict[str, Callable[[torch.Tensor, bool], object]]:
    """name -> call(logits, sorted): the public function per backend, and the cuda streaming kernel."""
    starts = torch.zeros(rows, dtype=torch.int32, device=device)
    ends = torch.full((rows,), length, dtype=torch.int32, device=device)

    def streaming(x: torch.Tensor, sorted_: bool) -> torch.Tensor:
        from flashdsa.runtime.indexer.cuda import topk

        return topk.indexer_topk(x, TOPK, starts, ends, sorted_, one_cta_per_row=True)

    return {
        "cuda": lambda x, sorted_: indexer_topk(x, TOPK, starts, ends, sorted=sorted_, backend="cuda"),
        "cuda, one CTA per row": streaming,
        "triton": lambda x, sorted_: indexer_topk(x, TOPK, starts, ends, sorted=sorted_, backend="triton"),
    }


def bench_shape(rows: int, length: int, device: torch.device) -> list[Row]:
    sets = [torch.randn(rows, length, device=device) for _ in range(input_sets_for(rows * length * 4, at_most=4))]
    ms_torch = median_ms([lambda x=x: torch.topk(x, TOPK, dim=-1) for x in sets], iters=20)  # as in BENCHMARKS
    torch_graph = graph_ms([lambda x=x: torch.topk(x, TOPK, dim=-1) for x in sets])
    shape = f"{rows} rows x {length // 1024}K, topk={TOPK}"
    out = []
    for name, call in variants(rows, length, device).items():
        try:
            for sorted_ in (True, False):
                ms = graph_ms([lambda x=x: call(x, sorted_) for x in sets])
                note = (f"CUDA graph, {'sorted' if sorted_ else 'unsorted'}; torch.topk {ms_torch:.3f} ms eager, "
                        f"{torch_graph:.3f} ms graph")
                out.append(Row(f"indexer_topk {name}", shape, ms, ms_torch / ms, "x torch.topk", FLOOR, note))
                log.info("%s", out[-1])
            ms = median_ms([lambda x=x: call(x, True) for x in sets], iters=20)
            note = f"eager (host launch cost included); kernels: {kernel_split(lambda: call(sets[0], True))}"
            out.append(Row(f"indexer_topk {name}", shape, ms, ms_torch / ms, "x torch.topk", FLOOR, note))
        except Exception as e:  # one variant failing must not hide the others' figures
            log.warning("%s top-k failed: %s", name, str(e).splitlines()[0][:300])
    del sets
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    args = output_parser(__doc__).parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    device = torch.device("cuda")
    rows = [row for rows, length in SHAPES for row in bench_shape(rows, length, device)]
    report("Indexer top-k per backend (cuda native, triton) vs torch.topk (graph device time)", rows, args.output)


if __name__ == "__main__":
    main()
