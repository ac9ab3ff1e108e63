"""``flashdsa make-tiny DIR [--arch deepseek_v4]``: write a tiny random DeepSeek-V3.2 (or V4) checkpoint."""

from __future__ import annotations

import argparse

from flashdsa.arguments import int_in, output_directory
from flashdsa.errors import ArgumentError, blame
from flashdsa.models.deepseek_v4_tiny import make_tiny_v4_checkpoint
from flashdsa.models.tiny import make_tiny_checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", type=output_directory, help="output directory (created if missing)")
    parser.add_argument("--arch", choices=("deepseek_v32", "deepseek_v4"), default="deepseek_v32",
                        help="architecture (default deepseek_v32; deepseek_v4: official layout, every layer type "
                             "and an MTP layer)")
    parser.add_argument("--fp8", action="store_true", help="store e4m3 weights with 128x128 block scales")
    parser.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0, help="random seed of the weights (default 0)")
    parser.add_argument("--shrink", action="store_true", help="shrink every width (fast CPU tests; reference mode only)")
    parser.add_argument("--shards", type=int_in(1, 64), default=1, help="number of safetensors files (default 1)")
    parser.add_argument("--mtp", action="store_true", help="add a multi-token-prediction layer (official layout)")
    parser.add_argument("--overwrite", action="store_true", help="write into DIR even if it is not empty")


def run(args: argparse.Namespace) -> int:
    if args.dir.is_dir() and any(args.dir.iterdir()) and not args.overwrite:
        raise ArgumentError("DIR", f"{args.dir} is not empty; choose a new directory or pass --overwrite")
    v4 = args.arch == "deepseek_v4"
    if v4 and (args.shrink or args.mtp):
        raise ArgumentError("--arch", "--shrink and --mtp apply to deepseek_v32 (a V4 tiny checkpoint is always "
                                      "small and has its MTP layer)")
    with blame("DIR", (OSError,)):  # e.g. a parent that is a file, or no permission
        if v4:
            path = make_tiny_v4_checkpoint(args.dir, fp8=args.fp8, seed=args.seed, shards=args.shards)
        else:
            path = make_tiny_checkpoint(args.dir, fp8=args.fp8, seed=args.seed, shrink=args.shrink,
                                        shards=args.shards, mtp=args.mtp)
    print(f"wrote a tiny {'DeepSeek-V4' if v4 else 'DeepSeek-V3.2'} checkpoint to {path}")
    return 0
