"""Triton MoE (alignment, grouped GEMMs, combine) against the reference backend.

The alignment must keep its contract exactly (it is integer work). fused_moe: both backends
accumulate in fp32 and round the intermediate and each pair's output to bf16, so they differ by
summation order only, which can flip a bf16 rounding (FP8: an e4m3 rounding of the intermediate).
Outputs start poisoned (NaN ``out``; on the GPU the allocator is flooded with NaN so internal
buffers start poisoned too). GPU tests are marked ``gpu``; the CPU test runs small cases under
TRITON_INTERPRET=1 in a subprocess.
"""

from __future__ import annotations

import pytest
import torch

from flashdsa.runtime.moe import align_tokens, fused_moe, max_blocks, select_experts
from flashdsa.testing import flood_cuda_allocator_with_nan, kernel_test_main, poisoned, run_under_interpreter
from moe_cases import (SEED, alignment_cases, assert_clip_matters, assert_moe_close, check_alignment, generator,
                       moe_inputs, with_fp4_weights)

V32 = dict(num_experts=256, top_k=8, hidden=7168, inter=2048)


def check_triton_alignment(ids: torch.Tensor, num_experts: int, block_m: int, **knobs) -> None:
    """Public op (or, with ``knobs`` such as min_chunk, the backend) keeps the contract."""
    if knobs:
        from flashdsa.runtime.moe.triton import align

        num_blocks = max_blocks(ids.numel(), num_experts, block_m)
        aligned = align.align_tokens(ids, num_experts, block_m, num_blocks, **knobs)
    else:
        aligned = align_tokens(ids, num_experts, block_m, backend="triton")
    check_alignment(ids, num_experts, block_m, aligned)


def check_fused(args: dict, fp8: bool, pow2_scales: bool = False, swiglu_limit: float | None = None,
                **knobs) -> None:
    """Triton (public op, or with ``knobs`` such as a launch config the backend) vs the reference,
    into a NaN ``out``."""
    x = args["x"]
    out = poisoned(x.shape, x.dtype, x.device)
    if not knobs:
        got = fused_moe(**args, pow2_scales=pow2_scales, swiglu_limit=swiglu_limit, out=out, backend="triton")
    else:
        from flashdsa.runtime.moe.triton import fused_moe as backend

        got = backend.fused_moe(args["x"], args["w13"], args["w2"], args["weights"], args["expert_ids"],
                                args.get("w13_scale"), args.get("w2_scale"), pow2_scales, True, out,
                                swiglu_limit=swiglu_limit, **knobs)
    assert got is out
    want = fused_moe(**args, pow2_scales=pow2_scales, swiglu_limit=swiglu_limit, backend="reference")
    assert_moe_close(got, want, fp8)


def interpreter_configs():
    from flashdsa.runtime.moe.triton.fused_moe import MoeConfig
    from flashdsa.runtime.moe.triton.grouped_gemm import Tile

    return [MoeConfig(16, Tile(32, 32, group_m=2), Tile(32, 64, group_m=1)), MoeConfig(32, Tile(16, 128), Tile(64, 32))]


def run_interpreter_cases() -> None:
    for _, ids, num_experts, block_m in alignment_cases():
        check_triton_alignment(ids, num_experts, block_m)
    g = generator(1)
    many = moe_inputs(150, 8, 40, 1, 1, False, g, invalid=0.05)["expert_ids"]
    check_triton_alignment(many, 40, 16, min_chunk=64)  # 19 chunks: count launch, then place
    check_triton_alignment(many, 40, 4, min_chunk=48)  # chunks that end inside a one-hot step
    small_tiles, block_m_32 = interpreter_configs()
    for fp8 in (False, True):
        args = moe_inputs(7, 3, 6, 200, 96, fp8, generator(2, fp8), invalid=0.15)  # no size a block multiple
        check_fused(args, fp8, config=small_tiles)
        check_fused(args, fp8, pow2_scales=fp8, config=block_m_32, chunk_tokens=3)  # chunks of 3, 3, 1 tokens
        check_fused(moe_inputs(4, 2, 3, 40, 24, fp8, generator(3, fp8)), fp8)  # the default decode config
        clipped = moe_inputs(6, 2, 4, 136, 128, fp8, generator(6, fp8), invalid=0.1)
        assert_clip_matters(clipped, 0.5)  # V4's clipped SwiGLU at a limit most gate and up values cross
        check_fused(clipped, fp8, pow2_scales=fp8, swiglu_limit=0.5, config=small_tiles)
        check_fused(clipped, fp8, swiglu_limit=0.5)
    run_fp4_interpreter_cases(small_tiles, block_m_32)
    crowded = moe_inputs(20, 2, 4, 64, 32, True, generator(4))
    crowded["expert_ids"][:] = 1  # all 40 pairs on one expert (3 blocks), experts 0, 2, 3 idle
    check_fused(crowded, True, config=small_tiles)
    check_fused(moe_inputs(0, 2, 4, 64, 32, False, generator(5)), False, config=small_tiles)


