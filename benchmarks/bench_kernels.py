"""All of issue 4's kernel benchmarks in one run: sparse MLA prefill forward and backward
(bench_attention), then sparse decode, FP8 indexer, top-k and cache writes (bench_decode_indexer),
the sparse decode per backend, triton and cuda, next to FlashMLA (bench_sparse_decode), then the
public top-k per backend, cuda and triton (bench_topk), each appending its table to the same
``--output``. Needs CUDA.

    python3 benchmarks/bench_kernels.py [--sweep] [--output BENCHMARKS.md]
"""

from __future__ import annotations

from benchmarks import bench_attention, bench_decode_indexer, bench_sparse_decode, bench_topk
from benchmarks.common import output_parser


def main(argv: list[str] | None = None) -> None:
    parser = output_parser(__doc__)
    parser.add_argument("--sweep", action="store_true", help="also sweep the attention kernels' configurations")
    args = parser.parse_args(argv)
    output = ["--output", args.output] if args.output else []
    bench_attention.main(output + (["--sweep"] if args.sweep else []))
    bench_decode_indexer.main(output)
    bench_sparse_decode.main(output)
    bench_topk.main(output)


if __name__ == "__main__":
    main()
