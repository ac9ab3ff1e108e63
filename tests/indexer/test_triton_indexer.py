"""Triton indexer kernels (Hadamard, FP8 logits ragged and paged, top-k, fused score + top-k)
against the reference backend.

Logits: the kernel sums FP8 tensor-core dots (whose in-step accumulation on SM90 keeps fewer
bits than fp32), the reference in float64, so each score may differ by rounding of its terms:
we allow 5e-4 of the score's magnitude bound ``k_scale * sum_h |w_h| sum_d |q_hd k_d|`` (the
reference evaluated on absolute values); -inf must match.
Top-k: both backends get the same logits and must agree exactly (same positions, same order,
ties to the lower position). The fused top-k must equal top-k of the Triton logits exactly (each
score is computed the same way whatever chunk holds it). The Hadamard butterfly is bit-exact.
GPU tests are marked ``gpu``; the CPU test runs tiny cases under TRITON_INTERPRET=1 in a subprocess.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from flashdsa.runtime.cache.layout import BLOCK_SIZE, indexer_block_views, quantize_indexer_key
from flashdsa.runtime.indexer import (
    hadamard_transform,
    indexer_fused_topk,
    indexer_logits,
    indexer_logits_paged,
    indexer_topk,
    reference,
    rotate_quantize_indexer,
)
from flashdsa.testing import (
    indexer_operands,
    kernel_test_main,
    poisoned_empty,
    random_block_table,
    run_under_interpreter,
    tricky_logits,
)

SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
LOGITS_RTOL = 5e-4


def generator(*salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + sum(s * 7919**i for i, s in enumerate(salt)))


def ragged_inputs(num_q, num_heads, num_keys, device, g):
    """Rotated-looking FP8 queries and keys, weights, and random ranges [start, end) per query."""
    q, weights, k_fp8, k_scale = indexer_operands(num_q, num_heads, num_keys, g)
    starts = torch.randint(0, max(1, num_keys // 3), (num_q,), generator=g, dtype=torch.int32).clamp(max=num_keys)
    ends = (starts + torch.randint(0, num_keys + 1, (num_q,), generator=g, dtype=torch.int32)).clamp(max=num_keys)
    return tuple(t.to(device) for t in (q, weights, k_fp8, k_scale, starts, ends))


def assert_logits_close(got, ref, bound):
    """Same -inf pattern and values (a NaN-poisoned output left unwritten fails); finite scores
    within LOGITS_RTOL of their magnitude bound."""
    assert got.shape == ref.shape and got.dtype == torch.float32
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), finite), f"seed {SEED}: -inf pattern differs"
    assert torch.equal(got[~finite], ref[~finite]), f"seed {SEED}: a masked score is not -inf (never written?)"
    err = (got - ref).abs()[finite]
    ratio = (err / (bound[finite] + 1e-30)).max().item() if err.numel() else 0.0
    assert ratio <= LOGITS_RTOL, f"seed {SEED}: logits off by {ratio:.3g} of their magnitude bound"


def fp8_abs(x: torch.Tensor) -> torch.Tensor:
    return (x.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)


def check_ragged(q, weights, k_fp8, k_scale, starts, ends, rows=None):
    """Public op vs the reference; with ``rows`` (queries a program scores), the kernel's window
    API instead, over a window of key columns that starts and ends inside the keys."""
    ref = reference.indexer_logits(q, weights, k_fp8, k_scale, starts, ends)
    bound = reference.indexer_logits(fp8_abs(q), weights.abs(), fp8_abs(k_fp8), k_scale, starts, ends)
    if rows is None:
        got = indexer_logits(q, weights, k_fp8, k_scale, starts, ends, backend="triton")
    else:
        from flashdsa.runtime.indexer.triton.logits import ragged_logits_into

        cols = slice(min(37, k_fp8.shape[0]), max(0, k_fp8.shape[0] - 5))
        got = torch.full((q.shape[0], cols.stop - cols.start), 7.0, device=q.device)
        ragged_logits_into(got, q, weights, k_fp8, k_scale, starts, ends, cols.start, rows=rows)
        ref, bound = ref[:, cols], bound[:, cols]
    assert_logits_close(got, ref, bound)
    return got


def paged_inputs(batch, next_n, num_heads, lens, device, g):
    """An indexer pool with random keys in scattered blocks, its block table and decode queries."""
    max_len = max(lens)
    blocks_per_seq = max(1, -(-max_len // BLOCK_SIZE))
    num_blocks = batch * blocks_per_seq + 2
    pool = torch.randint(0, 256, (num_blocks, BLOCK_SIZE, 1, 132), generator=g, dtype=torch.uint8)
    keys, scales = indexer_block_views(pool)
    k, s = quantize_indexer_key(torch.randn(num_blocks, BLOCK_SIZE, 128, generator=g))
    keys.copy_(k)
    scales.copy_(s)
    table = random_block_table(batch, blocks_per_seq, num_blocks, generator=g)
    q = (torch.randn(batch, next_n, num_heads, 128, generator=g) * 40).to(torch.float8_e4m3fn)
    weights = torch.randn(batch * next_n, num_heads, generator=g) * 0.1
    lens = torch.tensor(lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, weights, pool, lens, table)) + (max_len + 5,)


PAGED_MODULES = {"triton": "flashdsa.runtime.indexer.triton.logits", "cuda": "flashdsa.runtime.indexer.cuda.paged_logits"}


def check_paged(q, weights, pool, lens, table, width, backend="triton", fill_past_context=True, **knobs):
    """Public op (or, with launch ``knobs``, the backend itself) vs the reference; the output is
    poisoned before the kernel writes it. Without ``fill_past_context`` only the positions inside
    each request's context are compared (the rest is unspecified)."""
    with poisoned_empty():
        if knobs:
            module = importlib.import_module(PAGED_MODULES[backend])
            got = module.indexer_logits_paged(q, weights, pool, lens, table, width, fill_past_context, **knobs)
        else:
            got = indexer_logits_paged(q, weights, pool, lens, table, width, fill_past_context=fill_past_context,
                                       backend=backend)
    ref = reference.indexer_logits_paged(q, weights, pool, lens, table, width)
    abs_pool = pool.clone()
    keys, _ = indexer_block_views(abs_pool)
    keys.copy_(fp8_abs(keys))
    bound = reference.indexer_logits_paged(fp8_abs(q), weights.abs(), abs_pool, lens, table, width)
    if not fill_past_context:
        inside = torch.arange(width, device=got.device)[None, :] < lens.repeat_interleave(q.shape[1])[:, None]
        got, ref, bound = got[inside], ref[inside], bound[inside]
    assert_logits_close(got, ref, bound)
    return got


