"""indexer_logits (ragged prefill ranges) and indexer_logits_paged (paged decode, causal).

FP8 accuracy bound (worst case, holds for every score): after the Hadamard rotation each element
x of q and k is quantized as |x_fp8 * scale - x| <= d(x) = 2^-4 |x| + 2^-10 scale (e4m3 half ulp,
subnormal floor), plus the rounding of the rotation itself (2^-9 |x| for bf16 inputs, 2^-20 for
fp32). The rotation is orthogonal, so the exact score equals the unrotated one, and relu is
1-Lipschitz, hence
    |score_fp8 - score| <= sum_h |w_h| * sum_i (|q_hi| d(k_i) + d(q_hi) |k_i| + d(q_hi) d(k_i))
(+ 2^-23 |score| for the final fp32 rounding). On random data the errors mostly cancel, so the
test also holds the RMS error to 6% of the RMS score: each factor's relative rounding error is
uniform-like with RMS below 2^-4 / sqrt(3) = 3.6%, and two independent factors give about 5%.
"""

import pytest
import torch

from flashdsa.runtime.cache import write_indexer_cache
from flashdsa.runtime.cache.allocator import slot_mapping
from flashdsa.runtime.cache.pool import indexer_pool
from flashdsa.runtime.indexer import (
    hadamard_transform,
    indexer_logits,
    indexer_logits_paged,
    quantize_indexer,
    reference,
)

ROTATION_ERROR = {torch.bfloat16: 2.0**-9, torch.float32: 2.0**-20}


