"""fused_moe (Triton, and the native W4A8 kernels for FP4 on SM90) at DeepSeek-V3.2's routed-expert
shape (E=256, top-8, H=7168, I=2048) and DeepSeek-V4-Flash's (E=256, top-6, H=4096, I=2048).

V3.2: for T in {1, 32, 128, 4096} tokens, bf16 and FP8 (e4m3, 128x128 block scales, pow2
activation scales); V4-Flash: for T in {1, 32, 128}, bf16, FP8 and FP4 (the release's packed e2m1
with a UE8M0 scale per 32 inputs, bf16 activations); routed by select_experts on random logits:
- decode (T <= 128): device time of one call replayed from a CUDA graph (as decode runs it),
  and the bytes of the experts the batch chose (w13 + w2 + scales of each distinct expert) over
  that time, against the copy bandwidth measured in the same run;
- prefill (T = 4096): TFLOPS (2 * T * k * 3 * H * I) against a dense GEMM of the same FLOPs in the
  same run (torch.matmul for bf16, torch._scaled_mm with per-tensor scales for FP8);
- kernel launches per call (torch profiler) and the per-kernel split; select_experts' time and
  launches, as a share of the bf16 MoE time (a fused routing kernel is worth it only if large).
``--sweep`` times each grouped GEMM alone for every candidate block_m and tile at each (T, dtype)
and reports the best against the current heuristic (ratio < 1: the candidate is faster), logging
each best as a ``MoeConfig``, so one GPU run fixes ``flashdsa.runtime.moe.triton.fused_moe.HEURISTIC``.

    python3 benchmarks/bench_moe.py [--sweep] [--dtype bf16|fp8|fp4|all] [--shape v32|v4|both] [--output BENCHMARKS.md]
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from tqdm import tqdm

from benchmarks.bench_decode_indexer import copy_bandwidth
from benchmarks.common import Row, graph_ms, kernel_split, median_ms, output_parser, report
from flashdsa.runtime.fp4 import FP4_GROUP
from flashdsa.runtime.fp8 import E4M3
from flashdsa.runtime.gemm import quantize_activations
from flashdsa.runtime.moe import max_blocks, select_experts
from flashdsa.runtime.moe.triton import align, fused_moe
from flashdsa.runtime.moe.triton.fused_moe import MoeConfig
from flashdsa.runtime.moe.triton.grouped_gemm import Tile, grouped_gemm
from flashdsa.runtime.native import unavailable as native_unavailable

log = logging.getLogger("bench_moe")


@dataclass(frozen=True)
class Shape:
    """A model's routed experts: E experts, top_k a token, hidden H, intermediate I; the token
    counts benchmarked, the group-limited routing and the weight formats its release uses."""

    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    tokens: tuple[int, ...]
    n_group: int
    topk_group: int
    formats: tuple[str, ...]


V32 = Shape("V3.2", 256, 8, 7168, 2048, (1, 32, 128, 4096), 8, 4, ("bf16", "fp8"))
V4_FLASH = Shape("V4-Flash", 256, 6, 4096, 2048, (1, 32, 128), 1, 1, ("bf16", "fp8", "fp4"))
SHAPES = {"v32": (V32,), "v4": (V4_FLASH,), "both": (V32, V4_FLASH)}
SCALING = 2.5
DECODE_MAX = 128
INPUT_SETS = 4
SWEEP_BLOCK_M = {1: (16,), 32: (16, 32), 128: (16, 32, 64), 4096: (32, 64, 128)}
# Candidate tiles (block_n, block_k, warps, stages) for block_m <= 32 (decode) and above.
SMALL_TILES = [Tile(32, 128, 4, 4), Tile(64, 128, 4, 4), Tile(64, 64, 4, 4), Tile(128, 64, 4, 4), Tile(64, 128, 4, 5),
               Tile(64, 128, 4, 3), Tile(128, 128, 4, 3), Tile(64, 128, 8, 4), Tile(32, 256, 4, 3), Tile(16, 256, 4, 4),
               Tile(64, 32, 4, 4), Tile(128, 32, 4, 4), Tile(256, 64, 8, 3), Tile(128, 64, 8, 3)]
LARGE_TILES = [Tile(128, 64, 8, 3), Tile(128, 64, 4, 4), Tile(128, 128, 8, 3), Tile(64, 128, 4, 4),
               Tile(256, 64, 8, 3), Tile(128, 64, 8, 4), Tile(128, 128, 4, 3), Tile(128, 32, 4, 5)]


def make_experts(shape: Shape, fmt: str, device) -> dict:
    """w13 [E, 2I, H], w2 [E, H, I] about N(0, 1/K): bf16, e4m3 + block scales, or packed FP4 (random
    bytes) + UE8M0 exponent scales near 2^-6 per 32 inputs; made per expert."""
    experts = {}
    for name, (rows, cols) in (("w13", (2 * shape.inter, shape.hidden)), ("w2", (shape.hidden, shape.inter))):
        if fmt == "fp4":
            experts[name] = torch.randint(0, 256, (shape.experts, rows, cols // 2), dtype=torch.uint8, device=device)
            experts[name + "_scale"] = torch.randint(119, 123, (shape.experts, rows, cols // FP4_GROUP),
                                                     dtype=torch.uint8, device=device)
            continue
        fp8 = fmt == "fp8"
        w = torch.empty(shape.experts, rows, cols, dtype=E4M3 if fp8 else torch.bfloat16, device=device)
        for e in range(shape.experts):
            w[e] = torch.randn(rows, cols, device=device) * (1.0 if fp8 else cols**-0.5)
        experts[name] = w
        if fp8:
            scale = torch.rand(shape.experts, rows // 128, cols // 128, device=device) + 0.5
            experts[name + "_scale"] = scale * cols**-0.5
    return experts


def routed_inputs(shape: Shape, tokens: int, device) -> list[dict]:
    """INPUT_SETS of (x, weights, expert_ids) routed by select_experts."""
    sets = []
    for _ in range(INPUT_SETS):
        logits = torch.randn(tokens, shape.experts, device=device)
        bias = torch.randn(shape.experts, device=device) * 0.01
        weights, ids = select_experts(logits, bias, shape.top_k, shape.n_group, shape.topk_group, True, SCALING)
        sets.append(dict(x=torch.randn(tokens, shape.hidden, device=device, dtype=torch.bfloat16), weights=weights,
                         expert_ids=ids, logits=logits, bias=bias))
    return sets


def expert_bytes(experts: dict) -> int:
    return sum(t[0].numel() * t.element_size() for t in experts.values())


def count_launches(call) -> int:
    """Kernels (and memsets/copies) one ``call`` puts on the device."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def moe_call(inputs: dict, experts: dict, fmt: str, config=None, backend: str = "triton"):
    """One fused_moe call on the Triton backend (``config``: a launch shape) or the native one."""
    if backend == "cuda":
        from flashdsa.runtime.moe.cuda import fused_moe as native

        return lambda: native.fused_moe(inputs["x"], experts["w13"], experts["w2"], inputs["weights"],
                                        inputs["expert_ids"], experts["w13_scale"], experts["w2_scale"], False, True,
                                        None)
    return lambda: fused_moe.fused_moe(inputs["x"], experts["w13"], experts["w2"], inputs["weights"],
                                       inputs["expert_ids"], experts.get("w13_scale"), experts.get("w2_scale"),
                                       fmt == "fp8", True, None, config=config)


