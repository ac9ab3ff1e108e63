"""Triton cache writes against the reference: the pools must come out byte for byte equal.

Both backends write into copies of one pool of random bytes, so a slot written by one and not
the other, or a byte written outside its slot, shows up as a difference; skipped slots (< 0)
keep their old bytes. On a GPU the kernels divide with IEEE rounding and cast to e4m3 with
round-to-nearest-even like torch, and the indexer key rotation is the reference's butterfly
stage for stage, so equality is exact. GPU tests are marked ``gpu``; the CPU test runs the same
checks under TRITON_INTERPRET=1 in a subprocess.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashdsa.runtime.cache import write_indexer_cache, write_mla_cache
from flashdsa.runtime.cache.layout import BLOCK_SIZE, INDEXER_TOKEN_BYTES, MLA_TOKEN_BYTES
from flashdsa.testing import kernel_test_main, run_under_interpreter

SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure


def write_inputs(num_tokens, num_blocks, width, dtype, device, skipped=0.2, seed=0):
    """Random values [T, width] (with a few large and all-zero tokens), distinct slots with a
    fraction ``skipped`` set to -1."""
    g = torch.Generator().manual_seed(SEED + seed)
    x = torch.randn(num_tokens, width, generator=g) * torch.exp(torch.randn(num_tokens, 1, generator=g) * 3)
    x[::7] = 0.0
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < skipped] = -1
    return x.to(device, dtype), slots.to(device)


def random_pool(num_blocks, token_bytes, device, seed=0):
    g = torch.Generator().manual_seed(SEED + seed + 1)
    return torch.randint(0, 256, (num_blocks, BLOCK_SIZE, 1, token_bytes), generator=g, dtype=torch.uint8).to(device)


def check_mla(num_tokens, num_blocks, dtype, device):
    x, slots = write_inputs(num_tokens, num_blocks, 576, dtype, device, seed=num_tokens)
    c_kv, k_pe = x[:, :512], x[:, 512:]
    got, want = random_pool(num_blocks, MLA_TOKEN_BYTES, device), random_pool(num_blocks, MLA_TOKEN_BYTES, device)
    write_mla_cache(c_kv, k_pe, got, slots, backend="triton")
    write_mla_cache(c_kv, k_pe, want, slots, backend="reference")
    assert torch.equal(got, want), f"seed {SEED}: {int((got != want).sum())} MLA cache bytes differ"


def check_indexer(num_tokens, num_blocks, dtype, device):
    k, slots = write_inputs(num_tokens, num_blocks, 128, dtype, device, seed=num_tokens + 1)
    got, want = random_pool(num_blocks, INDEXER_TOKEN_BYTES, device), random_pool(num_blocks, INDEXER_TOKEN_BYTES, device)
    write_indexer_cache(k, got, slots, backend="triton")
    write_indexer_cache(k, want, slots, backend="reference")
    assert torch.equal(got, want), f"seed {SEED}: {int((got != want).sum())} indexer cache bytes differ"


cuda = torch.device("cuda")
CASES = [(1, 1), (100, 4), (3000, 60)]


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, num_blocks", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_write_is_byte_exact(num_tokens, num_blocks, dtype):
    check_mla(num_tokens, num_blocks, dtype, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, num_blocks", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexer_write_is_byte_exact(num_tokens, num_blocks, dtype):
    check_indexer(num_tokens, num_blocks, dtype, cuda)


@pytest.mark.gpu
def test_all_skipped_slots_leave_the_pool_untouched():
    x, slots = write_inputs(50, 2, 576, torch.bfloat16, cuda)
    pool = random_pool(2, MLA_TOKEN_BYTES, cuda)
    before = pool.clone()
    write_mla_cache(x[:, :512], x[:, 512:], pool, torch.full_like(slots, -1), backend="triton")
    assert torch.equal(pool, before)


def run_interpreter_cases() -> None:
    cpu = torch.device("cpu")
    for dtype in (torch.bfloat16, torch.float32):
        check_mla(40, 2, dtype, cpu)
        check_indexer(40, 2, dtype, cpu)


def test_writes_under_interpreter():
    run_under_interpreter(__file__, SEED)


def run_memcheck_case() -> None:
    check_mla(300, 6, torch.bfloat16, cuda)
    check_indexer(300, 6, torch.bfloat16, cuda)
    torch.cuda.synchronize()


if __name__ == "__main__":
    kernel_test_main(run_interpreter_cases, run_memcheck_case)