def run_fp4_interpreter_cases(small_tiles, block_m_32) -> None:
    """Packed FP4 experts (bf16 activations, fp32 accumulation): the bf16 tolerance, as the kernel's
    bf16 e2m1 values times fp32 scales equal the reference's fp32 dequantized weights. K = H and I multiples of 32 but not of 128, some experts idle, ids invalid."""
    from flashdsa.runtime.moe.triton.fused_moe import MoeConfig
    from flashdsa.runtime.moe.triton.grouped_gemm import Tile

    k32_tiles = MoeConfig(16, Tile(16, 32, group_m=3), Tile(32, 64, group_m=1))  # one scale group a K step
    for scale_dtype, tokens, top_k, experts, hidden, inter in (
            (torch.uint8, 7, 3, 6, 160, 96), (torch.float32, 5, 2, 9, 96, 32),
            (torch.float8_e8m0fnu, 1, 6, 8, 224, 64)):
        args = with_fp4_weights(moe_inputs(tokens, top_k, experts, hidden, inter, False,
                                           generator(7, tokens, experts), invalid=0.15), scale_dtype)
        check_fused(args, False)  # the public op: the default (decode) config, block_k 256 > K
        if scale_dtype != torch.float8_e8m0fnu:  # the backend takes the bytes the public op hands it
            args["w13"], args["w2"] = args["w13"].view(torch.uint8), args["w2"].view(torch.uint8)
            check_fused(args, False, config=k32_tiles)
            check_fused(args, False, swiglu_limit=0.5, config=small_tiles)
            check_fused(args, False, config=block_m_32, chunk_tokens=3)


def test_triton_moe_under_interpreter():
    run_under_interpreter(__file__, SEED)


cuda = torch.device("cuda")


@pytest.fixture(scope="module")
def v32_experts() -> dict:
    """DeepSeek-V3.2's routed experts (256 of 2048 x 7168) in bf16 and in FP8, made once on the GPU."""
    experts = {}
    for fp8 in (False, True):
        args = moe_inputs(1, V32["top_k"], V32["num_experts"], V32["hidden"], V32["inter"], fp8, generator(9, fp8),
                          device=cuda)
        experts[fp8] = {k: v for k, v in args.items() if k in ("w13", "w2", "w13_scale", "w2_scale")}
    return experts


def v32_inputs(tokens: int, experts: dict, fp8: bool) -> dict:
    g = generator(tokens, fp8)
    logits = torch.randn(tokens, V32["num_experts"], generator=g).to(cuda)
    weights, ids = select_experts(logits, torch.zeros(V32["num_experts"], device=cuda), V32["top_k"], 8, 4, True, 2.5)
    ids[::7, -1] = -1  # an expert another rank owns
    x = torch.randn(tokens, V32["hidden"], generator=g).to(cuda, torch.bfloat16)
    return dict(x=x, weights=weights, expert_ids=ids) | experts[fp8]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 32, 128, 2048])
@pytest.mark.parametrize("fp8", [False, True])
def test_v32_shapes_match_reference(tokens, fp8, v32_experts):
    args = v32_inputs(tokens, v32_experts, fp8)
    flood_cuda_allocator_with_nan(cuda, 1 << 30)  # room for every internal buffer at T=2048
    check_fused(args, fp8, pow2_scales=fp8)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32, 128, 512])