def backends(fmt: str) -> tuple[str, ...]:
    """The backends timed for a weight format: the native W4A8 kernels join Triton for FP4 on SM90."""
    if fmt != "fp4" or torch.cuda.get_device_capability() != (9, 0) or native_unavailable() is not None:
        return ("triton",)
    return ("triton", "cuda")


def dense_anchor_tflops(shape: Shape, tokens: int, fmt: str, device) -> float:
    """A dense GEMM of the MoE's gate/up FLOPs: [T*k, H] x [H, 2I], torch's fastest of that dtype."""
    fp8 = fmt == "fp8"
    a = torch.randn(tokens * shape.top_k, shape.hidden, device=device).to(E4M3 if fp8 else torch.bfloat16)
    b = torch.randn(2 * shape.inter, shape.hidden, device=device).to(a.dtype)
    one = torch.ones((), device=device)
    call = ((lambda: torch._scaled_mm(a, b.T, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)) if fp8
            else (lambda: a @ b.T))
    return 2 * a.shape[0] * shape.hidden * 2 * shape.inter / median_ms([call]) / 1e9


def bench_fused(shape: Shape, fmt: str, experts: dict, copy_gbs: float, device) -> tuple[list[Row], dict[int, float]]:
    rows, times = [], {}
    timed = backends(fmt)
    for tokens in shape.tokens:
        sets = routed_inputs(shape, tokens, device)
        desc = f"T={tokens} E={shape.experts} k={shape.top_k} H={shape.hidden} I={shape.inter}"
        flops = 2 * tokens * shape.top_k * 3 * shape.hidden * shape.inter
        block_m = fused_moe.choose_config(tokens * shape.top_k, shape.experts, fmt).block_m
        for backend in timed:
            calls = [moe_call(s, experts, fmt, backend=backend) for s in sets]
            eager = median_ms(calls)
            launches = count_launches(calls[0])
            shape_note = f"block_m {block_m}; " if backend == "triton" else "W4A8; "
            note = f"{launches} launches; {shape_note}{kernel_split(calls[0], top=4)}"
            label = f"fused_moe {shape.name} {fmt.upper() if fmt != 'bf16' else fmt}"
            label += f" ({backend})" if len(timed) > 1 else ""
            if tokens <= DECODE_MAX:
                ms = graph_ms(calls)
                chosen = sum(int(torch.unique(s["expert_ids"]).numel()) for s in sets) / len(sets)
                gbs = chosen * expert_bytes(experts) / ms / 1e6
                if backend != "triton":
                    note = f"{times[tokens] / ms:.2f}x triton; {note}"
                note = f"{chosen:.0f} experts chosen; eager {eager:.3f} ms; {flops / ms / 1e9:.1f} TFLOPS; {note}"
                rows.append(Row(f"{label}, CUDA graph", desc, ms, gbs, "GB/s", copy_gbs, note))
            else:
                ms = eager
                anchor = dense_anchor_tflops(shape, tokens, fmt, device)
                rows.append(Row(label, desc, ms, flops / ms / 1e9, "TFLOPS", anchor,
                                f"vs dense {'torch._scaled_mm' if fmt == 'fp8' else 'torch.matmul'} {anchor:.0f} "
                                f"TFLOPS; {note}"))
            times.setdefault(tokens, ms)  # the first backend's (triton's): the routing rows' yardstick
    return rows, times


