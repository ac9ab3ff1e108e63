"""Native (CUDA C++) paged indexer logits against the reference: the same -inf pattern, finite
scores within the Triton kernel's tolerance of their magnitude bound (both sum FP8 tensor-core
dots promoted to fp32 every 128). Fresh random inputs each run (the seed is printed on failure),
outputs poisoned before the kernel writes them. GPU tests (Hopper) are marked ``gpu``;
``python tests/indexer/test_cuda_paged_logits.py --memcheck`` runs small cases for compute-sanitizer.
"""

from __future__ import annotations

import sys

import pytest
import torch
from test_triton_indexer import check_paged, generator, paged_inputs

from flashdsa.runtime import dispatch
from flashdsa.runtime.indexer import indexer_logits_paged
from flashdsa.testing import assert_raw_op_refuses

cuda = torch.device("cuda")


def cuda_paged(next_n: int, heads: int, lens: list[int], *salt: int, width_extra: int = 0, **knobs) -> torch.Tensor:
    q, weights, pool, context_lens, table, width = paged_inputs(len(lens), next_n, heads, lens, cuda,
                                                                generator(next_n, heads, len(lens), *salt))
    return check_paged(q, weights, pool, context_lens, table, width + width_extra, backend="cuda", **knobs)


@pytest.mark.gpu
@pytest.mark.parametrize("next_n, heads, lens", [
    (1, 64, [1, 64, 65, 3000]), (2, 64, [2, 777]), (3, 16, [5, 130, 1000]), (4, 20, [4, 64]),
    (1, 128, [500, 3]), (2, 128, [129, 64]), (1, 256, [200]), (1, 8, [70, 1]), (4, 64, [4, 200, 4097]),
    (1, 1, [33]), (2, 32, [2, 300]),
])
def test_paged_logits_match_reference(next_n, heads, lens):
    cuda_paged(next_n, heads, lens)
    cuda_paged(next_n, heads, lens, 1, width_extra=-5)  # max_context_len = the longest context


@pytest.mark.gpu
@pytest.mark.parametrize("blocks_per_cta", [1, 3, 16, 64])
def test_launch_variants_and_a_wide_minus_inf_tail_match_reference(blocks_per_cta):
    """CTAs of 1..64 blocks, some past every context (only -inf), the last one partial."""
    cuda_paged(1, 64, [3, 300, 5000], blocks_per_cta, width_extra=9000, blocks_per_cta=blocks_per_cta)


@pytest.mark.gpu
@pytest.mark.parametrize("blocks_per_cta", [1, 16])
def test_positions_past_the_context_may_be_left_unwritten(blocks_per_cta):
    """fill_past_context=False: the positions inside each context are as with it (the rest is not
    compared); CTAs past every context, and a context ending inside a CTA's run."""
    cuda_paged(2, 64, [2, 300, 5000], blocks_per_cta, width_extra=9000, fill_past_context=False,
               blocks_per_cta=blocks_per_cta)


@pytest.mark.gpu
def test_table_entries_past_the_context_are_never_read():
    """A table exactly as wide as the longest context (the last request's), so reading past that
    context is out of bounds (compute-sanitizer's memcheck case); the shorter contexts' entries
    past them are out of range. One block a CTA, and CTAs past every context."""
    q, weights, pool, lens, table, width = paged_inputs(3, 1, 64, [10, 64, 129], cuda, generator(11))
    table = table[:, :3].contiguous()
    table[0, 1:] = 2**30  # blocks 1.. of a 10-token context
    table[1, 1:] = -1
    check_paged(q, weights, pool, lens, table, width + 300, backend="cuda", blocks_per_cta=1)


@pytest.mark.gpu
def test_decode_at_128k_context():
    """Two requests at 128K context; one of them an MTP pair (n = 2)."""
    cuda_paged(1, 64, [131072, 100000])
    cuda_paged(2, 64, [131072, 77777])


@pytest.mark.gpu
def test_dispatch_picks_cuda_on_hopper_and_refuses_what_it_cannot_fit(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the native kernels are Hopper's")
    assert dispatch.select("indexer_logits_paged", cuda, None, block_size=64, next_n=2, heads=64).__module__ == (
        "flashdsa.runtime.indexer.cuda.paged_logits")
    assert "triton" in dispatch.select("indexer_logits_paged", cuda, None, block_size=64, next_n=5, heads=64).__module__
    q, weights, pool, lens, table, width = paged_inputs(1, 3, 128, [70], cuda, generator(3))
    with pytest.raises(ValueError, match="256 columns"):
        indexer_logits_paged(q, weights, pool, lens, table, width, backend="cuda")


RAW_OP_CASES = """
q = torch.zeros(2, 1, 64, 128, dtype=torch.float8_e4m3fn, device="cuda")
w = torch.zeros(2, 64, device="cuda")
cache = torch.zeros(4, 64, 1, 132, dtype=torch.uint8, device="cuda")
lens = torch.ones(2, dtype=torch.int32, device="cuda")
table = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
out = torch.empty(2, 100, device="cuda")
CASES = [
    ("weights must be", (q, w[:1], cache, lens, table, 100, True, 4, out, 0)),
    ("cache must be [num_blocks, 64, 1, 132]", (q, w, cache.view(8, 32, 1, 132), lens, table, 100, True, 4, out, 0)),
    ("context_lens must have", (q, w, cache, lens[:1], table, 100, True, 4, out, 0)),
    ("block_tables must be", (q, w, cache, lens, table.t(), 100, True, 4, out, 0)),
    ("out must be", (q, w, cache, lens, table, 99, True, 4, out, 0)),
    ("blocks_per_cta must be", (q, w, cache, lens, table, 100, True, 65, out, 0)),
    ("do not fit one wgmma", (torch.zeros(2, 5, 64, 128, dtype=torch.float8_e4m3fn, device="cuda"), w.repeat(5, 1),
                              cache, lens, table, 100, True, 4, out.repeat(5, 1), 0)),
]
"""


@pytest.mark.gpu
def test_raw_op_refuses_bad_arguments_naming_them():
    assert_raw_op_refuses("flashdsa.runtime.indexer.cuda", "paged_logits",
                          "torch.ops.flashdsa.indexer_logits_paged_cuda", RAW_OP_CASES)


def run_memcheck_case() -> None:
    """Small cases at the edges for compute-sanitizer: partial blocks, -inf tails, every query
    count, table entries past the contexts out of range."""
    cuda_paged(1, 64, [1, 65, 300], width_extra=200, blocks_per_cta=2)
    cuda_paged(4, 16, [4, 130])
    cuda_paged(2, 128, [2, 64])
    test_table_entries_past_the_context_are_never_read()


if __name__ == "__main__":
    if sys.argv[1:] != ["--memcheck"]:
        sys.exit(f"usage: {sys.argv[0]} --memcheck")
    run_memcheck_case()
