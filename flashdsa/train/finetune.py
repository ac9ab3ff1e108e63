"""``flashdsa finetune``: train a DeepSeek-V3.2 (DSA) checkpoint on a text or chat file.

    flashdsa finetune --model DIR --data FILE --stage warmup|sparse --steps N --output DIR

writes ``DIR/`` (the trained model, HF layout), ``DIR/checkpoints/step-N/`` (resumable),
``DIR/log.jsonl`` and ``DIR/loss.png``. ``--resume`` continues from the newest checkpoint in
``--output`` exactly where it stopped (weights, optimizer, schedule, data position, RNG).

    torchrun --nproc-per-node N -m flashdsa finetune ...

trains data-parallel with FSDP2 over N processes (``flashdsa.train.distributed``): the same global
batch, checkpoints and outputs as one process; rank 0 writes every file.
A checkpoint's MTP layer trains with its own loss (``--mtp-loss-weight``); ``--add-mtp-layer``
gives a checkpoint without one a freshly initialised layer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from flashdsa.train.loop import STAGES, TrainConfig

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory to start from (HF layout with tokenizer)")
    parser.add_argument("--data", required=True, help=".txt file, or .jsonl with 'text' or chat 'messages' per line")
    parser.add_argument("--stage", choices=STAGES, required=True,
                        help="dense: LM loss, dense attention, indexer frozen (pre-training from scratch); "
                             "warmup: indexer KL only, dense attention; sparse: top-k attention, LM + indexer KL")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps")
    parser.add_argument("--output", required=True, help="output directory")
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence (default 512)")
    parser.add_argument("--batch-tokens", type=int, default=8192, help="tokens per optimizer step (default 8192)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="linear LR warm-up steps (default 5%%, <= 100)")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="final / peak LR of the cosine (default 0.1)")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices (default 0.1)")
    parser.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clip (default 1.0)")
    parser.add_argument("--kl-weight", type=float, default=1.0, help="weight of the indexer KL in the sparse stage")
    parser.add_argument("--eval-fraction", type=float, default=0.05, help="held-out tail of the data (default 0.05)")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations")
    parser.add_argument("--eval-tokens", type=int, default=32768, help="held-out tokens per evaluation")
    parser.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute layers in the backward")
    parser.add_argument("--seed", type=int, default=0, help="data order seed")
    parser.add_argument("--backend", choices=["triton", "reference"], default=None,
                        help="sparse attention backend (default: the fastest available)")
    parser.add_argument("--keep-best", action="store_true", help="save the weights of the best held-out loss")
    parser.add_argument("--time-limit", type=float, default=None, help="stop (resumably) after this many seconds")
    parser.add_argument("--save-dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of the final weights")
    parser.add_argument("--max-shard-mb", type=int, default=4096, help="largest safetensors shard in MiB")
    parser.add_argument("--mtp-loss-weight", type=float, default=0.1,
                        help="weight of the MTP layer's loss (default 0.1; DeepSeek-V3 used 0.3, then 0.1; 0: off)")
    parser.add_argument("--add-mtp-layer", action="store_true",
                        help="give a checkpoint without a multi-token-prediction layer a fresh one to train")


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from flashdsa.models.config import DeepseekV32Config
    from flashdsa.models.loader import load_model
    from flashdsa.models.mtp import add_mtp_layer
    from flashdsa.train import checkpoint as ckpt
    from flashdsa.train.init import initialize
    from flashdsa.train.data import read_documents, split_stream, token_stream
    from flashdsa.train.distributed import join, leave
    from flashdsa.train.loop import Trainer

    cfg = TrainConfig(stage=args.stage, steps=args.steps, lr=args.lr, seq_len=args.seq_len,
                      batch_tokens=args.batch_tokens, warmup_steps=args.warmup_steps, min_lr_ratio=args.min_lr_ratio,
                      weight_decay=args.weight_decay, grad_clip=args.grad_clip, kl_weight=args.kl_weight,
                      eval_every=args.eval_every, eval_tokens=args.eval_tokens, save_every=args.save_every,
                      checkpointing=args.gradient_checkpointing, seed=args.seed, backend=args.backend,
                      keep_best=args.keep_best, time_limit_s=args.time_limit, mtp_loss_weight=args.mtp_loss_weight)
    world = join(torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")))
    device = world.device
    resume_from = ckpt.latest_checkpoint(args.output) if args.resume else None
    if args.resume and resume_from is None:
        raise SystemExit(f"--resume: no checkpoint under {Path(args.output) / ckpt.CHECKPOINTS}")
    source = resume_from or args.model
    has_mtp = DeepseekV32Config.from_json(source).num_nextn_predict_layers > 0
    if args.add_mtp_layer and has_mtp and resume_from is None:
        raise SystemExit(f"--add-mtp-layer: {args.model} already has a multi-token-prediction layer")
    # fp32 master weights; several ranks read them to host memory and shard them onto the device
    model = load_model(source, device=device if world.size == 1 else "cpu", mode="reference", mtp=has_mtp)
    if args.add_mtp_layer and not has_mtp:
        initialize(add_mtp_layer(model), seed=args.seed, depth=model.config.num_hidden_layers)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokens = token_stream(read_documents(args.data, tokenizer), tokenizer)
    train_tokens, eval_tokens = split_stream(tokens, args.eval_fraction, cfg.seq_len)
    trainer = Trainer(model, train_tokens, eval_tokens, cfg, args.output, args.model, device, world)
    if resume_from is not None:
        trainer.load_state_dict(ckpt.load_training_state(resume_from))
        if world.is_main:
            print(f"resumed from {resume_from} at step {trainer.step}")
    metrics = trainer.train()
    weights = world.model_state(model)
    if world.is_main:
        ckpt.save_model(model, args.output, args.model, DTYPES[args.save_dtype], args.max_shard_mb << 20, weights)
        summary = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        print(f"{cfg.stage} stage: {trainer.step} steps on {len(train_tokens)} tokens; {summary}; "
              f"saved to {args.output}" + (f" ({world.size} ranks)" if world.size > 1 else ""))
    leave(world)
    return 0
