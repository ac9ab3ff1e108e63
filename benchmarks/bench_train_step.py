"""Training-step throughput of the default model's size: dense attention vs the sparse path.

One step = forward, backward and AdamW update (bf16 autocast, fp32 master weights). Rows: the
dense LM step, the sparse step through the Triton backward, and the same through the reference
backward, at the default model's training shape and at a longer context. Rate is thousands of
tokens per second; the target column is the dense step's rate at the same shape.

    python benchmarks/bench_train_step.py --output BENCHMARKS-train.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Row, median_ms, report  # noqa: E402

from flashdsa.defaults import DEFAULT_MODEL  # noqa: E402
from flashdsa.models.config import DeepseekV32Config  # noqa: E402
from flashdsa.models.deepseek_v32 import DeepseekV32ForCausalLM  # noqa: E402
from flashdsa.train.init import initialize  # noqa: E402
from flashdsa.train.loop import TrainConfig, compute_losses, make_optimizer, set_trainable  # noqa: E402

SHAPES = [(16, 512, 64), (2, 4096, 256)]  # (batch, seq_len, topk)
VARIANTS = [("dense", None), ("sparse", "triton"), ("sparse", "reference")]


def measure(batch: int, seq_len: int, topk: int, stage: str, backend) -> tuple[float, float]:
    """(median ms per step, peak GiB allocated) of one training step."""
    config = DeepseekV32Config.from_json(DEFAULT_MODEL)
    config.index_topk = topk
    model = initialize(DeepseekV32ForCausalLM(config, mode="reference"), seed=0).cuda()
    cfg = TrainConfig(stage=stage, steps=1000, seq_len=seq_len, batch_tokens=batch * seq_len, backend=backend)
    optimizer, _ = make_optimizer(set_trainable(model, stage), cfg)
    batches = [torch.randint(0, config.vocab_size, (batch, seq_len + 1), device="cuda") for _ in range(2)]

    def step(tokens: torch.Tensor) -> None:
        compute_losses(model, tokens, cfg)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(batches[0])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = median_ms([lambda b=b: step(b) for b in batches], warmup=2, iters=10)
    return ms, torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="BENCHMARKS-train.md")
    args = parser.parse_args()
    rows = []
    for batch, seq_len, topk in SHAPES:
        shape = f"B={batch} L={seq_len} topk={topk}"
        dense_rate = None
        for stage, backend in VARIANTS:
            try:
                ms, peak = measure(batch, seq_len, topk, stage, backend)
            except Exception as e:  # report the failure as a row rather than losing the table
                print(f"{stage}/{backend} at {shape} failed: {type(e).__name__}: {e}")
                continue
            rate = batch * seq_len / ms  # tokens per ms = thousands of tokens per second
            dense_rate = dense_rate or rate
            name = "train step, dense" if stage == "dense" else f"train step, sparse ({backend} bwd)"
            rows.append(Row(name, shape, ms, rate, "Ktok/s", dense_rate, f"peak {peak:.2f} GiB"))
    report("Training step, default model size (fwd + bwd + AdamW)", rows, args.output)


if __name__ == "__main__":
    main()