@pytest.mark.parametrize("weights", ["bf16", "fp8", "fp4"])
def test_v4_clipped_swiglu_matches_reference(tokens, weights):
    """DeepSeek-V4-Flash's expert widths (H=4096, I=2048, top-6; 64 of its 256 experts to keep the
    reference quick) with the SwiGLU clipped at 0.75, which most gate and up values cross; bf16,
    FP8 and the release's packed FP4 (UE8M0 exponent bytes) experts."""
    fp8 = weights == "fp8"
    args = moe_inputs(tokens, 6, 64, 4096, 2048, fp8, generator(30, tokens, fp8), invalid=0.05, device=cuda)
    if weights == "fp4":
        args = with_fp4_weights(args)
    plain = fused_moe(**args, pow2_scales=fp8, backend="reference").double()
    clipped = fused_moe(**args, pow2_scales=fp8, swiglu_limit=0.75, backend="reference").double()
    assert (clipped - plain).abs().max() > 0.25 * clipped.abs().max(), f"seed {SEED}: the clip hardly matters"
    flood_cuda_allocator_with_nan(cuda, 1 << 30)
    check_fused(args, fp8, pow2_scales=fp8, swiglu_limit=0.75)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, top_k, num_experts, block_m", [
    (1, 8, 256, 16), (4096, 8, 256, 64), (3000, 6, 1024, 16), (77, 3, 5, 128)])
def test_alignment_on_gpu(tokens, top_k, num_experts, block_m):
    ids = moe_inputs(tokens, top_k, num_experts, 1, 1, False, generator(tokens), invalid=0.02)["expert_ids"]
    flood_cuda_allocator_with_nan(cuda)
    check_triton_alignment(ids.to(cuda), num_experts, block_m)


def routed_experts(logits: torch.Tensor, x: torch.Tensor, experts: dict, fp8: bool) -> torch.Tensor:
    """One MoE layer's routed part as a decode step runs it: routing, then fused_moe."""
    bias = torch.zeros(logits.shape[1], device=logits.device)
    weights, ids = select_experts(logits, bias, V32["top_k"], 8, 4, True, 2.5)
    return fused_moe(x, experts["w13"], experts["w2"], weights, ids, experts.get("w13_scale"),
                     experts.get("w2_scale"), pow2_scales=fp8, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_no_host_sync_and_cuda_graph_replay(fp8, v32_experts):
    """Routing + fused_moe never sync, and a captured graph replays exactly what eager mode computes."""
    g = generator(11, fp8)
    logits = torch.randn(32, V32["num_experts"], generator=g).to(cuda)
    x = torch.randn(32, V32["hidden"], generator=g).to(cuda, torch.bfloat16)
    experts = v32_experts[fp8]
    routed_experts(logits, x, experts, fp8)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        routed_experts(logits, x, experts, fp8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = routed_experts(logits, x, experts, fp8)
    for salt in range(2):  # new inputs into the static buffers
        logits.copy_(torch.randn(logits.shape, generator=generator(12, salt)).to(cuda))
        x.copy_(torch.randn(x.shape, generator=generator(13, salt)).to(cuda, torch.bfloat16))
        graph.replay()
        assert torch.equal(captured, routed_experts(logits, x, experts, fp8)), f"seed {SEED}: replay differs"


def run_memcheck_case() -> None:
    """Small GPU cases of every MoE kernel (invalid ids, padding, idle experts) for compute-sanitizer."""
    for fp8 in (False, True):
        check_fused(moe_inputs(33, 4, 12, 300, 136, fp8, generator(20, fp8), invalid=0.1, device=cuda), fp8)
    check_fused(with_fp4_weights(moe_inputs(33, 4, 12, 288, 96, False, generator(22), invalid=0.1, device=cuda)), False)
    ids = moe_inputs(1500, 8, 20, 1, 1, False, generator(21), invalid=0.1)["expert_ids"]
    check_triton_alignment(ids.to(cuda), 20, 64)
    torch.cuda.synchronize()


if __name__ == "__main__":
    kernel_test_main(run_interpreter_cases, run_memcheck_case)
