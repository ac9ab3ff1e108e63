"""The FP4 decode GEMM (``fp4_gemv``: CUDA-core FMAs, 1-4 row blocks) inside fused_moe, against the
reference MoE and against the grouped (tensor-core) FP4 path.

All three round the intermediate and each pair's output to bf16 from fp32 sums taken in another
order, so they agree within assert_moe_close's bf16 tolerance. Outputs start poisoned (NaN
``out``; on the GPU the allocator is flooded with NaN so internal buffers start poisoned too).
The CPU cases run under TRITON_INTERPRET=1 in a subprocess; GPU tests are marked ``gpu``.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from flashdsa.runtime.moe import fused_moe
from flashdsa.runtime.moe.triton.fp4_gemv import GemvTile
from flashdsa.runtime.moe.triton.fused_moe import MoeConfig, choose_config
from flashdsa.runtime.moe.triton.grouped_gemm import Tile
from flashdsa.testing import flood_cuda_allocator_with_nan, kernel_test_main, poisoned, run_under_interpreter
from moe_cases import (SEED, assert_clip_matters, assert_moe_close, assert_sync_free_and_replayable, generator,
                       moe_inputs, with_fp4_weights)

V4_FLASH = dict(num_experts=256, top_k=6, hidden=4096, inter=2048)
GROUPED = MoeConfig(16, Tile(32, 64, group_m=2), Tile(32, 64, group_m=1))  # the tensor-core path, small tiles


def backend_moe(args: dict, config: MoeConfig, swiglu_limit: Optional[float] = None,
                chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """The triton backend with launch shape ``config`` into a NaN ``out`` (packed bytes as the public
    op hands them over)."""
    from flashdsa.runtime.moe.triton import fused_moe as backend

    out = poisoned(args["x"].shape, args["x"].dtype, args["x"].device)
    w13, w2 = args["w13"].view(torch.uint8), args["w2"].view(torch.uint8)
    scales = [s.view(torch.uint8) if s.dtype == torch.float8_e8m0fnu else s for s in (args["w13_scale"], args["w2_scale"])]
    chunks = {} if chunk_tokens is None else dict(chunk_tokens=chunk_tokens)
    got = backend.fused_moe(args["x"], w13, w2, args["weights"], args["expert_ids"], *scales, False, True, out,
                            swiglu_limit=swiglu_limit, config=config, **chunks)
    assert got is out
    return got


def check_decode_gemm(args: dict, config: MoeConfig, swiglu_limit: Optional[float] = None, **chunks) -> None:
    """The decode GEMM's output against the reference and against the grouped FP4 path."""
    got = backend_moe(args, config, swiglu_limit, **chunks)
    want = fused_moe(**args, swiglu_limit=swiglu_limit, backend="reference")
    assert_moe_close(got, want, False)
    assert_moe_close(got, backend_moe(args, GROUPED, swiglu_limit), False)


def fp4_inputs(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, scale_dtype: torch.dtype,
               salt: int, invalid: float = 0.15) -> dict:
    return with_fp4_weights(moe_inputs(tokens, top_k, num_experts, hidden, inter, False,
                                       generator(40, salt, tokens, num_experts), invalid=invalid), scale_dtype)


def run_interpreter_cases() -> None:
    """H and I multiples of 32 but not of the K steps or column tiles, idle experts, invalid ids,
    one expert repeated in a token's slots, UE8M0 bytes, e8m0 and fp32 scales, the clip, blocks of
    1, 2 and 4 rows, chunking, no tokens."""
    one_row, two_rows, four_rows = (MoeConfig(1, GemvTile(16, 64), GemvTile(32, 128, 2, 1)),
                                    MoeConfig(2, GemvTile(32, 256, 8, 3), GemvTile(16, 32)),
                                    MoeConfig(4, GemvTile(8, 128), GemvTile(64, 64)))
    args = fp4_inputs(5, 4, 8, 160, 96, torch.uint8, 1)
    args["expert_ids"][0] = torch.tensor([3, 3, 3, 1], dtype=torch.int32)  # duplicates in one token
    args["expert_ids"][1, :2] = 3  # and across tokens
    args["expert_ids"][2, 3] = -1
    for config in (one_row, two_rows, four_rows):
        check_decode_gemm(args, config)
    check_decode_gemm(args, two_rows, chunk_tokens=2)  # chunks of 2, 2, 1 tokens
    clipped = fp4_inputs(3, 6, 16, 96, 64, torch.float32, 2)
    assert_clip_matters(clipped, 0.5)  # V4's clipped SwiGLU at a limit most gate and up values cross
    check_decode_gemm(clipped, one_row, swiglu_limit=0.5)
    check_decode_gemm(clipped, four_rows, swiglu_limit=0.5)
    public = fp4_inputs(1, 6, 12, 224, 64, torch.float8_e8m0fnu, 3)
    assert isinstance(choose_config(6, 12, "fp4").gate_up, GemvTile)
    got = fused_moe(**public, out=poisoned((1, 224), torch.bfloat16), swiglu_limit=0.5, backend="triton")
    assert_moe_close(got, fused_moe(**public, swiglu_limit=0.5, backend="reference"), False)
    dead = fp4_inputs(3, 2, 8, 64, 32, torch.uint8, 4)
    dead["expert_ids"] = torch.tensor([[-1, 8], [9, -7], [2**31 - 1, -(2**31)]], dtype=torch.int32)
    assert torch.equal(backend_moe(dead, one_row), torch.zeros(3, 64, dtype=torch.bfloat16)), f"seed {SEED}"
    backend_moe(fp4_inputs(0, 2, 8, 64, 32, torch.uint8, 5), two_rows)


