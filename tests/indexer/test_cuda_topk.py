"""Native (CUDA C++) indexer top-k against the reference on the same logits: exactly the same
positions in the same order (score descending, ties to the lower column, -1 padded); unsorted,
the same set by ascending column. Every case runs both kernels: the cluster kernel (rows up to
~160K columns, 1 to 8 CTAs per row, more when rows are few) and the streaming one (longer rows;
forced with ``one_cta_per_row``). Fresh random inputs each run (the seed is printed on failure),
outputs poisoned before the kernel writes them. GPU tests (Hopper) are marked ``gpu``;
``python tests/indexer/test_cuda_topk.py --memcheck`` runs small cases for compute-sanitizer.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from flashdsa.runtime import dispatch
from flashdsa.runtime.indexer import CUDA_MAX_TOPK, indexer_topk
from flashdsa.testing import poisoned_empty, tricky_logits

SEED = int.from_bytes(os.urandom(4), "little")
INT32_MAX = torch.iinfo(torch.int32).max
cuda = torch.device("cuda")


def generator(*salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + sum(s * 7919**i for i, s in enumerate(salt)))


def random_ranges(rows: int, length: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random [start, end) per row, with one full row, one empty row and one row of length 1."""
    a, b = torch.randint(0, length + 1, (2, rows), generator=g, dtype=torch.int32)
    starts, ends = torch.minimum(a, b), torch.maximum(a, b)
    starts[0], ends[0] = 0, length
    if rows > 2:
        starts[1] = ends[1] = length // 2
        starts[2], ends[2] = length - 1, length
    return starts.to(cuda), ends.to(cuda)


def check(logits: torch.Tensor, topk: int, starts=None, ends=None) -> None:
    """cuda (both kernels) vs reference, sorted and unsorted, every output element poisoned before
    the kernel runs."""
    from flashdsa.runtime.indexer.cuda import topk as cuda_topk

    ref = indexer_topk(logits, topk, starts, ends, backend="reference")
    want = torch.where(ref >= 0, ref, INT32_MAX).sort(1).values
    want = torch.where(want == INT32_MAX, -1, want)
    rows, length = logits.shape
    starts = torch.zeros(rows, dtype=torch.int32, device=cuda) if starts is None else starts
    ends = torch.full((rows,), length, dtype=torch.int32, device=cuda) if ends is None else ends
    for one_cta_per_row in (False, True):
        kernel = "streaming" if one_cta_per_row else "default"
        with poisoned_empty():
            got = cuda_topk.indexer_topk(logits, topk, starts, ends, True, one_cta_per_row)
            loose = cuda_topk.indexer_topk(logits, topk, starts, ends, False, one_cta_per_row)
        assert got.dtype == torch.int32 and got.shape == ref.shape
        assert torch.equal(got, ref), f"seed {SEED}, {kernel} kernel: {int((got != ref).sum())} positions differ"
        assert torch.equal(loose, want), f"seed {SEED}, {kernel} kernel: unsorted top-k differs"


@pytest.mark.gpu
@pytest.mark.parametrize("rows, length, topk", [
    (8, 3000, 64), (12, 70000, 2048), (5, 100, 256), (3, 1, 1), (6, 4099, 2048), (2, 70001, 2048),
    (4, 131072, 2048), (64, 4103, 512), (3, 5, 7), (1, 65536, 1),
    (2, 163837, 2048), (2, 163838, 2048), (3, 200003, 1024),  # the longest cluster-sized row, then streaming
    (600, 20000, 2048), (300, 70001, 100), (130, 131075, 2048)])  # many rows: the fewest CTAs per row
def test_topk_matches_reference_on_full_rows_and_random_ranges(rows, length, topk):
    g = generator(rows, length, topk)
    logits = tricky_logits(rows, length, cuda, g)
    check(logits, topk)
    check(logits, topk, *random_ranges(rows, length, g))


@pytest.mark.gpu
@pytest.mark.parametrize("offset, width", [(1, 20000), (0, 20003), (3, 20005), (2, 6)])
def test_rows_off_16_byte_boundaries_match(offset, width):
    """Contiguous rows whose addresses are not 16-byte aligned: a storage offset, odd row lengths."""
    g = generator(offset, width)
    logits = torch.randn(offset + 9 * width, generator=g).to(cuda)[offset:].view(9, width)
    check(logits, 2048)
    check(logits, 300, *random_ranges(9, width, g))


@pytest.mark.gpu
@pytest.mark.parametrize("pad", [1, 37, 4096])
def test_rows_with_any_stride_match(pad):
    """Row views of a wider tensor (stride != width): each row starts at a different alignment."""
    g = generator(pad)
    logits = torch.randn(10, 50000 + pad, generator=g).to(cuda)[:, pad // 2:pad // 2 + 50000]
    check(logits, 2048)
    check(logits, 999, *random_ranges(10, 50000, g))


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["first", "last", "boundary"])
def test_selection_crowded_into_one_slice_of_a_row_matches(where):
    """The whole top-k in one CTA's slice (its selection starts at output rank 0, or after nothing
    from the others), or level scores straddling the slice boundaries."""
    g = generator(len(where))
    logits = torch.randn(4, 120000, generator=g)
    if where == "first":
        logits[:, :3000] += 100.0
    elif where == "last":
        logits[:, -3000:] += 100.0
    else:
        logits[:, 14000:19000] = 50.0  # level with the threshold across slice edges (15004, 30008)
        logits[:, 30000:31000] = 60.0
    check(logits.to(cuda), 2048)
    check(logits.to(cuda), 2048, *random_ranges(4, 120000, g))


