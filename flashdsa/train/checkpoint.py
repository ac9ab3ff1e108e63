"""Checkpoints in the Hugging Face layout, plus the training state that makes a resume exact.

A model directory holds ``config.json``, ``model.safetensors`` (or shards with
``model.safetensors.index.json``) under the checkpoint's own tensor names, and the tokenizer
files; ``flashdsa.models.loader.load_model``, ``generate``, ``serve`` and ``transformers`` read
it. The weights are streamed from the model (from FSDP2 shards, one tensor at a time:
``weight_stream``) and each file is written under a temporary name and renamed (``safe_io``).
A training checkpoint ``<output>/checkpoints/step-NNNNNN/`` is such a directory with fp32
weights, ``optimizer/`` (the optimizer state, each rank writing its own shards with
torch.distributed.checkpoint, reshardable to any rank count) and ``trainer_state.pt`` (step,
scheduler, data position, RNG), written whole as ``.partial-step-NNNNNN/`` and renamed, so a
kill never leaves a half-written ``step-*``.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

from flashdsa.models.resolve import LOAD_ERRORS
from flashdsa.train.distributed import World
from flashdsa.train.safe_io import PARTIAL, atomic_path, write_text
from flashdsa.train.weight_stream import write_weights

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "generation_config.json")
TRAINER_STATE = "trainer_state.pt"
OPTIMIZER = "optimizer"  # the optimizer state's directory in a training checkpoint
CHECKPOINTS = "checkpoints"


def save_model(
    model,
    output_dir: str | Path,
    tokenizer_dir: Optional[str | Path] = None,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = 4 << 30,
    world: Optional[World] = None,
) -> Path:
    """Write ``model``'s config, weights (cast to ``dtype`` when given, fp32-only tensors stay fp32)
    and the tokenizer files found in ``tokenizer_dir`` to ``output_dir``. With a ``world`` of
    several ranks every rank must call this and rank 0 writes, holding at most one weight file's
    tensors. A V3.2 MTP layer is written as the official checkpoint stores it
    (``model.layers.{num_hidden_layers}.*``); a V4 model in the official V4 layout (``mtp.0.*``)."""
    world = world or World()
    output_dir = Path(output_dir)
    if world.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
    config = write_weights(model, output_dir, dtype, max_shard_bytes, world)
    if not world.is_main:
        return output_dir
    write_text(output_dir / "config.json", json.dumps(config, indent=2) + "\n")
    if tokenizer_dir is not None and Path(tokenizer_dir).resolve() != output_dir.resolve():
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                with atomic_path(output_dir / name) as temporary:
                    shutil.copyfile(Path(tokenizer_dir) / name, temporary)
    return output_dir


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"step-{step:06d}"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """The training checkpoints under ``output_dir``, newest first. Partial ones (a save cut off
    by a kill) are skipped with a warning."""
    root = Path(output_dir) / CHECKPOINTS
    for partial in sorted(root.glob(PARTIAL + "step-*")):
        logger.warning("skipping %s: an incomplete checkpoint (its save was cut off)", partial)
    return sorted((p.parent for p in root.glob(f"step-*/{TRAINER_STATE}")), reverse=True)


def latest_checkpoint(output_dir: str | Path) -> Optional[Path]:
    """The newest complete training checkpoint under ``output_dir``, or None."""
    done = complete_checkpoints(output_dir)
    return done[0] if done else None


def save_training_checkpoint(model, optimizer, state: dict, output_dir: str | Path, step: int, tokenizer_dir,
                             world: Optional[World] = None, keep: int = 2) -> Path:
    """Save model (training dtype), ``optimizer`` (sharded, ``OPTIMIZER``) and the small ``state`` as
    checkpoint ``step``; keep the newest ``keep``. Every rank of ``world`` must call this."""
    world = world or World()
    path = checkpoint_dir(output_dir, step)
    partial = path.with_name(PARTIAL + path.name)
    if world.is_main:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
    world.barrier()  # before any rank writes into it
    save_model(model, partial, tokenizer_dir, world=world)
    world.save_optimizer(model, optimizer, partial / OPTIMIZER)
    if world.is_main:
        torch.save(state, partial / TRAINER_STATE)
        if path.exists():  # the same step saved again (a resumed run stopped where it started)
            shutil.rmtree(path)
        os.replace(partial, path)
        for old in sorted(path.parent.glob("step-*"))[:-keep]:
            shutil.rmtree(old)
    world.barrier()
    return path


def load_training_state(path: str | Path) -> dict:
    """The trainer state of checkpoint ``path``; its ``"optimizer"`` is the directory of the sharded
    optimizer state, or, in a checkpoint written before that existed, the full state by parameter
    name (memory-mapped, copy-on-write: a page is read when used)."""
    state = torch.load(Path(path) / TRAINER_STATE, weights_only=False, mmap=True)
    if "optimizer" not in state:
        state["optimizer"] = Path(path) / OPTIMIZER
        if not (state["optimizer"] / ".metadata").is_file():  # DCP's index of the shards
            raise FileNotFoundError(f"{state['optimizer']} holds no optimizer state (no .metadata)")
    return state


def load_latest_checkpoint(output_dir: str | Path, load: Callable[[Path], torch.nn.Module]
                           ) -> Optional[tuple[Path, torch.nn.Module, dict]]:
    """(path, model, trainer state) of the newest training checkpoint under ``output_dir`` that
    loads, its model read by ``load(path)``; damaged ones (truncated files) are skipped with a
    warning. None if none loads."""
    for path in complete_checkpoints(output_dir):
        try:
            return path, load(path), load_training_state(path)
        except (*LOAD_ERRORS, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
            logger.warning("skipping %s: it does not load (%s: %s)", path, type(exc).__name__, exc)
    return None
