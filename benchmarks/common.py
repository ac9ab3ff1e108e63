"""Timing and reporting shared by the benchmark scripts (scripts, not tests).

Timing follows the team's method: CUDA events, warm-up first, median of many runs, and inputs
rotated through several sets so that repeated runs do not measure the L2 cache.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

log = logging.getLogger("benchmarks")

L2_BYTES = 64 << 20  # larger than the H100 (50 MB) and H200 (60 MB) L2


def input_sets_for(bytes_per_set: int, at_least: int = 2, at_most: int = 8) -> int:
    """How many input sets to rotate so that together they exceed the L2 several times."""
    return max(at_least, min(at_most, -(-4 * L2_BYTES // max(bytes_per_set, 1))))


def median_ms(calls: Sequence[Callable[[], object]], warmup: int = 3, iters: int = 30) -> float:
    """Median device time in ms of one call, cycling through ``calls`` (one per input set)."""
    for i in range(warmup):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        calls[i % len(calls)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_ms(calls: Sequence[Callable[[], object]], per_graph: int = 16) -> float:
    """Median device time in ms of one call when the calls run back to back from one CUDA graph,
    as a decode step replays them: no host launch cost, ``per_graph`` calls cycling through
    ``calls`` (one per input set, so the weights come from memory, not L2)."""
    for call in calls:
        call()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            calls[i % len(calls)]()
    return median_ms([graph.replay], iters=10) / per_graph


@dataclass
class Row:
    kernel: str
    shape: str
    ms: float
    rate: float  # TFLOPS or GB/s
    unit: str  # "TFLOPS" or "GB/s"
    target: float  # the floor or target in the same unit
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.rate / self.target


def table(rows: Sequence[Row]) -> str:
    """A Markdown table of ``rows``."""
    lines = [
        "| kernel | shape | ms | rate | target | ratio | note |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.kernel} | {r.shape} | {r.ms:.3f} | {r.rate:.1f} {r.unit} | "
            f"{r.target:.0f} {r.unit} | {r.ratio:.2f} | {r.note} |"
        )
    return "\n".join(lines)


def commit() -> str:
    """The commit measured: ``FLASHDSA_COMMIT`` (set by the GPU script, which runs without .git) or git."""
    if os.environ.get("FLASHDSA_COMMIT"):
        return os.environ["FLASHDSA_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def report(title: str, rows: Sequence[Row], output: Optional[str | os.PathLike]) -> str:
    """Without ``output``, print the table. With it, print the table under a heading with device,
    date and commit, and append that section to ``output`` (Markdown). Returns what was printed."""
    if not output:
        print(table(rows))
        return table(rows)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = f"\n## {title}\n\n{device}, {date}, commit {commit()}, torch {torch.__version__}\n\n{table(rows)}\n"
    print(section)
    with Path(output).open("a") as f:
        f.write(section)
    return section


def output_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by the first line of a script's ``doc``, with its ``--output`` option."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--output", help="append the table to this Markdown file")
    return parser


def side_by_side_rows(op: str, shape: str, times: dict[str, float], differences: Callable[[str], list[str]],
                      flops: float, target: float) -> list[Row]:
    """One row per backend timed at one shape next to FlashMLA: each note gives the ratio to
    FlashMLA (when it ran) and ``differences(name)``, that backend's output differences."""
    rows = []
    for name, ms in times.items():
        notes = [f"{times['FlashMLA'] / ms:.2f}x FlashMLA"] if "FlashMLA" in times else []
        note = "; ".join(notes + differences(name))
        rows.append(Row(f"{op} {name}", shape, ms, flops / ms / 1e9, "TFLOPS", target, note))
        print(rows[-1])
    return rows


FLASHMLA_DIR = Path(__file__).resolve().parents[1] / ".device" / "flashmla"


def load_flashmla():
    """FlashMLA's Python package built for sm_90a, or None (logged) when it cannot be built here."""
    try:
        sys.path.insert(0, str(FLASHMLA_DIR))
        from build import flash_mla  # noqa: PLC0415 (the anchor's build script, on the GPU machine only)
        return flash_mla()
    except Exception as e:  # a missing anchor or toolchain only drops the side-by-side column
        log.warning("FlashMLA not available (%s): flashdsa only", e)
        return None


def parse_with_flashmla(doc: str, argv: Optional[list[str]]) -> tuple[argparse.Namespace, object]:
    """Parse ``--output`` and ``--no-flashmla`` for a benchmark timed next to FlashMLA, turn on INFO
    logging, and return (args, FlashMLA's package or None)."""
    parser = output_parser(doc)
    parser.add_argument("--no-flashmla", action="store_true", help="skip FlashMLA's side-by-side timings")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    return args, None if args.no_flashmla else load_flashmla()


def cache_keys(jit_fn) -> set:
    """The variants a Triton ``jit_fn`` has compiled so far (on its first device)."""
    caches = list(jit_fn.device_caches.values())
    return set(caches[0][0]) if caches else set()


def compiled_stats(jit_fn, before: set, launch: bool = False) -> str:
    """Registers, spills and shared memory of the variants ``jit_fn`` compiled since ``before``
    (a :func:`cache_keys` taken earlier); ``launch`` adds each variant's warps and stages."""
    cache = next(iter(jit_fn.device_caches.values()))[0]
    notes = []
    for key in set(cache) - before:
        k = cache[key]
        note = f"{k.n_regs} regs, {k.n_spills} spills, {k.metadata.shared // 1024} KiB smem"
        if launch:
            note += f", {k.metadata.num_warps} warps, {k.metadata.num_stages} stages"
        notes.append(note)
    return "; ".join(notes)


def short_kernel_name(name: str) -> str:
    """A profiler kernel name without return type, namespaces, template arguments or parameters
    (``void ns::(anonymous namespace)::dq_kernel<64>(Args)`` -> ``dq_kernel``); a generic last
    component keeps its scope (``gemvx::kernel``); names that are not C++ signatures (``Memcpy DtoD
    (Device -> Device)``) stay whole. At most 40 characters."""
    bare, depth = [], 0
    for ch in name.replace("(anonymous namespace)::", ""):  # drop template arguments, nested or not
        depth += (ch == "<") - (ch == ">")
        if depth == 0 and ch != ">":
            bare.append(ch)
    bare = "".join(bare)
    head, paren, _ = bare.partition("(")
    if not paren or head.endswith(" "):  # not a function signature
        return name.strip()[:40]
    parts = head.split()[-1].split("::")
    keep = 2 if parts[-1] in ("kernel", "device_kernel") and len(parts) > 1 else 1
    return "::".join(parts[-keep:])[:40]


def kernel_split(call, top: int = 3) -> str:
    """Device time of each kernel in one ``call`` (torch profiler), largest first."""
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        times = sorted(((e.device_time_total / 1000, e.key) for e in prof.key_averages() if e.device_time_total > 0),
                       reverse=True)
        return ", ".join(f"{short_kernel_name(name)} {ms:.3f} ms" for ms, name in times[:top])
    except Exception as e:  # the profiler is a convenience here, never a reason to fail
        log.warning("profiler failed: %s", e)
        return ""