def check_topk(logits, topk, starts=None, ends=None, **knobs):
    """Public op (or, with launch ``knobs`` such as columns per program, the backend) vs the reference."""
    ref = indexer_topk(logits, topk, starts, ends, backend="reference")
    if knobs:
        from flashdsa.runtime.indexer.triton import topk as kernels

        rows, length = logits.shape
        starts = torch.zeros(rows, dtype=torch.int32, device=logits.device) if starts is None else starts
        ends = torch.full((rows,), length, dtype=torch.int32, device=logits.device) if ends is None else ends
        got = kernels.indexer_topk(logits, topk, starts, ends, **knobs)
    else:
        got = indexer_topk(logits, topk, starts, ends, backend="triton")
    assert got.dtype == torch.int32 and got.shape == ref.shape
    assert torch.equal(got, ref), f"seed {SEED}: {int((got != ref).sum())} positions differ"
    if not knobs:  # sorted=False: the same set, by ascending position (deterministic), then the -1 padding
        loose = indexer_topk(logits, topk, starts, ends, sorted=False, backend="triton")
        last = torch.iinfo(torch.int32).max
        want = torch.where(ref >= 0, ref, last).sort(1).values
        assert torch.equal(loose, torch.where(want == last, -1, want)), f"seed {SEED}: unsorted top-k differs"


def check_fused(q, weights, k_fp8, k_scale, starts, ends, topk, chunk):
    got = indexer_fused_topk(q, weights, k_fp8, k_scale, starts, ends, topk, chunk=chunk, backend="triton")
    logits = indexer_logits(q, weights, k_fp8, k_scale, starts, ends, backend="triton")
    want = indexer_topk(logits, topk, starts, ends, backend="reference")
    assert torch.equal(got, want), f"seed {SEED}: fused top-k differs at {int((got != want).sum())} places"


cuda = torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hadamard_is_bit_exact(dtype):
    x = torch.randn(3, 257, 128, generator=generator(1)).to(cuda, dtype)
    assert torch.equal(hadamard_transform(x, backend="triton"), hadamard_transform(x, backend="reference"))


