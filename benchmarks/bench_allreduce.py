"""The collectives of a tensor-parallel step between the GPUs of this machine, against NVLink.

Run one process per GPU:  torchrun --standalone --nproc-per-node 2 benchmarks/bench_allreduce.py

Times, from a CUDA graph as a decode step replays them, the NCCL all-reduce of a V3.2 step's
hidden states (``tokens x 7168`` bf16: after the embedding, each attention and each MLP / MoE) at
decode batches and one prefill chunk, and the LM head's all-gather of a decode batch's logits.
Rate: NCCL's bus bandwidth (``2 (n - 1) / n`` x bytes / time for the all-reduce), against 450 GB/s
(one direction of an H100/H200's NVLink 4). The note says whether the GPUs reach each other's
memory directly (peer access): without it NCCL stages every transfer through host memory. Rank 0
prints the table (``--output``: and appends it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import Row, graph_ms, output_parser, report  # noqa: E402

HIDDEN, VOCAB = 7168, 129280
NVLINK_GBPS = 450.0
DECODE_TOKENS = (1, 32, 128)
PREFILL_TOKENS = 8192


def main() -> None:
    args = output_parser(__doc__).parse_args()
    dist.init_process_group("nccl")
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    peer = all(torch.cuda.can_device_access_peer(device, other) for other in range(torch.cuda.device_count())
               if other != device.index)
    rows = []
    for tokens in (*DECODE_TOKENS, PREFILL_TOKENS):
        sets = [torch.randn(tokens, HIDDEN, device=device).bfloat16() for _ in range(2)]
        ms = graph_ms([lambda x=x: dist.all_reduce(x) for x in sets])
        nbytes = sets[0].numel() * 2
        rows.append(Row("all_reduce", f"{tokens} x {HIDDEN} bf16, {size} ranks", ms,
                        2 * (size - 1) / size * nbytes / ms / 1e6, "GB/s", NVLINK_GBPS, f"peer access: {peer}"))
    for tokens in DECODE_TOKENS:
        part = torch.randn(tokens, VOCAB // size, device=device).bfloat16()
        outs = [torch.empty_like(part) for _ in range(size)]
        ms = graph_ms([lambda: dist.all_gather(outs, part)])
        rows.append(Row("all_gather (LM head)", f"{tokens} x {VOCAB // size} bf16 a rank", ms,
                        (size - 1) / size * part.numel() * 2 * size / ms / 1e6, "GB/s", NVLINK_GBPS,
                        f"peer access: {peer}"))
    if rank == 0:
        report(f"NCCL collectives of a tensor-parallel step ({size} GPUs)", rows, args.output)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
