"""FP8 block-scaled GEMM at DeepSeek-V3.2's linear shapes against cuBLAS FP8 and the copy bandwidth.

For each (N, K) of V3.2's FP8 linear layers and M in {1, 2, 4, 8, 32, 128, 4096, 16384}: the time,
TFLOPS and GB/s (weights + activations + scales read, output written) of ``fp8_gemm`` as dispatched
(the row names the backend that ran: Triton, or cuBLAS from M = 256; the note gives Triton's rate
too where cuBLAS ran); torch._scaled_mm with one
scale per tensor on the same e4m3 operands (cuBLAS, the anchor for M >= 128) and, where torch and
cuBLAS accept it on this GPU, with DeepSeek's blockwise scales (1x128 activations, 128x128 weights);
the copy bandwidth measured in the same run (the anchor for M <= 64). Targets: >= 80% of copy
bandwidth for M <= 64, >= 90% of the per-tensor cuBLAS rate for M >= 128 (issue 10 sets it for
M >= 2048; M = 128 is shown against the same anchor). Inputs are random, rotated through sets that
together exceed the L2 several times.

``--sweep`` times every candidate launch shape of the heuristic (``configs.candidates``) per
shape and prints, per shape, the heuristic's choice against the fastest; ``--sweep-json`` saves
every timing, so one GPU run is enough to fix the heuristic.

``--one-launch`` instead times, per shape at decode sizes (default M = 1, 4, 32), ``fp8_linear``
from bf16 activations (power-of-two scales, V3.2's) as the two Triton steps (quantize_activations,
then fp8_gemm and its split-K sum kernel) against the one-launch kernel (``gemm.fp8_linear``), both
replayed from CUDA graphs; the row's ratio is two-step time / one-launch time.

    python3 benchmarks/bench_gemm.py [--sweep] [--sweep-json gemm_sweep.json] [--shapes q_a,o_proj]
        [--m 1,4096] [--one-launch] [--output BENCHMARKS.md]
"""

from __future__ import annotations

import json
import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

from benchmarks.bench_decode_indexer import copy_bandwidth, fp8_bytes
from benchmarks.common import L2_BYTES, Row, graph_ms, median_ms, output_parser, report
from flashdsa.runtime.gemm import cublas, fp8_gemm, fp8_gemm_backend, quantize_activations
from flashdsa.runtime.gemm.triton import configs, gemm, quantize

SHAPES = configs.V32_LINEAR_SHAPES  # name: (N, K)
MS = (1, 2, 4, 8, 32, 128, 4096, 16384)
ONE_LAUNCH_MS = (1, 4, 32)
COPY_SHARE, CUBLAS_SHARE = 0.8, 0.9
MAX_SETS, MAX_SET_BYTES = 256, 2 << 30

log = logging.getLogger("bench_gemm")


