"""Lightning-indexer ops of DeepSeek Sparse Attention: Hadamard rotation, FP8 quantization,
logits (ragged prefill ranges and paged decode) and top-k. Public functions validate their
inputs and dispatch to a backend. Range and block-table values are read back to check them (one
device sync per call) except inside ``checks.trusted_values()``, which the engine uses.

Registered backends (lazy "module:function" targets; backend functions take the public
function's arguments positionally, already validated; ``indexer_topk``'s ``starts``/``ends`` are
both tensors or both None, whole rows, and the other ops' are always tensors):
  hadamard_transform     reference  flashdsa.runtime.indexer.reference:hadamard_transform
                         triton     flashdsa.runtime.indexer.triton.hadamard:hadamard_transform
  rotate_quantize_indexer reference flashdsa.runtime.indexer.reference:rotate_quantize_indexer
                         triton     flashdsa.runtime.indexer.triton.quantize:rotate_quantize_indexer
  indexer_logits         reference  flashdsa.runtime.indexer.reference:indexer_logits
                         triton     flashdsa.runtime.indexer.triton.logits:indexer_logits
  indexer_logits_paged   reference  flashdsa.runtime.indexer.reference:indexer_logits_paged
                         triton     flashdsa.runtime.indexer.triton.logits:indexer_logits_paged
  indexer_topk           reference  flashdsa.runtime.indexer.reference:indexer_topk
                         triton     flashdsa.runtime.indexer.triton.topk:indexer_topk
  indexer_fused_topk     reference  flashdsa.runtime.indexer.reference:indexer_fused_topk
                         triton     flashdsa.runtime.indexer.triton.topk:indexer_fused_topk
  indexer_topk           cuda       flashdsa.runtime.indexer.cuda.topk:indexer_topk (SM90)
  indexer_fused_topk     cuda       flashdsa.runtime.indexer.cuda.topk:indexer_fused_topk (SM90;
                                    Triton logits of whole rows, native top-k)
  indexer_logits_paged   cuda       flashdsa.runtime.indexer.cuda.paged_logits:indexer_logits_paged (SM90)
Triton support check (facts ``head_dim``, ``dtype``, ``topk``, ``block_size``): head_dim 128, no
float64 input, topk <= TRITON_MAX_TOPK, power-of-two cache block size. CUDA support check: topk <=
CUDA_MAX_TOPK and a CUDA toolchain to build the kernel with (``flashdsa.runtime.native``); the fused
top-k's also needs the Triton logits kernel's; the paged logits' 64-token cache blocks and n * H
within one wgmma's 256 columns (facts ``block_size``, ``next_n``, ``heads``).
"""

from __future__ import annotations

from typing import Optional

import torch

from flashdsa.runtime import dispatch, native
from flashdsa.runtime.cache.layout import INDEX_HEAD_DIM, INDEXER_TOKEN_BYTES, quantize_indexer_key
from flashdsa.runtime.checks import can_check_values, check, check_tensor, describe
from flashdsa.runtime.fp8 import E4M3

_TRITON_MODULE = {
    "hadamard_transform": "hadamard",
    "rotate_quantize_indexer": "quantize",
    "indexer_logits": "logits",
    "indexer_logits_paged": "logits",
    "indexer_topk": "topk",
    "indexer_fused_topk": "topk",
}


TRITON_MAX_TOPK = 8192  # the triton top-k sorts its selection in registers
CUDA_MAX_TOPK = 2048  # MAX_TOPK of cuda/topk.cu: the selection is held and sorted in shared memory


def _triton_supports(
    head_dim: int = INDEX_HEAD_DIM, dtype: Optional[torch.dtype] = None, topk: int = 1, block_size: int = 64, **_
) -> Optional[str]:
    if head_dim != INDEX_HEAD_DIM:
        return f"triton indexer kernels need head_dim 128, got {head_dim}"
    if dtype == torch.float64:
        return "triton indexer kernels take bf16/fp16/fp32, not float64"
    if topk > TRITON_MAX_TOPK:
        return f"triton indexer top-k supports topk <= {TRITON_MAX_TOPK}, got {topk}"
    if block_size & (block_size - 1):
        return f"triton paged indexer needs a power-of-two block size, got {block_size}"
    return None


def _cuda_topk_supports(topk: int = 1, **_) -> Optional[str]:
    if topk > CUDA_MAX_TOPK:
        return f"cuda indexer top-k supports topk <= {CUDA_MAX_TOPK}, got {topk}"
    return native.unavailable()


