"""GPU: a DeepSeek-V4 training step under the loop's bf16 autocast follows the fp32 CPU step."""

from __future__ import annotations

import pytest
import torch

from flashdsa.models.deepseek_v4_loader import load_v4_model
from flashdsa.train.loop import TrainConfig, compute_losses, set_trainable

pytestmark = pytest.mark.gpu

SEQ_LEN, BATCH = 1024, 2  # 256 CSA entries (top-8 of them per query), 8 HCA entries, past the 128 window


def step(model, batch: torch.Tensor, stage: str, checkpointing: bool = False):
    """Losses (floats) and fp32 CPU gradients of one step of ``stage``."""
    set_trainable(model, stage)
    model.zero_grad(set_to_none=True)
    cfg = TrainConfig(stage=stage, steps=1, seq_len=SEQ_LEN, batch_tokens=BATCH * SEQ_LEN, checkpointing=checkpointing)
    losses = compute_losses(model, batch.to(model.device), cfg)
    losses["loss"].backward()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return {k: float(v.detach()) for k, v in losses.items()}, grads


@pytest.mark.parametrize("stage", ["warmup", "sparse"])
def test_cuda_step_follows_the_cpu_fp32_step(tiny_v4_dir, stage):
    batch = torch.randint(4, 500, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    want_losses, want_grads = step(load_v4_model(tiny_v4_dir, mtp=True), batch, stage)
    losses, grads = step(load_v4_model(tiny_v4_dir, "cuda", mtp=True), batch, stage, checkpointing=True)
    assert losses.keys() == want_losses.keys()
    for key, want in want_losses.items():
        assert abs(losses[key] - want) < 3e-2 * abs(want) + 1e-3, key
    assert grads.keys() == want_grads.keys() and grads
    for name, want in want_grads.items():
        assert torch.isfinite(grads[name]).all(), name
        if want.norm() > 1e-6:
            cosine = torch.nn.functional.cosine_similarity(grads[name].flatten(), want.flatten(), dim=0)
            assert cosine > 0.95, f"{name}: cosine {cosine:.4f}"
