"""Triton sparse_mla_decode over the FP8 paged cache against the reference backend.

GPU tests (marked ``gpu``) walk heads (16/64/128 and odd counts), top-k 64..2048, batch 1..128,
s_q 1..4 (MTP) and forced split-KV counts, plus corner cases (no valid slot, empty pool, top-k
longer than the context, out-of-range slot ids) and a 64K-token context. Outputs the kernel
allocates start as NaN (the caching allocator is flooded with NaN first). The CPU test runs tiny
cases in a subprocess with TRITON_INTERPRET=1. The reference gets fp32 copies of q, so the only
extra rounding the kernel does is P to bf16 before P @ V, out to bf16 and, by default
(prescaled keys), each key to bf16: FlashMLA tolerances, except where a test says why not.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashdsa.runtime.cache.layout import BLOCK_SIZE, D_QK
from flashdsa.runtime.kernels import sparse_mla_decode
from flashdsa.runtime.kernels.triton import sparse_decode
from flashdsa.testing import (
    assert_decode_close,
    flood_cuda_allocator_with_nan,
    kernel_test_main,
    random_decode_inputs,
    run_under_interpreter,
)

SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
SM_SCALE = D_QK**-0.5


def decode_inputs(b, s_q, h_q, topk, context, device, scale=0.1, **options):
    """:func:`random_decode_inputs` seeded from this run's SEED and the shape."""
    g = torch.Generator().manual_seed(SEED + b * 7919 + s_q * 131 + h_q * 31 + topk)
    return random_decode_inputs(b, s_q, h_q, topk, context, device, generator=g, scale=scale, **options)


def check_decode(q, pool, slots, num_splits=None, out_abs_tol=1e-3, config=None, lse_abs_tol=1e-6):
    """Kernel vs the reference (fp32 q) with FlashMLA's tolerances; returns (out, lse).
    ``num_splits`` / ``config`` call the backend directly with a forced split count / launch."""
    flood_cuda_allocator_with_nan(q.device)
    if num_splits is None and config is None:
        out, lse = sparse_mla_decode(q, pool, slots, SM_SCALE, backend="triton")
    else:
        out, lse = sparse_decode.sparse_mla_decode(q, pool, slots, SM_SCALE, 512, num_splits=num_splits, config=config)
    assert_decode_close(out, lse, q, pool, slots, SM_SCALE, out_abs_tol, lse_abs_tol)
    return out, lse


cuda = torch.device("cuda")
FEW_KEYS_LSE_TOL = 3e-4
GRID = [  # (b, s_q, h_q, topk, context)
    (1, 1, 128, 2048, 4096), (2, 2, 128, 512, 700), (8, 4, 64, 1024, 2000), (4, 3, 16, 64, 100),
    (3, 2, 20, 128, 300), (1, 4, 80, 256, 256), (128, 2, 128, 128, 512), (16, 1, 1, 64, 64),
    (2, 2, 128, 100, 300), (5, 1, 32, 1, 40),  # topk not a multiple of 64
]


@pytest.mark.gpu
@pytest.mark.parametrize("b, s_q, h_q, topk, context", GRID)
def test_decode_matches_reference(b, s_q, h_q, topk, context):
    inputs = decode_inputs(b, s_q, h_q, topk, context, cuda, invalid=0.1)
    if topk >= 64:
        check_decode(*inputs)
        return
    # With a handful of keys the lse is about one score, which the default's bf16 keys move by up to
    # 2^-9 * sm_scale * sum|q||k| (~3e-4 here): the exact path meets FlashMLA's lse tolerance.
    check_decode(*inputs, lse_abs_tol=FEW_KEYS_LSE_TOL)
    check_decode(*inputs, config=sparse_decode.DecodeConfig(prescaled_keys=False))


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 32])
def test_forced_splits_combine_to_the_same_result(num_splits):
    check_decode(*decode_inputs(2, 2, 64, 1024, 3000, cuda, invalid=0.2), num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n, warps, stages, q_in_loop, split_dv, prescaled, prefetch", [
    (64, 8, 2, False, True, False, False), (32, 8, 2, True, True, False, True), (64, 4, 2, False, True, False, False),
    (64, 8, 1, True, False, False, False), (64, 8, 2, False, False, True, False), (64, 8, 1, True, False, True, False),
    (64, 8, 3, False, False, True, True), (32, 8, 4, False, False, True, True), (64, 8, 2, False, False, False, False)])
def test_launch_variants_match_reference(block_n, warps, stages, q_in_loop, split_dv, prescaled, prefetch):
    config = sparse_decode.DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages, q_in_loop=q_in_loop,
                                        split_dv=split_dv, prescaled_keys=prescaled, prefetch_slots=prefetch)
    q, pool, slots = decode_inputs(3, 2, 128, 512, 2000, cuda, invalid=0.1)
    for splits in (None, 3):
        check_decode(q, pool, slots, splits, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(out_of_range=0.4), dict(duplicates=True, invalid=0.3)])