def _cuda_fused_topk_supports(**facts) -> Optional[str]:
    return _triton_supports(**facts) or _cuda_topk_supports(**facts)


def _cuda_paged_supports(block_size: int = 64, next_n: int = 1, heads: int = 64, **_) -> Optional[str]:
    """The native paged logits kernel scores one 64-token block a wgmma, every query's heads on its N:
    queries padded to a power of two up to 4, each to 64 / 128 / 256 divided by that many columns."""
    if block_size != 64:
        return f"cuda paged indexer logits need 64-token cache blocks, got {block_size}"
    queries = 1 << max(next_n - 1, 0).bit_length()
    if queries > 4 or heads > 256 // queries:
        return (f"cuda paged indexer logits fit n * H in 256 columns (n padded to a power of two), "
                f"got n={next_n} H={heads}")
    return native.unavailable()


for _op, _module in _TRITON_MODULE.items():
    dispatch.register(_op, "reference", f"flashdsa.runtime.indexer.reference:{_op}")
    dispatch.register(_op, "triton", f"flashdsa.runtime.indexer.triton.{_module}:{_op}", _triton_supports)
dispatch.register("indexer_topk", "cuda", "flashdsa.runtime.indexer.cuda.topk:indexer_topk", _cuda_topk_supports)
dispatch.register("indexer_fused_topk", "cuda", "flashdsa.runtime.indexer.cuda.topk:indexer_fused_topk",
                  _cuda_fused_topk_supports)
dispatch.register("indexer_logits_paged", "cuda", "flashdsa.runtime.indexer.cuda.paged_logits:indexer_logits_paged",
                  _cuda_paged_supports)


def _check_ranges(starts: object, ends: object, num_rows: int, length: int, device: torch.device) -> None:
    """starts, ends: int32 [num_rows] with 0 <= starts <= ends <= length."""
    for name, t in (("starts", starts), ("ends", ends)):
        check_tensor(name, t, torch.int32, [num_rows], f"int32 [T={num_rows}]", device)
    if num_rows and can_check_values(device):
        flags = torch.stack(((starts < 0).any(), (ends > length).any(), (starts > ends).any()))
        bad_start, bad_end, crossed = flags.tolist()
        check(not bad_start, f"starts must be >= 0, got min {int(starts.min())}")
        check(not bad_end, f"ends must be <= {length} (the number of keys), got max {int(ends.max())}")
        check(not crossed, "starts must be <= ends in every row")


def _check_float(name: str, x: object, dtypes: tuple[torch.dtype, ...], expected: str) -> None:
    """x: a tensor of at least one dim, any shape and strides, of one of ``dtypes``."""
    ok = isinstance(x, torch.Tensor) and x.dtype in dtypes and x.dim() >= 1
    check(ok, f"{name} must be {expected}, got {describe(x) if isinstance(x, torch.Tensor) else type(x).__name__}")


def _check_int(name: str, value: object, low: int) -> None:
    """value: an int (not a bool) >= low; the message is only formatted for a bad one (host time)."""
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def hadamard_transform(x: torch.Tensor, *, backend: Optional[str] = None) -> torch.Tensor:
    """Orthogonal Walsh-Hadamard rotation of the last dim: ``x @ H / sqrt(n)``, H Sylvester order.

    x: [..., n] bf16/fp16/fp32/fp64, n a power of two (128 for the indexer). Returns the same
    shape and dtype; computed in fp32 (fp64 for fp64). Rotating both q and k leaves q . k unchanged.
    """
    _check_float("x", x, (torch.bfloat16, torch.float16, torch.float32, torch.float64), "bf16/fp16/fp32/fp64 [..., n]")
    n = x.shape[-1]
    check(n > 0 and n & (n - 1) == 0, f"x's last dim must be a power of two, got {n}")
    return dispatch.select("hadamard_transform", x.device, backend, head_dim=n, dtype=x.dtype)(x)


def _check_indexer_rows(x: object) -> None:
    """x: bf16/fp16/fp32 [..., 128], the rows the indexer quantizes."""
    _check_float("x", x, (torch.bfloat16, torch.float16, torch.float32), "bf16/fp16/fp32 [..., 128]")
    check(x.shape[-1] == INDEX_HEAD_DIM, f"x must be [..., 128], got {list(x.shape)}")


