"""Test helpers shared by the CPU and GPU kernel tests (device-agnostic).

- poison: NaN-filled outputs, so an element a kernel forgot to write fails the comparison (also
  for outputs a backend allocates itself: the CUDA allocator flooded with NaN, or on CPU
  ``torch.empty`` patched to poison);
- FlashMLA-style comparators: elementwise abs-or-rel tolerance plus a cosine-distance bound;
- random indices with invalid (-1), out-of-range (< -1 or >= s_kv) and duplicate entries;
- a random FP8 paged MLA cache with a random block table, and position -> slot id mapping;
- an independent dense sparse-attention oracle (count matrix, float64) for the reference itself;
- the plumbing that runs a Triton kernel test file's CPU cases under the interpreter.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from typing import Callable, Iterator, Optional, Sequence

import torch

from flashdsa.runtime.cache.layout import BLOCK_SIZE, KV_LORA_RANK, ROPE_DIM, quantize_indexer_key, quantize_mla

INT32_MAX = 2**31 - 1
_SAMPLE_ELEMENTS = 2**24  # random scores drawn at once when sampling distinct indices


def poisoned(shape: Sequence[int], dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """A tensor whose every element is a value no kernel should produce: NaN for floats,
    the dtype's maximum for integers."""
    fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max
    return torch.full(tuple(shape), fill, dtype=dtype, device=device)


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """:func:`poisoned` with ``t``'s shape, dtype and device."""
    return poisoned(t.shape, t.dtype, t.device)


