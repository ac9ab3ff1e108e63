"""The DeepSeek-V4 (FlashMLA MODEL1) cache: byte layout, quantization and the cache write.

The layout is checked against an independent, byte-by-byte construction of what FlashMLA's sm90
sparse decode reads (a block's tokens' 576 data bytes first, then their 8 scale bytes); the write
op (reference and Triton) against the reference quantizer, into pools of random bytes so a stray
or missing byte shows. The Triton write runs under TRITON_INTERPRET=1 in a subprocess on CPU and
byte-exactly on a GPU (``gpu`` marker).
"""

from __future__ import annotations

import os
import struct

import pytest
import torch

from flashdsa.runtime.cache import write_v4_cache
from flashdsa.runtime.cache.layout_v4 import (
    V4_TOKEN_BYTES,
    dequantize_v4,
    gather_v4,
    quantize_v4,
    v4_block_views,
    v4_bytes_per_token,
)
from flashdsa.runtime.cache.pool import v4_pool
from flashdsa.testing import kernel_test_main, run_under_interpreter

SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure


def random_rows(num_tokens: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Rows [T, 512] with magnitudes over many binades and a few all-zero rows."""
    g = torch.Generator().manual_seed(SEED + seed)
    x = torch.randn(num_tokens, 512, generator=g) * torch.exp(torch.randn(num_tokens, 1, generator=g) * 3)
    x[::7] = 0.0
    return x.to(dtype)


def random_pool(num_blocks: int, block_size: int, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + seed + 1)
    shape = (num_blocks, block_size, 1, V4_TOKEN_BYTES)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(device)


def test_token_is_584_bytes_and_csa_layers_keep_179_per_token():
    assert V4_TOKEN_BYTES == 448 + 2 * 64 + 7 + 1
    assert v4_bytes_per_token("csa") == (584 + 132) / 4
    assert v4_bytes_per_token("hca") == 584 / 128
    with pytest.raises(ValueError, match="layer_type"):
        v4_bytes_per_token("dense")


def test_block_bytes_match_flashmla_model1_layout():
    """Token j of a block: data at j * 576 (448 e4m3 then 64 bf16), scales at bs * 576 + j * 8."""
    block_size = 16
    rows = random_rows(block_size, seed=1)
    pool = v4_pool(1, "cpu", block_size=block_size)
    write_v4_cache(rows, pool, torch.arange(block_size), backend="reference")
    raw = pool.flatten().tolist()
    for j in (0, 5, block_size - 1):
        data, scales = quantize_v4(rows[j])
        assert raw[j * 576:(j + 1) * 576] == data.tolist()
        assert raw[block_size * 576 + j * 8:block_size * 576 + (j + 1) * 8] == scales.tolist()
        rope = struct.unpack("<64H", bytes(raw[j * 576 + 448:(j + 1) * 576]))
        assert list(rope) == rows[j, 448:].bfloat16().view(torch.int16).view(torch.uint16).tolist()
        assert scales[7] == 0  # the pad byte


def test_scales_are_powers_of_two_and_dequantization_is_within_e4m3_rounding():
    rows = random_rows(64, seed=2)
    data, scales = quantize_v4(rows)
    exponent = scales[:, :7].int() - 127
    amax = rows[:, :448].abs().unflatten(-1, (7, 64)).amax(-1).clamp_min(1e-4)
    assert torch.equal(exponent, torch.ceil(torch.log2(amax / 448)).int())
    back = dequantize_v4(data, scales)
    assert torch.equal(back[:, 448:], rows[:, 448:].bfloat16().float())
    tile_scale = torch.exp2(exponent.float()).repeat_interleave(64, dim=1)
    err = (back[:, :448] - rows[:, :448]).abs()
    assert (err <= torch.maximum(rows[:, :448].abs() / 16, tile_scale / 2**9 * 1.001)).all()


@pytest.mark.parametrize("num_tokens, num_blocks, block_size", [(1, 1, 64), (37, 3, 64), (50, 5, 16)])
def test_reference_write_lands_each_token_at_its_slot_and_nowhere_else(num_tokens, num_blocks, block_size):
    rows = random_rows(num_tokens, seed=num_tokens).bfloat16()
    pool = random_pool(num_blocks, block_size, "cpu")
    before = pool.clone()
    g = torch.Generator().manual_seed(SEED + num_tokens)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.25] = -1
    write_v4_cache(rows, pool, slots, backend="reference")

    data, scales = v4_block_views(pool)
    old_data, old_scales = v4_block_views(before)
    want_data, want_scales = quantize_v4(rows)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, block_size)
            assert torch.equal(data[block, offset], want_data[t]) and torch.equal(scales[block, offset], want_scales[t])
            written[block, offset] = True
    assert torch.equal(data[~written], old_data[~written]) and torch.equal(scales[~written], old_scales[~written])
    live = slots[slots >= 0]
    assert torch.equal(gather_v4(pool, live), dequantize_v4(want_data[slots >= 0], want_scales[slots >= 0]))


def test_write_rejects_bad_inputs():
    pool = v4_pool(2, "cpu")
    with pytest.raises(ValueError, match="kv must be"):
        write_v4_cache(torch.randn(3, 576), pool, torch.arange(3))
    with pytest.raises(ValueError, match="kv_cache must be"):
        write_v4_cache(torch.randn(3, 512), torch.zeros(2, 64, 1, 656, dtype=torch.uint8), torch.arange(3))
    with pytest.raises(ValueError, match="beyond"):
        write_v4_cache(torch.randn(3, 512), pool, torch.tensor([0, 1, 128]))
    with pytest.raises(ValueError, match="twice"):
        write_v4_cache(torch.randn(3, 512), pool, torch.tensor([4, 4, 5]))


def check_triton_write(num_tokens: int, num_blocks: int, block_size: int, dtype, device) -> None:
    rows = random_rows(num_tokens, seed=num_tokens, dtype=dtype).to(device)
    g = torch.Generator().manual_seed(SEED + num_tokens)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1
    slots = slots.to(device)
    got, want = random_pool(num_blocks, block_size, device), random_pool(num_blocks, block_size, device)
    write_v4_cache(rows, got, slots, backend="triton")
    write_v4_cache(rows, want, slots, backend="reference")
    assert torch.equal(got, want), f"seed {SEED}: {int((got != want).sum())} V4 cache bytes differ"


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, num_blocks, block_size", [(1, 1, 64), (100, 4, 64), (3000, 60, 64), (70, 9, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_write_is_byte_exact(num_tokens, num_blocks, block_size, dtype):
    check_triton_write(num_tokens, num_blocks, block_size, dtype, torch.device("cuda"))


def run_interpreter_cases() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        check_triton_write(40, 2, 64, dtype, torch.device("cpu"))
        check_triton_write(20, 3, 16, dtype, torch.device("cpu"))


def test_triton_write_under_interpreter():
    run_under_interpreter(__file__, SEED)


def run_memcheck_case() -> None:
    check_triton_write(300, 6, 64, torch.bfloat16, torch.device("cuda"))
    torch.cuda.synchronize()


if __name__ == "__main__":
    kernel_test_main(run_interpreter_cases, run_memcheck_case)
