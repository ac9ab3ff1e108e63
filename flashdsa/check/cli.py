"""``flashdsa check``: compare flashdsa with transformers layer by layer on one checkpoint."""

from __future__ import annotations

import argparse

import torch

from flashdsa.arguments import add_model_arguments, int_in
from flashdsa.check.layerwise import THRESHOLDS, compare, format_report, load_hf_reference, run_flashdsa, run_hf
from flashdsa.check.mtp import compare_mtp, flashdsa_mtp, format_mtp, mtp_failures, reference_mtp
from flashdsa.errors import ArgumentError
from flashdsa.models.tiny_tokenizer import TRAINING_TEXT
from flashdsa.runtime.parallel.plan_command import add_parallel_arguments, parallel_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, required=True, mode="reference", device="cpu")
    parser.add_argument("--tokens", type=int_in(1), default=256,
                        help="prompt length to compare on (default 256; at most the model's positions)")
    add_parallel_arguments(parser)


def prompt_tokens(tokenizer, n: int) -> torch.Tensor:
    """``n`` token ids of built-in English text, tokenized by the checkpoint's tokenizer."""
    text = TRAINING_TEXT * (1 + 8 * n // len(TRAINING_TEXT))
    ids = tokenizer(text).input_ids[:n]
    if len(ids) < n:
        raise ArgumentError("--tokens", f"the built-in text gives only {len(ids)} tokens, fewer than {n}")
    return torch.tensor(ids)


def run(args: argparse.Namespace) -> int:
    from flashdsa.models.resolve import is_v4, open_model, read_checkpoint, resolve_model

    parallel = parallel_config(args, "check")
    path = resolve_model(args.model)
    config = read_checkpoint(path)
    if args.tokens > config.max_position_embeddings:
        raise ArgumentError("--tokens", f"at most the model's {config.max_position_embeddings} positions, "
                                        f"got {args.tokens}")
    # the MTP layer is checked for V3.2 in one process (DeepSeek-V4's MTP layer is not served yet)
    has_mtp = config.num_nextn_predict_layers > 0 and parallel.tensor_parallel_size == 1 and not is_v4(config)
    model, tokenizer = open_model(path, args.device, args.mode, args.quantization, parallel, mtp=has_mtp)
    ids = prompt_tokens(tokenizer, args.tokens).to(args.device)
    hf_run = run_hf(load_hf_reference(path, args.device), ids)
    report = compare(hf_run, run_flashdsa(model, ids.to(model.device)), args.mode)
    print(format_report(report))
    failures = report.failures(args.mode)
    if has_mtp:  # the MTP layer (one process only), against the paper's equations around HF's layer
        result = compare_mtp(reference_mtp(path, ids, args.device), flashdsa_mtp(model, ids))
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