@pytest.mark.gpu
def test_crowded_threshold_bins_resolve_every_digit():
    """Scores in a narrow band (every score in the top bin: the second and third digit passes read
    the row), all equal (the lowest columns win), and many copies of the threshold score."""
    g = generator(7)
    logits = torch.randn(6, 50000, generator=g)
    logits[0] = 1.0 + torch.randint(0, 50, (50000,), generator=g).float() * 2**-20
    logits[1] = 3.0
    logits[2, :] = -1.0
    logits[2, torch.randperm(50000, generator=g)[:5000]] = 2.0  # 5000 tied at the threshold, 2048 taken
    logits[3] = torch.randint(0, 3, (50000,), generator=g).float()
    logits[4] = 1.0 + torch.randint(0, 2**14, (50000,), generator=g).float() * 2**-22  # crowded in digit 2
    check(logits.to(cuda), 2048)
    check(logits.to(cuda), 17, *random_ranges(6, 50000, g))
    assert indexer_topk(logits[1:2].to(cuda), 2048, backend="cuda").tolist() == [list(range(2048))]


@pytest.mark.gpu
def test_rows_with_nothing_finite_or_nothing_in_range_are_all_minus_one():
    logits = torch.full((4, 700), float("-inf"), device=cuda)
    logits[1] = float("nan")
    logits[2] = float("inf")
    logits[3] = 1.0
    starts = torch.tensor([0, 0, 0, 350], dtype=torch.int32, device=cuda)
    ends = torch.tensor([700, 700, 700, 350], dtype=torch.int32, device=cuda)
    for sorted_ in (True, False):
        with poisoned_empty():
            got = indexer_topk(logits, 128, starts, ends, sorted=sorted_, backend="cuda")
        assert (got == -1).all()
    assert indexer_topk(torch.randn(0, 9, device=cuda), 5, backend="cuda").shape == (0, 5)
    assert (indexer_topk(torch.randn(3, 0, device=cuda), 5, backend="cuda") == -1).all()


@pytest.mark.gpu
def test_topk_replays_in_a_cuda_graph():
    g = generator(11)
    logits = torch.randn(16, 30000, generator=g).to(cuda)
    starts, ends = random_ranges(16, 30000, g)
    indexer_topk(logits, 2048, starts, ends, backend="cuda")  # build and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = indexer_topk(logits, 2048, starts, ends, backend="cuda")
    logits.copy_(torch.randn(16, 30000, generator=g).to(cuda))
    graph.replay()
    assert torch.equal(out, indexer_topk(logits, 2048, starts, ends, backend="reference"))


@pytest.mark.gpu
def test_dispatch_picks_cuda_on_hopper_and_refuses_larger_topk(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cuda backend serves SM90 only")
    from flashdsa.runtime.indexer.cuda import topk

    assert dispatch.select("indexer_topk", cuda, topk=2048) is topk.indexer_topk
    with pytest.raises(ValueError, match=f"topk <= {CUDA_MAX_TOPK}, got {CUDA_MAX_TOPK + 1}"):
        indexer_topk(torch.randn(2, 5000, device=cuda), CUDA_MAX_TOPK + 1, backend="cuda")


def run_memcheck_case() -> None:
    """Small cases that stress the edges for compute-sanitizer: ranges at the row ends, empty rows,
    rows with nothing finite, topk > length, unaligned views, crowded bins."""
    g = generator(5)
    logits = tricky_logits(8, 1501, cuda, g)
    check(logits, 2048, *random_ranges(8, 1501, g))
    check(logits.view(-1)[1:1 + 8 * 1500].view(8, 1500), 64)
    check(torch.full((3, 900), float("nan"), device=cuda), 16)
    check((1.0 + torch.randint(0, 9, (2, 9000), generator=g).float() * 2**-20).to(cuda), 2048)
    multi = tricky_logits(4, 20001, cuda, g)  # few rows: 8 CTAs per row, ranges ending in any slice
    check(multi, 2048, *random_ranges(4, 20001, g))
    check(multi.view(-1)[3:3 + 4 * 20000].view(4, 20000)[:, 1:19990], 700)
    check(tricky_logits(1, 170001, cuda, g), 2048)  # too long for a cluster: the streaming kernel
    torch.cuda.synchronize()


if __name__ == "__main__":
    if sys.argv[1:] != ["--memcheck"]:
        sys.exit(f"usage: {sys.argv[0]} --memcheck")
    run_memcheck_case()
