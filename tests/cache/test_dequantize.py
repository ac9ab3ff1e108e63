"""dequantize_mla_blocks: every backend against a token-by-token restatement through the layout's
``dequantize_mla``, on random pools (bytes of unlisted blocks are NaN codes), block ids that are
-1, past the pool or repeated, several block sizes; outputs start poisoned (NaN)."""

import pytest
import torch

from flashdsa.runtime.cache import dequantize_mla_blocks
from flashdsa.runtime.cache.layout import D_QK, dequantize_mla
from flashdsa.testing import (
    flood_cuda_allocator_with_nan,
    kernel_test_main,
    poisoned_empty,
    random_mla_cache,
    run_under_interpreter,
)

# (pool blocks, block size, block ids: -1 and ids past the pool give zero rows)
CASES = [(6, 64, [3, 0, -1, 5, 3]), (5, 16, [4, 9, 1, 2]), (3, 4, [2, -1, 0]), (2, 64, []), (1, 64, [-1, -1])]


def restated(pool: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    rows = []
    for block in block_ids:
        for o in range(pool.shape[1]):
            listed = 0 <= block < pool.shape[0]
            rows.append(dequantize_mla(pool[block, o, 0]) if listed else torch.zeros(D_QK))
    return torch.stack(rows).view(-1, 1, D_QK) if rows else torch.zeros(0, 1, D_QK)


def check_backend(device: str, backend: str, dtype: torch.dtype = torch.bfloat16) -> None:
    g = torch.Generator().manual_seed(0)
    for num_blocks, block_size, ids in CASES:
        pool = random_mla_cache(num_blocks + 1, block_size, generator=g, scale=0.3)
        pool[-1] = 0xFF  # NaN codes and scales: a read of a block past num_blocks shows
        pool = pool[:num_blocks]
        want = restated(pool, ids).to(dtype)
        for id_dtype in (torch.int32, torch.int64):
            flood_cuda_allocator_with_nan(torch.device(device))
            got = dequantize_mla_blocks(pool.to(device), torch.tensor(ids, dtype=id_dtype, device=device), dtype,
                                        backend=backend)
            assert got.dtype == dtype and got.shape == (len(ids) * block_size, 1, D_QK), (got.dtype, got.shape)
            assert torch.equal(got.cpu(), want), (num_blocks, block_size, ids, backend)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_matches_the_restatement(dtype):
    with poisoned_empty():
        check_backend("cpu", "reference", dtype)


@pytest.mark.parametrize("bad, message", [
    (dict(kv_cache=torch.zeros(2, 64, 1, 132, dtype=torch.uint8)), "kv_cache must be"),
    (dict(block_ids=torch.zeros(2, 1, dtype=torch.int32)), "block_ids must be"),
    (dict(block_ids=torch.zeros(2)), "block_ids must be"), (dict(dtype=torch.float16), "dtype must be")])
def test_bad_arguments_name_themselves(bad, message):
    args = dict(kv_cache=torch.zeros(2, 64, 1, 656, dtype=torch.uint8), block_ids=torch.zeros(2, dtype=torch.int32),
                dtype=torch.bfloat16) | bad
    with pytest.raises(ValueError, match=message):
        dequantize_mla_blocks(**args)


def test_triton_kernel_matches_in_the_interpreter():
    run_under_interpreter(__file__, 0)


@pytest.mark.gpu
def test_triton_kernel_matches_on_gpu():
    check_backend("cuda", "triton")


if __name__ == "__main__":
    kernel_test_main(lambda: check_backend("cpu", "triton"), lambda: check_backend("cuda", "triton"))
