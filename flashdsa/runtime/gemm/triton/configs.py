"""Launch shapes of the Triton FP8 GEMM: the candidates per (M, N, K) and the one the heuristic picks.

No timing happens at run time: the choice is a pure function of the shape and the SM count,
cached per (M rounded up to a power of two, N, K, SMs), so a CUDA-graph capture or the first
call of a shape never waits on an autotuner. ``benchmarks/bench_gemm.py --sweep`` times every
candidate of :func:`candidates` on a GPU; its winners are what the rules below encode.

Regimes:
- decode (M <= 64): weight-bandwidth bound. Swap AB (64 weight rows on the MMA's M side, the
  tokens padded to 16..64 on its N side) and split K until there are ~4 programs per SM, so
  every SM streams weights.
- middle (64 < M < 1024): 64 x 128 tiles, K split while the tiles do not fill the GPU.
- large (M >= 1024): 128 x 128 x 128 tiles, 8 warps, grouped tile order.
Both use TMA loads where K allows (a multiple of 16); decode uses plain pipelined loads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from flashdsa.runtime.gemm.reference import GROUP  # K per step: one activation/weight scale group

DECODE_MAX_M = 64
LARGE_MIN_M = 1024
PROGRAMS_PER_SM = 4  # small-M launches aim for this many programs per SM
MIN_GROUPS_PER_SPLIT = 4  # a split of K walks at least this many 128-wide groups
MAX_SPLIT_K = 32
DEFAULT_SMS = 132  # H100/H200 SXM; used off a GPU (interpreter, compile test)
V32_LINEAR_SHAPES = {  # (N, K) of DeepSeek-V3.2's FP8 linear layers: what the heuristic is tuned on
    "q_a": (1536, 7168), "q_b": (24576, 1536), "kv_a": (576, 7168), "kv_b": (32768, 512),
    "o_proj": (7168, 16384), "dense_gate_up": (36864, 7168), "dense_down": (7168, 18432),
    "shared_gate_up": (4096, 7168), "shared_down": (7168, 2048), "wq_b": (8192, 1536), "wk": (128, 7168),
    "qkv_a_fused": (2240, 7168),  # q_a | wk | kv_a as one GEMM at inference (MLA.fuse_input_projections)
}


@dataclass(frozen=True)
class GemmConfig:
    """One launch shape. ``block_m`` x ``block_n`` output tile (tokens x weight rows, whatever
    ``swap_ab`` puts on the dot's M side), ``split_k`` programs over K per tile."""

    block_m: int
    block_n: int
    split_k: int = 1
    swap_ab: bool = False
    defer: bool = False  # scale each group's product while the next group's dot runs
    tma: bool = False  # load the tiles with TMA descriptors (where K % 16 == 0)
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4

    def __str__(self) -> str:
        flags = (" swap" if self.swap_ab else "") + (" defer" if self.defer else "") + (" tma" if self.tma else "")
        return (f"{self.block_m}x{self.block_n}{flags} split={self.split_k} "
                f"w={self.num_warps} st={self.num_stages} g={self.group_m}")


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (DEFAULT_SMS off a GPU)."""
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def token_block(m: int) -> int:
    """The smallest dot width (>= 16, a power of two) that holds M tokens."""
    return max(16, triton.next_power_of_2(m))


def split_for(tiles: int, k: int, sms: int) -> int:
    """How many programs to split K over so ``tiles`` output tiles make ~PROGRAMS_PER_SM per SM,
    each split keeping at least MIN_GROUPS_PER_SPLIT groups."""
    groups = triton.cdiv(k, GROUP)
    wanted = triton.cdiv(PROGRAMS_PER_SM * sms, tiles)
    return max(1, min(wanted, groups // MIN_GROUPS_PER_SPLIT, MAX_SPLIT_K))


def candidates(m: int, n: int, k: int, sms: int = DEFAULT_SMS) -> list[GemmConfig]:
    """The launch shapes worth timing for this problem; the heuristic's choice comes first."""
    out = [choose(m, n, k, sms)]
    if m <= DECODE_MAX_M:
        bm = token_block(m)
        for bn, stages_list, tma in [(32, (3, 4, 6), False), (64, (3, 4, 6), False), (128, (3, 4, 6), False),
                                     (64, (4, 6), True), (128, (4, 6), True)]:
            base = split_for(triton.cdiv(n, bn), k, sms)
            for split in sorted({1, max(1, base // 2), base, base * 2} - ({1} if tma else set())):
                for stages in stages_list:
                    out.append(GemmConfig(bm, bn, split, swap_ab=True, tma=tma, num_warps=4, num_stages=stages))
        for split in (1, split_for(triton.cdiv(n, 128), k, sms)):  # tokens on the dot's M side
            out.append(GemmConfig(bm, 128, split, num_warps=4, num_stages=4))
    else:  # (block_m, block_n, warps, stages, defer, tma); 128 x 256 tiles spill (255 registers + stack)
        shapes = [(64, 128, 4, 4, False, False), (64, 128, 4, 5, False, False), (64, 128, 4, 4, True, False),
                  (128, 64, 4, 4, False, False), (128, 128, 8, 3, False, False), (128, 128, 8, 4, False, False),
                  (128, 128, 8, 4, True, False), (64, 256, 8, 3, False, False),
                  (64, 128, 4, 4, False, True), (64, 128, 4, 5, False, True), (128, 128, 8, 3, False, True),
                  (128, 128, 8, 4, False, True), (128, 128, 8, 4, True, True), (64, 256, 8, 3, False, True)]
        for bm, bn, warps, stages, defer, tma in shapes:
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            for split in sorted({1, split_for(tiles, k, sms)}):
                out.append(GemmConfig(bm, bn, split, defer=defer, tma=tma, num_warps=warps, num_stages=stages))
    return list(dict.fromkeys(out))  # drop repeats, keep order


@functools.lru_cache(maxsize=4096)
def choose(m: int, n: int, k: int, sms: int = DEFAULT_SMS) -> GemmConfig:
    """The heuristic's launch shape for [m, k] x [n, k]^T."""
    if m <= DECODE_MAX_M:
        bn = 64
        return GemmConfig(token_block(m), bn, split_for(triton.cdiv(n, bn), k, sms), swap_ab=True,
                          num_warps=4, num_stages=4)
    if m < LARGE_MIN_M:
        bm, bn, warps, stages = 64, 128, 4, 4
    else:
        bm, bn, warps, stages = 128, 128, 8, 4
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = split_for(tiles, k, sms) if tiles < sms else 1
    return GemmConfig(bm, bn, split, tma=True, num_warps=warps, num_stages=stages)


def choose_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """:func:`choose` for this device, cached per M rounded up to a power of two."""
    return choose(triton.next_power_of_2(m), n, k, num_sms(device))
