"""Native (CUDA C++, SM90) sparse_mla_decode over the FP8 paged cache against the reference.

GPU tests (marked ``gpu``, Hopper only) walk batch 1..128, s_q 1..4, h_q 64 and 128, top-k 1..16384
(multiples of the 64-key tile and not), contexts shorter than the top-k, forced split-KV counts,
and the corner cases: rows without a valid slot (-1 everywhere, or out of range everywhere),
out-of-range and duplicate slot ids, an empty pool, unscaled inputs (a peaked softmax), more
than 65535 query rows, CUDA-graph replay. Fresh random inputs each run (the seed is printed on
failure); outputs the kernel allocates start as NaN (the allocator is flooded with NaN first).
Keys are rounded to bf16(e4m3 * scale) as FlashMLA does, so FlashMLA's tolerances apply except
where a test says why not. ``python tests/kernels/test_cuda_sparse_decode.py --memcheck`` runs a
small case full of invalid ids for compute-sanitizer.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from flashdsa.runtime import dispatch
from flashdsa.runtime.cache.layout import BLOCK_SIZE, D_QK
from flashdsa.runtime.kernels import sparse_mla_decode
from flashdsa.testing import (
    assert_decode_close,
    assert_raw_op_refuses,
    assert_flashmla_close,
    flood_cuda_allocator_with_nan,
    random_decode_inputs,
)

SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
SM_SCALE = D_QK**-0.5
cuda = torch.device("cuda")
# With a handful of keys the lse is about one score, which bf16 keys move by up to
# 2^-9 * sm_scale * sum|q||k| (~3e-4 at the 1/10 scale): FlashMLA's abs 1e-6 assumes many keys.
FEW_KEYS_LSE_TOL = 3e-4
# Unscaled inputs (|score| ~ 1): bf16 keys move each score by ~1e-3 (as in the Triton decode tests).
UNSCALED_LSE_TOL = 2e-3


def hopper() -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cuda backend serves SM90 only")


def decode_inputs(b, s_q, h_q, topk, context, scale=0.1, **options):
    g = torch.Generator().manual_seed(SEED + b * 7919 + s_q * 131 + h_q * 31 + topk)
    return random_decode_inputs(b, s_q, h_q, topk, context, cuda, generator=g, scale=scale, **options)


def check_decode(q, pool, slots, num_splits=None, out_abs_tol=1e-3, lse_abs_tol=1e-6):
    """The cuda backend (through the public op, or with a forced split count) vs the reference."""
    from flashdsa.runtime.kernels.cuda import sparse_decode  # noqa: PLC0415 (builds the extension)

    flood_cuda_allocator_with_nan(q.device)
    if num_splits is None:
        out, lse = sparse_mla_decode(q, pool, slots, SM_SCALE, backend="cuda")
    else:
        out, lse = sparse_decode.sparse_mla_decode(q, pool, slots, SM_SCALE, 512, num_splits=num_splits)
    try:
        assert_decode_close(out, lse, q, pool, slots, SM_SCALE, out_abs_tol, lse_abs_tol)
    except AssertionError as e:
        raise AssertionError(f"seed {SEED}, splits {num_splits}: {e}") from None
    return out, lse


GRID = [  # (b, s_q, h_q, topk, context)
    (1, 1, 128, 2048, 4096), (1, 1, 64, 2048, 4096), (2, 2, 64, 512, 700), (8, 4, 64, 1024, 2000),
    (4, 1, 128, 2048, 32768), (4, 1, 128, 16384, 20000), (128, 2, 128, 2048, 2048), (128, 1, 64, 2048, 2500),
    (64, 1, 128, 128, 512), (16, 3, 128, 4096, 8192), (2, 4, 64, 8192, 6000),  # topk > context: -1 padded
    (3, 2, 128, 100, 300), (5, 1, 64, 200, 40), (7, 2, 128, 1000, 1500),  # topk not a multiple of 64
]


@pytest.mark.gpu
@pytest.mark.parametrize("b, s_q, h_q, topk, context", GRID)
def test_decode_matches_reference(b, s_q, h_q, topk, context):
    hopper()
    check_decode(*decode_inputs(b, s_q, h_q, topk, context, invalid=0.1))


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [1, 5, 63])
def test_fewer_keys_than_one_tile(topk):
    hopper()
    check_decode(*decode_inputs(3, 2, 64, topk, 100, invalid=0.2), lse_abs_tol=FEW_KEYS_LSE_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 16, 32, 128])
def test_forced_splits_combine_to_the_same_result(num_splits, h_q):
    hopper()
    check_decode(*decode_inputs(2, 2, h_q, 2048, 3000, invalid=0.2), num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(out_of_range=0.4), dict(duplicates=True, invalid=0.3)])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_out_of_range_and_duplicate_slots(options, num_splits):
    hopper()
    q, pool, slots = decode_inputs(4, 2, 128, 256, 1000, **options)
    num_slots = pool.shape[0] * BLOCK_SIZE
    slots[0, 0, :5] = torch.tensor([-7, num_slots, 2**31 - 1, -(2**31), num_slots - 1])
    check_decode(q, pool, slots, num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_rows_without_valid_slot_give_zero_out_and_inf_lse(num_splits):
    hopper()
    q, pool, slots = decode_inputs(3, 2, 64, 256, 500)
    slots[1] = -1
    slots[2, 1, :] = 2**31 - 1
    out, lse = check_decode(q, pool, slots, num_splits)
    assert not out[1].any() and torch.isposinf(lse[1]).all() and torch.isposinf(lse[2, :, 1]).all()
    assert out[0].abs().sum() > 0 and torch.isfinite(lse[0]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 2])
def test_empty_pool_and_topk_longer_than_context(num_splits):
    hopper()
    q, pool, slots = decode_inputs(2, 1, 64, 128, 1)
    out, lse = check_decode(q, pool[:0], slots, num_splits)  # no slot exists
    assert not out.any() and torch.isposinf(lse).all()
    check_decode(*decode_inputs(2, 2, 128, 2048, 100), num_splits)  # 100 valid, the rest -1


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 5])
def test_peaked_softmax_with_unscaled_inputs(num_splits):
    hopper()
    check_decode(*decode_inputs(4, 2, 128, 512, 2000, scale=1.0), num_splits, out_abs_tol=1e-2,
                 lse_abs_tol=UNSCALED_LSE_TOL)


@pytest.mark.gpu
def test_more_than_65535_query_rows():
    """66000 rows of one batch entry (a long prefill chunk read from the cache); the reference
    checks the first, the last and a random sample of rows (rows are independent)."""
    hopper()
    rows = 66000
    g = torch.Generator(device=cuda).manual_seed(SEED)
    _, pool, _ = decode_inputs(1, 1, 64, 64, 300)
    q = torch.randn(1, rows, 64, D_QK, device=cuda, dtype=torch.bfloat16, generator=g) / 10
    slots = torch.randint(-1, pool.shape[0] * BLOCK_SIZE, (1, rows, 64), device=cuda, dtype=torch.int32, generator=g)
    flood_cuda_allocator_with_nan(cuda)
    out, lse = sparse_mla_decode(q, pool, slots, SM_SCALE, backend="cuda")
    pick = torch.cat([torch.arange(64), torch.arange(rows - 64, rows), torch.randperm(rows)[:128]]).to(cuda)
    assert_decode_close(out[:, pick], lse[:, :, pick], q[:, pick].contiguous(), pool, slots[:, pick].contiguous(),
                        SM_SCALE)


@pytest.mark.gpu
def test_agrees_with_triton_to_rounding():
    """Both round keys to bf16(e4m3 * scale) and P to bf16: only the summation order differs."""
    hopper()
    q, pool, slots = decode_inputs(8, 2, 128, 2048, 5000, invalid=0.1)
    out, lse = sparse_mla_decode(q, pool, slots, SM_SCALE, backend="cuda")
    ref_out, ref_lse = sparse_mla_decode(q, pool, slots, SM_SCALE, backend="triton")
    assert_flashmla_close(f"out (seed {SEED})", out, ref_out, abs_tol=1e-4, rel_tol=2 / 128, cos_tol=5e-6)
    assert_flashmla_close(f"lse (seed {SEED})", lse, ref_lse, abs_tol=1e-5, rel_tol=0.0)


@pytest.mark.gpu
def test_decode_replays_in_a_cuda_graph():
    hopper()
    q, pool, slots = decode_inputs(4, 1, 128, 2048, 4096, invalid=0.1)
    sparse_mla_decode(q, pool, slots, SM_SCALE, backend="cuda")  # build and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = sparse_mla_decode(q, pool, slots, SM_SCALE, backend="cuda")
    q.copy_(torch.randn_like(q) / 10)
    slots.copy_(slots.roll(7, dims=-1))
    slots[1] = -1
    graph.replay()
    assert_decode_close(out, lse, q, pool, slots, SM_SCALE)
    assert torch.isposinf(lse[1]).all()


@pytest.mark.gpu
def test_the_public_op_refuses_unsupported_shapes_by_name():
    hopper()
    q, pool, slots = decode_inputs(2, 1, 64, 128, 200)
    from flashdsa.runtime.kernels.cuda import sparse_decode  # noqa: PLC0415

    with pytest.raises(ValueError, match="cuda sparse attention needs h_q in"):
        sparse_mla_decode(torch.cat([q, q[:, :, :32]], dim=2), pool, slots, SM_SCALE, backend="cuda")
    assert sparse_decode.split_count(ctas=8, topk=2048, sms=132) == 16


RAW_OP_CASES = """
from flashdsa.testing import random_decode_inputs
q, pool, slots = random_decode_inputs(2, 1, 64, 128, 200, cuda, generator=torch.Generator().manual_seed(0))
out = torch.empty(2, 1, 64, 512, dtype=torch.bfloat16, device=cuda)
lse = torch.empty(2, 64, 1, device=cuda)
none = torch.empty(0, device=cuda)
CASES = [(message, (*args, none, none, stream)) for message, args in [
    ("indices must be a contiguous Int", (q, pool, slots.long(), 0.1, 1, 128, out, lse)),
    ("num_splits must be in", (q, pool, slots, 0.1, 0, 128, out, lse)),
    ("tokens_per_split must be a positive multiple of 64", (q, pool, slots, 0.1, 2, 96, out, lse)),
    ("part_out must be", (q, pool, slots, 0.1, 2, 64, out, lse)),
    ("lse must be", (q, pool, slots, 0.1, 1, 128, out, lse.transpose(1, 2))),
    ("sm_scale must be a positive", (q, pool, slots, float("nan"), 1, 128, out, lse))]]