def bench_routing(shape: Shape, moe_ms: dict[int, float], device) -> list[Row]:
    rows = []
    for tokens in shape.tokens:
        sets = routed_inputs(shape, tokens, device)
        calls = [lambda s=s: select_experts(s["logits"], s["bias"], shape.top_k, shape.n_group, shape.topk_group, True,
                                            SCALING) for s in sets]
        ms = graph_ms(calls) if tokens <= DECODE_MAX else median_ms(calls)
        note = f"{count_launches(calls[0])} launches; target: the first dtype's fused_moe time"
        rows.append(Row(f"select_experts {shape.name}", f"T={tokens} E={shape.experts} groups "
                        f"{shape.n_group}/{shape.topk_group}", ms, ms * 1e3, "us", moe_ms[tokens] * 1e3, note))
    return rows


def gemm_times(shape: Shape, block_m: int, tiles: dict[str, list[Tile]], inputs: dict, experts: dict, fmt: str,
               ) -> tuple[float, dict[str, list[tuple[float, Tile]]]]:
    """The alignment's time, and each grouped GEMM's time alone per candidate tile, fastest first."""
    device = inputs["x"].device
    tokens, fp8, k, e = inputs["x"].shape[0], fmt == "fp8", shape.top_k, shape.experts
    ids, weights = inputs["expert_ids"], inputs["weights"].view(-1)
    a, a_scale = quantize_activations(inputs["x"], pow2_scales=True) if fp8 else (inputs["x"], None)
    blocks = max_blocks(tokens * k, e, block_m)
    aligned = align.align_tokens(ids, e, block_m, blocks)
    align_ms = median_ms([lambda: align.align_tokens(ids, e, block_m, blocks)])
    h = torch.randn(blocks * block_m, shape.inter, device=device, dtype=torch.bfloat16)
    h_in, h_scale = quantize_activations(h, pow2_scales=True) if fp8 else (h, None)
    pair_out = torch.empty(tokens * k, shape.hidden, device=device, dtype=torch.bfloat16)
    gemms = {"gate_up": lambda tile: grouped_gemm(a, a_scale, experts["w13"], experts.get("w13_scale"), h, aligned,
                                                  k, tile, gated=True),
             "down": lambda tile: grouped_gemm(h_in, h_scale, experts["w2"], experts.get("w2_scale"), pair_out, aligned,
                                               k, tile, gated=False, route_weights=weights)}
    results = {}
    for name, gemm in gemms.items():
        results[name] = []
        for tile in tiles[name]:
            try:
                results[name].append((median_ms([lambda: gemm(tile)], iters=20), tile))
            except Exception as e:  # e.g. out of shared memory: skip the candidate
                log.warning("%s %s: %s", name, tile, str(e).splitlines()[0][:160])
        results[name].sort(key=lambda pair: pair[0])
    return align_ms, results


