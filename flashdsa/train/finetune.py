"""``flashdsa finetune``: train a DeepSeek-V3.2 (DSA) or DeepSeek-V4 checkpoint on a text or chat file.

    flashdsa finetune --model DIR --data FILE --stage warmup|sparse --steps N --output DIR

writes ``DIR/`` (the trained model, HF layout), ``DIR/checkpoints/step-N/`` (resumable),
``DIR/log.jsonl`` and ``DIR/loss.png``. ``--resume`` continues from the newest checkpoint in
``--output`` exactly where it stopped (weights, optimizer, schedule, data position, RNG).

    torchrun --nproc-per-node N -m flashdsa finetune ...

trains data-parallel with FSDP2 over N processes (``flashdsa.train.distributed``): the same global
batch, checkpoints and outputs as one process; each rank reads only its shards of a V3.2 checkpoint
(``flashdsa.train.sharded_load``); rank 0 writes the weights, gathered one tensor at a time, and
every rank its shards of the optimizer state (``flashdsa.train.checkpoint``).
A checkpoint's MTP layer trains with its own loss (``--mtp-loss-weight``) and, to raise speculative
decoding's acceptance, by distillation toward the main model's next-token distribution
(``--mtp-distill-weight``, ``--mtp-distill-temperature``); ``--mtp-only`` trains it alone, the main
model frozen, and ``--keep-best-by mtp_agreement`` keeps its weights of the best held-out top-1
agreement with the main model. ``--add-mtp-layer`` gives a checkpoint without one a freshly
initialised layer. A V4 checkpoint (``model_type``
``deepseek_v4``) trains through the same stages, its CSA indexers over the compressed entries
(``flashdsa.train.forward_v4``), and is saved in the official V4 layout.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch

from flashdsa.arguments import device_type, float_in, int_in, output_directory
from flashdsa.errors import ArgumentError, blame
from flashdsa.train.loop import KEEP_BEST_BY, STAGES, TrainConfig

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    positive, count = float_in(0, low_open=True), int_in(1)
    parser.add_argument("--model", required=True, help="checkpoint to start from (directory in HF layout with "
                        "tokenizer, or Hugging Face repo id)")
    parser.add_argument("--data", required=True, type=Path,
                        help=".txt file, or .jsonl with 'text' or chat 'messages' per line")
    parser.add_argument("--stage", choices=STAGES, required=True,
                        help="dense: LM loss, dense attention, indexer frozen (pre-training from scratch); "
                             "warmup: indexer KL only, dense attention; sparse: top-k attention, LM + indexer KL")
    parser.add_argument("--steps", type=count, required=True, help="optimizer steps")
    parser.add_argument("--output", required=True, type=output_directory, help="output directory")
    parser.add_argument("--lr", type=positive, default=3e-4, help="peak learning rate (default 3e-4)")
    parser.add_argument("--seq-len", type=int_in(2), default=512, help="tokens per training sequence (default 512)")
    parser.add_argument("--batch-tokens", type=count, default=8192,
                        help="tokens per optimizer step, at least --seq-len (default 8192)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output")
    parser.add_argument("--device", type=device_type, default=None, help="cpu, cuda or cuda:N (default: cuda "
                        "when present, else cpu)")
    parser.add_argument("--warmup-steps", type=int_in(0), default=None, help="linear LR warm-up steps (default 5%%, <= 100)")
    parser.add_argument("--min-lr-ratio", type=float_in(0, 1), default=0.1, help="final / peak LR of the cosine (default 0.1)")
    parser.add_argument("--weight-decay", type=float_in(0), default=0.1, help="AdamW weight decay on matrices (default 0.1)")
    parser.add_argument("--grad-clip", type=positive, default=1.0, help="gradient norm clip (default 1.0)")
    parser.add_argument("--kl-weight", type=float_in(0), default=1.0, help="weight of the indexer KL in the sparse stage")
    parser.add_argument("--eval-fraction", type=float_in(0, 0.5, low_open=True), default=0.05,
                        help="held-out tail of the data (default 0.05)")
    parser.add_argument("--eval-every", type=count, default=100, help="steps between held-out evaluations")
    parser.add_argument("--eval-tokens", type=count, default=32768, help="held-out tokens per evaluation")
    parser.add_argument("--save-every", type=int_in(0), default=0, help="steps between checkpoints (0: at the end only)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute layers in the backward")
    parser.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0, help="data order seed")
    parser.add_argument("--backend", choices=["triton", "reference"], default=None,
                        help="sparse attention backend (default: the fastest available)")
    parser.add_argument("--keep-best", action="store_true", help="end with (and save) the best held-out weights")
    parser.add_argument("--keep-best-by", choices=KEEP_BEST_BY, default="loss",
                        help="what --keep-best ranks by: the held-out loss (default), or mtp_agreement, the MTP "
                             "layer's top-1 agreement with the main model (greedy speculative acceptance)")
    parser.add_argument("--time-limit", type=positive, default=None, help="stop (resumably) after this many seconds")
    parser.add_argument("--save-dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of the final weights")
    parser.add_argument("--max-shard-mb", type=int_in(0), default=4096, help="largest safetensors shard in MiB")
    parser.add_argument("--mtp-loss-weight", type=float_in(0), default=0.1,
                        help="weight of the MTP layer's loss (default 0.1; DeepSeek-V3 used 0.3, then 0.1; 0: off)")
    parser.add_argument("--mtp-distill-weight", type=float_in(0), default=0.0,
                        help="weight of the MTP layer's KL to the main model's next-token distribution, what "
                             "speculative decoding accepts (default 0: off; dense and sparse stages)")
    parser.add_argument("--mtp-distill-temperature", type=positive, default=1.0,
                        help="softmax temperature of that KL (scaled by its square; default 1)")
    parser.add_argument("--mtp-only", action="store_true",
                        help="train only the MTP layer: main model, embedding and head frozen (outputs unchanged)")
    parser.add_argument("--add-mtp-layer", action="store_true",
                        help="give a checkpoint without a multi-token-prediction layer a fresh one to train")


def train_config(args: argparse.Namespace, positions: int) -> TrainConfig:
    """The run's settings, once the lengths are seen to fit each other and the model."""
    if args.seq_len > positions:
        raise ArgumentError("--seq-len", f"at most the model's {positions} positions, got {args.seq_len}")
    if args.batch_tokens < args.seq_len:
        raise ArgumentError("--batch-tokens", f"at least --seq-len ({args.seq_len}), got {args.batch_tokens}")
    if args.keep_best_by != "loss" and not args.keep_best:
        raise ArgumentError("--keep-best-by", "ranks the weights --keep-best keeps: pass --keep-best too")
    return TrainConfig(stage=args.stage, steps=args.steps, lr=args.lr, seq_len=args.seq_len,
                       batch_tokens=args.batch_tokens, warmup_steps=args.warmup_steps, min_lr_ratio=args.min_lr_ratio,
                       weight_decay=args.weight_decay, grad_clip=args.grad_clip, kl_weight=args.kl_weight,
                       eval_every=args.eval_every, eval_tokens=args.eval_tokens, save_every=args.save_every,
                       checkpointing=args.gradient_checkpointing, seed=args.seed, backend=args.backend,
                       keep_best=args.keep_best, keep_best_by=args.keep_best_by, time_limit_s=args.time_limit,
                       mtp_loss_weight=args.mtp_loss_weight, mtp_distill_weight=args.mtp_distill_weight,
                       mtp_distill_temperature=args.mtp_distill_temperature, mtp_only=args.mtp_only)