def quantized_case(num_q, num_heads, num_keys, seed, dtype=torch.float32):
    """Unrotated q [T, H, 128], k [S, 128], raw weights [T, H], and the FP8 indexer inputs."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_q, num_heads, 128, generator=g).to(dtype)
    k = (torch.randn(num_keys, 128, generator=g) * torch.rand(num_keys, 1, generator=g) * 4).to(dtype)
    w = torch.randn(num_q, num_heads, generator=g)
    q_fp8, q_scale = quantize_indexer(hadamard_transform(q))
    k_fp8, k_scale = quantize_indexer(hadamard_transform(k))
    return q, k, w, q_fp8, w * q_scale, k_fp8, k_scale


def full_ranges(num_q, num_keys):
    return torch.zeros(num_q, dtype=torch.int32), torch.full((num_q,), num_keys, dtype=torch.int32)


def definition(q_fp8, weights, k_fp8, k_scale):
    """score[t, s] = k_scale[s] * sum_h weights[t, h] * relu(q_fp8[t, h] . k_fp8[s]), float64."""
    dots = torch.relu(torch.einsum("thd,sd->ths", q_fp8.double(), k_fp8.double()))
    return torch.einsum("th,ths->ts", weights.double(), dots) * k_scale.double()


def deviation(x_rot, scale, dtype):
    return (2.0**-4 + ROTATION_ERROR[dtype]) * x_rot.double().abs() + 2.0**-10 * scale.double()[..., None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q, num_heads, num_keys", [(1, 64, 129), (9, 4, 64), (5, 7, 31)])
def test_fp8_scores_stay_within_the_quantization_bound_of_unquantized_scores(dtype, num_q, num_heads, num_keys):
    q, k, w, q_fp8, weights, k_fp8, k_scale = quantized_case(num_q, num_heads, num_keys, seed=num_keys, dtype=dtype)
    got = indexer_logits(q_fp8, weights, k_fp8, k_scale, *full_ranges(num_q, num_keys)).double()
    exact = torch.einsum("th,ths->ts", w.double(), torch.relu(torch.einsum("thd,sd->ths", q.double(), k.double())))

    q_rot, k_rot = hadamard_transform(q).double(), hadamard_transform(k).double()
    _, q_scale = quantize_indexer(hadamard_transform(q))
    dq, dk = deviation(q_rot, q_scale, dtype), deviation(k_rot, k_scale, dtype)
    dot_err = (torch.einsum("thd,sd->ths", q_rot.abs(), dk) + torch.einsum("thd,sd->ths", dq, k_rot.abs())
               + torch.einsum("thd,sd->ths", dq, dk))
    bound = torch.einsum("th,ths->ts", w.double().abs(), dot_err) + 2.0**-23 * exact.abs()
    err = (got - exact).abs()
    assert (err <= bound).all()
    assert 0 < err.square().mean().sqrt() <= 0.06 * exact.square().mean().sqrt()


def test_ragged_ranges_score_inside_and_give_minus_inf_outside():
    num_q, num_keys = 7, 50
    *_, q_fp8, weights, k_fp8, k_scale = quantized_case(num_q, 3, num_keys, seed=1)
    starts = torch.tensor([0, 10, 49, 25, 0, 50, 3], dtype=torch.int32)
    ends = torch.tensor([50, 20, 50, 25, 1, 50, 40], dtype=torch.int32)  # rows 3 and 5 empty
    got = indexer_logits(q_fp8, weights, k_fp8, k_scale, starts, ends)
    cols = torch.arange(num_keys)
    inside = (cols >= starts[:, None].long()) & (cols < ends[:, None].long())
    assert got.dtype == torch.float32 and got.shape == (num_q, num_keys)
    assert torch.isneginf(got[~inside]).all()
    expect = definition(q_fp8, weights, k_fp8, k_scale)
    torch.testing.assert_close(got[inside].double(), expect[inside], rtol=2.0**-22, atol=0)


def test_row_chunking_does_not_change_a_single_bit(monkeypatch):
    *_, q_fp8, weights, k_fp8, k_scale = quantized_case(11, 5, 70, seed=2)
    ranges = full_ranges(11, 70)
    whole = indexer_logits(q_fp8, weights, k_fp8, k_scale, *ranges)
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 150)  # two rows at a time
    assert torch.equal(indexer_logits(q_fp8, weights, k_fp8, k_scale, *ranges), whole)


def paged_case(context_lens, next_n, num_heads=4, num_blocks=12, block_size=64, seed=0):
    """Write each request's keys into a shuffled paged pool; return the paged inputs and, per
    request, the contiguous keys (unrotated) the pool holds."""
    g = torch.Generator().manual_seed(seed)
    pool = indexer_pool(num_blocks, "cpu", block_size)
    free = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(-(-n // block_size) for n in context_lens)
    tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    keys = []
    for b, length in enumerate(context_lens):
        table = [free.pop() for _ in range(-(-length // block_size))]
        tables[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
        keys.append(torch.randn(length, 128, generator=g))
        write_indexer_cache(keys[-1], pool, slot_mapping(table, range(length), block_size))
    q = torch.randn(len(context_lens), next_n, num_heads, 128, generator=g)
    q_fp8, q_scale = quantize_indexer(hadamard_transform(q))
    weights = (torch.randn(len(context_lens), next_n, num_heads, generator=g) * q_scale).flatten(0, 1)
    return q_fp8, weights, pool, torch.tensor(context_lens, dtype=torch.int32), tables, keys


@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("context_lens, block_size", [([5, 64, 130], 64), ([2, 33, 17, 9], 16)])
def test_paged_equals_ragged_on_gathered_keys_with_causal_mask(next_n, context_lens, block_size):
    q_fp8, weights, pool, lens, tables, keys = paged_case(context_lens, next_n, block_size=block_size, seed=next_n)
    width = max(context_lens) + 3
    got = indexer_logits_paged(q_fp8, weights, pool, lens, tables, width)
    assert got.shape == (len(context_lens) * next_n, width)
    for b, length in enumerate(context_lens):
        k_fp8, k_scale = quantize_indexer(hadamard_transform(keys[b]))
        positions = torch.arange(length - next_n, length, dtype=torch.int32)  # query j at length - n + j
        ends = positions + 1  # causal: sees [0, position]
        rows = slice(b * next_n, (b + 1) * next_n)
        ragged = indexer_logits(q_fp8[b], weights[rows], k_fp8, k_scale, torch.zeros_like(ends), ends)
        assert torch.equal(got[rows, :length], ragged)
        assert torch.isneginf(got[rows, length:]).all()
        for j, pos in enumerate(positions.tolist()):
            assert torch.isfinite(got[b * next_n + j, : pos + 1]).all()
            assert torch.isneginf(got[b * next_n + j, pos + 1 :]).all()


RAGGED_OK = dict(
    q_fp8=torch.randn(3, 2, 128).to(torch.float8_e4m3fn), weights=torch.randn(3, 2),
    k_fp8=torch.randn(10, 128).to(torch.float8_e4m3fn), k_scale=torch.rand(10),
    starts=torch.zeros(3, dtype=torch.int32), ends=torch.full((3,), 10, dtype=torch.int32),
)


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    """These tests pin down the reference ops; GPU backends are tested against them elsewhere."""
    monkeypatch.setenv("FLASHDSA_BACKEND", "reference")


@pytest.mark.parametrize("name, bad", [
    ("q_fp8", torch.randn(3, 2, 128).bfloat16()),
    ("q_fp8", torch.randn(3, 128).to(torch.float8_e4m3fn)),
    ("weights", torch.randn(3, 2).bfloat16()),
    ("weights", torch.randn(3, 3)),
    ("k_fp8", torch.randn(10, 64).to(torch.float8_e4m3fn)),
    ("k_scale", torch.rand(9)),
    ("starts", torch.zeros(3, dtype=torch.int64)),
    ("starts", torch.tensor([0, -1, 0], dtype=torch.int32)),
    ("ends", torch.tensor([10, 11, 10], dtype=torch.int32)),
])
def test_indexer_logits_rejects_bad_input_naming_it(name, bad):
    with pytest.raises(ValueError, match=name):
        indexer_logits(**{**RAGGED_OK, name: bad})


def test_indexer_logits_rejects_a_start_after_its_end():
    crossed = dict(starts=torch.tensor([0, 6, 0], dtype=torch.int32), ends=torch.tensor([10, 5, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="starts must be <= ends"):
        indexer_logits(**{**RAGGED_OK, **crossed})


def paged_ok():
    q_fp8, weights, pool, lens, tables, _ = paged_case([3, 70], next_n=2, num_blocks=3)
    return dict(q_fp8=q_fp8, weights=weights, k_cache=pool, context_lens=lens, block_tables=tables, max_context_len=70)


@pytest.mark.parametrize("name, bad", [
    ("q_fp8", torch.randn(2, 2, 4, 64).to(torch.float8_e4m3fn)),
    ("weights", torch.randn(2, 4)),
    ("k_cache", torch.zeros(3, 64, 1, 656, dtype=torch.uint8)),
    ("context_lens", torch.tensor([3, 70])),
    ("context_lens", torch.tensor([1, 70], dtype=torch.int32)),  # fewer than next_n tokens
    ("context_lens", torch.tensor([3, 200], dtype=torch.int32)),  # beyond the table
    ("max_context_len", 69),
    ("max_context_len", 70.0),
    ("block_tables", torch.tensor([[0, -1], [1, -1]], dtype=torch.int32)),  # request 1 needs 2 blocks
    ("block_tables", torch.tensor([[0, -1], [1, 3]], dtype=torch.int32)),  # block 3 of 3
    ("block_tables", torch.zeros(2, 2, dtype=torch.int64)),
    ("fill_past_context", 0),
])
def test_indexer_logits_paged_rejects_bad_input_naming_it(name, bad):
    with pytest.raises(ValueError, match=name):
        indexer_logits_paged(**{**paged_ok(), name: bad})


@pytest.mark.parametrize("num_q, num_keys", [(2, 0), (0, 5)])
def test_no_keys_or_no_queries_give_empty_logits(num_q, num_keys):
    *_, q_fp8, weights, k_fp8, k_scale = quantized_case(num_q, 3, num_keys, seed=3)
    got = indexer_logits(q_fp8, weights, k_fp8, k_scale, *full_ranges(num_q, num_keys))
    assert got.shape == (num_q, num_keys)