def groups(n: int) -> int:
    return -(-n // configs.GROUP)


def make_sets(m: int, n: int, k: int, device) -> list[tuple[torch.Tensor, ...]]:
    """(x_fp8, x_scale, w_fp8, w_scale) sets, enough that the weights together exceed the L2
    three times (a decode step reads each layer's weights from memory, never from L2)."""
    per_set = n * k + m * k
    count = max(2, min(MAX_SETS, -(-3 * L2_BYTES // per_set), max(1, MAX_SET_BYTES // per_set)))
    sets = []
    for _ in range(count):
        x = fp8_bytes((m, k), device).view(torch.float8_e4m3fn)
        w = fp8_bytes((n, k), device).view(torch.float8_e4m3fn)
        x_scale = torch.exp2(torch.randint(-8, 0, (m, groups(k)), device=device).float())
        w_scale = torch.rand(groups(n), groups(k), device=device) * 1e-2 + 1e-3
        sets.append((x, x_scale, w, w_scale))
    return sets


def bytes_moved(m: int, n: int, k: int) -> int:
    return n * k + m * k + 4 * (m + groups(n)) * groups(k) + 2 * m * n


def time_calls(sets, call: Callable, iters: int) -> float:
    """Device ms of one call; at decode sizes (M <= DECODE_MAX_M) replayed from a CUDA graph, as
    decode runs it, since eager timing there measures the host's launch cost, not the kernel."""
    calls = [lambda s=s: call(*s) for s in sets]
    if sets[0][0].shape[0] <= configs.DECODE_MAX_M:
        return graph_ms(calls)
    return median_ms(calls, iters=iters)


def per_tensor_scaled_mm(x, x_scale, w, w_scale):
    one = torch.ones((), device=x.device)
    return torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def blockwise_scaled_mm(x, x_scale, w, w_scale):
    """cuBLAS's DeepSeek recipe (torch >= 2.9, CUDA >= 12.9, SM90) at any M, as the cublas backend calls it."""
    return cublas.scaled_mm(x, x_scale, w, w_scale, torch.bfloat16)


def anchor_ms(name: str, fn: Callable, sets, ours: torch.Tensor, iters: int) -> tuple[Optional[float], str]:
    """Time a torch._scaled_mm variant; None and the reason when torch or cuBLAS refuse the shape.
    The blockwise variant computes our function, so its output is compared with ours."""
    try:
        out = fn(*sets[0])
        note = ""
        if name == "blockwise":
            cos = F.cosine_similarity(out.float().flatten(), ours.float().flatten(), dim=0).item()
            note = f"cos {cos:.5f} vs ours"
        return time_calls(sets, fn, iters), note
    except (RuntimeError, ValueError, TypeError) as e:
        return None, str(e).strip().splitlines()[0][:90]


def bench_shape(name: str, m: int, n: int, k: int, device, copy_gbs: float, iters: int) -> Row:
    """The dispatched fp8_gemm against the anchors: GB/s vs copy for M <= 64, else TFLOPS vs cuBLAS."""
    sets = make_sets(m, n, k, device)
    backend = fp8_gemm_backend(m, n, k, device)
    ours_ms = time_calls(sets, fp8_gemm, iters)
    ours = fp8_gemm(*sets[0])
    triton_ms = ours_ms if backend == "triton" else time_calls(sets, lambda *s: gemm.fp8_gemm(*s, torch.bfloat16), iters)
    flops, moved = 2 * m * n * k, bytes_moved(m, n, k)
    tensor_ms, tensor_note = anchor_ms("per-tensor", per_tensor_scaled_mm, sets, ours, iters)
    block_ms, block_note = anchor_ms("blockwise", blockwise_scaled_mm, sets, ours, iters)

    def tflops(ms: Optional[float]) -> float:
        return flops / ms / 1e9 if ms else float("nan")

    def anchor(ms: Optional[float], why: str) -> str:
        return f"{tflops(ms):.0f} TFLOPS" + (f" ({why})" if why else "") if ms else f"n/a ({why})"

    note = (f"{tflops(ours_ms):.0f} TFLOPS, {moved / ours_ms / 1e6:.0f} GB/s; cuBLAS per-tensor "
            f"{anchor(tensor_ms, tensor_note)}; cuBLAS blockwise {anchor(block_ms, block_note)}; "
            f"triton {tflops(triton_ms):.0f} TFLOPS with {configs.choose_config(m, n, k, device)}")
    shape, kernel = f"{name} N={n} K={k} M={m}", f"fp8_gemm {backend}"
    if m <= configs.DECODE_MAX_M:
        return Row(kernel, shape, ours_ms, moved / ours_ms / 1e6, "GB/s", COPY_SHARE * copy_gbs, note)
    return Row(kernel, shape, ours_ms, tflops(ours_ms), "TFLOPS", CUBLAS_SHARE * tflops(tensor_ms), note)


def bench_quantizer(device, copy_gbs: float, k: int = 7168) -> list[Row]:
    rows = []
    for m in (1, 128, 16384):
        xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in range(4)]
        ms = median_ms([lambda x=x: quantize_activations(x, pow2_scales=True, backend="triton") for x in xs])
        moved = 3 * m * k + 4 * m * groups(k)
        rows.append(Row("quantize_activations triton", f"M={m} K={k} bf16", ms, moved / ms / 1e6, "GB/s",
                        COPY_SHARE * copy_gbs, "no target; launch-bound at small M"))
    return rows


def bench_one_launch(name: str, m: int, n: int, k: int, device) -> Row:
    """fp8_linear at decode size M: quantize + fp8_gemm (+ its split-K sum) against the one launch,
    both from CUDA graphs, on bf16 activations with power-of-two scales. Rate: the one launch's
    GB/s; target: the two steps' GB/s (ratio = speedup)."""
    sets = [(torch.randn(m, k, device=device, dtype=torch.bfloat16), w, w_scale)
            for _, _, w, w_scale in make_sets(m, n, k, device)]

    def two_steps(x, w, w_scale):
        return gemm.fp8_gemm(*quantize.quantize_activations(x, True), w, w_scale, torch.bfloat16)

    def one_launch(x, w, w_scale):
        return gemm.fp8_linear(x, w, w_scale, True, torch.bfloat16)

    same = torch.equal(two_steps(*sets[0]), one_launch(*sets[0]))
    two_ms = graph_ms([lambda s=s: two_steps(*s) for s in sets])
    one_ms = graph_ms([lambda s=s: one_launch(*s) for s in sets])
    moved = bytes_moved(m, n, k)
    return Row("fp8_linear one launch", f"{name} N={n} K={k} M={m}", one_ms, moved / one_ms / 1e6, "GB/s",
               moved / two_ms / 1e6, f"two steps {two_ms * 1e3:.1f} us, one launch {one_ms * 1e3:.1f} us "
               f"with {configs.choose_config(m, n, k, device)}" + ("" if same else "; OUTPUTS DIFFER"))


def sweep_shape(name: str, m: int, n: int, k: int, device, iters: int) -> tuple[Row, dict]:
    """Time every candidate config. Returns a row (kernel: the fastest config; rate: the
    heuristic's ms; target: the fastest ms; ratio: heuristic / fastest) and all timings."""
    sets = make_sets(m, n, k, device)
    timings = {}
    for config in configs.candidates(m, n, k, configs.num_sms(device)):
        try:
            timings[str(config)] = time_calls(sets, lambda *s: gemm.fp8_gemm(*s, torch.bfloat16, config=config), iters)
        except Exception as e:  # e.g. out of shared memory: report and go on
            log.warning("%s M=%d %s failed: %s", name, m, config, str(e).splitlines()[0][:160])
    chosen = str(configs.choose_config(m, n, k, device))
    best = min(timings, key=timings.get)
    row = Row(best, f"{name} N={n} K={k} M={m}", timings[best], timings.get(chosen, float("nan")), "ms",
              timings[best], f"heuristic: {chosen}")
    return row, {"shape": name, "m": m, "n": n, "k": k, "heuristic": chosen, "best": best, "ms": timings}


def main(argv: list[str] | None = None) -> None:
    parser = output_parser(__doc__)
    parser.add_argument("--sweep", action="store_true", help="time every candidate config per shape")
    parser.add_argument("--sweep-json", help="save the sweep's timings to this JSON file")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shape names")
    parser.add_argument("--m", help=f"comma-separated M values (default {MS}, with --one-launch {ONE_LAUNCH_MS})")
    parser.add_argument("--one-launch", action="store_true",
                        help="only time fp8_linear's two Triton steps against its one launch (decode M)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per measurement (median)")
    parser.add_argument("--sweep-iters", type=int, default=10, help="timed calls per swept candidate")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    device = torch.device("cuda")
    names = args.shapes.split(",")
    ms = [int(m) for m in args.m.split(",")] if args.m else list(ONE_LAUNCH_MS if args.one_launch else MS)
    if args.one_launch:
        rows = []
        for name in tqdm(names, desc="shapes"):
            for m in ms:
                try:
                    rows.append(bench_one_launch(name, m, *SHAPES[name], device))
                    print(rows[-1])
                except Exception as e:  # one failing shape must not hide the other figures
                    log.exception("%s M=%d failed: %s", name, m, e)
            torch.cuda.empty_cache()
        report("fp8_linear at decode sizes: two Triton steps (target) vs one launch (rate); ratio = speedup",
               rows, args.output)
        return
    copy_gbs = copy_bandwidth(device)
    rows = [Row("device copy", "2 GiB", 0.0, copy_gbs, "GB/s", copy_gbs, "read + write")]
    sweep_rows, sweeps = [], []
    for name in tqdm(names, desc="shapes"):
        n, k = SHAPES[name]
        for m in ms:
            try:
                rows.append(bench_shape(name, m, n, k, device, copy_gbs, args.iters))
                print(rows[-1])
                if args.sweep:
                    row, timings = sweep_shape(name, m, n, k, device, args.sweep_iters)
                    sweep_rows.append(row)
                    sweeps.append(timings)
                    print(row)
            except Exception as e:  # one failing shape must not hide the other figures
                log.exception("%s M=%d failed: %s", name, m, e)
            torch.cuda.empty_cache()
    rows += bench_quantizer(device, copy_gbs)
    report("FP8 block-scaled GEMM (fp8_gemm as dispatched) at DeepSeek-V3.2 shapes", rows, args.output)
    if sweep_rows:
        report("FP8 GEMM sweep: fastest candidate (kernel) vs the heuristic's choice (rate, ms); "
               "ratio = heuristic / fastest", sweep_rows, args.output)
    if args.sweep_json:
        with open(args.sweep_json, "w") as f:
            json.dump(sweeps, f, indent=1)


if __name__ == "__main__":
    main()