def check_mtp_options(cfg: TrainConfig, has_mtp: bool) -> None:
    """ArgumentError naming the first MTP option set for a checkpoint without an MTP layer (and no
    --add-mtp-layer): distillation, --mtp-only and ranking by agreement would have nothing to act on."""
    if has_mtp:
        return
    for flag, used in (("--mtp-distill-weight", cfg.mtp_distill_weight > 0), ("--mtp-only", cfg.mtp_only),
                       ("--keep-best-by", cfg.keep_best_by == "mtp_agreement")):
        if used:
            raise ArgumentError(flag, "the checkpoint has no multi-token-prediction layer; add one with "
                                      "--add-mtp-layer")


def read_data(path: Path, tokenizer, eval_fraction: float, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token streams of the data file; ArgumentError naming --data on any problem."""
    from flashdsa.train.data import read_documents, split_stream, token_stream

    if not path.is_file():
        raise ArgumentError("--data", f"{path}: no such file" if not path.exists() else f"{path} is not a file")
    with blame("--data", (ValueError, OSError)):  # malformed JSON, bad records, too few tokens, unreadable
        return split_stream(token_stream(read_documents(path, tokenizer), tokenizer), eval_fraction, seq_len)


def run(args: argparse.Namespace) -> int:
    from flashdsa.models.resolve import LOAD_ERRORS, is_v4, load_tokenizer, parse_device, read_checkpoint, resolve_model
    from flashdsa.train import checkpoint as ckpt
    from flashdsa.train.distributed import join, leave
    from flashdsa.train.loop import Trainer
    from flashdsa.train.sharded_load import load_for_training

    world = join(parse_device(args.device))
    model_dir = resolve_model(args.model)
    config = read_checkpoint(model_dir)  # a V3.2 or V4 config, told apart by model_type
    cfg = train_config(args, config.max_position_embeddings)
    if is_v4(config) and args.backend not in (None, "reference"):
        raise ArgumentError("--backend", f"DeepSeek-V4 training runs the reference (plain torch) attention: no "
                                         f"{args.backend} V4 attention backward exists; pass reference or leave it out")
    has_mtp = config.num_nextn_predict_layers > 0
    if args.add_mtp_layer and has_mtp and not args.resume:
        raise ArgumentError("--add-mtp-layer", f"{model_dir} already has a multi-token-prediction layer")
    check_mtp_options(cfg, has_mtp or args.add_mtp_layer)
    with blame("--batch-tokens", (ValueError,)):  # its sequences must split evenly over the ranks
        world.check_batch(cfg.batch_size)
    tokenizer = load_tokenizer(model_dir)
    train_tokens, eval_tokens = read_data(args.data, tokenizer, args.eval_fraction, cfg.seq_len)
    if not args.resume and (args.output / ckpt.CHECKPOINTS).is_dir():  # a fresh run would prune them
        raise ArgumentError("--output", f"{args.output} holds the checkpoints of an earlier run; pass --resume to "
                                        f"continue it, or choose another --output")
    # fp32 master weights; several ranks each read their FSDP2 shards of them (sharded_load)
    load = partial(load_for_training, world=world)
    resumed = ckpt.load_latest_checkpoint(args.output, load) if args.resume else None
    if args.resume and resumed is None:
        raise ArgumentError("--resume", f"no checkpoint that loads under {args.output / ckpt.CHECKPOINTS}; "
                                        f"run without --resume to start afresh")
    if resumed is None:
        with blame("model", LOAD_ERRORS):  # missing, mis-shaped or damaged tensors
            model = load(model_dir, fresh_mtp_seed=args.seed if args.add_mtp_layer else None)
    else:
        model = resumed[1]
    with blame("--data", (ValueError,)):  # too few tokens for one batch
        trainer = Trainer(model, train_tokens, eval_tokens, cfg, args.output, model_dir, world.device, world)
    if resumed is not None:
        with blame("--stage", (ValueError,)):  # the checkpoint is of another stage
            trainer.load_state_dict(resumed[2])
        if world.is_main:
            print(f"resumed from {resumed[0]} at step {trainer.step}")
    metrics = trainer.train()
    ckpt.save_model(model, args.output, model_dir, DTYPES[args.save_dtype], args.max_shard_mb << 20, world)
    if world.is_main:
        summary = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        print(f"{cfg.stage} stage: {trainer.step} steps on {len(train_tokens)} tokens; {summary}; "
              f"saved to {args.output}" + (f" ({world.size} ranks)" if world.size > 1 else ""))
    leave(world)
    return 0
