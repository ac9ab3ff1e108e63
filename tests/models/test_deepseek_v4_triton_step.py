"""DeepSeek-V4's production engine step on its Triton kernels end to end (the path a GPU runs:
fused RoPE, RMSNorms and head norms, routing, shared-input projections, the FP8 linears and FP4
experts, mHC, compressors, indexer and sparse attention) against the same model on the reference
backends. On CPU the kernels run under TRITON_INTERPRET in a child process, so a wiring error of a
GPU-only path shows in CI; ``--memcheck`` runs the same step on a GPU for compute-sanitizer.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

import torch

from flashdsa.models.deepseek_v4_loader import load_v4_model
from flashdsa.models.deepseek_v4_tiny import make_tiny_v4_checkpoint
from flashdsa.runtime.dispatch import ENV_VAR
from flashdsa.runtime.metadata import BatchMetadata
from flashdsa.testing import kernel_test_main, run_under_interpreter

SEED = 5
STEPS = [8, 1, 1, 1, 1]  # a prefill, then decode steps through the CSA windows closing at 7 and 11


def run(path: Path, device: str, backend: str) -> torch.Tensor:
    """Logits of every token of STEPS on ``backend`` (every op that has it), prepared as the runner does."""
    os.environ[ENV_VAR] = backend
    model = load_v4_model(path, device, mode="production")
    model.prepare_for_inference()
    caches = model.allocate_caches(8, 2)
    ids = torch.randint(0, 512, (sum(STEPS),), generator=torch.Generator().manual_seed(SEED)).to(device)
    done, rows = 0, []
    for n in STEPS:
        meta = BatchMetadata.for_step([done], [n], torch.arange(8)[None], torch.arange(n), state_slots=[0])
        rows.append(model(ids[done:done + n], meta.to(torch.device(device)), caches).float().cpu())
        done += n
    return torch.cat(rows)


def compare(device: str) -> None:
    """Triton against reference backends: as close as the FP8 paths allow (mean cosine >= 0.998)."""
    with TemporaryDirectory() as tmp:
        path = make_tiny_v4_checkpoint(tmp, seed=SEED, fp8=True, fp4_experts=True)
        got, want = run(path, device, "triton"), run(path, device, "reference")
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cosine.mean() >= 0.998 and cosine.min() >= 0.99, cosine


def test_production_step_on_triton_kernels_matches_reference_backends_under_interpreter():
    run_under_interpreter(__file__, SEED)


if __name__ == "__main__":
    kernel_test_main(lambda: compare("cpu"), lambda: compare("cuda"))
