"""Sparse MLA prefill forward over bf16 keys, backend by backend: triton, cuda (native SM90) and FlashMLA.

Issue 13's prefill shapes: s_q = 4096 query tokens, topk = 2048 distinct indices per token drawn
uniformly over s_kv = 8K / 64K / 128K keys, h_q 128 (and 64 at 64K), d_qk 576, d_v 512. FLOPs
2*h_q*topk*(d_qk + d_v) per query token. Each row's note gives the ratio to FlashMLA (when
``flash_mla`` builds from ``.device/flashmla``, see ``common.load_flashmla``; its
``flash_mla_sparse_fwd``) and the largest |out| and |lse| differences to FlashMLA and to triton.

    python3 -m benchmarks.bench_sparse_prefill [--output BENCHMARKS.md] [--no-flashmla]
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
from tqdm import tqdm

from benchmarks.bench_attention import uniform_indices
from benchmarks.common import Row, input_sets_for, median_ms, parse_with_flashmla, report, side_by_side_rows
from flashdsa.runtime.kernels import sparse_mla_fwd

log = logging.getLogger("bench_sparse_prefill")
S_Q, TOPK, D_QK, D_V = 4096, 2048, 576, 512
SHAPES = [(8192, 128), (65536, 128), (131072, 128), (65536, 64)]  # (s_kv, h_q)
SM_SCALE = D_QK**-0.5
FLASHMLA_TFLOPS = {(8192, 128): 593.0, (65536, 128): 525.0, (131072, 128): 498.0, (65536, 64): 492.0}  # issue 13
BACKENDS = ("triton", "cuda")

Call = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def backend_call(backend: str) -> Call:
    return lambda q, kv, indices: sparse_mla_fwd(q, kv, indices, SM_SCALE, D_V, backend=backend)


def flashmla_call(fm) -> Call:
    return lambda q, kv, indices: fm.flash_mla_sparse_fwd(q, kv, indices, SM_SCALE)


def bench_shape(device, s_kv: int, h_q: int, fm) -> list[Row]:
    per_set = S_Q * h_q * (D_QK + D_V) * 2 + s_kv * D_QK * 2 + S_Q * TOPK * 4
    sets = [((torch.randn(S_Q, h_q, D_QK, device=device) / 10).bfloat16(),
             (torch.randn(s_kv, 1, D_QK, device=device) / 10).bfloat16(), uniform_indices(s_kv, device))
            for _ in range(input_sets_for(per_set, at_most=3))]
    flops = S_Q * 2 * h_q * TOPK * (D_QK + D_V)
    shape = f"s_q={S_Q} s_kv={s_kv // 1024}K topk={TOPK} h_q={h_q} d_qk={D_QK}"
    calls = {name: backend_call(name) for name in BACKENDS}
    if fm is not None:
        calls["FlashMLA"] = flashmla_call(fm)
    times, outs = {}, {}
    for name, call in calls.items():
        try:
            times[name] = median_ms([lambda s=s, call=call: call(*s) for s in sets])
            out, _, lse = call(*sets[0])
            outs[name] = (out.float(), lse.float())
        except Exception as e:  # one failing backend must not hide the others
            log.warning("%s at %s failed: %s", name, shape, str(e).splitlines()[0][:300])

    def differences(name: str) -> list[str]:
        return [f"max |out - {other}| {(outs[name][0] - outs[other][0]).abs().max().item():.1e}, "
                f"|lse - {other}| {(outs[name][1] - outs[other][1]).abs().max().item():.1e}"
                for other in ("FlashMLA", "triton") if other in outs and other != name]

    return side_by_side_rows("sparse_mla_fwd", shape, times, differences, flops, FLASHMLA_TFLOPS[s_kv, h_q])


def main(argv: Optional[list[str]] = None) -> None:
    args, fm = parse_with_flashmla(__doc__, argv)
    device = torch.device("cuda")
    rows = []
    for s_kv, h_q in tqdm(SHAPES, desc="sparse prefill"):
        rows += bench_shape(device, s_kv, h_q, fm)
        torch.cuda.empty_cache()
    report("Sparse MLA prefill forward over bf16 keys: triton, cuda, FlashMLA", rows, args.output)


if __name__ == "__main__":
    main()
