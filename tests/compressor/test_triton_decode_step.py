"""The Triton compressor decode step against the reference: states bit-equal, entries to fp32
rounding, over CSA (overlap) and HCA windows of several ratios (non-powers of two too), bf16 and
fp32 projections with strided rows, a state pool addressed through state_slots, and fresh
sequences (their old rows full of garbage); bf16 entries (``out_dtype``) bit-equal to the fp32
ones rounded. Entries the kernel allocates start as NaN. The CPU
test runs in a TRITON_INTERPRET=1 subprocess; GPU tests are marked ``gpu``.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashdsa.runtime.compressor import compress_decode_step
from flashdsa.testing import flood_cuda_allocator_with_nan, kernel_test_main, poisoned_empty, run_under_interpreter

SEED = int.from_bytes(os.urandom(4), "little")


def check_steps(overlap: bool, ratio: int, dim: int, batch: int, steps: int, dtype: torch.dtype, device,
                pooled: bool = True) -> None:
    """``steps`` decode steps of ``batch`` sequences at scattered positions, both backends from one
    random (garbage) state; with ``pooled`` through a larger pool, permuted state_slots and fresh rows."""
    g = torch.Generator().manual_seed(SEED + 1000 * ratio + dim + overlap)
    channels = 2 * dim if overlap else dim
    rows = 2 * ratio if overlap else ratio
    slots_total = batch + 3 if pooled else batch
    state_kv = torch.randn(slots_total, rows, channels, generator=g)
    state_score = torch.randn(slots_total, rows, channels, generator=g)
    state_score[:, :, ::3] = float("-inf")  # empty slots in some columns
    bias = torch.randn(ratio, channels, generator=g)
    state_slots = torch.randperm(slots_total, generator=g)[:batch] if pooled else None
    start = torch.randint(0, 3 * ratio, (batch,), generator=g)
    start[0] = 2 * ratio - 2  # closes a window at step 1 (and it has a previous window), however few steps
    start[-1] = 3 * ratio - 1  # closes one at step 0: fresh there when pooled (its old rows must not count)
    theirs = [t.to(device) for t in (state_kv, state_score)]
    ours = [t.clone() for t in theirs]
    for step in range(steps):
        wide = torch.randn(batch, channels + 16, generator=g).to(dtype)
        kv, gate = wide[:, :channels], (2 * torch.randn(batch, channels, generator=g)).to(dtype)
        positions = start + step
        options = {}
        if pooled:
            fresh = (torch.rand(batch, generator=g) < 0.3) if step == 0 else torch.zeros(batch, dtype=torch.bool)
            fresh[-1] = step == 0
            options = dict(state_slots=state_slots.to(device), fresh=fresh.to(device))
        args = [t.to(device) for t in (kv, gate, positions, bias)]
        flood_cuda_allocator_with_nan(torch.device(device))
        narrow_state = [t.clone() for t in ours]  # the same step with bf16 entries (the model's out_dtype)
        narrow, _ = compress_decode_step(*args, overlap, *narrow_state, backend="triton", out_dtype=torch.bfloat16,
                                         **options)
        entries, closed = compress_decode_step(*args, overlap, *ours, backend="triton", **options)
        theirs_narrow = [t.clone() for t in theirs]
        want_narrow, _ = compress_decode_step(*args, overlap, *theirs_narrow, backend="reference",
                                              out_dtype=torch.bfloat16, **options)
        want, want_closed = compress_decode_step(*args, overlap, *theirs, backend="reference", **options)
        assert narrow.dtype == want_narrow.dtype == torch.bfloat16
        assert torch.equal(narrow, entries.bfloat16()) and torch.equal(want_narrow, want.bfloat16()), f"seed {SEED}"
        assert all(torch.equal(a, b) for a, b in zip(narrow_state + theirs_narrow, ours + theirs)), f"seed {SEED}"
        what = f"seed {SEED}, overlap {overlap}, ratio {ratio}, step {step}"
        assert closed.dtype == torch.bool and torch.equal(closed, want_closed), what
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1]), f"state: {what}"
        torch.testing.assert_close(entries[closed], want[closed], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")
        assert (entries[~closed] == 0).all(), what


CPU_CASES = [(True, 4, 24, 3, 9), (False, 4, 40, 2, 5), (False, 128, 20, 2, 3), (True, 3, 8, 4, 7),
             (False, 1, 16, 2, 2), (True, 2, 300, 2, 4)]


def run_interpreter_cases() -> None:
    with poisoned_empty():
        for i, (overlap, ratio, dim, batch, steps) in enumerate(CPU_CASES):
            dtype = torch.bfloat16 if i % 2 else torch.float32
            check_steps(overlap, ratio, dim, batch, steps, dtype, "cpu", pooled=i != 1)
    print("interpreter cases passed")


def test_decode_step_kernel_matches_reference_under_interpreter():
    run_under_interpreter(__file__, SEED)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap, ratio, dim, batch", [(True, 4, 512, 32), (True, 4, 128, 32), (False, 128, 512, 32),
                                                        (False, 128, 512, 1), (True, 4, 512, 1), (True, 3, 100, 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_step_kernel_matches_reference_on_gpu(overlap, ratio, dim, batch, dtype):
    check_steps(overlap, ratio, dim, batch, 2 * ratio + 1 if ratio < 8 else 3, dtype, "cuda")
    check_steps(overlap, ratio, dim, batch, 3, dtype, "cuda", pooled=False)


def run_memcheck_case() -> None:
    check_steps(True, 4, 512, 32, 9, torch.bfloat16, "cuda")
    check_steps(False, 128, 512, 8, 2, torch.bfloat16, "cuda")
    torch.cuda.synchronize()


if __name__ == "__main__":
    kernel_test_main(run_interpreter_cases, run_memcheck_case)
