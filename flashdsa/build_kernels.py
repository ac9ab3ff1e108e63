"""``flashdsa build-kernels``: build every native (CUDA C++) kernel ahead of time into the cache
that the first use would fill, or with ``--compile-only`` compile them for sm_90a without a GPU and
print ptxas's registers, spills and shared memory per kernel (what CI runs)."""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from flashdsa.runtime import native

LOG_LEVEL = "INFO"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile-only", action="store_true",
                        help="compile for sm_90a without linking or loading (no GPU needed); print ptxas figures")


def run(args: argparse.Namespace) -> int:
    failed = 0
    for ext in tqdm(native.extensions(), desc="native kernels", disable=len(native.extensions()) < 2):
        try:
            if args.compile_only:
                print(native.compile_check(ext))
            else:
                print(f"{ext.name}: built in {native.build(ext)}")
        except native.NativeBuildError as e:
            tqdm.write(f"flashdsa build-kernels: error: {e}", file=sys.stderr)  # on its own line, not the bar's
            failed += 1
    return 1 if failed else 0
