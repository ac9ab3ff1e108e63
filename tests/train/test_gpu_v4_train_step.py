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


def flash_width_model() -> torch.nn.Module:
    """V4-Flash attention widths (hidden 4096, 64 heads of 512, indexer 64 x 128, top-512, window
    128) in one CSA and one HCA layer; few small experts and a small vocabulary."""
    from flashdsa.models.deepseek_v4 import DeepseekV4ForCausalLM
    from flashdsa.models.deepseek_v4_config import DeepseekV4Config
    from flashdsa.train.init import initialize

    config = DeepseekV4Config(vocab_size=1024, num_hidden_layers=2, compress_ratios=[4, 128], hash_layers=0,
                              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                              num_nextn_predict_layers=0)
    with torch.device("cuda"):
        model = DeepseekV4ForCausalLM(config)
    return initialize(model, seed=0)  # its generator is a CPU one: outside the device context


def peak_step_bytes(model, length: int) -> int:
    """Peak bytes a sparse-stage step (forward + backward, layers recomputed) adds to the model's."""
    set_trainable(model, "sparse")
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    batch = torch.randint(0, 1024, (1, length + 1), device="cuda")
    cfg = TrainConfig(stage="sparse", steps=1, seq_len=length, batch_tokens=length, checkpointing=True)
    compute_losses(model, batch, cfg)["loss"].backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_flash_width_step_memory_grows_linearly_with_length():
    """Chunked attention, chunked top-k selection and recomputed layers: doubling L to 4096 at most
    about doubles a step's memory (a [L, L] term would quadruple it)."""
    model = flash_width_model()
    short, long = peak_step_bytes(model, 2048), peak_step_bytes(model, 4096)
    print(f"V4-Flash-width sparse step peak: L=2048 {short / 2**30:.2f} GiB, L=4096 {long / 2**30:.2f} GiB")
    assert long < 2.5 * short
    assert long < 40 * 2**30