def test_fp4_decode_gemm_under_interpreter():
    run_under_interpreter(__file__, SEED)


@pytest.mark.parametrize("tokens, top_k, num_experts, decode", [
    (1, 6, 256, True), (32, 6, 256, True), (85, 6, 256, True), (86, 6, 256, False), (128, 6, 256, False),
    (1, 8, 4, True), (2, 8, 4, False)])
def test_fp4_picks_the_decode_gemm_at_two_pairs_an_expert_or_fewer(tokens, top_k, num_experts, decode):
    config = choose_config(tokens * top_k, num_experts, "fp4")
    assert isinstance(config.gate_up, GemvTile) == isinstance(config.down, GemvTile) == decode
    for weights in ("bf16", "fp8"):  # the decode GEMM is FP4's only
        assert isinstance(choose_config(tokens * top_k, num_experts, weights).gate_up, Tile)


cuda = torch.device("cuda")


@pytest.fixture(scope="module")
def v4_experts() -> dict:
    """V4-Flash's 256 routed experts as packed FP4: random bytes (every nibble is an e2m1 code) and
    UE8M0 exponents 2^-8..2^-5 per 32 inputs, made on the GPU (quantizing 13 GB of bf16 is slow)."""
    g = torch.Generator(cuda).manual_seed(SEED)
    e, h, i = V4_FLASH["num_experts"], V4_FLASH["hidden"], V4_FLASH["inter"]
    experts = {}
    for name, (rows, cols) in (("w13", (2 * i, h)), ("w2", (h, i))):
        experts[name] = torch.randint(0, 256, (e, rows, cols // 2), dtype=torch.uint8, device=cuda, generator=g)
        experts[name + "_scale"] = torch.randint(119, 123, (e, rows, cols // 32), dtype=torch.uint8, device=cuda,
                                                 generator=g)
    return experts


def v4_inputs(tokens: int, experts: dict, salt: int) -> dict:
    args = moe_inputs(tokens, V4_FLASH["top_k"], V4_FLASH["num_experts"], 1, 1, False, generator(41, tokens, salt),
                      invalid=0.05)
    x = torch.randn(tokens, V4_FLASH["hidden"], generator=generator(42, tokens, salt)).bfloat16()
    return dict(x=x.to(cuda), weights=args["weights"].to(cuda), expert_ids=args["expert_ids"].to(cuda)) | experts


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 32])
@pytest.mark.parametrize("swiglu_limit", [None, 0.75])
def test_v4_flash_decode_matches_reference_and_grouped(tokens, swiglu_limit, v4_experts):
    """V4-Flash widths (H 4096, I 2048, 256 experts, top-6): the heuristic's decode GEMM against the
    reference and the grouped tensor-core path (its former decode tiles, tl.dot_scaled)."""
    args = v4_inputs(tokens, v4_experts, 0)
    assert isinstance(choose_config(tokens * V4_FLASH["top_k"], V4_FLASH["num_experts"], "fp4").gate_up, GemvTile)
    flood_cuda_allocator_with_nan(cuda)
    got = fused_moe(**args, swiglu_limit=swiglu_limit, out=poisoned(args["x"].shape, torch.bfloat16, cuda),
                    backend="triton")
    assert_moe_close(got, fused_moe(**args, swiglu_limit=swiglu_limit, backend="reference"), False)
    grouped = MoeConfig(16, Tile(64, 128, 4, 3), Tile(64, 128, 4, 5))
    assert_moe_close(got, backend_moe(args, grouped, swiglu_limit), False)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [2, 4])
def test_v4_flash_decode_blocks_of_several_rows_match_reference(block_m, v4_experts):
    args = v4_inputs(32, v4_experts, block_m)
    flood_cuda_allocator_with_nan(cuda)
    got = backend_moe(args, MoeConfig(block_m, GemvTile(16, 512), GemvTile(32, 256, 8, 3)), 0.75)
    assert_moe_close(got, fused_moe(**args, swiglu_limit=0.75, backend="reference"), False)


@pytest.mark.gpu
def test_v4_flash_decode_is_sync_free_and_replays_from_a_cuda_graph(v4_experts):
    """The decode path never syncs, and a captured graph replayed on new tokens, weights and expert
    ids (written into the static inputs) gives what eager mode gives."""
    args = v4_inputs(4, v4_experts, 1)
    run = lambda: (fused_moe(**args, swiglu_limit=0.75, backend="triton"),)  # noqa: E731
    run()  # compile outside the checks

    def refill():
        fresh = v4_inputs(4, v4_experts, 2)
        for name in ("x", "weights", "expert_ids"):
            args[name].copy_(fresh[name])

    assert_sync_free_and_replayable(run, refill)


def run_memcheck_case() -> None:
    """Small GPU cases of the decode GEMM (invalid ids, duplicates, blocks of 1 and 4 rows) for compute-sanitizer."""
    args = {k: v.to(cuda) for k, v in fp4_inputs(9, 4, 12, 288, 96, torch.uint8, 6).items()}
    for config in (MoeConfig(1, GemvTile(16, 512), GemvTile(16, 512)), MoeConfig(4, GemvTile(32, 256), GemvTile(8, 1024))):
        assert_moe_close(backend_moe(args, config), fused_moe(**args, backend="reference"), False)
    torch.cuda.synchronize()


if __name__ == "__main__":
    kernel_test_main(run_interpreter_cases, run_memcheck_case)
