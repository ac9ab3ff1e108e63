"""Every Triton kernel compiles for Hopper (sm_90a) and Blackwell (sm_100a) on a machine without a GPU.

The interpreter (TRITON_INTERPRET=1) runs kernels through NumPy and accepts code that the GPU
compiler rejects (plain Python globals inside a kernel, for one). Here each Triton backend is
called on CPU tensors at the shapes the GPU serves, with ``JITFunction.run`` recording the launch
instead of running it; every distinct (kernel, signature, constexprs, launch options) is then
compiled through Triton's whole pipeline to a cubin for ``GPUTarget("cuda", 90, 32)`` and
``GPUTarget("cuda", 100, 32)``. That needs
the ptxas shipped with triton, but no driver. Nothing is executed, so outputs are not checked.
``compile_all(..., specialize=True)`` compiles with the argument specialization a GPU launch
would use (16-divisible ints and pointers, ints equal to 1 as constants), which turns on the
software pipelining of loads, and checks the kernel fits Hopper's shared memory.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from flashdsa.runtime.cache.layout import quantize_indexer_key  # noqa: E402
from flashdsa.testing import random_mla_cache, random_sparse_inputs  # noqa: E402

ARG_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
             torch.int64: "i64", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}
TARGETS = (GPUTarget("cuda", 90, 32), GPUTarget("cuda", 100, 32))  # Hopper, Blackwell (datacenter)
MAX_SMEM = 232448  # bytes of shared memory one block may use on SM90 and SM100


def _signature(fn: JITFunction, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    """Triton's type string of every runtime argument, and the constexpr values."""
    bound = dict(zip(fn.arg_names, args)) | kwargs
    signature, constexprs = {}, {}
    for param in fn.params:
        value = bound.get(param.name, param.default)
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + ARG_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            signature[param.name] = "fp32"
    return signature, constexprs


