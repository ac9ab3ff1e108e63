"""Native (CUDA C++) indexer top-k against the reference on the same logits: exactly the same
positions in the same order (score descending, ties to the lower column, -1 padded); unsorted,
the same set by ascending column (radix kernel) or in the sorted order (rank kernel: rows of at
most RANK_MAX_WIDTH columns while rows x width^2 <= RANK_MAX_WORK). Fresh random inputs each run (the seed is printed on failure),
outputs poisoned before the kernel writes them. GPU tests (Hopper) are marked ``gpu``;
``python tests/indexer/test_cuda_topk.py --memcheck`` runs small cases for compute-sanitizer.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from flashdsa.runtime import dispatch
from flashdsa.runtime.indexer import CUDA_MAX_TOPK, indexer_fused_topk, indexer_logits, indexer_topk
from flashdsa.testing import assert_raw_op_refuses, indexer_operands, poisoned_empty, tricky_logits

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


RANK_MAX_WIDTH, RANK_MAX_WORK = 4096, 1 << 27  # topk.cu's rank kernel serves these batches


def rank_kernel_serves(rows: int, width: int) -> bool:
    return width <= RANK_MAX_WIDTH and rows * width * width <= RANK_MAX_WORK


TIE_RUN_MAX = 64  # topk.cu: a sorted selection with a longer run of equal scores takes the 64-bit sort


def longest_ties(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """Per row, the longest run of equal scores in the (reference) sorted top-k of whole rows."""
    ref = indexer_topk(logits, topk, backend="reference").long()
    scores = logits.gather(1, ref.clamp(min=0)).masked_fill(ref < 0, float("nan")).cpu()
    equal = scores[:, 1:] == scores[:, :-1]  # -0.0 == +0.0; NaN padding equals nothing
    run, longest = torch.zeros(logits.shape[0]), torch.zeros(logits.shape[0])
    for j in range(equal.shape[1]):
        run = (run + 1) * equal[:, j]
        longest = torch.maximum(longest, run)
    return longest.long() + 1


def repeat_per_sm(logits: torch.Tensor, rows_per_sm: int) -> torch.Tensor:
    """The rows repeated to at least ``rows_per_sm`` rows an SM (0: once), on the GPU."""
    sms = torch.cuda.get_device_properties(cuda).multi_processor_count
    return logits.repeat(max(1, -(-rows_per_sm * sms // logits.shape[0])), 1).to(cuda)


def check(logits: torch.Tensor, topk: int, starts=None, ends=None) -> None:
    """cuda vs reference, sorted and unsorted, every output element poisoned before the kernel runs."""
    ref = indexer_topk(logits, topk, starts, ends, backend="reference")
    with poisoned_empty():
        got = indexer_topk(logits, topk, starts, ends, backend="cuda")
        loose = indexer_topk(logits, topk, starts, ends, sorted=False, backend="cuda")
    assert got.dtype == torch.int32 and got.shape == ref.shape
    assert torch.equal(got, ref), f"seed {SEED}: {int((got != ref).sum())} positions differ"
    if rank_kernel_serves(*logits.shape):
        assert torch.equal(loose, ref), f"seed {SEED}: the rank kernel's unsorted top-k is not its sorted one"
        return
    want = torch.where(ref >= 0, ref, INT32_MAX).sort(1).values
    assert torch.equal(loose, torch.where(want == INT32_MAX, -1, want)), f"seed {SEED}: unsorted top-k differs"


@pytest.mark.gpu
@pytest.mark.parametrize("rows, length, topk", [
    (8, 3000, 64), (12, 70000, 2048), (5, 100, 256), (3, 1, 1), (6, 4099, 2048), (2, 70001, 2048),
    (4, 131072, 2048), (64, 4103, 512), (3, 5, 7), (1, 65536, 1), (300, 2500, 256), (400, 9000, 2048),
    (300, 65536, 2048), (280, 70000, 17), (3, 200000, 2048), (2, 500000, 2048)])
def test_topk_matches_reference_on_full_rows_and_random_ranges(rows, length, topk):
    """Rows fewer than twice the SMs run 1024-thread CTAs, more rows 512-thread ones. Rows of 16
    tiles or more (131072 columns and longer in 1024-thread CTAs, 65536 in 512-thread ones) take
    the one-pass path with a sampled floor. Unsorted columns come from a bitmap of the row up to
    458752 columns, a radix sort by column past it (500000)."""
    g = generator(rows, length, topk)
    logits = tricky_logits(rows, length, cuda, g)
    check(logits, topk)
    check(logits, topk, *random_ranges(rows, length, g))


@pytest.mark.gpu
@pytest.mark.parametrize("rows, length, topk", [
    (1, 1024, 512), (32, 1024, 512), (1, 4096, 2048), (8, 4096, 64), (3, 777, 2048), (128, 1024, 512),
    (2, 4095, 1), (1, 1, 1), (5, 30, 2048), (65535, 1, 1)])
def test_short_rows_rank_kernel_matches_reference(rows, length, topk):
    """Decode-sized rows (rank kernel), with ties (the tricky logits' repeats, relu zeros), topk
    above the length, ranges that cut rows short or empty them."""
    assert rank_kernel_serves(rows, length)
    g = generator(rows, length, topk, 5)
    logits = tricky_logits(rows, length, cuda, g)
    check(logits, topk)
    check(logits, topk, *random_ranges(rows, length, g))
    check(torch.relu(logits), topk)  # a crowd of zeros level with each other: ties to the lower column


@pytest.mark.gpu
@pytest.mark.parametrize("offset, width", [(1, 20000), (0, 20003), (3, 20005), (2, 6), (1, 1024), (0, 1024),
                                           (1, 131072), (3, 140001)])
def test_rows_off_16_byte_boundaries_match(offset, width):
    """Contiguous rows whose addresses are not 16-byte aligned: a storage offset, odd row lengths
    (the last two long enough for the one-pass path)."""
    g = generator(offset, width)
    logits = torch.randn(offset + 9 * width, generator=g).to(cuda)[offset:].view(9, width)
    check(logits, 2048)
    check(logits, 300, *random_ranges(9, width, g))


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_sm", [0, 2])
def test_crowded_threshold_bins_resolve_every_digit(rows_per_sm):
    """Scores in a narrow band (every score in the top bin: the second and third digit passes read
    the row), all equal (the lowest columns win), many copies of the threshold score (more than the
    4096 candidates held in shared memory: the ordered pass; fewer: the select on columns), and
    equal scores above the threshold (sorted by column). The 8 rows repeat to ``rows_per_sm`` rows
    an SM: few rows (a pair of 1024-thread CTAs a long row, one for a shorter) and 512-thread CTAs."""
    g = generator(7)
    logits = torch.randn(8, 50000, generator=g)
    logits[0] = 1.0 + torch.randint(0, 50, (50000,), generator=g).float() * 2**-20
    logits[1] = 3.0
    logits[2, :] = -1.0
    logits[2, torch.randperm(50000, generator=g)[:5000]] = 2.0  # 5000 tied at the threshold, 2048 taken
    logits[3] = torch.randint(0, 3, (50000,), generator=g).float()
    logits[4] = 1.0 + torch.randint(0, 2**14, (50000,), generator=g).float() * 2**-22  # crowded in digit 2
    logits[5:7] = -1.0
    columns = torch.randperm(50000, generator=g)
    logits[5, columns[:3000]] = 2.0  # 3000 tied at the threshold, 2048 taken by the lowest columns
    logits[6, columns[:1000]] = 3.0  # 1000 equal above the threshold, then 1048 of 2500 tied
    logits[6, columns[1000:3500]] = 2.0
    logits[7] = -1.0  # 1000 above, then 1048 of 1500 tied: the select on columns for every CTA size
    logits[7, columns[3500:4500]] = 3.0
    logits[7, columns[4500:6000]] = 2.0
    logits = repeat_per_sm(logits, rows_per_sm)
    check(logits, 2048)
    check(logits, 17, *random_ranges(logits.shape[0], 50000, g))
    assert indexer_topk(logits[1:2], 2048, backend="cuda").tolist() == [list(range(2048))]


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_sm", [0, 2])
def test_sorted_short_ties_are_put_in_column_order(rows_per_sm):
    """Whole-number scores (normal x 400, rounded): the 2048 selected of 131072 hold runs of 2 to
    about 20 equal scores, which the sorted path puts in column order after its sort on relative
    keys. One row's selection crosses zero (+0.0 and -0.0 level with each other, keys of both
    signs: a 32-bit relative span). The 4 rows repeat to ``rows_per_sm`` rows an SM, so each CTA
    size (1024, 512 threads) runs them; then random ranges (shorter rows, longer runs)."""
    g = generator(13)
    logits = torch.randn(4, 131072, generator=g).mul(400)
    logits[3] -= 1000.0  # the 2048th largest about -140
    logits = logits.round()
    zeros = torch.randperm(131072, generator=g)[:8]
    logits[3, zeros[:4]], logits[3, zeros[4:]] = -0.0, 0.0
    longest = longest_ties(logits, 2048)
    assert ((longest >= 2) & (longest <= TIE_RUN_MAX)).all(), longest
    logits = repeat_per_sm(logits, rows_per_sm)
    check(logits, 2048)
    check(logits, 2048, *random_ranges(logits.shape[0], 131072, g))


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_sm", [0, 2])
def test_sorted_ties_longer_than_the_run_limit_take_the_64_bit_sort(rows_per_sm):
    """Selections holding a run of more than TIE_RUN_MAX equal scores (the row sorts (key, column)
    packed in 64 bits instead): TIE_RUN_MAX + 1 copies of a score inside the selection, 500 at
    its top, a relu'd row's zeros below its ~90 positive scores (a crowded tie), and TIE_RUN_MAX + 1
    taken at the threshold; next to runs of exactly TIE_RUN_MAX (no fallback: the widest runs
    put in column order) inside the selection, at its top, at the threshold, and all of it in
    such runs. The 8 rows repeat to ``rows_per_sm`` rows an SM, so each CTA size (1024, 512
    threads) runs them."""
    g = generator(17)
    width = 131072
    logits = torch.randn(8, width, generator=g)
    columns = torch.randperm(width, generator=g)
    logits[0, columns[:TIE_RUN_MAX + 1]] = 3.3  # about 60 normal scores above
    logits[1, columns[:TIE_RUN_MAX]] = 3.3
    logits[2, columns[:500]] = 6.0
    logits[3, columns[:TIE_RUN_MAX]] = 6.0
    logits[4] = torch.relu(logits[4] - 3.2)
    logits[5:8] = -1.0
    for r, need in ((5, TIE_RUN_MAX), (6, TIE_RUN_MAX + 1)):  # 2048 - need above, `need` of 100 level taken
        logits[r, columns[:2048 - need]] = 10.0 + torch.rand(2048 - need, generator=g)
        logits[r, columns[2048 - need:2148 - need]] = 5.0
    logits[7, columns[:2048]] = 10.0 + (torch.arange(2048) // TIE_RUN_MAX).float()
    longest = longest_ties(logits, 2048)
    assert (longest > TIE_RUN_MAX).tolist() == [True, False, True, False, True, False, True, False], longest
    assert (longest[1::2] == TIE_RUN_MAX).all(), longest
    logits = repeat_per_sm(logits, rows_per_sm)
    check(logits, 2048)
    check(logits, 100)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [200, 1000])
def test_rows_whose_digit_passes_resolve_the_threshold_have_no_race(rows):
    """Every row's scores share their top 21 key bits (1 + j * 2^-20, 50 values of ~1000 copies):
    the row passes resolve all three digits, and the ~1000 candidates level with the threshold are
    cut by column. A missing barrier there once lost about one such row in 500."""
    g = generator(rows)
    logits = 1.0 + torch.randint(0, 50, (rows, 50000), generator=g).float() * 2**-20
    check(logits.to(cuda), 2048)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 300])
def test_one_pass_rows_whose_sample_misleads_fall_back(rows):
    """One-pass rows (a pair of 1024-thread CTAs a row at 2 rows, 512 threads at 300) whose sampled
    tiles (every 8th tile from each CTA's first: 8192 and 4096 columns at those sizes) differ from the rest: sample scores far above
    the rest's (fewer than topk reach the floor), far below them (the candidate list overflows),
    and a sample holding the row's only finite scores; then the same with random ranges."""
    g = generator(rows, 11)
    length = 131072 if rows == 2 else 65536
    tile = 8192 if rows == 2 else 4096
    logits = torch.randn(rows, length, generator=g)
    sample = (torch.arange(length) // tile) % 8 == 0
    logits[0::3, sample] = 3.0 + torch.rand(logits[0::3].shape[0], int(sample.sum()), generator=g)
    logits[1::3, sample] = -10.0 + torch.randn(logits[1::3].shape[0], int(sample.sum()), generator=g)
    logits[2::3, ~sample] = float("-inf")
    logits = logits.to(cuda)
    check(logits, 2048)
    check(logits, 300, *random_ranges(rows, length, g))


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_sm", [0, 1, 2])
def test_one_pass_rows_at_the_candidate_limits(rows_per_sm):
    """Long rows of -1.0 holding C copies of one score x, 400 of them in the sampled tiles (so the
    floor lands on x): C = topk - 1 (too few reach the floor: the digit passes), topk, 4096 (every
    candidate slot used) and 4097 (overflow: the digit passes); x = +0.0 and -0.0 mixed (a floor of
    exactly +0.0) and a negative subnormal. The lowest columns of the tie win. Rows an SM: 0, a pair
    of 1024-thread CTAs a row (each half's first tile sampled: tiles 0 and 8 here, as for one CTA);
    1, one 1024-thread CTA; 2, 512-thread CTAs."""
    length, tile = (65536, 4096) if rows_per_sm == 2 else (131072, 8192)
    sampled = torch.nonzero((torch.arange(length) // tile) % 8 == 0).flatten()
    rest = torch.nonzero((torch.arange(length) // tile) % 8 != 0).flatten()
    g = generator(rows_per_sm, 13)
    rows = []
    for count in (2047, 2048, 4096, 4097):
        for x in ("zero", -1e-40):
            row = torch.full((length,), -1.0)
            at = torch.cat([sampled[torch.randperm(len(sampled), generator=g)[:400]],
                            rest[torch.randperm(len(rest), generator=g)[:count - 400]]])
            if x == "zero":
                row[at] = torch.where(torch.rand(count, generator=g) < 0.5, 0.0, -0.0)
            else:
                row[at] = x
            rows.append(row)
    logits = repeat_per_sm(torch.stack(rows), rows_per_sm)
    check(logits, 2048)


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_sm", [0.5, 1])
def test_long_rows_of_small_batches_split_over_cta_pairs(rows_per_sm):
    """At most half a row an SM, rows of a long row's width or more take a pair of CTAs each (one
    half a CTA; 1 row an SM: one CTA a row). Rows whose top scores all sit in one half, straddle the
    middle, tie across it, mislead the sample (every tile but the row's sampled ones -inf: the second
    half's sample is empty), hold nothing but NaN in one half, or nothing finite at all, with and
    without ranges; the widths are odd so the halves meet off a 16-byte boundary."""
    sms = torch.cuda.get_device_properties(cuda).multi_processor_count
    rows, width = max(8, int(rows_per_sm * sms)), 200003
    g = generator(int(rows_per_sm * 10))
    logits = torch.randn(rows, width, generator=g)
    logits[0, : width // 2] += 5.0  # the first half holds every top score
    logits[1, width // 2:] += 5.0  # the second
    logits[2, width // 2 - 1500: width // 2 + 1500] = 9.0  # 3000 tied across the middle: the lowest columns
    logits[3] = torch.randint(0, 4, (width,), generator=g).float()  # ties everywhere: the digit passes
    sample = (torch.arange(width) // 8192) % 8 == 0
    logits[4, ~sample] = float("-inf")
    logits[5, : width // 2] = float("nan")
    logits[6] = float("nan")
    logits[7] = float("-inf")
    logits = logits.to(cuda)
    check(logits, 2048)
    check(logits, 777, *random_ranges(rows, width, g))


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
def test_rows_without_ranges_make_no_host_sync():
    """Without starts/ends nothing needs checking on the device, so eager calls queue back to back
    (given ranges are checked, which reads them back)."""
    logits = torch.randn(4, 5000, device=cuda)
    indexer_topk(logits, 64, backend="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        indexer_topk(logits, 64, backend="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def fused_inputs(num_q: int, num_keys: int, g: torch.Generator, causal: bool = False) -> tuple:
    """FP8 queries [T, 64, 128], weights of both signs, quantized keys, and ranges per query: random
    ones (with an empty and a full row), or causal ones as a prefill's last T queries have."""
    q, weights, k_fp8, k_scale = indexer_operands(num_q, 64, num_keys, g)
    if causal:
        ends = (num_keys - num_q + 1 + torch.arange(num_q, dtype=torch.int32)).clamp(0, num_keys)
        starts = torch.zeros_like(ends)
    else:
        starts, ends = (t.cpu() for t in random_ranges(num_q, num_keys, g))
    return tuple(t.to(cuda) for t in (q, weights, k_fp8, k_scale, starts, ends))


@pytest.mark.gpu
@pytest.mark.parametrize("num_q, num_keys, topk, causal, scratch_rows", [
    (70, 9000, 2048, False, None), (300, 5000, 64, True, 7), (5, 3000, 2048, True, 1), (40, 1, 4, False, None),
    (9, 0, 16, True, None), (0, 100, 8, True, None), (1200, 1500, 512, True, 500)])
def test_fused_topk_equals_topk_of_the_logits(monkeypatch, num_q, num_keys, topk, causal, scratch_rows):
    """Whole rows scored a group at a time (``scratch_rows`` rows a group where given: several groups,
    one row each, a short last one), then selected: exactly the reference top-k of the Triton logits."""
    from flashdsa.runtime.indexer.cuda import topk as cuda_topk

    if scratch_rows is not None:
        monkeypatch.setattr(cuda_topk, "SCRATCH_BYTES", scratch_rows * 4 * num_keys)
    inputs = fused_inputs(num_q, num_keys, generator(num_q, num_keys, topk), causal)
    with poisoned_empty():
        got = indexer_fused_topk(*inputs, topk, backend="cuda")
    logits = indexer_logits(*inputs, backend="triton")
    want = indexer_topk(logits, topk, *inputs[4:], backend="reference")
    assert torch.equal(got, want), f"seed {SEED}: fused top-k differs at {int((got != want).sum())} places"


RAW_OP_CASES = """
logits = torch.randn(4, 300, device=cuda)
ends = torch.full((4,), 300, dtype=torch.int32, device=cuda)
starts = torch.zeros_like(ends)
out = torch.empty(4, 64, dtype=torch.int32, device=cuda)
CASES = [
    ("logits must be a CUDA fp32", (logits.half(), starts, ends, 64, True, out, stream)),
    ("topk must be in [1, ", (logits, starts, ends, 0, True, out, stream)),
    ("starts must be a Int tensor of 4 rows", (logits, starts.long(), ends, 64, True, out, stream)),
    ("ends must be a Int tensor of 4 rows", (logits, starts, ends[:3], 64, True, out, stream)),
    ("starts and ends must be given together", (logits, starts, None, 64, True, out, stream)),
    ("out must be [4, 32]", (logits, starts, ends, 32, True, out, stream))]
"""


@pytest.mark.gpu
def test_the_raw_op_refuses_bad_arguments_with_their_names():
    """The C++ op's own checks, which print numbers and shapes (see native.py on libstdc++)."""
    assert_raw_op_refuses("flashdsa.runtime.indexer.cuda", "topk", "torch.ops.flashdsa.indexer_topk_cuda",
                          RAW_OP_CASES)


@pytest.mark.gpu
def test_dispatch_picks_cuda_on_hopper_and_refuses_larger_topk(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cuda backend serves SM90 only")
    from flashdsa.runtime.indexer.cuda import topk

    assert dispatch.select("indexer_topk", cuda, topk=2048) is topk.indexer_topk
    assert dispatch.select("indexer_fused_topk", cuda, head_dim=128, topk=2048) is topk.indexer_fused_topk
    with pytest.raises(ValueError, match=f"topk <= {CUDA_MAX_TOPK}, got {CUDA_MAX_TOPK + 1}"):
        indexer_topk(torch.randn(2, 5000, device=cuda), CUDA_MAX_TOPK + 1, backend="cuda")


def run_memcheck_case() -> None:
    """Small cases that stress the edges for compute-sanitizer (memcheck, racecheck): ranges at the
    row ends, empty rows, rows with nothing finite, topk > length, unaligned views, every CTA size,
    crowded bins (the last: all three digits resolved by row passes)."""
    g = generator(5)
    logits = tricky_logits(8, 1501, cuda, g)
    check(logits, 2048, *random_ranges(8, 1501, g))
    check(logits.view(-1)[1:1 + 8 * 1500].view(8, 1500), 64)
    check(tricky_logits(300, 700, cuda, g), 300)  # 512-thread CTAs
    check(torch.randn(2, 131072, generator=g).to(cuda), 2048)  # one pass with a sampled floor
    check(torch.full((3, 900), float("nan"), device=cuda), 16)
    check((1.0 + torch.randint(0, 9, (2, 9000), generator=g).float() * 2**-20).to(cuda), 2048)
    torch.cuda.synchronize()


if __name__ == "__main__":
    if sys.argv[1:] != ["--memcheck"]:
        sys.exit(f"usage: {sys.argv[0]} --memcheck")
    run_memcheck_case()
