"""Inputs and checks shared by the MoE tests (CPU, interpreter and GPU)."""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from flashdsa.runtime.fp8 import E4M3
from flashdsa.runtime.moe import AlignedPairs, max_blocks
from flashdsa.testing import cosine_distance

SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure


def generator(*salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + sum(s * 7919**i for i, s in enumerate(salt)))


def random_expert_ids(tokens: int, top_k: int, num_experts: int, g: torch.Generator, invalid: float = 0.0,
                      device="cpu") -> torch.Tensor:
    """int32 [T, k] ids in [0, E), a fraction ``invalid`` of them replaced by values < 0 or >= E."""
    ids = torch.randint(0, num_experts, (tokens, top_k), generator=g)
    roll = torch.rand(tokens, top_k, generator=g)
    wild = torch.where(torch.rand(tokens, top_k, generator=g) < 0.5,
                       torch.randint(-(2**31), 0, (tokens, top_k), generator=g),
                       torch.randint(num_experts, 2**31 - 1, (tokens, top_k), generator=g))
    return torch.where(roll < invalid, wild, ids).to(torch.int32).to(device)


def random_weight(shape: tuple[int, int, int], fp8: bool, dtype: torch.dtype, g: torch.Generator,
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Stacked expert weights ``[E, N, K]`` about N(0, 1/K) on ``g``'s device, made one expert at a
    time (no fp32 copy of a V3.2-size stack): ``dtype``, or e4m3 with random 128x128 block scales
    ``[E, ceil(N/128), ceil(K/128)]`` fp32."""
    experts, rows, cols = shape
    w = torch.empty(shape, dtype=E4M3 if fp8 else dtype, device=g.device)
    for e in range(experts):
        w[e] = torch.randn(rows, cols, generator=g, device=g.device) * (1.0 if fp8 else cols**-0.5)
    if not fp8:
        return w, None
    scale = torch.rand(experts, -(-rows // 128), -(-cols // 128), generator=g, device=g.device) + 0.5
    return w, scale * cols**-0.5


def moe_inputs(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, fp8: bool, g: torch.Generator,
               *, invalid: float = 0.0, dtype: torch.dtype = torch.bfloat16, device="cpu") -> dict:
    """Keyword arguments of ``fused_moe`` on ``device``: random x, stacked experts (``dtype``, or FP8
    with scales), positive routing weights and expert ids (a fraction ``invalid`` out of range)."""
    on_device = torch.Generator(device).manual_seed(int(torch.randint(2**62, (1,), generator=g)))
    args = dict(x=torch.randn(tokens, hidden, generator=g).to(dtype),
                weights=torch.rand(tokens, top_k, generator=g) + 0.1,
                expert_ids=random_expert_ids(tokens, top_k, num_experts, g, invalid))
    args = {name: t.to(device) for name, t in args.items()}
    args["w13"], w13_scale = random_weight((num_experts, 2 * inter, hidden), fp8, dtype, on_device)
    args["w2"], w2_scale = random_weight((num_experts, hidden, inter), fp8, dtype, on_device)
    if fp8:
        args["w13_scale"], args["w2_scale"] = w13_scale, w2_scale
    return args


def with_fp4_weights(args: dict, scale_dtype: torch.dtype = torch.uint8) -> dict:
    """``args`` (bf16 experts) with w13, w2 quantized to packed FP4 per expert (``runtime.fp4``) and
    their scales as UE8M0 exponent bytes (uint8), float8_e8m0fnu, or fp32 (here not powers of two:
    the UE8M0 scales times a random factor in [1, 2), so the kernel's bf16 rounding of w is exercised)."""
    from flashdsa.runtime.fp4 import quantize_fp4

    out = dict(args)
    for name in ("w13", "w2"):
        packed, scales = zip(*(quantize_fp4(w) for w in args[name]))
        scale = torch.stack(scales)
        if scale_dtype == torch.uint8:
            scale = scale.view(torch.uint8)
        elif scale_dtype == torch.float32:
            factor = torch.rand(scale.shape, generator=torch.Generator().manual_seed(SEED)).to(scale.device) + 1
            scale = scale.float() * factor
        out[name], out[name + "_scale"] = torch.stack(packed), scale
    return out


def alignment_cases() -> list[tuple[str, torch.Tensor, int, int]]:
    """(name, expert_ids, E, block_m): the corners the contract names."""
    g = generator(1)
    return [
        ("no tokens", torch.zeros(0, 8, dtype=torch.int32), 256, 16),
        ("one token, V3.2", random_expert_ids(1, 8, 256, g), 256, 16),
        ("all on one expert", torch.full((40, 2), 3, dtype=torch.int32), 5, 16),
        ("nobody picks experts 1..6", torch.tensor([[0, 7]] * 9, dtype=torch.int32), 8, 4),
        ("every id invalid", torch.tensor([[-1, 8], [9, -5]], dtype=torch.int32), 8, 4),
        ("some ids invalid", random_expert_ids(50, 4, 10, g, invalid=0.3), 10, 8),
        ("block_m 1", random_expert_ids(20, 3, 7, g), 7, 1),
        ("more pairs than blocks fill", random_expert_ids(300, 8, 16, g, invalid=0.05), 16, 64),
        ("duplicate experts in a token", torch.tensor([[2, 2, 2], [1, 2, 1]], dtype=torch.int32), 3, 2),
    ]


def check_alignment(expert_ids: torch.Tensor, num_experts: int, block_m: int, aligned: AlignedPairs) -> None:
    """The contract of ``align_tokens``, element by element."""
    flat = expert_ids.flatten().long().cpu()
    pairs, experts = aligned.sorted_pairs.cpu(), aligned.block_experts.cpu()
    num_blocks = max_blocks(flat.numel(), num_experts, block_m)
    assert pairs.dtype == experts.dtype == torch.int32, f"seed {SEED}: dtypes {pairs.dtype}, {experts.dtype}"
    assert pairs.shape == (num_blocks * block_m,) and experts.shape == (num_blocks,), f"seed {SEED}: static sizes"
    rows = pairs.view(num_blocks, block_m).long()
    block = 0
    for e in range(num_experts):
        want = (flat == e).nonzero().flatten()
        used = -(-want.numel() // block_m)
        assert (experts[block:block + used] == e).all(), f"seed {SEED}: expert {e} should own blocks {block}+{used}"
        run = rows[block:block + used].flatten()
        assert torch.equal(run[:want.numel()], want), f"seed {SEED}: expert {e}'s pairs are not its, in order"
        assert (run[want.numel():] == -1).all(), f"seed {SEED}: expert {e}'s padding is not -1"
        block += used
    assert (experts[block:] == -1).all() and (rows[block:] == -1).all(), f"seed {SEED}: unused blocks not -1"


def assert_moe_close(got: torch.Tensor, ref: torch.Tensor, fp8: bool) -> None:
    """Elementwise within a few bf16 ulps of the output's scale (FP8: a few e4m3 rounding flips of
    the intermediate allowed), and cosine distance tight; NaN (an unwritten element) never passes.
    Both sides round the intermediate and each of the top_k pair outputs to bf16, but from fp32
    sums taken in another order: each rounding may land one ulp apart, so an output may differ by
    up to ~top_k ulps of its pairs' magnitude (seen on an H100: 2 ulps at |out| ~ 2). With FP8 an
    e4m3 flip of one intermediate value moves a product by 2^-3 of it: 11 of 14.7M outputs at
    T=2048 were 1.5x past an atol of 2^-5 rms on an H100, so FP8 gets 2^-4."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, f"{got.dtype} {list(got.shape)} vs {list(ref.shape)}"
    got, ref = got.double().cpu(), ref.double().cpu()
    assert torch.isfinite(got).all(), f"seed {SEED}: {int((~torch.isfinite(got)).sum())} non-finite elements"
    rms = ref.square().mean().sqrt().item() if ref.numel() else 0.0
    atol, rtol, cos_tol = (2**-4 * rms, 2**-6, 1e-4) if fp8 else (2**-6 * rms, 2**-6, 1e-5)
    err = (got - ref).abs()
    bad = err > atol + rtol * ref.abs()
    assert not bad.any(), (f"seed {SEED}: {int(bad.sum())}/{bad.numel()} elements off, max err {err.max().item():.3g} "
                           f"(output rms {rms:.3g})")
    assert cosine_distance(got, ref) <= cos_tol, f"seed {SEED}: cosine distance {cosine_distance(got, ref):.3g}"


def dense_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
              w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
              swiglu_limit: Optional[float] = None) -> torch.Tensor:
    """Plain float64 re-statement, pair by pair, on dequantized weights and unquantized activations
    (``swiglu_limit``: V4's clipped SwiGLU)."""
    from flashdsa.runtime.fp4 import dequantize_fp4
    from flashdsa.runtime.gemm.reference import dequantize_weight

    def weight(w, scale, e):
        if scale is None:
            return w[e].double()
        if w.dtype in (torch.uint8, torch.int8):
            scale = scale[e].view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale[e]
            return dequantize_fp4(w[e], scale).double()
        return dequantize_weight(w[e], scale[e]).double()

    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j, e in enumerate(expert_ids[t].tolist()):
            if 0 <= e < w13.shape[0]:
                gate, up = (weight(w13, w13_scale, e) @ x[t].double()).split(inter)
                if swiglu_limit is not None:
                    gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
                h = torch.nn.functional.silu(gate) * up
                out[t] += weights[t, j].double() * (weight(w2, w2_scale, e) @ h)
    return out


def assert_clip_matters(args: dict, swiglu_limit: float) -> None:
    """The clip moves the exact output by far more than any test tolerance, so a backend that
    ignored ``swiglu_limit`` would fail the comparison."""
    clipped, plain = dense_moe(**args, swiglu_limit=swiglu_limit), dense_moe(**args)
    moved = (clipped - plain).abs().max().item()
    assert moved > 0.25 * clipped.abs().max().item(), f"seed {SEED}: the clip at {swiglu_limit} moves only {moved:.3g}"


def assert_sync_free_and_replayable(run: Callable[[], tuple[torch.Tensor, ...]], refill: Callable[[], None]) -> None:
    """``run`` (a GPU op on fixed input tensors) makes no host sync, and a CUDA graph of it,
    replayed after ``refill`` rewrites those inputs in place, gives what eager ``run`` gives."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    refill()
    graph.replay()
    eager = run()
    assert all(torch.equal(c, e) for c, e in zip(captured, eager)), f"seed {SEED}: replay differs from eager"