def flood_cuda_allocator_with_nan(device: torch.device, nbytes: int = 256 << 20) -> None:
    """Leave NaN in the CUDA caching allocator's free blocks, so outputs a kernel allocates with
    ``torch.empty`` start poisoned (an element it forgets to write fails as NaN); no-op off CUDA."""
    if device.type == "cuda":
        torch.full((nbytes // 4,), float("nan"), device=device)


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """Inside this block ``torch.empty`` returns tensors filled like :func:`poisoned` (NaN, or the
    integer maximum), so outputs a backend allocates start poisoned on CPU too. For the
    interpreter subprocesses of kernel tests; restores ``torch.empty`` on exit."""
    empty = torch.empty

    def poisoning(*size, **kwargs):
        t = empty(*size, **kwargs)
        return t.fill_(float("nan") if t.dtype.is_floating_point else torch.iinfo(t.dtype).max)

    torch.empty = poisoning
    try:
        yield
    finally:
        torch.empty = empty


def tricky_logits(rows: int, length: int, device, g: torch.Generator) -> torch.Tensor:
    """Rows with heavy ties, -inf and NaN holes, tiny and signed zeros, and plain normal scores."""
    x = torch.randn(rows, length, generator=g)
    x[0::4] = torch.randint(0, 7, (x[0::4].shape), generator=g).float()  # many exact ties
    x[1::4, ::3] = float("-inf")
    x[1::4, 1::11] = float("nan")
    x[2::4] = -torch.rand(x[2::4].shape, generator=g) * 1e-38  # subnormal negatives and zeros
    x[2::4, ::5] = 0.0
    x[2::4, 1::5] = -0.0
    return x.to(device)


def indexer_operands(num_q: int, num_heads: int, num_keys: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """CPU operands of the ragged indexer ops: rotated-looking FP8 queries ``[T, H, 128]``, head
    weights of both signs ``[T, H]`` and quantized keys ``[S, 128]`` with their scales ``[S]``."""
    q = (torch.randn(num_q, num_heads, 128, generator=g) * 40).to(torch.float8_e4m3fn)
    weights = torch.randn(num_q, num_heads, generator=g) * 0.1
    k_fp8, k_scale = quantize_indexer_key(torch.randn(num_keys, 128, generator=g))
    return q, weights, k_fp8, k_scale


def cosine_distance(got: torch.Tensor, ref: torch.Tensor) -> float:
    """FlashMLA's ``1 - 2 <x, y> / (|x|^2 + |y|^2)`` in float64 (0 when both are zero)."""
    x, y = got.double().flatten(), ref.double().flatten()
    denominator = (x * x + y * y).sum()
    if denominator == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)


def assert_flashmla_close(
    name: str, got: torch.Tensor, ref: torch.Tensor,
    abs_tol: float = 1e-3, rel_tol: float = 2 / 128, cos_tol: float = 1e-5,
) -> None:
    """Assert ``got`` matches ``ref`` the way FlashMLA's tests do.

    Shapes must be equal; non-finite values must match exactly in place and value (NaN never
    passes); every finite element must be within ``abs_tol`` or ``rel_tol``; and the cosine
    distance over the finite elements must be <= ``cos_tol``.
    """
    assert got.shape == ref.shape, f"{name}: shape {list(got.shape)} != reference {list(ref.shape)}"
    got, ref = got.double().cpu(), ref.double().cpu()
    nan = torch.isnan(got) | torch.isnan(ref)
    assert not nan.any(), f"{name}: {int(nan.sum())} NaN elements, first at {_first(nan)}"
    finite = torch.isfinite(ref)
    mismatch = (finite != torch.isfinite(got)) | (~finite & (got != ref))
    assert not mismatch.any(), (
        f"{name}: non-finite values differ at {int(mismatch.sum())} places, first at {_first(mismatch)}")
    err = (got - ref).abs().where(finite, 0.0)
    bad = (err > abs_tol) & (err > rel_tol * ref.abs())
    if bad.any():
        at = _first(bad)
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{bad.numel()} elements off (abs {abs_tol}, rel {rel_tol}); "
            f"first at {at}: got {got[at].item()}, ref {ref[at].item()}; max abs err {err.max().item():.3g}"
        )
    cos = cosine_distance(got[finite], ref[finite])
    assert cos <= cos_tol, f"{name}: cosine distance {cos:.3g} > {cos_tol}"


def assert_lse_close(got: torch.Tensor, ref: torch.Tensor, name: str = "lse") -> None:
    """lse tolerance from FlashMLA: abs 1e-6 or rel 8/65536; +inf must match +inf."""
    assert_flashmla_close(name, got, ref, abs_tol=1e-6, rel_tol=8 / 65536)


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def random_indices(
    shape: Sequence[int], s_kv: int, *, invalid: float = 0.0, out_of_range: float = 0.0,
    duplicates: bool = False, generator: Optional[torch.Generator] = None, device="cpu",
) -> torch.Tensor:
    """Random int32 indices ``[*shape]`` (last dim = topk) into ``[0, s_kv)``.

    By default each row holds distinct valid indices; when topk > s_kv the row holds all s_kv
    positions and the rest is -1. ``duplicates`` draws with replacement instead. Then a fraction
    ``invalid`` of the entries becomes -1, and a fraction ``out_of_range`` becomes a value < -1 or
    >= s_kv (half each), which a kernel must mask and never dereference.
    """
    *lead, topk = shape
    rows = math.prod(lead)
    if duplicates and s_kv > 0:
        idx = torch.randint(0, s_kv, (rows, topk), generator=generator)
    else:
        idx = torch.full((rows, topk), -1, dtype=torch.int64)
        take = min(topk, s_kv)
        step = max(1, _SAMPLE_ELEMENTS // max(s_kv, 1))
        for start in range(0, rows, step):
            n = min(step, rows - start)
            scores = torch.rand(n, s_kv, generator=generator)
            idx[start:start + n, :take] = scores.topk(take, dim=-1).indices
    idx = idx[:, torch.randperm(topk, generator=generator)] if topk else idx
    roll = torch.rand(rows, topk, generator=generator)
    idx = idx.masked_fill(roll < invalid, -1)
    wild = (roll >= invalid) & (roll < invalid + out_of_range)
    above = torch.randint(s_kv, INT32_MAX, (rows, topk), generator=generator)
    below = -torch.randint(2, INT32_MAX, (rows, topk), generator=generator)
    side = torch.rand(rows, topk, generator=generator) < 0.5
    idx = torch.where(wild, torch.where(side, above, below), idx)
    return idx.to(torch.int32).view(*shape).to(device)


def random_sparse_inputs(
    s_q: int, s_kv: int, h_q: int, d_qk: int, topk: int, dtype: torch.dtype = torch.bfloat16, device="cpu",
    *, generator: Optional[torch.Generator] = None, **index_options,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random (q ``[s_q, h_q, d_qk]``, kv ``[s_kv, 1, d_qk]``, indices ``[s_q, 1, topk]`` int32) for
    ``sparse_mla_fwd``; ``index_options`` go to :func:`random_indices`."""
    q = torch.randn(s_q, h_q, d_qk, generator=generator).to(dtype=dtype, device=device)
    kv = torch.randn(s_kv, 1, d_qk, generator=generator).to(dtype=dtype, device=device)
    indices = random_indices((s_q, 1, topk), s_kv, generator=generator, device=device, **index_options)
    return q, kv, indices


def random_mla_cache(
    num_blocks: int, block_size: int = BLOCK_SIZE, *, generator: Optional[torch.Generator] = None, device="cpu",
    scale: float = 1.0,
) -> torch.Tensor:
    """FP8 MLA pool ``[num_blocks, block_size, 1, 656]`` uint8 with every slot holding a random
    token, N(0, scale^2) (0.1 is FlashMLA's test scale, where its absolute tolerance applies)."""
    shape = (num_blocks, block_size, 1)
    c_kv = torch.randn(*shape, KV_LORA_RANK, generator=generator) * scale
    k_pe = torch.randn(*shape, ROPE_DIM, generator=generator) * scale
    return quantize_mla(c_kv, k_pe).to(device)


def random_block_table(
    batch: int, blocks_per_seq: int, num_blocks: int, *, generator: Optional[torch.Generator] = None, device="cpu",
) -> torch.Tensor:
    """int32 ``[batch, blocks_per_seq]``: distinct pool blocks scattered at random over the pool."""
    if batch * blocks_per_seq > num_blocks:
        raise ValueError(f"{batch} x {blocks_per_seq} blocks do not fit in a pool of {num_blocks}")
    chosen = torch.randperm(num_blocks, generator=generator)[: batch * blocks_per_seq]
    return chosen.view(batch, blocks_per_seq).to(torch.int32).to(device)


def slots_from_positions(
    positions: torch.Tensor, block_table: torch.Tensor, block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """Slot ids (block_id * block_size + offset) of ``positions: [b, ...]`` through ``block_table:
    [b, max_blocks]``; a position < 0 or beyond the table maps to -1. Returns int32, same shape."""
    pos = positions.long()
    capacity = block_table.shape[1] * block_size
    valid = (pos >= 0) & (pos < capacity)
    safe = torch.where(valid, pos, 0)
    table = block_table.long().view(block_table.shape[0], *([1] * (pos.dim() - 2)), -1).expand(*pos.shape[:-1], -1)
    blocks = torch.gather(table, -1, safe // block_size)
    return torch.where(valid, blocks * block_size + safe % block_size, -1).to(torch.int32)


def random_decode_inputs(
    b: int, s_q: int, h_q: int, topk: int, context: int, device, *, generator: torch.Generator,
    scale: float = 0.1, **index_options,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs of ``sparse_mla_decode``: q ``[b, s_q, h_q, 576]`` bf16, an FP8 pool holding ``b``
    contexts of ``context`` tokens in scattered blocks (plus 3 spare blocks), and slot ids
    ``[b, s_q, topk]`` int32 of random positions (``index_options`` as in :func:`random_indices`).
    q and the cached tokens are N(0, scale^2), 1/10 as in FlashMLA's tests (its tolerances assume it)."""
    blocks_per_seq = max(1, -(-context // BLOCK_SIZE))
    num_blocks = b * blocks_per_seq + 3
    pool = random_mla_cache(num_blocks, generator=generator, device=device, scale=scale)
    table = random_block_table(b, blocks_per_seq, num_blocks, generator=generator)
    positions = random_indices((b, s_q, topk), context, generator=generator, **index_options)
    slots = slots_from_positions(positions, table).to(device)
    q = (torch.randn(b, s_q, h_q, KV_LORA_RANK + ROPE_DIM, generator=generator) * scale).to(device, torch.bfloat16)
    return q, pool, slots


def assert_decode_close(
    out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, sm_scale: float,
    out_abs_tol: float = 1e-3, lse_abs_tol: float = 1e-6,
) -> None:
    """A decode backend's (out, lse) against the reference on fp32 copies of q, with FlashMLA's
    tolerances (``lse_abs_tol`` loosened where a caller says why)."""
    from flashdsa.runtime.kernels import reference  # noqa: PLC0415 (testing imports no kernel at load)

    ref_out, ref_lse = reference.sparse_mla_decode(q.float(), pool, slots, sm_scale)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32, (out.dtype, lse.dtype)
    assert_flashmla_close("out", out, ref_out, abs_tol=out_abs_tol)
    assert_flashmla_close("lse", lse, ref_lse, abs_tol=lse_abs_tol, rel_tol=8 / 65536)


def dense_sparse_mla(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Independent oracle for ``sparse_mla_fwd``: dense masked softmax in float64 (differentiable).

    A count matrix ``[s_q, s_kv]`` records how often each query selected each row (duplicates
    count twice); invalid indices are dropped. Returns (out ``[s_q, h_q, d_v]``, max_logits,
    lse ``[s_q, h_q]``) in float64, with out 0, max_logits -inf, lse +inf on empty rows.
    """
    s_q, s_kv = q.shape[0], kv.shape[0]
    idx = indices[:, 0].long()
    valid = (idx >= 0) & (idx < s_kv)
    counts = torch.zeros(s_q, s_kv + 1, dtype=torch.float64, device=q.device)
    counts.scatter_add_(1, torch.where(valid, idx, s_kv), valid.double())
    counts = counts[:, :s_kv].unsqueeze(1)  # [s_q, 1, s_kv]
    k = kv[:, 0].double()
    scores = torch.einsum("qhd,kd->qhk", q.double(), k) * sm_scale
    weighted = scores.masked_fill(counts == 0, float("-inf")) + counts.log()
    lse = torch.logsumexp(weighted, dim=-1)
    safe_lse = torch.where(torch.isfinite(lse), lse, 0.0)
    out = torch.einsum("qhk,kv->qhv", torch.exp(weighted - safe_lse.unsqueeze(-1)), k[:, :d_v])
    max_logits = scores.masked_fill(counts == 0, float("-inf")).amax(dim=-1) if s_kv else lse.clone()
    return out, max_logits, lse.masked_fill(lse == float("-inf"), float("inf"))


RAW_OP_CHILD = """
import sys, torch
from {module} import {name} as _load  # builds the extension
cuda = torch.device("cuda")
op = {op}
stream = torch.cuda.current_stream().cuda_stream
{setup}
for message, args in CASES:
    try:
        op(*args)
    except RuntimeError as error:
        assert message in str(error), (message, str(error))
    else:
        sys.exit(f"no error: {{message}}")
"""


def assert_raw_op_refuses(module: str, name: str, op: str, setup: str) -> None:
    """Call native op ``op`` (made loadable by importing ``name`` from ``module``) with the bad
    arguments of ``setup``'s ``CASES`` list of (expected message, args) in a child process, and
    assert each raises a RuntimeError naming its argument: a crash (the C++ runtime's own failure
    mode) fails the test rather than the whole run."""
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    code = RAW_OP_CHILD.format(module=module, name=name, op=op, setup=setup)
    run = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=path), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"


def run_under_interpreter(script: str, seed: int, timeout: float = 600) -> None:
    """Run ``python script --interpret`` with ``TRITON_INTERPRET=1`` and assert it succeeds.

    Triton reads the variable when it is first imported, so the CPU cases of a kernel test file
    run in a fresh process and the other tests of the same pytest run keep the normal triton.
    The working directory (the repository root) goes first on PYTHONPATH so the child imports
    this checkout; a failure shows ``seed`` and the tails of the child's output.
    """
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    run = subprocess.run([sys.executable, script, "--interpret"], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, f"seed {seed}\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"


def kernel_test_main(interpreter_cases: Callable[[], None], memcheck_case: Callable[[], None],
                     patch: bool = True) -> None:
    """The ``__main__`` of a Triton kernel test file.

    ``--interpret`` (the child :func:`run_under_interpreter` starts) runs ``interpreter_cases`` on
    2 threads, first installing :func:`flashdsa.runtime.triton_interpreter.patch_interpreter`
    unless ``patch`` is False (kernels that carry their own in-kernel workarounds);
    ``--memcheck`` runs ``memcheck_case``, a small GPU case for ``compute-sanitizer``.
    """
    mode = sys.argv[1:]
    if mode == ["--interpret"]:
        assert os.environ.get("TRITON_INTERPRET") == "1", "--interpret needs TRITON_INTERPRET=1"
        torch.set_num_threads(2)
        if patch:
            from flashdsa.runtime.triton_interpreter import patch_interpreter

            patch_interpreter()
        interpreter_cases()
    elif mode == ["--memcheck"]:
        memcheck_case()
    else:
        sys.exit(f"usage: {sys.argv[0]} --interpret | --memcheck")
