"""Triton DeepSeek-V4 sparse attention (prefill over bf16 rows, decode over FP8 MODEL1 pages)
against the reference backend.

Cases walk h_q 64 / 128 (and odd counts), top-k lengths per query, the sliding-window extra set,
sinks (finite, -inf, +inf), forced split-KV counts for decode (and bit-equal results for lists
padded to a wider width), s_q 1..4 and a large prefill, plus
the corner cases: all indices invalid, out-of-range and duplicate ids, top-k longer than the
table, a window shorter than 128, an empty kv table. Outputs the kernel allocates start as NaN
(the CUDA allocator flooded; ``torch.empty`` poisoned under the interpreter). The reference gets
fp32 q; FlashMLA tolerances on inputs scaled by 1/10. GPU tests are marked ``gpu``; the CPU test
runs small cases in a subprocess with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashdsa.runtime.cache import write_v4_cache
from flashdsa.runtime.cache.pool import v4_pool
from flashdsa.runtime.kernels import sparse_attention_v4_decode, sparse_attention_v4_prefill
from flashdsa.runtime.kernels.triton import sparse_v4
from flashdsa.testing import (
    assert_flashmla_close,
    assert_lse_close,
    flood_cuda_allocator_with_nan,
    kernel_test_main,
    poisoned_empty,
    random_indices,
    run_under_interpreter,
)

SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
SCALE = 512**-0.5
WINDOW = 128


def _generator(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + sum(k * 7919**i for i, k in enumerate(key)))


def _options(g, rows: int, topk: int, extra_topk: int, sink: bool, lengths: bool, heads: int):
    lengths_ = torch.randint(0, topk + 2, (rows,), generator=g, dtype=torch.int32) if lengths else None
    extra_lengths = torch.randint(0, extra_topk + 1, (rows,), generator=g, dtype=torch.int32) if lengths else None
    sinks = torch.randn(heads, generator=g) if sink else None
    if sinks is not None and heads > 2:
        sinks[0], sinks[1] = float("-inf"), float("inf")
    return lengths_, extra_lengths, sinks


def check_prefill(s_q, h_q, s_kv, topk, s_extra, device, sink=True, lengths=True, **index_options):
    g = _generator(s_q, h_q, s_kv, topk, s_extra)
    q = (torch.randn(s_q, h_q, 512, generator=g) * 0.1).bfloat16()
    kv = (torch.randn(s_kv, 1, 512, generator=g) * 0.1).bfloat16()
    extra_kv = (torch.randn(s_extra, 1, 512, generator=g) * 0.1).bfloat16()
    idx = random_indices((s_q, 1, topk), s_kv, generator=g, **index_options)
    extra_idx = random_indices((s_q, 1, min(WINDOW, max(s_extra, 1))), s_extra, invalid=0.05, generator=g)
    topk_length, extra_length, sinks = _options(g, s_q, topk, extra_idx.shape[-1], sink, lengths, h_q)
    kwargs = dict(topk_length=topk_length, attn_sink=sinks, extra_indices=extra_idx, extra_topk_length=extra_length)
    kwargs = {k: v.to(device) if v is not None else None for k, v in kwargs.items()}
    flood_cuda_allocator_with_nan(torch.device(device))
    out, lse = sparse_attention_v4_prefill(q.to(device), kv.to(device), idx.to(device), SCALE,
                                           extra_kv=extra_kv.to(device), backend="triton", **kwargs)
    ref_out, ref_lse = sparse_attention_v4_prefill(q.float().to(device), kv.float().to(device), idx.to(device), SCALE,
                                                   extra_kv=extra_kv.float().to(device), backend="reference", **kwargs)
    assert_flashmla_close(f"out (seed {SEED})", out, ref_out)
    assert_lse_close(lse, ref_lse, f"lse (seed {SEED})")


def random_v4_pool(num_blocks: int, block_size: int, g: torch.Generator, device) -> torch.Tensor:
    pool = v4_pool(num_blocks, "cpu", block_size=block_size)
    write_v4_cache(torch.randn(num_blocks * block_size, 512, generator=g) * 0.1, pool,
                   torch.randperm(num_blocks * block_size, generator=g), backend="reference")
    return pool.to(device)


def check_decode(b, s_q, h_q, topk, num_blocks, device, num_splits=None, sink=True, lengths=True, window=WINDOW,
                 window_invalid=0.0, **index_options):
    g = _generator(b, s_q, h_q, topk, num_blocks)
    pool = random_v4_pool(num_blocks, 64, g, device)
    window_pool = random_v4_pool(max(1, b * 2), 64, g, device)  # the sliding window: another pool, 64-token blocks
    q = (torch.randn(b, s_q, h_q, 512, generator=g) * 0.1).bfloat16().to(device)
    slots = random_indices((b, s_q, topk), num_blocks * 64, generator=g, **index_options).to(device)
    extra = random_indices((b, s_q, window), window_pool.shape[0] * 64, invalid=window_invalid, generator=g).to(device)
    topk_length, extra_length, sinks = _options(g, b, topk, window, sink, lengths, h_q)
    kwargs = dict(topk_length=topk_length, attn_sink=sinks, extra_kv_cache=window_pool, extra_indices=extra,
                  extra_topk_length=extra_length)
    kwargs = {k: v.to(device) if v is not None else None for k, v in kwargs.items()}
    flood_cuda_allocator_with_nan(torch.device(device))
    if num_splits is None:
        out, lse = sparse_attention_v4_decode(q, pool, slots, SCALE, backend="triton", **kwargs)
    else:
        out, lse = sparse_v4.sparse_attention_v4_decode(q, pool, slots, SCALE, num_splits=num_splits, **kwargs)
    ref_out, ref_lse = sparse_attention_v4_decode(q.float(), pool, slots, SCALE, backend="reference", **kwargs)
    assert_flashmla_close(f"out (seed {SEED})", out, ref_out)
    assert_lse_close(lse, ref_lse, f"lse (seed {SEED})")
    return out, lse


cuda = torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("s_q, h_q, s_kv, topk, s_extra", [
    (1, 64, 1000, 512, 128), (300, 128, 4096, 512, 128), (64, 64, 2000, 1024, 77), (17, 20, 300, 100, 128),
    (4096, 128, 32768, 512, 128), (8, 128, 10, 64, 5),  # topk > s_kv, window shorter than 128
])
def test_prefill_matches_reference(s_q, h_q, s_kv, topk, s_extra):
    check_prefill(s_q, h_q, s_kv, topk, s_extra, "cuda", invalid=0.1, out_of_range=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("b, s_q, h_q, topk, num_blocks", [
    (1, 1, 64, 512, 64), (1, 1, 128, 512, 64), (4, 2, 128, 512, 40), (16, 4, 64, 1024, 300),
    (128, 1, 128, 512, 600), (128, 2, 64, 512, 600), (3, 3, 20, 100, 8),
])
def test_decode_matches_reference(b, s_q, h_q, topk, num_blocks):
    check_decode(b, s_q, h_q, topk, num_blocks, cuda, invalid=0.1, out_of_range=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 3, 8, 20])
def test_decode_split_kv_counts_agree(num_splits):
    """Splits cut the window then the top-k list (640 positions: 20 splits of 32, the first 4 all window)."""
    check_decode(2, 2, 128, 512, 40, cuda, num_splits=num_splits, duplicates=True)


@pytest.fixture(scope="module")
def flash_mla():
    """FlashMLA built from the anchor copied to ``.device/flashmla`` (GPU machine), else skip."""
    import sys

    sys.path.insert(0, os.path.join(os.getcwd(), ".device", "flashmla"))
    try:
        from build import flash_mla as build
    except Exception as e:  # no anchor or toolchain here: the comparison cannot run
        pytest.skip(f"FlashMLA not available: {e}")
    return build()


@pytest.mark.gpu
@pytest.mark.parametrize("b, s_q, h_q", [(1, 1, 64), (4, 2, 128), (64, 1, 64)])
def test_decode_matches_flashmla_model1_on_the_same_cache_bytes(flash_mla, b, s_q, h_q):
    """The same pool bytes, slots, window, lengths and sinks through FlashMLA's MODEL1 decode: a
    layout mismatch (a byte read from the wrong place) would show as O(1) differences."""
    g = _generator(b, s_q, h_q, 99)
    pool, window_pool = random_v4_pool(64, 64, g, cuda), random_v4_pool(max(2, b * 2), 64, g, cuda)
    q = (torch.randn(b, s_q, h_q, 512, generator=g) * 0.1).bfloat16().to(cuda)
    slots = random_indices((b, s_q, 512), 64 * 64, invalid=0.1, generator=g).to(cuda)
    window = random_indices((b, s_q, WINDOW), window_pool.shape[0] * 64, generator=g).to(cuda)
    lengths = torch.randint(1, 513, (b,), generator=g, dtype=torch.int32).to(cuda)
    window_lengths = torch.randint(1, WINDOW + 1, (b,), generator=g, dtype=torch.int32).to(cuda)
    sinks = torch.randn(h_q, generator=g).to(cuda)
    out, lse = sparse_attention_v4_decode(q, pool, slots, SCALE, topk_length=lengths, attn_sink=sinks,
                                          extra_kv_cache=window_pool, extra_indices=window,
                                          extra_topk_length=window_lengths, backend="triton")
    their_out, their_lse = flash_mla.flash_mla_with_kvcache(
        q, pool, None, None, 512, flash_mla.get_mla_metadata()[0], softmax_scale=SCALE, is_fp8_kvcache=True,
        indices=slots, attn_sink=sinks, extra_k_cache=window_pool, extra_indices_in_kvcache=window,
        topk_length=lengths, extra_topk_length=window_lengths)
    assert_flashmla_close("out vs FlashMLA", out, their_out)
    assert_lse_close(lse, their_lse, "lse vs FlashMLA")


@pytest.mark.gpu
def test_prefill_matches_flashmla_sparse_fwd_with_sinks_and_lengths(flash_mla):
    g = _generator(4096, 99)
    q = (torch.randn(512, 128, 512, generator=g) * 0.1).bfloat16().to(cuda)
    kv = (torch.randn(4096, 1, 512, generator=g) * 0.1).bfloat16().to(cuda)
    idx = random_indices((512, 1, 512), 4096, invalid=0.1, generator=g).to(cuda)
    lengths = torch.randint(0, 513, (512,), generator=g, dtype=torch.int32).to(cuda)
    sinks = torch.randn(128, generator=g).to(cuda)
    out, lse = sparse_attention_v4_prefill(q, kv, idx, SCALE, topk_length=lengths, attn_sink=sinks, backend="triton")
    their_out, _, their_lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx, SCALE, 512, attn_sink=sinks,
                                                             topk_length=lengths)
    assert_flashmla_close("out vs FlashMLA", out, their_out)
    finite = torch.isfinite(lse)  # FlashMLA's lse of a row with nothing valid is its own convention
    assert_lse_close(lse[finite], their_lse[finite], "lse vs FlashMLA")


def check_padding_changes_no_bit(device) -> None:
    """A top-k list padded with invalid ids to a wider width (a CUDA graph's width) gives the same
    bits as the unpadded one: the splits fall at the same positions, empty trailing splits add exact
    zeros, and one split written directly rounds as the combine of one split does."""
    g = _generator(77)
    pool, window_pool = random_v4_pool(8, 64, g, device), random_v4_pool(4, 64, g, device)
    q = (torch.randn(2, 1, 64, 512, generator=g) * 0.1).bfloat16().to(device)
    slots = random_indices((2, 1, 100), 8 * 64, invalid=0.1, generator=g).to(device)
    window = random_indices((2, 1, 64), 4 * 64, generator=g).to(device)
    lengths = torch.tensor([100, 37], dtype=torch.int32, device=device)
    sinks = torch.randn(64, generator=g).to(device)
    padded = torch.cat([slots, torch.full((2, 1, 412), -1, dtype=slots.dtype, device=device)], -1)
    kwargs = dict(topk_length=lengths, attn_sink=sinks, extra_kv_cache=window_pool, extra_indices=window)
    narrow = sparse_v4.sparse_attention_v4_decode(q, pool, slots, SCALE, **kwargs)
    wide = sparse_v4.sparse_attention_v4_decode(q, pool, padded, SCALE, **kwargs)
    for ours, theirs in zip(wide, narrow):
        assert torch.equal(ours, theirs)
    one = sparse_v4.sparse_attention_v4_decode(q, pool, slots[..., :64], SCALE, attn_sink=sinks, num_splits=1)
    two = sparse_v4.sparse_attention_v4_decode(q, pool, padded[..., :128].clone().fill_(-1).index_copy_(
        -1, torch.arange(64, device=device), slots[..., :64]), SCALE, attn_sink=sinks, num_splits=2)
    for ours, theirs in zip(two, one):
        assert torch.equal(ours, theirs)


@pytest.mark.gpu
def test_padding_the_lists_changes_no_bit():
    check_padding_changes_no_bit(cuda)


def check_all_invalid(device) -> None:
    out, lse = check_decode(2, 2, 64, 128, 4, device, num_splits=2, invalid=1.0, window_invalid=1.0, lengths=False)
    assert (out == 0).all() and (lse == float("inf")).all()


@pytest.mark.gpu
def test_all_invalid_gives_zero_out_and_inf_lse():
    check_all_invalid(cuda)


def run_interpreter_cases() -> None:
    cpu = torch.device("cpu")
    with poisoned_empty():
        check_prefill(3, 16, 100, 64, 40, cpu, invalid=0.1, out_of_range=0.1)
        check_prefill(2, 64, 10, 64, 5, cpu, duplicates=True)  # topk > s_kv, short window, duplicates
        check_prefill(2, 16, 0, 64, 3, cpu, sink=False, lengths=False)  # empty main table
        check_prefill(1, 16, 50, 64, 20, cpu, invalid=1.0, lengths=False)  # every main index invalid
        check_decode(2, 2, 16, 128, 3, cpu, num_splits=2, window=64, invalid=0.1, out_of_range=0.1)
        check_decode(1, 1, 20, 64, 2, cpu, window=16, invalid=1.0, lengths=False)
        for splits in (2, 6):  # splits of the window alone, a split across the window's end into the top-k list
            check_decode(1, 1, 16, 100, 3, cpu, num_splits=splits, window=64, invalid=0.1)
        check_decode(3, 1, 16, 100, 3, cpu, window=64, invalid=0.1)  # the default partition
        check_padding_changes_no_bit(cpu)
        check_all_invalid(cpu)
    print("interpreter cases passed")


def test_kernels_under_interpreter():
    run_under_interpreter(__file__, SEED)


def run_memcheck_case() -> None:
    check_decode(4, 2, 128, 512, 40, cuda, invalid=0.1, out_of_range=0.1)
    check_prefill(64, 64, 2000, 512, 128, "cuda", invalid=0.1, out_of_range=0.1)
    torch.cuda.synchronize()


if __name__ == "__main__":
    kernel_test_main(run_interpreter_cases, run_memcheck_case)