"""


@pytest.mark.gpu
def test_the_raw_op_refuses_bad_arguments_with_their_names():
    """The C++ op's own checks (a compiler that links libstdc++ statically made every failed check
    a SIGSEGV; see native.py)."""
    hopper()
    assert_raw_op_refuses("flashdsa.runtime.kernels.cuda", "sparse_decode", "torch.ops.flashdsa.sparse_decode_cuda",
                          RAW_OP_CASES)


@pytest.mark.gpu
def test_automatic_selection_picks_cuda_where_it_serves_and_triton_elsewhere(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    facts = dict(dtype=torch.bfloat16, h_q=128, d_qk=576, d_v=512, topk=2048)
    assert dispatch.choose("sparse_mla_decode", cuda, **facts) == "cuda"
    assert dispatch.choose("sparse_mla_decode", cuda, **facts | dict(h_q=32)) == "triton"


def run_memcheck_case() -> None:
    """Small cases full of invalid and out-of-range slot ids, split and unsplit, an empty pool and
    a topk longer than the context, for compute-sanitizer."""
    q, pool, slots = decode_inputs(2, 2, 128, 256, 300, invalid=0.3, out_of_range=0.3)
    for splits in (None, 1, 3):
        check_decode(q, pool, slots, splits)
    q, pool, slots = decode_inputs(2, 1, 64, 100, 50)
    check_decode(q, pool[:0], slots)
    check_decode(q, pool, slots, 2)
    torch.cuda.synchronize()


if __name__ == "__main__":
    if sys.argv[1:] != ["--memcheck"]:
        sys.exit(f"usage: {sys.argv[0]} --memcheck")
    run_memcheck_case()