def _fits(fmt: str, tile: Tile) -> bool:
    """FP8 tiles need block_k dividing 128 (one scale a step), FP4 a multiple of 32 (whole scale groups)."""
    return {"fp8": 128 % tile.block_k == 0, "fp4": tile.block_k % FP4_GROUP == 0}.get(fmt, True)


def sweep(shape: Shape, fmt: str, experts: dict, device) -> list[Row]:
    """Per T and candidate block_m: the fastest tile of each GEMM, against the current heuristic."""
    rows = []
    label = f"{shape.name} {fmt}"
    for tokens in shape.tokens:
        inputs = routed_inputs(shape, tokens, device)[0]
        current = fused_moe.choose_config(tokens * shape.top_k, shape.experts, fmt)
        align_ms, now = gemm_times(shape, current.block_m, {"gate_up": [current.gate_up], "down": [current.down]},
                                   inputs, experts, fmt)
        heuristic_ms = align_ms + now["gate_up"][0][0] + now["down"][0][0]
        for block_m in SWEEP_BLOCK_M[tokens]:
            candidates = [t for t in (SMALL_TILES if block_m <= 32 else LARGE_TILES) if _fits(fmt, t)]
            align_ms, best = gemm_times(shape, block_m, {"gate_up": candidates, "down": candidates}, inputs, experts,
                                        fmt)
            if not best["gate_up"] or not best["down"]:
                continue
            total = align_ms + best["gate_up"][0][0] + best["down"][0][0]
            note = "; ".join(f"{name}: " + ", ".join(f"{_tile(t)} {ms:.3f}" for ms, t in times[:3])
                             for name, times in best.items())
            rows.append(Row(f"sweep {label}", f"T={tokens} block_m={block_m}", total, total * 1e3, "us",
                            heuristic_ms * 1e3, f"align {align_ms:.3f} ms; {note}; target: the heuristic's time"))
            log.info("best %s T=%d: %s", label, tokens,
                     MoeConfig(block_m, best["gate_up"][0][1], best["down"][0][1]))
    return rows


def _tile(t: Tile) -> str:
    return f"n{t.block_n} k{t.block_k} w{t.num_warps} s{t.num_stages}"


def main(argv: list[str] | None = None) -> None:
    parser = output_parser(__doc__)
    parser.add_argument("--sweep", action="store_true", help="time every candidate launch shape of both GEMMs")
    parser.add_argument("--dtype", choices=("bf16", "fp8", "fp4", "all"), default="all",
                        help="expert weights to run (each shape runs the formats its release uses)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="both", help="V3.2's experts, V4-Flash's, or both")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    device = torch.device("cuda")
    copy_gbs = copy_bandwidth(device)
    rows = [Row("device copy", "2 GiB", 0.0, copy_gbs, "GB/s", copy_gbs, "read + write")]
    runs = [(shape, fmt) for shape in SHAPES[args.shape] for fmt in shape.formats if args.dtype in ("all", fmt)]
    moe_ms = {}
    for shape, fmt in tqdm(runs, desc="shapes and dtypes"):
        experts = make_experts(shape, fmt, device)
        if args.sweep:
            rows += sweep(shape, fmt, experts, device)
        else:
            fused_rows, times = bench_fused(shape, fmt, experts, copy_gbs, device)
            rows += fused_rows
            moe_ms.setdefault(shape, times)
        del experts
        torch.cuda.empty_cache()
    for shape, times in moe_ms.items():
        rows += bench_routing(shape, times, device)
    title = "Grouped MoE sweep (Triton)" if args.sweep else "Grouped MoE (Triton; native W4A8 for FP4 on SM90)"
    report(title, rows, args.output)


if __name__ == "__main__":
    main()
