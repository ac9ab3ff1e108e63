"""Argument types and shared options of the ``flashdsa`` subcommands.

Each type refuses a bad value at parse time, so argparse reports one line naming the flag and
the accepted range (``argument --port: must be an integer in [0, 65535], got '99999'``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from flashdsa.errors import ArgumentError
from flashdsa.models.caches import MODES


def int_in(low: int, high: Optional[int] = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]`` (no upper bound when ``high`` is None)."""
    wanted = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
        return value

    return parse


def float_in(low: float, high: float = math.inf, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in ``[low, high]`` (``(low, high]`` when ``low_open``)."""
    bound = f"> {low}" if low_open else f">= {low}"
    wanted = f"a number {bound}" if high == math.inf else f"a number in {'(' if low_open else '['}{low}, {high}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value > low if low_open else value >= low) and value <= high):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
        return value

    return parse


def device_type(text: str):
    """An argparse type: a torch device that exists here (``cuda`` needs a visible GPU)."""
    from flashdsa.models.resolve import parse_device

    try:
        return parse_device(text)
    except ArgumentError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def add_model_arguments(parser: argparse.ArgumentParser, *, required: bool = False, mode: str = "production",
                        device: Optional[str] = None) -> None:
    """``--model`` (a checkpoint directory or Hub repo id; default the embedded model unless
    ``required``), ``--device`` (default ``device``, else CUDA when present), ``--mode`` and
    ``--quantization``."""
    default = "the embedded Shakespeare model" if not required else None
    parser.add_argument("--model", required=required, type=str, help="checkpoint directory (HF layout) or Hugging "
                        "Face repo id (from the HF cache, downloaded if missing)" + (f"; default: {default}" if
                                                                                     default else ""))
    parser.add_argument("--device", type=device_type, default=device,
                        help=f"cpu, cuda or cuda:N (default: {device or 'cuda when present, else cpu'})")
    parser.add_argument("--mode", choices=MODES, default=mode,
                        help=f"precision mode: production = FP8 caches and indexer, reference = exact (default {mode})")
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="fp8: store a bf16 checkpoint's linear layers and experts as e4m3 with 128x128 block "
                             "scales (FP8 checkpoints always load that way)")


def output_directory(text: str) -> Path:
    """An argparse type: a directory path that is not an existing file."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; pass a directory")
    return path


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """How the engine runs a step: ``--enforce-eager`` and ``--async-scheduling`` /
    ``--no-async-scheduling`` (default None: on CUDA, see runtime/overlap.py)."""
    parser.add_argument("--enforce-eager", action="store_true", help="run decode steps eagerly (no CUDA graphs)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="schedule and launch each step while the GPU runs the one before (default: on with CUDA)")