def quantize_indexer(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 quantization with one power-of-two scale per 128 values (``2^ceil(log2(amax/448))``).

    x: [..., 128] bf16/fp16/fp32. Returns (e4m3 [..., 128], scale fp32 [...]), ``x ~= q * scale``.
    """
    _check_indexer_rows(x)
    return quantize_indexer_key(x)


def rotate_quantize_indexer(x: torch.Tensor, *, backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_indexer(hadamard_transform(x))``, the indexer queries' path: one kernel on a GPU.

    x: [..., 128] bf16/fp16/fp32. Returns (e4m3 [..., 128], scale fp32 [...]), bit-identical to
    the two calls (the rotation rounds to x's dtype before quantizing) for rows whose rotation is
    finite; a row holding inf or NaN (an fp16 query past 65504: the model has already diverged)
    gets garbage codes, not the reference's NaN.
    """
    _check_indexer_rows(x)
    return dispatch.select("rotate_quantize_indexer", x.device, backend, dtype=x.dtype)(x)


def _check_ragged(q_fp8, weights, k_fp8, k_scale, starts, ends) -> None:
    """The inputs of :func:`indexer_logits` / :func:`indexer_fused_topk`."""
    check_tensor("q_fp8", q_fp8, E4M3, [None, None, None], "float8_e4m3fn [T, H, d]")
    num_q, num_heads, head_dim = q_fp8.shape
    device = q_fp8.device
    check_tensor("weights", weights, torch.float32, [num_q, num_heads], f"fp32 [T={num_q}, H={num_heads}]", device)
    check_tensor("k_fp8", k_fp8, E4M3, [None, head_dim], f"float8_e4m3fn [S, d={head_dim}]", device)
    num_keys = k_fp8.shape[0]
    check_tensor("k_scale", k_scale, torch.float32, [num_keys], f"fp32 [S={num_keys}]", device)
    _check_ranges(starts, ends, num_q, num_keys, device)


def indexer_logits(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    k_fp8: torch.Tensor,
    k_scale: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    *,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Indexer scores of T queries against S keys over ragged ranges (prefill).

    q_fp8: [T, H, d] e4m3, the rotated, quantized queries (their scales folded into weights).
    weights: [T, H] fp32, per-head weights with q_scale and constants folded in.
    k_fp8: [S, d] e4m3 rotated keys; k_scale: [S] fp32 their scales.
    starts, ends: [T] int32, query t scores keys [starts[t], ends[t]), 0 <= start <= end <= S.
    Returns [T, S] fp32: ``k_scale[s] * sum_h weights[t, h] * relu(q_fp8[t, h] . k_fp8[s])``
    inside each range, -inf outside.
    """
    _check_ragged(q_fp8, weights, k_fp8, k_scale, starts, ends)
    impl = dispatch.select("indexer_logits", q_fp8.device, backend, head_dim=q_fp8.shape[-1])
    return impl(q_fp8, weights, k_fp8, k_scale, starts, ends)


def _check_paged(context_lens, block_tables, num_blocks, block_size, batch, next_n, max_context_len, device) -> None:
    check_tensor("context_lens", context_lens, torch.int32, [batch], f"int32 [B={batch}]", device)
    check_tensor("block_tables", block_tables, torch.int32, [batch, None], f"int32 [B={batch}, max_blocks]", device)
    _check_int("max_context_len", max_context_len, 0)
    if not batch or not can_check_values(device):
        return
    lens = context_lens.long()
    needed = torch.arange(block_tables.shape[1], device=device) * block_size < lens[:, None]
    bad_block = needed & ((block_tables < 0) | (block_tables >= num_blocks))
    short, long, unmapped, bad = torch.stack((
        (lens < next_n).any(), (lens > max_context_len).any(),
        (lens > block_tables.shape[1] * block_size).any(), bad_block.any(),
    )).tolist()
    check(not short, f"context_lens must be >= next_n ({next_n}) (the queries are in the cache), got {lens.tolist()}")
    check(not long, f"context_lens must be <= max_context_len ({max_context_len}), got max {int(lens.max())}")
    check(not unmapped, f"block_tables has {block_tables.shape[1]} columns of {block_size} slots, "
                        f"too few for context_lens max {int(lens.max())}")
    check(not bad, f"block_tables must hold block ids in [0, {num_blocks}) for every block a context uses")


def indexer_logits_paged(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_context_len: int,
    *,
    fill_past_context: bool = True,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Indexer scores of decode queries against the paged FP8 key cache (causal).

    q_fp8: [B, n, H, 128] e4m3, n query tokens per request (next_n: 1 for decode, 2 with MTP).
    weights: [B * n, H] fp32 (q_scale folded in), row b * n + j for query j of request b.
    k_cache: [num_blocks, block_size, 1, 132] uint8 indexer pool (layout in ``cache.layout``).
    context_lens: [B] int32, tokens of request b in the cache, the n queries included (>= n).
    block_tables: [B, max_blocks] int32 block ids; entries past a request's context are ignored.
    max_context_len: int >= max(context_lens), the width of the result.
    fill_past_context: False leaves the positions at and past context_lens[b] unspecified (not
    written: a CUDA graph's rows are max_context_len wide whatever the batch's contexts), for
    callers whose top-k reads each row only up to its query's end.
    Returns [B * n, max_context_len] fp32: query j of request b sits at position
    ``context_lens[b] - n + j`` and scores positions [0, that position]; -inf beyond.
    """
    check_tensor("q_fp8", q_fp8, E4M3, [None, None, None, INDEX_HEAD_DIM], "float8_e4m3fn [B, n, H, 128]")
    batch, next_n, num_heads, _ = q_fp8.shape
    device = q_fp8.device
    check_tensor("weights", weights, torch.float32, [batch * next_n, num_heads],
                 f"fp32 [B*n={batch * next_n}, H={num_heads}]", device)
    check_tensor("k_cache", k_cache, torch.uint8, [None, None, 1, INDEXER_TOKEN_BYTES],
                 "uint8 [num_blocks, block_size, 1, 132]", device)
    _check_paged(context_lens, block_tables, k_cache.shape[0], k_cache.shape[1], batch, next_n, max_context_len, device)
    check(isinstance(fill_past_context, bool), f"fill_past_context must be a bool, got {fill_past_context!r}")
    impl = dispatch.select("indexer_logits_paged", device, backend, block_size=k_cache.shape[1], next_n=next_n,
                           heads=num_heads)
    return impl(q_fp8, weights, k_cache, context_lens, block_tables, max_context_len, fill_past_context)


def indexer_topk(
    logits: torch.Tensor,
    topk: int,
    starts: Optional[torch.Tensor] = None,
    ends: Optional[torch.Tensor] = None,
    *,
    sorted: bool = True,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Top-k positions of each logits row.

    logits: [T, L] fp32 scores; non-finite entries are never selected.
    topk: int >= 1. starts, ends: [T] int32 ranges (default [0, L)); 0 <= start <= end <= L.
    Returns [T, topk] int32: the columns of the topk largest finite scores inside [start, end),
    by descending score, ties to the lower column, padded with -1. ``sorted=False`` returns the
    same set in an unspecified but deterministic order (the valid ones first), for callers that
    only gather the positions (sparse attention): the Triton backend then sorts 32-bit positions
    instead of 64-bit (score, position) keys.
    """
    check_tensor("logits", logits, torch.float32, [None, None], "fp32 [T, L]")
    _check_int("topk", topk, 1)
    num_q, length = logits.shape
    if starts is not None or ends is not None:  # only given ranges are checked (their values: a host sync)
        starts = torch.zeros(num_q, dtype=torch.int32, device=logits.device) if starts is None else starts
        ends = torch.full((num_q,), length, dtype=torch.int32, device=logits.device) if ends is None else ends
        _check_ranges(starts, ends, num_q, length, logits.device)
    if not isinstance(sorted, bool):
        raise ValueError(f"sorted must be a bool, got {sorted!r}")
    return dispatch.select("indexer_topk", logits.device, backend, topk=topk)(logits, topk, starts, ends, sorted)


def indexer_fused_topk(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    k_fp8: torch.Tensor,
    k_scale: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    topk: int,
    *,
    chunk: int = 4096,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """``indexer_topk(indexer_logits(q_fp8, weights, k_fp8, k_scale, starts, ends), topk, starts, ends)``
    without materialising all T logits rows at once. The Triton backend scores keys ``chunk`` at a
    time and merges them into a running top-k (memory O(T * (topk + chunk))); the CUDA backend
    scores whole rows, as many as fit a fixed 256 MiB buffer (at least one), and selects each in one
    pass. Arguments as in :func:`indexer_logits`; chunk: int >= 1, keys per step of the Triton merge.
    Returns [T, topk] int32.
    """
    _check_int("topk", topk, 1)
    _check_int("chunk", chunk, 1)
    _check_ragged(q_fp8, weights, k_fp8, k_scale, starts, ends)
    impl = dispatch.select("indexer_fused_topk", q_fp8.device, backend, head_dim=q_fp8.shape[-1], topk=topk)
    return impl(q_fp8, weights, k_fp8, k_scale, starts, ends, topk, chunk)