@pytest.mark.parametrize("prescaled", [False, True])
def test_out_of_range_and_duplicate_slots(options, prescaled):
    q, pool, slots = decode_inputs(4, 2, 128, 256, 1000, cuda, **options)
    slots[0, 0, :4] = torch.tensor([-7, pool.shape[0] * BLOCK_SIZE, 2**31 - 1, pool.shape[0] * BLOCK_SIZE - 1])
    check_decode(q, pool, slots, config=sparse_decode.DecodeConfig(prescaled_keys=prescaled))


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 4])
@pytest.mark.parametrize("prescaled", [False, True])
def test_rows_without_valid_slot_give_zero_out_and_inf_lse(num_splits, prescaled):
    q, pool, slots = decode_inputs(3, 2, 64, 256, 500, cuda)
    slots[1] = -1
    slots[2, 1, :] = 2**31 - 1
    out, lse = check_decode(q, pool, slots, num_splits, config=sparse_decode.DecodeConfig(prescaled_keys=prescaled))
    assert not out[1].any() and torch.isposinf(lse[1]).all() and torch.isposinf(lse[2, :, 1]).all()


@pytest.mark.gpu
def test_empty_pool_and_topk_longer_than_context():
    q, pool, slots = decode_inputs(2, 1, 64, 128, 1, cuda)
    check_decode(q, pool[:0], slots)  # no slot exists
    q, pool, slots = decode_inputs(2, 2, 128, 2048, 100, cuda)  # 100 valid, the rest -1
    check_decode(q, pool, slots)


# Keys rounded to bf16 (prescaled_keys) move each unscaled score (|s| ~ 1) by up to ~1e-3: beyond
# FlashMLA's lse tolerance, which assumes its 1/10-scaled inputs (there the error is ~3e-6).
PRESCALED_UNSCALED_LSE_TOL = 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("prescaled", [False, True])
def test_peaked_softmax_with_unscaled_inputs(prescaled):
    config = sparse_decode.DecodeConfig(prescaled_keys=prescaled)
    check_decode(*decode_inputs(4, 2, 128, 512, 2000, cuda, scale=1.0), out_abs_tol=1e-2, config=config,
                 lse_abs_tol=PRESCALED_UNSCALED_LSE_TOL if prescaled else 1e-6)


def test_prescaled_keys_refuse_split_dv():
    q, pool, slots = decode_inputs(1, 1, 16, 64, 64, torch.device("cpu"))
    config = sparse_decode.DecodeConfig(prescaled_keys=True, split_dv=True)
    with pytest.raises(ValueError, match="config: prescaled_keys"):
        sparse_decode.sparse_mla_decode(q, pool, slots, SM_SCALE, 512, config=config)


@pytest.mark.gpu
def test_long_context_64k():
    check_decode(*decode_inputs(2, 2, 128, 2048, 65536, cuda))


INTERPRETER_CASES = [  # (b, s_q, h_q, topk, context, num_splits, options): tiny, the interpreter is slow
    (1, 2, 16, 64, 100, None, dict(invalid=0.3)),
    (2, 1, 20, 64, 50, 2, dict(out_of_range=0.3, duplicates=True)),
    (1, 1, 70, 128, 90, 3, {}),  # two head blocks, the second padded; topk > context
    (2, 1, 16, 37, 60, 2, dict(invalid=0.2)),  # topk not a multiple of the step
]


def run_interpreter_cases() -> None:
    cpu = torch.device("cpu")
    for b, s_q, h_q, topk, context, splits, options in INTERPRETER_CASES:
        check_decode(*decode_inputs(b, s_q, h_q, topk, context, cpu, **options), num_splits=splits)
    exact = sparse_decode.DecodeConfig(prescaled_keys=False, prefetch_slots=False, num_stages=2)
    check_decode(*decode_inputs(2, 2, 20, 128, 150, cpu, invalid=0.2), num_splits=2, config=exact)
    variant = sparse_decode.DecodeConfig(block_n=32, q_in_loop=True, split_dv=True, prescaled_keys=False,
                                         prefetch_slots=True)
    check_decode(*decode_inputs(1, 2, 20, 64, 80, cpu), num_splits=2, config=variant)
    prescaled = sparse_decode.DecodeConfig(block_n=32, prescaled_keys=True, prefetch_slots=True)
    check_decode(*decode_inputs(1, 2, 20, 96, 80, cpu, invalid=0.2), num_splits=2, config=prescaled)
    check_decode(*decode_inputs(1, 1, 16, 128, 200, cpu, scale=1.0), out_abs_tol=1e-2,  # peaked, 4 steps
                 config=sparse_decode.DecodeConfig(block_n=32, prescaled_keys=True, q_in_loop=True),
                 lse_abs_tol=PRESCALED_UNSCALED_LSE_TOL)
    q, pool, slots = decode_inputs(1, 1, 16, 64, 10, cpu)
    out, lse = check_decode(q, pool, torch.full_like(slots, -1))
    assert not out.any() and torch.isposinf(lse).all()


def test_decode_under_interpreter():
    run_under_interpreter(__file__, SEED)


def run_memcheck_case() -> None:
    """A small GPU case full of invalid slot ids, split and unsplit, exact and prescaled keys, for
    compute-sanitizer."""
    q, pool, slots = decode_inputs(2, 2, 128, 256, 300, cuda, invalid=0.3, out_of_range=0.3)
    for splits in (None, 3):
        for prescaled in (False, True):
            check_decode(q, pool, slots, splits, config=sparse_decode.DecodeConfig(prescaled_keys=prescaled))
    torch.cuda.synchronize()


if __name__ == "__main__":
    kernel_test_main(run_interpreter_cases, run_memcheck_case)