def check_rotate_quantize(x: torch.Tensor) -> None:
    """The fused rotation + quantization equals the reference's two steps, byte for byte."""
    with poisoned_empty():
        codes, scale = rotate_quantize_indexer(x, backend="triton")
    want_codes, want_scale = rotate_quantize_indexer(x, backend="reference")
    assert codes.dtype == want_codes.dtype and codes.shape == want_codes.shape and scale.shape == want_scale.shape
    differ = int((codes.view(torch.uint8) != want_codes.view(torch.uint8)).sum())
    assert differ == 0, f"seed {SEED}: {differ} e4m3 codes differ"
    assert torch.equal(scale, want_scale), f"seed {SEED}: scales differ"


def quantize_inputs(shape, dtype, device, g) -> torch.Tensor:
    """Normal rows, rows scaled far apart (tiny to large scales, finite in ``dtype`` once rotated:
    fp16 overflows past 2^16), an all-zero row and one spike."""
    span = 10 if dtype == torch.float16 else 30
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-span, span, (*shape[:-1], 1), generator=g).float())
    x.view(-1, shape[-1])[0] = 0.0
    x.view(-1, shape[-1])[-1, 5] = 3e4
    return x.to(device, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 128), (17, 128), (3, 257, 128), (128, 64, 128)])
def test_rotate_quantize_is_bit_exact(dtype, shape):
    check_rotate_quantize(quantize_inputs(shape, dtype, cuda, generator(len(shape), shape[0])))


@pytest.mark.gpu
@pytest.mark.parametrize("num_q, num_heads, num_keys", [(1, 64, 100), (37, 64, 5000), (300, 32, 2049), (5, 3, 700)])
def test_ragged_logits_match_reference(num_q, num_heads, num_keys):
    check_ragged(*ragged_inputs(num_q, num_heads, num_keys, cuda, generator(num_q, num_heads, num_keys)))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_ragged_logits_over_a_key_window_match_reference(rows):
    """Programs of 1, 2 and 4 queries (a short last one: 37 queries), the key window inside the keys."""
    check_ragged(*ragged_inputs(37, 64, 3000, cuda, generator(rows, 7)), rows=rows)


@pytest.mark.gpu
@pytest.mark.parametrize("next_n, num_heads, lens", [(1, 64, [1, 64, 65, 3000]), (2, 64, [2, 777]),
                                                    (3, 16, [5, 130, 1000]), (4, 20, [4, 64])])
def test_paged_logits_match_reference(next_n, num_heads, lens):
    check_paged(*paged_inputs(len(lens), next_n, num_heads, lens, cuda, generator(next_n, num_heads, len(lens))))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, steps, warps, heads_on_n, next_n", [
    (128, 8, 4, False, 2), (256, 4, 8, False, 1), (64, 16, 4, True, 1), (128, 8, 4, True, 3), (64, 8, 4, True, 2)])
def test_paged_logits_launch_variants_match_reference(tokens, steps, warps, heads_on_n, next_n):
    inputs = paged_inputs(3, next_n, 64, [3, 300, 1000], cuda, generator(tokens, next_n))
    check_paged(*inputs, tokens_per_step=tokens, steps=steps, num_warps=warps, heads_on_n=heads_on_n)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, length, topk", [(8, 3000, 64), (12, 70000, 2048), (5, 100, 256), (4, 5000, 8192)])
def test_topk_matches_reference_on_same_logits(rows, length, topk):
    g = generator(rows, length, topk)
    logits = tricky_logits(rows, length, cuda, g)
    check_topk(logits, topk)
    starts = torch.randint(0, length, (rows,), generator=g, dtype=torch.int32)
    ends = (starts + torch.randint(0, length, (rows,), generator=g, dtype=torch.int32)).clamp(max=length)
    check_topk(logits, topk, starts.to(cuda), ends.to(cuda))


@pytest.mark.gpu
@pytest.mark.parametrize("split, num_warps, block", [(2048, 4, 1024), (16384, 8, 2048), (4096, 8, 512)])
def test_topk_launch_variants_match_reference(split, num_warps, block):
    """Columns per program and warps; one row packed in a narrow band, so every key is a candidate."""
    g = generator(split, num_warps, block)
    logits = tricky_logits(8, 40000, cuda, g)
    logits[5] = 1.0 + torch.randint(0, 50, (40000,), generator=g).float().to(cuda) * 2**-20
    check_topk(logits, 2048, split=split, num_warps=num_warps, block=block)


