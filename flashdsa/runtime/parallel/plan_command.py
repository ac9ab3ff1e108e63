"""``flashdsa plan --model DIR --tensor-parallel-size N [--enable-expert-parallel]``: the memory
plan of every rank from the checkpoint's config.json alone, no weight read, no GPU needed.

Exits 2 with the numbers when the setting cannot fit (weights over the device, or a cache smaller
than one ``--max-model-len`` sequence)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from flashdsa.arguments import int_in
from flashdsa.models.caches import MODES


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tensor-parallel-size`` and ``--enable-expert-parallel``, shared by every model command."""
    parser.add_argument("--tensor-parallel-size", "-tp", type=int_in(1), default=1,
                        help="ranks (one process per GPU) the model is split over (default 1)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="split the routed experts over the ranks instead of each expert's width")


def parallel_config(args: argparse.Namespace, command: str):
    """The ParallelConfig of the parsed arguments (SystemExit naming the argument if bad)."""
    from flashdsa.runtime.parallel.shard import ParallelConfig

    try:
        return ParallelConfig(args.tensor_parallel_size, args.enable_expert_parallel)
    except ValueError as exc:
        raise SystemExit(f"flashdsa {command}: --{str(exc).replace('_', '-')}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory (only config.json is read)")
    add_parallel_arguments(parser)
    parser.add_argument("--gpu-memory-gb", type=float, default=None,
                        help="memory of one GPU in GB (default: the visible GPU's, else 141, an H200)")
    parser.add_argument("--memory-fraction", type=float, default=0.9, help="share of it flashdsa may use (0.9)")
    parser.add_argument("--mode", choices=MODES, default="production", help="precision mode (default production)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's max positions")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="running sequences at most (default 128)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step (default 2048)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (no graph reserve)")


def run(args: argparse.Namespace) -> int:
    from flashdsa.models.config import DeepseekV32Config
    from flashdsa.runtime.parallel.plan import format_plan, memory_plan, plan_problem

    def fail(message: str) -> int:
        print(f"flashdsa plan: {message}")
        return 2

    parallel = parallel_config(args, "plan")
    if not 0 < args.memory_fraction <= 1:
        return fail(f"--memory-fraction must be in (0, 1], got {args.memory_fraction}")
    if args.gpu_memory_gb is not None and args.gpu_memory_gb <= 0:
        return fail(f"--gpu-memory-gb must be > 0, got {args.gpu_memory_gb}")
    try:
        config = DeepseekV32Config.from_json(args.model)
        device_bytes = (int(args.gpu_memory_gb * 1e9) if args.gpu_memory_gb else
                        torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else int(141e9))
        quantization = "fp8" if config.weight_block_size else None
        plans = memory_plan(config, parallel, device_bytes, args.mode, quantization, args.memory_fraction,
                            args.max_num_batched_tokens, args.max_num_seqs, not args.enforce_eager)
    except ValueError as exc:
        return fail(str(exc))
    max_len = args.max_model_len or config.max_position_embeddings
    print(f"{args.model}: {config.num_hidden_layers} layers + {config.num_nextn_predict_layers} MTP, "
          f"{quantization or 'bf16'} weights, tensor parallel {parallel.tensor_parallel_size}"
          f"{' with expert parallel' if parallel.enable_expert_parallel else ''}, "
          f"{device_bytes / 1e9:.1f} GB per GPU x {args.memory_fraction:.0%}")
    print(format_plan(plans))
    problem = plan_problem(plans, max_len)
    if problem:
        return fail(f"does not fit: {problem}")
    print(f"fits: {plans[0].kv_tokens:,} cache tokens per rank, {plans[0].kv_tokens // max_len} sequences of "
          f"{max_len} tokens")
    return 0
