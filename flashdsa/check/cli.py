"""``flashdsa check``: compare flashdsa with transformers layer by layer on one checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from flashdsa.check.layerwise import THRESHOLDS, compare, format_report, load_hf_reference, run_flashdsa, run_hf
from flashdsa.check.mtp import compare_mtp, flashdsa_mtp, format_mtp, mtp_failures, reference_mtp
from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.caches import MODES
from flashdsa.runtime.parallel.launcher import load
from flashdsa.runtime.parallel.plan_command import add_parallel_arguments, parallel_config
from flashdsa.models.tiny_tokenizer import TRAINING_TEXT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=Path, help="checkpoint directory (HF layout)")
    parser.add_argument("--mode", choices=MODES, default="reference", help="flashdsa precision mode (default reference)")
    parser.add_argument("--tokens", type=int, default=256, help="prompt length to compare on (default 256)")
    parser.add_argument("--device", default="cpu", help="torch device for both models (default cpu)")
    add_parallel_arguments(parser)


def prompt_tokens(path: Path, n: int) -> torch.Tensor:
    """``n`` token ids of built-in English text, tokenized by the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    text = TRAINING_TEXT * (1 + 8 * n // len(TRAINING_TEXT))
    ids = tokenizer(text).input_ids[:n]
    if len(ids) < n:
        raise ValueError(f"the built-in text gives only {len(ids)} tokens, fewer than --tokens {n}")
    return torch.tensor(ids)


def run(args: argparse.Namespace) -> int:
    if args.tokens < 1:
        raise SystemExit("--tokens must be at least 1")
    parallel = parallel_config(args, "check")
    ids = prompt_tokens(args.model, args.tokens).to(args.device)
    hf_run = run_hf(load_hf_reference(args.model, args.device), ids)
    has_mtp = DeepseekV32Config.from_json(args.model).num_nextn_predict_layers > 0
    try:
        model = load(args.model, parallel, args.device, args.mode, mtp=has_mtp and parallel.tensor_parallel_size == 1)
    except ValueError as exc:
        raise SystemExit(f"flashdsa check: {exc}")
    report = compare(hf_run, run_flashdsa(model, ids.to(model.device)), args.mode)
    print(format_report(report))
    failures = report.failures(args.mode)
    if model.has_mtp:  # the MTP layer (one process only), against the paper's equations around HF's layer
        result = compare_mtp(reference_mtp(args.model, ids, args.device), flashdsa_mtp(model, ids))
        print(format_mtp(result))
        failures += mtp_failures(result, THRESHOLDS[args.mode])
    limits = ", ".join(f"{k} {v}" for k, v in THRESHOLDS[args.mode].items())
    if failures:
        print(f"FAIL ({args.mode} thresholds: {limits})")
        for f in failures:
            print(f"  {f}")
        return 1
    print(f"PASS ({args.mode} thresholds: {limits})")
    return 0