@pytest.mark.gpu
def test_topk_of_rows_with_nothing_finite_is_all_minus_one():
    logits = torch.full((3, 500), float("-inf"), device=cuda)
    logits[1] = float("nan")
    got = indexer_topk(logits, 128, backend="triton")
    assert (got == -1).all()


@pytest.mark.gpu
@pytest.mark.parametrize("topk, chunk", [(64, 1000), (2048, 4096), (512, 333)])
def test_fused_topk_equals_topk_of_logits(topk, chunk):
    inputs = ragged_inputs(70, 64, 9000, cuda, generator(topk, chunk))
    check_fused(*inputs, topk, chunk)


@pytest.mark.gpu
def test_paged_logits_past_the_context_may_be_left_unwritten():
    """fill_past_context=False: programs past every context write nothing; inside the contexts the
    scores (and the causal -inf of the queries before the last) are as with it."""
    q, weights, pool, lens, table, width = paged_inputs(3, 2, 64, [2, 300, 1000], cuda, generator(17))
    check_paged(q, weights, pool, lens, table, width + 5000, fill_past_context=False)


@pytest.mark.gpu
def test_decode_at_128k_context():
    """Paged logits of 2 requests at 128K context, then top-2048 from them, both backends."""
    q, weights, pool, lens, table, width = paged_inputs(2, 1, 64, [131072, 100000], cuda, generator(128))
    logits = check_paged(q, weights, pool, lens, table, width)
    check_topk(logits, 2048)


INTERPRETER_RAGGED = [(3, 16, 300), (2, 5, 130)]  # tiny: the interpreter is slow


def run_interpreter_cases() -> None:
    cpu = torch.device("cpu")
    x = torch.randn(3, 5, 128, generator=generator(2))
    assert torch.equal(hadamard_transform(x, backend="triton"), hadamard_transform(x, backend="reference"))
    xb = x.bfloat16()
    assert torch.equal(hadamard_transform(xb, backend="triton"), hadamard_transform(xb, backend="reference"))
    for dtype in (torch.float32, torch.bfloat16):
        check_rotate_quantize(quantize_inputs((3, 5, 128), dtype, cpu, generator(9)))
    for num_q, num_heads, num_keys in INTERPRETER_RAGGED:
        inputs = ragged_inputs(num_q, num_heads, num_keys, cpu, generator(num_q))
        check_ragged(*inputs)
        check_fused(*inputs, 16, 100)
    for rows in (1, 4):
        check_ragged(*ragged_inputs(5, 64, 260, cpu, generator(rows)), rows=rows)
    check_paged(*paged_inputs(2, 2, 16, [3, 150], cpu, generator(3)))
    check_paged(*paged_inputs(2, 1, 16, [70, 200], cpu, generator(4)), tokens_per_step=128, steps=2)
    check_paged(*paged_inputs(2, 3, 16, [70, 200], cpu, generator(5)), tokens_per_step=64, steps=2, heads_on_n=True)
    q, weights, pool, lens, table, width = paged_inputs(2, 2, 16, [3, 150], cpu, generator(6))
    check_paged(q, weights, pool, lens, table, width + 300, fill_past_context=False, tokens_per_step=64, steps=1)
    logits = tricky_logits(4, 1500, cpu, generator(4))
    check_topk(logits, 64)
    check_topk(logits, 32, torch.tensor([0, 100, 7, 1500], dtype=torch.int32),
               torch.tensor([1500, 120, 1499, 1500], dtype=torch.int32))
    check_topk(logits, 48, split=256, block=128)  # many programs per row share the lists


def test_indexer_under_interpreter():
    run_under_interpreter(__file__, SEED)


def run_memcheck_case() -> None:
    """Small GPU cases of every indexer kernel (ranges, short contexts, -1 padding) for compute-sanitizer."""
    inputs = ragged_inputs(9, 64, 700, cuda, generator(5))
    check_ragged(*inputs)
    check_fused(*inputs, 64, 256)
    check_paged(*paged_inputs(3, 2, 64, [2, 65, 300], cuda, generator(6)))
    check_topk(tricky_logits(4, 900, cuda, generator(7)), 1024)
    hadamard_transform(torch.randn(7, 128, device=cuda), backend="triton")
    check_rotate_quantize(quantize_inputs((19, 128), torch.bfloat16, cuda, generator(8)))
    torch.cuda.synchronize()


if __name__ == "__main__":
    kernel_test_main(run_interpreter_cases, run_memcheck_case)