def _specialized(fn: JITFunction, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """Signature, constexprs and divisibility attributes as a GPU launch of these values gets them."""
    bound = dict(zip(fn.arg_names, args)) | kwargs
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = bound.get(param.name, param.default)
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        kind, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[param.name] = spec
        elif spec == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


@pytest.fixture
def launches(monkeypatch) -> dict:
    """Launches recorded (not run) while the test body calls Triton backends; keyed to dedupe.
    Each holds the plain signature and the GPU launch's specialization (see :func:`compile_all`)."""
    recorded = {}

    def record(fn, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        signature, constexprs = _signature(fn, args, kwargs)
        key = (fn.__name__, repr(sorted(signature.items())), repr(sorted(constexprs.items())), repr(options))
        recorded.setdefault(key, (fn, signature, constexprs, options, _specialized(fn, args, kwargs)))

    monkeypatch.setattr(JITFunction, "run", record)
    return recorded


def compile_all(launches: dict, specialize: bool = False) -> list[str]:
    """Compile every recorded launch to a cubin for each target; return the kernel names compiled.
    With ``specialize``, compile as the GPU would specialize the launch and check shared memory."""
    assert launches, "no Triton launch was recorded"
    for fn, signature, constexprs, options, specialized in launches.values():
        attrs = {}
        if specialize:
            signature, constexprs, attrs = specialized
        for target in TARGETS:
            kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                    target=target, options=options)
            assert kernel.asm.get("cubin"), f"{fn.__name__} {constexprs} sm_{target.arch}: no cubin"
            if specialize:
                smem = kernel.metadata.shared
                assert smem <= MAX_SMEM, f"{fn.__name__} {constexprs} {options} sm_{target.arch}: {smem} B of shared memory"
    return sorted({fn.__name__ for fn, *_ in launches.values()})


def test_attention_kernels_compile_for_hopper_and_blackwell(launches):
    from flashdsa.runtime.kernels.triton import sparse_bwd, sparse_decode, sparse_fwd

    for h_q, d_qk in ((128, 576), (16, 512)):
        q, kv, idx = random_sparse_inputs(2, 300, h_q, d_qk, 2048)
        out, _, lse = sparse_fwd.sparse_mla_fwd(q, kv, idx, d_qk**-0.5)
        for deterministic in (False, True):
            sparse_bwd.sparse_mla_bwd(q, kv, out, out, lse, idx, d_qk**-0.5, deterministic=deterministic)
    cache = random_mla_cache(4)
    for batch in (1, 128):  # split over the top-k with a combine, and one program per row
        q = torch.randn(batch, 2, 128, 576).bfloat16()
        slots = torch.randint(-1, 256, (batch, 2, 2048), dtype=torch.int32)
        sparse_decode.sparse_mla_decode(q, cache, slots, 576**-0.5)
    assert compile_all(launches) == ["_bwd_dkv_kernel", "_bwd_dq_kernel", "_combine_kernel",
                                     "_decode_partial_kernel", "_reduce_rows_kernel", "_sparse_fwd_kernel"]


def test_v4_attention_and_cache_kernels_compile_for_hopper_and_blackwell(launches):
    """V4 prefill (bf16 rows) and decode (MODEL1 pages, one program per row and split-KV with the
    sink-applying combine), with and without the optional inputs, and the MODEL1 cache write."""
    from flashdsa.runtime.cache.triton import writes_v4
    from flashdsa.runtime.kernels.triton import sparse_v4

    pool = torch.zeros(8, 64, 1, 584, dtype=torch.uint8)
    writes_v4.write_v4_cache(torch.randn(16, 512).bfloat16(), pool, torch.arange(16))
    for h_q in (20, 64, 128):  # 20: padded to one 64-head block
        sink = torch.zeros(h_q)
        q, kv = torch.randn(300, h_q, 512).bfloat16(), torch.randn(2000, 1, 512).bfloat16()
        idx = torch.zeros(300, 1, 512, dtype=torch.int32)
        lengths = torch.full((300,), 512, dtype=torch.int32)
        sparse_v4.sparse_attention_v4_prefill(q, kv, idx, 512**-0.5)
        sparse_v4.sparse_attention_v4_prefill(q, kv, idx, 512**-0.5, lengths, sink, kv[:128], idx[:, :, :128], lengths)
        for batch in (1, 128):
            q = torch.randn(batch, 2, h_q, 512).bfloat16()
            slots = torch.zeros(batch, 2, 512, dtype=torch.int32)
            window, lens = torch.zeros(batch, 2, 128, dtype=torch.int32), torch.full((batch,), 100, dtype=torch.int32)
            sparse_v4.sparse_attention_v4_decode(q, pool, slots, 512**-0.5)
            sparse_v4.sparse_attention_v4_decode(q, pool, slots, 512**-0.5, lens, sink, pool, window, lens)
    assert compile_all(launches, specialize=True) == ["_combine_kernel", "_sparse_v4_kernel", "_write_v4_kernel"]


def test_indexer_and_cache_kernels_compile_for_hopper_and_blackwell(launches):
    from flashdsa.runtime.cache.triton import dequantize, writes
    from flashdsa.runtime.indexer.triton import hadamard, logits, quantize, topk

    num_q, num_keys, heads = 3, 500, 64
    q = torch.randn(num_q, heads, 128).to(torch.float8_e4m3fn)
    weights = torch.randn(num_q, heads)
    k_fp8, k_scale = quantize_indexer_key(torch.randn(num_keys, 128))
    starts = torch.zeros(num_q, dtype=torch.int32)
    ends = torch.full((num_q,), num_keys, dtype=torch.int32)
    hadamard.hadamard_transform(torch.randn(5, 128).bfloat16())
    quantize.rotate_quantize_indexer(torch.randn(5, 64, 128).bfloat16())
    scores = logits.indexer_logits(q, weights, k_fp8, k_scale, starts, ends)
    topk.indexer_topk(scores, 2048, starts, ends)
    topk.indexer_fused_topk(q, weights, k_fp8, k_scale, starts, ends, 2048, 4096)
    pool = torch.zeros(8, 64, 1, 132, dtype=torch.uint8)
    lens = torch.tensor([70, 200], dtype=torch.int32)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    logits.indexer_logits_paged(q[:2].view(2, 1, heads, 128), weights[:2], pool, lens, table, 256)
    slots = torch.arange(16, dtype=torch.int32)
    writes.write_mla_cache(torch.randn(16, 512).bfloat16(), torch.randn(16, 64).bfloat16(),
                           torch.zeros(4, 64, 1, 656, dtype=torch.uint8), slots)
    writes.write_indexer_cache(torch.randn(16, 128).bfloat16(), pool, slots)
    dequantize.dequantize_mla_blocks(torch.zeros(4, 64, 1, 656, dtype=torch.uint8), slots[:3], torch.bfloat16)
    assert compile_all(launches) == ["_collect_kernel", "_dequantize_mla_kernel", "_finish_kernel", "_hadamard_kernel", "_histogram_kernel",
                                     "_paged_kernel", "_ragged_kernel", "_rotate_quantize_kernel",
                                     "_write_indexer_kernel", "_write_mla_kernel"]


def _moe_experts(experts: int, hidden: int, inter: int) -> dict:
    """Uninitialised expert stacks and scales per weight format (nothing runs)."""
    fp4_scales = (torch.empty(experts, 2 * inter, hidden // 32, dtype=torch.uint8),
                  torch.empty(experts, hidden, inter // 32, dtype=torch.uint8))
    return {
        "bf16": (torch.empty(experts, 2 * inter, hidden).bfloat16(), torch.empty(experts, hidden, inter).bfloat16(),
                 None, None),
        "fp8": (torch.empty(experts, 2 * inter, hidden, dtype=torch.float8_e4m3fn),
                torch.empty(experts, hidden, inter, dtype=torch.float8_e4m3fn),
                torch.ones(experts, 2 * inter // 128, hidden // 128), torch.ones(experts, hidden // 128, inter // 128)),
        "fp4": (torch.empty(experts, 2 * inter, hidden // 2, dtype=torch.uint8),
                torch.empty(experts, hidden, inter // 2, dtype=torch.uint8), *fp4_scales),
    }


def test_moe_kernels_compile_for_hopper_and_blackwell(launches):
    """Every launch shape of the MoE heuristic (bf16, FP8 and FP4 weights) and both alignment paths,
    at V3.2 widths (the weights are left uninitialised: nothing runs); V4's clipped SwiGLU at the
    decode and the prefill shapes; FP4 with fp32 scales too."""
    from flashdsa.runtime.moe.triton import align, fused_moe

    experts, hidden, inter, top_k = 4, 7168, 2048, 8
    x = torch.randn(3, hidden).bfloat16()
    ids = torch.randint(0, experts, (3, top_k), dtype=torch.int32)
    weights = torch.rand(3, top_k)
    stacks = _moe_experts(experts, hidden, inter)
    for row in fused_moe.HEURISTIC:
        for column, name in enumerate(fused_moe.WEIGHT_FORMATS, start=1):
            config, fp8 = row[column], name == "fp8"
            fused_moe.fused_moe(x, *stacks[name][:2], weights, ids, *stacks[name][2:], fp8, True, None, config=config)
            if row in (fused_moe.HEURISTIC[0], fused_moe.HEURISTIC[-1]):
                fused_moe.fused_moe(x, *stacks[name][:2], weights, ids, *stacks[name][2:], fp8, True, None,
                                    config=config, swiglu_limit=10.0)
    w13, w2, w13_scale, w2_scale = stacks["fp4"]
    fused_moe.fused_moe(x, w13, w2, weights, ids, w13_scale.float(), w2_scale.float(), False, True, None)
    many = torch.randint(0, 256, (4096, top_k), dtype=torch.int32)
    align.align_tokens(many, 256, 64, 4096)  # several chunks: the count launch too
    assert compile_all(launches) == ["_combine_kernel", "_count_kernel", "_grouped_gemm_kernel", "_place_kernel"]


def test_fp4_moe_kernels_fit_hopper_shared_memory(launches):
    """The FP4 grouped GEMMs of every heuristic row at DeepSeek-V4-Flash's expert widths (H 4096,
    I 2048), compiled as a GPU launch specializes them (pipelined loads), within shared memory."""
    from flashdsa.runtime.moe.triton import fused_moe

    experts, hidden, inter, top_k = 4, 4096, 2048, 6
    x, ids = torch.randn(4, hidden).bfloat16(), torch.randint(0, experts, (4, top_k), dtype=torch.int32)
    w13, w2, w13_scale, w2_scale = _moe_experts(experts, hidden, inter)["fp4"]
    for row in fused_moe.HEURISTIC:
        fused_moe.fused_moe(x, w13, w2, torch.rand(4, top_k), ids, w13_scale, w2_scale, False, True, None,
                            config=row[1 + fused_moe.WEIGHT_FORMATS.index("fp4")], swiglu_limit=10.0)
    assert compile_all(launches, specialize=True) == ["_combine_kernel", "_grouped_gemm_kernel", "_place_kernel"]


def test_gemm_kernels_compile_for_hopper_and_blackwell(launches):
    """The quantizer, and the GEMM at the heuristic's choice per regime (decode with split-K,
    middle and prefill with TMA loads; K a multiple of 128 or not) plus the deferred-scaling and
    the decode TMA variants; the one-launch decode linear (quantizing in the kernel, split-K
    summed through tickets) from bf16 and fp32, K a multiple of 128 or not."""
    from flashdsa.runtime.gemm.triton import configs, gemm, quantize

    for pow2 in (False, True):
        quantize.quantize_activations(torch.randn(3, 300).bfloat16(), pow2)
    w_fp8, w_scale = torch.zeros(1536, 7168, dtype=torch.float8_e4m3fn), torch.ones(12, 56)
    for m in (1, 32, 256, 4096):
        x_fp8, x_scale = torch.zeros(m, 7168, dtype=torch.float8_e4m3fn), torch.ones(m, 56)
        gemm.fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, torch.bfloat16)
    for config in (configs.GemmConfig(128, 128, defer=True, num_warps=8, num_stages=3),
                   configs.GemmConfig(16, 64, 4, swap_ab=True, tma=True, num_stages=6)):
        gemm.fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, torch.bfloat16, config=config)
    x_fp8, w_fp8, x_scale = x_fp8[:, :7000].contiguous(), w_fp8[:, :7000].contiguous(), x_scale[:, :55].contiguous()
    gemm.fp8_gemm(x_fp8, x_scale, w_fp8, w_scale[:, :55].contiguous(), torch.bfloat16)
    for m, dtype, pow2 in ((1, torch.bfloat16, True), (64, torch.float32, False)):  # one launch: split K with tickets
        gemm.fp8_linear(torch.randn(m, 7168).to(dtype), torch.zeros(1536, 7168, dtype=torch.float8_e4m3fn),
                        torch.ones(12, 56), pow2, dtype)
    gemm.fp8_linear(torch.randn(3, 7000).bfloat16(), w_fp8, w_scale[:, :55].contiguous(), True, torch.bfloat16)
    w_fp8, w_scale = torch.zeros(8 * 1024, 4096, dtype=torch.float8_e4m3fn), torch.ones(64, 32)  # V4's grouped wo_a
    gemm.fp8_linear(torch.randn(1, 8 * 4096).bfloat16(), w_fp8, w_scale, True, torch.bfloat16, groups=8)
    gemm.fp8_gemm(torch.zeros(1, 8 * 4096, dtype=torch.float8_e4m3fn), torch.ones(1, 256), w_fp8, w_scale,
                  torch.bfloat16, groups=8)
    assert compile_all(launches, specialize=True) == ["_gemm_kernel", "_quantize_kernel", "_sum_splits_kernel"]


def test_argmax_kernels_compile_for_hopper_and_blackwell(launches, monkeypatch):
    """Greedy sampling's argmax over V4's vocabulary, from fp32 and bf16 logits."""
    from flashdsa.runtime import argmax

    monkeypatch.setattr(argmax, "interpreting", lambda: True)  # CPU tensors take the Triton path
    for dtype in (torch.float32, torch.bfloat16):
        argmax.argmax_rows(torch.zeros(3, 129280, dtype=dtype))
    assert compile_all(launches, specialize=True) == ["_chunk_kernel", "_rows_kernel"]


def test_norm_kernel_compiles_for_hopper_and_blackwell(launches):
    """RMSNorm with and without the fused residual, at the widths of V3.2's four norms per layer, and
    DeepSeek-V4's (an fp32 weight multiplied in fp32; the weightless head normalization)."""
    from flashdsa.runtime.norm.triton import rms_norm

    for dim in (7168, 1536, 512):
        x = torch.randn(2, dim).bfloat16()
        rms_norm.rms_norm(x, torch.ones(dim).bfloat16(), 1e-6, None)
        rms_norm.rms_norm(x, torch.ones(dim).bfloat16(), 1e-6, x)
    x = torch.randn(2, 4096).bfloat16()
    rms_norm.rms_norm(x, torch.ones(4096), 1e-6, None, True)
    rms_norm.rms_norm(x[:, :512], None, 1e-6, None)
    assert compile_all(launches, specialize=True) == ["_rms_norm_kernel"]


def test_rope_kernel_compiles_for_hopper_and_blackwell(launches):
    """Both rotations at V3.2's shapes: MLA's q_pe [T, 128, 64] (strided views) with k_pe, the
    indexer's q [T, 64, 128] with k, in bf16."""
    from flashdsa.runtime.rope.triton import rope

    inv_freq = torch.rand(32)
    for tokens, heads, dim, interleaved in ((1, 128, 64, True), (7, 64, 128, False)):
        q = torch.randn(tokens, heads, 128 + dim).bfloat16()[:, :, 128:]
        k = torch.randn(tokens, 512 + dim).bfloat16()[:, 512:]
        rope.apply_rope_(q, k, torch.arange(tokens), inv_freq, 1.0, interleaved)
    assert compile_all(launches, specialize=True) == ["_rope_kernel"]


def test_routing_kernel_compiles_for_hopper_and_blackwell(launches):
    """V3.2's routing (256 experts, 8 groups keep 4, top-8), ungrouped routing, and V4's (top-6 of
    sqrt(softplus) scores), V4's hash routing (its vocabulary's table, int64 or int32), both on bf16 logits."""
    from flashdsa.runtime.moe.triton import routing

    logits, bias = torch.randn(3, 256), torch.randn(256)
    routing.select_experts(logits, bias, 8, 8, 4, True, 2.5)
    routing.select_experts(logits, bias, 6, 1, 1, False, 1.0)
    routing.select_experts(logits, bias, 6, 1, 1, True, 1.5, "sqrtsoftplus")
    table = torch.zeros(129280, 6, dtype=torch.int64)
    for ids in (torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int32)):
        routing.hash_experts(logits, table, ids, 1.5, "sqrtsoftplus")
    routing.hash_experts(logits, table.int(), torch.zeros(3, dtype=torch.int64), 1.5, "sigmoid")
    routing.select_experts(logits.bfloat16(), bias, 6, 1, 1, True, 1.5, "sqrtsoftplus")  # V4's bf16 router GEMM
    routing.hash_experts(logits.bfloat16(), table, torch.zeros(3, dtype=torch.int64), 1.5, "sqrtsoftplus")
    assert compile_all(launches, specialize=True) == ["_hash_route_kernel", "_route_kernel"]


def test_dense_gemv_kernel_compiles_for_hopper_and_blackwell(launches):
    """The decode GEMV at V4-Flash's router (256 x 4096) and fused compressor inputs, a strided x,
    widths off every block, in bf16 and fp16."""
    from flashdsa.runtime.dense.triton import gemv

    for dtype in (torch.bfloat16, torch.float16):
        gemv.dense_linear(torch.randn(1, 4096).to(dtype), torch.randn(256, 4096).to(dtype))
        gemv.dense_linear(torch.randn(4, 4104).to(dtype)[:, 3:4099], torch.randn(1344, 4096).to(dtype))
        gemv.dense_linear(torch.randn(2, 100).to(dtype), torch.randn(5000, 100).to(dtype))
    assert compile_all(launches, specialize=True) == ["_gemv_kernel"]


def test_swiglu_kernel_compiles_for_hopper_and_blackwell(launches):
    """DeepSeek-V4-Flash's shared expert (the halves of a fused [T, 4096] gate|up, clipped at 10),
    plain SwiGLU, fp16 and fp32."""
    from flashdsa.runtime.moe.triton import swiglu

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        fused = torch.zeros(3, 4096, dtype=dtype)
        for limit in (10.0, None):
            swiglu.swiglu(fused[:, :2048], fused[:, 2048:], limit)
    assert compile_all(launches, specialize=True) == ["_swiglu_kernel"]


def test_slots_kernel_compiles_for_hopper_and_blackwell(launches):
    """The decode shape (top-2048 positions a token, int32) and int64 positions."""
    from flashdsa.runtime.cache.triton import slots

    tables, seq_ids = torch.zeros(2, 512, dtype=torch.int32), torch.tensor([0, 1, 1])
    for dtype in (torch.int32, torch.int64):
        slots.positions_to_slots(torch.zeros(3, 2048, dtype=dtype), seq_ids, tables, 64)
    assert compile_all(launches, specialize=True) == ["_slots_kernel"]


def test_hyper_connection_kernels_compile_for_hopper_and_blackwell(launches):
    """mHC at V4-Flash widths (D 4096, n 4; decode and prefill token counts, bf16 and fp32 streams),
    the head's variant, the post with a second block output, and n = 8 / n = 2 at other widths."""
    from flashdsa.runtime.hyper.triton import hyper

    for tokens, n, dim, dtype in ((1, 4, 4096, torch.bfloat16), (128, 4, 4096, torch.bfloat16),
                                  (4096, 4, 4096, torch.bfloat16), (32, 4, 4096, torch.float32),
                                  (3, 8, 448, torch.bfloat16), (5, 2, 1000, torch.float32)):
        h = torch.empty(tokens, n, dim, dtype=dtype)
        width = (2 + n) * n
        fn, base, scale = torch.empty(width, n * dim), torch.empty(width), torch.empty(3)
        _, post, comb = hyper.hc_pre(h, fn, base, scale, 20, 1e-6, 1e-6)
        y = torch.empty(tokens, dim, dtype=dtype)
        hyper.hc_post(y, h, post, comb)
        hyper.hc_post(y, h, post, comb, torch.empty(tokens, dim, dtype=dtype))  # V4's routed + shared experts
        hyper.hc_head(h, fn[:n], base[:n], scale[:1], 1e-6, 1e-6)
    assert compile_all(launches, specialize=True) == ["_mix_kernel", "_post_kernel", "_pre_kernel"]


def test_compressor_decode_step_kernel_compiles_for_hopper_and_blackwell(launches):
    """V4's CSA (ratio 4, head 512 and the indexer's 128, overlap) and HCA (ratio 128) decode steps,
    on a state pool with fresh rows (fp32 and bf16 entries) and on plain [B, W, C] states."""
    from flashdsa.runtime.compressor import new_state
    from flashdsa.runtime.compressor.triton import decode_step

    for overlap, ratio, dim in ((True, 4, 512), (True, 4, 128), (False, 128, 512)):
        channels = 2 * dim if overlap else dim
        for batch in (1, 32):
            kv, positions = torch.empty(batch, channels, dtype=torch.bfloat16), torch.zeros(batch, dtype=torch.int64)
            bias = torch.empty(ratio, channels)
            for out_dtype in (torch.float32, torch.bfloat16):  # the model asks for bf16 entries
                decode_step.compress_decode_step(kv, kv, positions, bias, overlap, *new_state(
                    batch + 2, ratio, channels, overlap, "cpu"), positions, torch.zeros(batch, dtype=torch.bool),
                    out_dtype)
            decode_step.compress_decode_step(kv, kv, positions, bias, overlap, *new_state(batch, ratio, channels,
                                             overlap, "cpu"))
    assert compile_all(launches, specialize=True) == ["_decode_step_kernel"]
