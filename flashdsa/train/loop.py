"""The training loop for the DSA stages: AdamW, warm-up + cosine schedule, clipping, eval, resume.

Stages (DeepSeek-V3.2's recipe, plus ``dense`` for training a model from scratch first):
  dense   dense attention, language-model loss; every weight but the indexer trains
  warmup  dense attention, indexer KL to the main attention over all causal keys; only the
          indexer trains
  sparse  top-k attention through the sparse kernels; LM loss for the model plus the indexer
          KL over the selected keys, the indexer's inputs detached, so each learns from its own loss
A model with an MTP layer adds its loss (predicting the token after next, weight
``mtp_loss_weight``, as DeepSeek-V3) in the dense and sparse stages, and its indexer's KL; with
``mtp_distill_weight`` also its KL to the main model's next-token distribution (``losses.distill_kl``:
what speculative decoding accepts). ``mtp_only`` trains the MTP layer alone (what the stage would
train of it), the main model, embedding and head frozen, so the model's own outputs stay bit for bit.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from flashdsa.train import checkpoint as ckpt
from flashdsa.train.data import TokenBatches, eval_batches
from flashdsa.train.distributed import World, full_norm
from flashdsa.errors import ArgumentError
from flashdsa.train.architecture import forwards, mtp_layer
from flashdsa.train.losses import distill_kl, lm_loss, top1_agreement
from flashdsa.train.plot import save_loss_png
from flashdsa.train.safe_io import append_record, read_records, truncate_records
from flashdsa.train.sharded_load import load_for_training

logger = logging.getLogger(__name__)

STAGES = ("dense", "warmup", "sparse")
KEEP_BEST_BY = ("loss", "mtp_agreement")  # the held-out loss (lowest), or MTP top-1 agreement (highest)
LOG_FILE, PLOT_FILE, BEST_DIR = "log.jsonl", "loss.png", "best"


@dataclass
class TrainConfig:
    stage: str
    steps: int
    lr: float = 3e-4
    seq_len: int = 512
    batch_tokens: int = 8192
    warmup_steps: Optional[int] = None  # default: 5% of steps, at most 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    kl_weight: float = 1.0
    eval_every: int = 100
    eval_tokens: int = 32768
    save_every: int = 0  # 0: only at the end
    checkpointing: bool = False
    seed: int = 0
    backend: Optional[str] = None  # sparse attention backend (None: the fastest available)
    keep_best: bool = False  # end with the best held-out weights by ``keep_best_by`` (kept in <output>/best)
    keep_best_by: str = "loss"
    time_limit_s: Optional[float] = None  # stop early (with a checkpoint) after this long
    mtp_loss_weight: float = 0.1  # weight of the MTP layer's loss (DeepSeek-V3: 0.3, then 0.1); 0: not run
    mtp_distill_weight: float = 0.0  # weight of the MTP layer's KL to the main model (losses.distill_kl)
    mtp_distill_temperature: float = 1.0
    mtp_only: bool = False  # train the MTP layer alone; the main model, embedding and head frozen

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {self.stage!r}")
        if self.mtp_loss_weight < 0:
            raise ValueError(f"mtp_loss_weight must be >= 0, got {self.mtp_loss_weight}")
        self._check_mtp_options()
        if self.steps < 1 or self.seq_len < 2 or self.batch_tokens < self.seq_len:
            raise ValueError(f"need steps >= 1, seq_len >= 2, batch_tokens >= seq_len; got {self.steps}, "
                             f"{self.seq_len}, {self.batch_tokens}")

    def _check_mtp_options(self) -> None:
        """ArgumentError naming the field of an MTP setting that cannot work with the others."""
        if not self.mtp_distill_weight >= 0:
            raise ArgumentError("mtp_distill_weight", f"must be >= 0, got {self.mtp_distill_weight}")
        if not self.mtp_distill_temperature > 0:
            raise ArgumentError("mtp_distill_temperature", f"must be > 0, got {self.mtp_distill_temperature}")
        if self.keep_best_by not in KEEP_BEST_BY:
            raise ArgumentError("keep_best_by", f"must be one of {KEEP_BEST_BY}, got {self.keep_best_by!r}")
        if self.mtp_distill_weight > 0 and self.stage == "warmup":
            raise ArgumentError("mtp_distill_weight", "the warmup stage trains only indexers; distill the MTP "
                                                      "layer in the dense or sparse stage")
        if self.mtp_only and not self.runs_mtp:
            raise ArgumentError("mtp_only", "nothing would train: needs mtp_loss_weight or mtp_distill_weight > 0")
        if self.keep_best_by == "mtp_agreement" and (self.stage == "warmup" or not self.runs_mtp):
            raise ArgumentError("keep_best_by", "mtp_agreement needs the MTP layer's predictions: a dense or sparse "
                                                "stage with mtp_loss_weight or mtp_distill_weight > 0")

    @property
    def runs_mtp(self) -> bool:
        """Whether the MTP layer runs (on a model that has one)."""
        return self.mtp_loss_weight > 0 or self.mtp_distill_weight > 0

    @property
    def batch_size(self) -> int:
        return self.batch_tokens // self.seq_len

    @property
    def attention(self) -> str:
        return "sparse" if self.stage == "sparse" else "dense"


def set_trainable(model, stage: str, mtp_only: bool = False) -> list[torch.nn.Parameter]:
    """Freeze/unfreeze by stage (and, ``mtp_only``, all but the MTP layer); returns the trainable parameters."""
    if mtp_only and not model.has_mtp:
        raise ArgumentError("mtp_only", "the model has no MTP layer to train")
    mtp = {id(p) for p in mtp_layer(model).parameters()} if mtp_only else set()
    for name, p in model.named_parameters():
        is_indexer = ".indexer." in name
        by_stage = {"dense": not is_indexer, "warmup": is_indexer, "sparse": True}[stage]
        p.requires_grad_(by_stage and (not mtp_only or id(p) in mtp))
    return [p for p in model.parameters() if p.requires_grad]


def make_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig):
    """AdamW (decay on matrices only) and a linear warm-up + cosine decay to ``min_lr_ratio * lr``."""
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else min(100, cfg.steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, cfg.steps - warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def compute_losses(model, batch: torch.Tensor, cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """``batch: [B, L + 1]`` -> {"loss", "lm_loss", "mtp_loss", "mtp_distill", "mtp_agreement",
    "indexer_kl"} (those the stage and model have). The MTP terms cover the L - 1 positions whose
    token after next is in the batch: MTP row i against the data's token i + 2 (``mtp_loss``) and
    against the main model's row i + 1 (``mtp_distill``, the KL; ``mtp_agreement``, the share of
    equal argmaxes: greedy acceptance on this text, a metric without gradient)."""
    mtp = model.has_mtp and cfg.runs_mtp
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=batch.is_cuda):
        out = forwards(model)[0](model, batch[:, :-1], cfg.attention, indexer_loss=cfg.stage != "dense",
                               checkpointing=cfg.checkpointing, backend=cfg.backend,
                               next_ids=batch[:, 1:] if mtp else None)
    losses = {}
    if cfg.stage != "warmup":
        losses["lm_loss"] = lm_loss(out.logits, batch[:, 1:])
        if out.mtp_logits is not None:
            draft, main = out.mtp_logits[:, :-1], out.logits[:, 1:]  # both predict token i + 2
            losses["mtp_loss"] = lm_loss(draft, batch[:, 2:])
            losses["mtp_distill"] = distill_kl(draft, main, cfg.mtp_distill_temperature)
            losses["mtp_agreement"] = top1_agreement(draft, main)
    if out.indexer_kl is not None:
        losses["indexer_kl"] = out.indexer_kl
    losses["loss"] = (losses.get("lm_loss", 0.0) + cfg.mtp_loss_weight * losses.get("mtp_loss", 0.0)
                      + cfg.mtp_distill_weight * losses.get("mtp_distill", 0.0)
                      + cfg.kl_weight * losses.get("indexer_kl", 0.0))
    return losses


@torch.no_grad()
def evaluate(model, batches: list[torch.Tensor], cfg: TrainConfig, device) -> dict[str, float]:
    """Mean held-out losses, named ``eval_<loss>``."""
    totals: dict[str, float] = {}
    for batch in batches:
        for name, value in compute_losses(model, batch.to(device), cfg).items():
            totals[name] = totals.get(name, 0.0) + float(value) / len(batches)
    return {f"eval_{name}": value for name, value in totals.items()}


class Trainer:
    """Runs one stage on ``model`` (fp32 weights) and writes checkpoints, log and plot to ``output_dir``.

    With a ``world`` of several ranks (``flashdsa.train.distributed``) the model is sharded with
    FSDP2, each rank trains on its rows of every batch, rank 0 writes the weights (streamed), log and
    plot, and every rank its shards of the optimizer state."""

    def __init__(self, model, train_tokens, eval_tokens, cfg: TrainConfig, output_dir, tokenizer_dir, device,
                 world: Optional[World] = None):
        self.model, self.cfg, self.device = model, cfg, torch.device(device)
        self.output_dir, self.tokenizer_dir = Path(output_dir), tokenizer_dir
        self.world = world or World(device=self.device)
        self.world.check_batch(cfg.batch_size)
        set_trainable(model, cfg.stage, cfg.mtp_only)
        self.world.shard(model)  # replaces the parameters with this rank's shards
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = make_optimizer(self.params, cfg)
        self.batches = TokenBatches(train_tokens, cfg.seq_len, cfg.batch_size, cfg.seed)
        self.eval_set = eval_batches(eval_tokens, cfg.seq_len, cfg.batch_size, cfg.eval_tokens)
        self.step, self.best_eval = 0, math.inf

    def state_dict(self) -> dict:
        """The small state a resume needs beside the weights and the optimizer's (saved apart, sharded)."""
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return {"step": self.step, "best_eval": self.best_eval, "config": asdict(self.cfg),
                "scheduler": self.scheduler.state_dict(),
                "data": self.batches.state_dict(), "rng": torch.get_rng_state(), "cuda_rng": cuda_rng}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state`` as ``checkpoint.load_training_state`` reads it (with the optimizer's)."""
        if state["config"]["stage"] != self.cfg.stage:
            raise ValueError(f"cannot resume a {state['config']['stage']!r} run as stage {self.cfg.stage!r}")
        self.step, self.best_eval = state["step"], state["best_eval"]
        self.world.load_optimizer(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.batches.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self._truncate_log()

    def train(self) -> dict[str, float]:
        """Run from ``self.step`` to ``cfg.steps``; returns the last eval losses."""
        cfg, metrics, started_run = self.cfg, {}, time.perf_counter()
        bar = tqdm(total=cfg.steps, initial=self.step, desc=f"{cfg.stage}", unit="step", dynamic_ncols=True,
                   disable=not self.world.is_main)
        while self.step < cfg.steps:
            started = time.perf_counter()
            losses = compute_losses(self.model, self.world.local_rows(next(self.batches)).to(self.device), cfg)
            losses["loss"].backward()
            grad_norm = full_norm(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip))
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            record = {"step": self.step, "stage": cfg.stage, "lr": self.scheduler.get_last_lr()[0],
                      **self.world.mean(losses), "grad_norm": grad_norm}
            record["tokens_per_s"] = cfg.batch_size * cfg.seq_len / (time.perf_counter() - started)
            out_of_time = cfg.time_limit_s is not None and self.world.any(
                time.perf_counter() - started_run > cfg.time_limit_s)  # every rank stops at the same step
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps or out_of_time:
                metrics = evaluate(self.model, self.eval_set, cfg, self.device)
                record.update(metrics)
                self._keep_if_best(metrics)
            self._log(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}", **{k: f"{v:.4f}" for k, v in metrics.items()})
            bar.update(1)
            if out_of_time:
                logger.warning("%s stage stopped at step %d: time limit of %.0f s reached", cfg.stage, self.step,
                               cfg.time_limit_s)
                break
            if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
                self.save_checkpoint()
        bar.close()
        self.save_checkpoint()
        self.plot()
        if cfg.keep_best and (self.output_dir / BEST_DIR).is_dir():
            self._restore_best()
            best = self.best_eval if cfg.keep_best_by == "loss" else -self.best_eval
            metrics = {**metrics, f"best_eval_{cfg.keep_best_by}": best}
        return metrics

    def _keep_if_best(self, metrics: dict[str, float]) -> None:
        """Save the weights when ``metrics`` are the best yet; ``best_eval`` holds the score to beat,
        lower is better: the held-out loss, or minus the MTP top-1 agreement."""
        by_loss = self.cfg.keep_best_by == "loss"
        score = metrics["eval_loss"] if by_loss else -metrics["eval_mtp_agreement"]
        if self.cfg.keep_best and score < self.best_eval:  # every rank evaluates alike, so all agree
            self.best_eval = score
            ckpt.save_model(self.model, self.output_dir / BEST_DIR, self.tokenizer_dir, world=self.world)

    def _restore_best(self) -> None:
        """Load the best weights (fp32, as saved on disk) back into the model: each rank reads its
        shards of them (one process: the whole model, on the host, as the device holds the model)."""
        reader = self.world if self.world.size > 1 else World()
        self.world.load_model_state(self.model, load_for_training(self.output_dir / BEST_DIR, reader))

    def save_checkpoint(self) -> Path:
        """Write the checkpoint: weights streamed to rank 0, optimizer shards by every rank (all ranks must call this)."""
        return ckpt.save_training_checkpoint(self.model, self.optimizer, self.state_dict(), self.output_dir, self.step,
                                             self.tokenizer_dir, self.world)

    def _log(self, record: dict) -> None:
        if not self.world.is_main:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        append_record(self.output_dir / LOG_FILE, record)

    def _truncate_log(self) -> None:
        """Drop log lines past the resumed step (written after the checkpoint by an interrupted run)."""
        if self.world.is_main:
            truncate_records(self.output_dir / LOG_FILE, self.step)

    def plot(self) -> None:
        """loss.png: training and held-out losses of the log, by step (rank 0)."""
        if not self.world.is_main:
            return
        records = read_records(self.output_dir / LOG_FILE)
        series = []
        for key in ("loss", "eval_loss", "eval_indexer_kl", "eval_mtp_distill"):
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                series.append((key.replace("_", " "), points))
        save_loss_png(self.output_dir / PLOT_FILE, series)
